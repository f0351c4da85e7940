"""A child process for the trace tests: decodes with the tiny model through the real pipeline and the trace
recorder built by ``default_run_plugins`` (so concurrency, SIGKILL and SIGINT are tested end to end).

    python trace_worker.py runs DB N        N short runs, one after another
    python trace_worker.py slow DB          one long, slowed-down run (to be killed or interrupted)
    python trace_worker.py stream DB        the same through Pipeline.stream (the CLI's path)
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ for helpers

import torch  # noqa: E402
from helpers import make_pipeline, tiny_loaded  # noqa: E402

from mtpflow.config import compose  # noqa: E402
from mtpflow.plugins import hookimpl  # noqa: E402
from mtpflow.plugins.manager import default_run_plugins  # noqa: E402

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8]


class SlowSteps:
    """Makes each step take a while, so a signal arrives mid-generation: the parent signals once it sees 3
    steps in the database, and the run (about 95 tokens to EOS on the tiny model) must still be going then,
    even when the parent is slow to see them (a loaded machine, a reader waiting on the writer's lock). So
    after the first few steps each one takes 0.5 s, leaving the parent most of a minute."""

    def __init__(self):
        self.steps = 0

    @hookimpl
    def on_step_end(self, record):
        self.steps += 1
        time.sleep(0.05 if self.steps <= 3 else 0.5)


def pipeline(db: str, *overrides: str):
    trace = [f"trace.db={db}", "trace.flush_seconds=0"]  # flush every step: the most write contention
    cfg = compose(["strategy=draft_model", *trace])
    return make_pipeline(tiny_loaded(), "draft_model", "strategy.propose.layers=1", *trace, *overrides,
                         run_plugins=default_run_plugins(cfg))


def main(mode: str, db: str, n: str = "1") -> None:
    torch.set_num_threads(1)  # two of these run at once on a small machine
    if mode == "runs":
        pipe = pipeline(db, "max_new_tokens=16")
        for i in range(int(n)):
            result = pipe(prompt_ids=[(t + i) % 300 + 1 for t in PROMPT])
            print(result.run_id, len(result.token_ids), flush=True)
    elif mode == "slow":
        pipe = pipeline(db, "max_new_tokens=800")
        print("ready", flush=True)
        pipe(prompt_ids=PROMPT, extra_plugins=(SlowSteps(),))
    elif mode == "stream":
        pipe = pipeline(db, "max_new_tokens=800")
        print("ready", flush=True)
        for _ in pipe.stream(prompt_ids=PROMPT, extra_plugins=(SlowSteps(),)):
            pass


if __name__ == "__main__":
    main(*sys.argv[1:])
