"""End to end in headless Chromium: a real comparison on the default model through the page, both panes and
stats filled, a screenshot saved (in the test's temporary folder, or $MTPFLOW_TEST_ARTIFACTS when set), and a past
run reopened from the history tab."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from mtpflow.playground.screenshot import run_comparison

pytestmark = [pytest.mark.browser, pytest.mark.default_model]
PROMPT = ("Summarize in one sentence: The quarterly planning meeting has been moved from Tuesday to Thursday at "
          "3 pm because the client asked for more time to review the proposal.")


def test_comparison_in_the_browser(playground_url, page, tmp_path):
    timings = run_comparison(page, playground_url, PROMPT, "pld", "baseline", max_new_tokens=32)
    assert timings["status"].startswith("done"), timings
    for side in ("a", "b"):
        pane = page.locator(f"#pane-{side}")
        assert pane.locator(".tok").count() >= 4
        assert len(pane.inner_text().strip()) > 10
        stats = page.locator(f"#stats-{side}").inner_text()
        assert "MAL" in stats and "tokens/s" in stats and "forward passes" in stats
    def emitted_text(side):  # the tokens only, not the refused drafts shown between them
        return "".join(page.locator(f"#pane-{side} .tok").all_inner_texts())

    assert emitted_text("a") == emitted_text("b")  # both lossless and greedy: the same answer
    assert page.locator("#pane-a .tok-accepted").count() > 0  # the summary copies the prompt: pld drafts
    assert "target p =" in page.locator("#pane-a .tok").nth(1).get_attribute("title")
    assert "Speedup of A (pld) over B (baseline)" in page.locator("#speedup").inner_text()
    page.locator("#plot img").wait_for()
    artifacts = Path(os.environ.get("MTPFLOW_TEST_ARTIFACTS") or tmp_path)  # never the repository
    artifacts.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(artifacts / "playground.png"), full_page=True)
    (artifacts / "playground-timing.json").write_text(json.dumps(timings, indent=2))

    run_a = re.search(r"run (\d+)", page.locator("#stats-a").inner_text()).group(1)
    page.get_by_role("tab", name="History").click()
    page.locator("#history-run-a").get_by_role("textbox").fill(run_a)
    page.locator("#history-open").click()
    page.locator("#history-pane-a .tok").first.wait_for()
    assert "MAL" in page.locator("#history-stats-a").inner_text()
    assert page.locator("#history-pane-a .tok").count() == page.locator("#pane-a .tok").count()
