"""Drive a running playground in headless Chromium: run one comparison, measure click-to-first-token, save a
screenshot. Used by the browser tests and to make the README's pictures:

    python -m mtpflow.playground.screenshot --url http://127.0.0.1:7860/ --a pld --b baseline \\
        --out docs/playground-pld-vs-baseline.png

Needs the ``playwright`` package and Debian's ``chromium`` (``/usr/bin/chromium``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]


def choose(page, label: str, option: str) -> None:
    """Pick ``option`` in the Gradio dropdown labelled ``label``."""
    box = page.get_by_role("combobox", name=label, exact=True)
    box.click()
    box.fill(option)
    # another dropdown's list may still be in the page: take the option from this box's own list
    options = page.locator(f"#{box.get_attribute('aria-controls')}")
    options.get_by_role("option", name=option, exact=True).click()


def run_comparison(page, url: str, prompt: str, strategy_a: str, strategy_b: str, max_new_tokens: int,
                   k: str = "", timeout_s: float = 240.0) -> dict:
    """Fill the form, press Compare, wait for both sides; seconds from the click to A's first token and to done."""
    page.set_default_timeout(timeout_s * 1000)
    page.goto(url)
    page.get_by_label("Prompt", exact=True).fill(prompt)
    choose(page, "Strategy A", strategy_a)
    choose(page, "Strategy B", strategy_b)
    page.locator("#knob-max-new-tokens").get_by_role("spinbutton").fill(str(max_new_tokens))
    page.locator("#knob-k").get_by_role("textbox").fill(k)
    t0 = time.perf_counter()
    page.get_by_role("button", name="Compare", exact=True).click()
    page.locator("#pane-a .tok").first.wait_for()
    first_token = time.perf_counter() - t0
    page.locator("#status").get_by_text("done").or_(page.locator("#status .mtp-status-error")).wait_for()
    done = time.perf_counter() - t0
    return {"click_to_first_token_s": round(first_token, 3), "click_to_done_s": round(done, 3),
            "status": page.locator("#status").inner_text().strip()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtpflow.playground.screenshot", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:7860/")
    p.add_argument("--a", default="pld")
    p.add_argument("--b", default="baseline")
    p.add_argument("--prompt", default=None, help="default: the first benchmark prompt")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default="test-artifacts/playground.png")
    args = p.parse_args(argv)
    from playwright.sync_api import sync_playwright

    from mtpflow.playground.runner import example_prompts

    prompt = args.prompt or example_prompts()[0]["prompt"]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1500, "height": 1300})
        timings = run_comparison(page, args.url, prompt, args.a, args.b, args.max_new_tokens)
        page.locator("#plot img").wait_for()
        time.sleep(0.5)  # let the plot image paint
        page.screenshot(path=args.out, full_page=True)
        browser.close()
    print(json.dumps({**timings, "screenshot": args.out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
