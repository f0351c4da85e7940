"""A strategy that raises mid-decode: its pane shows the error, the other side still runs, and the app keeps
serving (in-process server on the tiny model; API and browser)."""
from __future__ import annotations

import pytest

from mtpflow.plugins import hookimpl

from mtpflow.playground.runner import PlaygroundRunner


class ExplodingProposer:
    """Takes over ``propose`` and raises on the third step, like a buggy third-party stage."""

    @hookimpl(tryfirst=True)
    def propose(self, state, k):
        if state.step >= 2:
            raise RuntimeError("the proposer exploded")
        return None


class RunnerWithABrokenStrategy(PlaygroundRunner):
    def strategies(self):
        return [*super().strategies(), "exploding"]

    def build(self, strategy, knobs, extra):
        if strategy != "exploding":
            return super().build(strategy, knobs, extra)
        pipe = super().build("pld", knobs, extra)
        pipe.run_plugins = [*pipe.run_plugins, lambda _pipe: ExplodingProposer()]
        pipe.cfg.strategy.name = "exploding"
        return pipe


@pytest.fixture(scope="module")
def tiny_app_url(tiny, tmp_path_factory):
    from mtpflow.playground.app import build_blocks
    from mtpflow.playground.server import BackgroundServer, create_server_app

    db = tmp_path_factory.mktemp("failing") / "traces.db"
    runner = RunnerWithABrokenStrategy((f"trace.db={db}", "chat=false"), loaded=tiny, max_tokens_cap=64)
    server = BackgroundServer(create_server_app(build_blocks(runner), runner.trace_store())).start()
    yield server.url
    server.stop()


def test_a_failing_strategy_is_reported_and_the_app_keeps_serving(tiny_app_url):
    from gradio_client import Client

    client = Client(tiny_app_url, verbose=False)
    out = client.predict("the quick brown fox", "exploding", "baseline", 12, "", "", "", "", True, api_name="/compare")
    status, pane_a, pane_b, summary = out[0], out[1], out[2], out[-1]
    assert summary["error"] is True and "the proposer exploded" in summary["status"]
    assert "RuntimeError: the proposer exploded" in pane_a and "mtp-error" in pane_a
    assert 'data-error="true"' in status
    assert summary["b"]["error"] is None and summary["b"]["stats"]["new_tokens"] == 12  # B still ran
    again = client.predict("the quick brown fox", "baseline", "pld", 6, "", "", "", "", True, api_name="/compare")
    assert again[-1]["error"] is False and again[-1]["a"]["text"] == again[-1]["b"]["text"]


@pytest.mark.browser
def test_messages_show_in_the_page(tiny_app_url, page):
    from mtpflow.playground.screenshot import choose

    page.goto(tiny_app_url)
    prompt = page.get_by_label("Prompt", exact=True)
    compare = page.get_by_role("button", name="Compare", exact=True)
    status = page.locator("#status")

    prompt.fill("")
    compare.click()
    status.get_by_text("empty prompt").wait_for()

    prompt.fill("the quick brown fox")
    page.locator("#knob-k").get_by_role("textbox").fill("abc")
    compare.click()
    status.get_by_text("K must be").wait_for()

    page.locator("#knob-k").get_by_role("textbox").fill("")
    page.locator("#knob-max-new-tokens").get_by_role("spinbutton").fill("8")
    choose(page, "Strategy A", "exploding")
    compare.click()
    page.locator("#pane-a").get_by_text("the proposer exploded").wait_for()
    status.get_by_text("strategy failed").wait_for()
    assert page.locator("#pane-b .tok").count() > 0  # B ran after A failed

    choose(page, "Strategy A", "pld")
    compare.click()
    page.locator("#status").get_by_text("done").wait_for()
    assert page.locator("#pane-a .tok").count() > 0 and page.locator("#pane-b .tok").count() > 0
