"""In-process A/B of the float32 backend's panel copies on huge pages against plain pages.

One float32 pipeline; per prompt, both sides in turn (the order flipped every prompt): MTPFLOW_HUGE_PAGES set for
the side, the backend's panel copies and its certified head dropped, rebuilt by an untimed 8-token request, then
the prompt timed as a first-time request (shared state cleared), 128 new tokens, greedy.

    python docs/bench/huge_pages_dec06/f32_panels_ab.py STRATEGY [PROMPTS] [override ...]
"""
import os
import sys
import time

import mtpflow
from mtpflow.backends.native.memory import huge_page_bytes
from mtpflow.tools.specbench import load_prompt_suite


def main(strategy: str, n: int, overrides: list[str]) -> None:
    items = load_prompt_suite()
    pipe = mtpflow.pipeline(strategy, overrides=["max_new_tokens=128", "trace=off", *overrides])
    backend = pipe.backend

    def side(huge: bool) -> None:
        os.environ["MTPFLOW_HUGE_PAGES"] = "1" if huge else "0"
        backend._panels.clear()
        backend._rows._panels = None
        backend._head = None

    pipe(prompt_ids=pipe.encode("Hello there, how are you?"))
    res = {False: [0, 0.0], True: [0, 0.0]}
    for i, item in enumerate(items[:n]):
        ids = pipe.encode(item["prompt"])
        for huge in ((False, True) if i % 2 else (True, False)):
            side(huge)
            pipe(prompt_ids=ids[:8])
            if i == 0:
                panels = [p for _, p in backend._panels.values()]
                head = 0 if backend._head is None else huge_page_bytes(backend._head.panels)
                print(f"{'huge' if huge else '4 KB'}: panels {sum(p.numel() * p.element_size() for p in panels) / 2**20:.1f} MiB, "
                      f"{sum(huge_page_bytes(p) for p in panels) / 2**20:.1f} on huge pages; head {head / 2**20:.1f} MiB "
                      "on huge pages", flush=True)
            pipe.shared.clear()
            t0 = time.perf_counter()
            result = pipe(prompt_ids=ids)
            res[huge][0] += len(result.token_ids)
            res[huge][1] += time.perf_counter() - t0
    rate = {huge: tokens / seconds for huge, (tokens, seconds) in res.items()}
    print(f"{strategy}: 4 KB pages {rate[False]:.1f} tokens/s, huge pages {rate[True]:.1f}, "
          f"gain {rate[True] / rate[False]:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 8, sys.argv[3:])
