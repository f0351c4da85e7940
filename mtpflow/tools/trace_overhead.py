"""What trace recording costs: the benchmark prompts decoded with ``trace=off`` and ``trace=sqlite`` in one
process on one loaded model, alternating which goes first, plus the time spent inside the recorder's hooks.
Wall time and process CPU time are both reported: on a shared machine the CPU-time ratio is the steadier one.

    python -m mtpflow.tools.trace_overhead strategies=[pld,jacobi] limit=2 max_new_tokens=128
"""
from __future__ import annotations

import functools
import sys
import tempfile
import time
from pathlib import Path

from omegaconf import OmegaConf

DEFAULTS = {"strategies": ["pld"], "limit": 2, "max_new_tokens": 128, "db": None, "repeats": 1}
TIMED_HOOKS = ("on_run_start", "on_step_end", "on_run_end")


def timed_factory(factory, seconds: list[float]):
    """Wrap a recorder factory so every recorder adds the wall and CPU time of its hooks to ``seconds[0:2]``."""

    def make(pipeline):
        recorder = factory(pipeline)
        for name in TIMED_HOOKS:
            method = getattr(recorder, name)

            @functools.wraps(method)  # keeps pluggy's hookimpl marker
            def timed(*args, _method=method, **kwargs):
                t0, c0 = time.perf_counter(), time.process_time()
                try:
                    return _method(*args, **kwargs)
                finally:
                    seconds[0] += time.perf_counter() - t0
                    seconds[1] += time.process_time() - c0

            setattr(recorder, name, timed)
        return recorder

    return make


def measure(strategies, limit: int, max_new_tokens: int, db: str, repeats: int = 1) -> list[dict]:
    from tqdm import tqdm

    from mtpflow.api import Pipeline
    from mtpflow.tools.specbench import load_prompt_suite
    from mtpflow.config import compose
    from mtpflow.plugins.manager import default_run_plugins

    suite = load_prompt_suite(None, None, limit)
    rows = []
    bar = tqdm(total=len(strategies) * len(suite) * 2 * repeats, desc="trace overhead", unit="run", file=sys.stderr)
    loaded = None
    for name in strategies:
        common = [f"strategy={name}", f"max_new_tokens={max_new_tokens}"]
        cfg_off = compose(common + ["trace=off"])
        cfg_on = compose(common + ["trace=sqlite", f"trace.db={db}"])
        off = Pipeline(cfg_off, run_plugins=default_run_plugins(cfg_off), loaded=loaded)
        loaded = off.loaded
        hook_seconds = [0.0, 0.0]
        on = Pipeline(cfg_on, loaded=loaded,
                      run_plugins=tuple(timed_factory(f, hook_seconds) for f in default_run_plugins(cfg_on)))
        warm = off.encode("Hello")
        off(prompt_ids=warm)
        on(prompt_ids=warm)
        totals = {"off": 0.0, "on": 0.0}
        cpu = {"off": 0.0, "on": 0.0}
        tokens = {"off": 0, "on": 0}
        steps = 0
        hook_seconds[:] = [0.0, 0.0]
        for i, item in enumerate(suite * repeats):
            ids = off.encode(item["prompt"])
            order = [("off", off), ("on", on)] if i % 2 == 0 else [("on", on), ("off", off)]
            for label, pipe in order:
                t0, c0 = time.perf_counter(), time.process_time()
                result = pipe(prompt_ids=ids)
                totals[label] += time.perf_counter() - t0
                cpu[label] += time.process_time() - c0
                tokens[label] += len(result.token_ids)
                if label == "on":
                    steps += len(result.steps)
                bar.update()
        rows.append({
            "strategy": name, "prompts": len(suite) * repeats, "tokens": tokens["on"], "steps": steps,
            "off_seconds": round(totals["off"], 3), "on_seconds": round(totals["on"], 3),
            "end_to_end_overhead": round(totals["on"] / totals["off"] - 1, 4),
            "off_cpu_seconds": round(cpu["off"], 3), "on_cpu_seconds": round(cpu["on"], 3),
            "cpu_overhead": round(cpu["on"] / cpu["off"] - 1, 4),
            "hook_seconds": round(hook_seconds[0], 4),
            "hook_share_of_decode": round(hook_seconds[0] / totals["on"], 4),
            "hook_cpu_share_of_decode": round(hook_seconds[1] / cpu["on"], 4),
            "hook_ms_per_step": round(1000 * hook_seconds[0] / max(steps, 1), 3),
        })
    bar.close()
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    with tempfile.TemporaryDirectory() as tmp:
        db = str(opts.db or Path(tmp) / "overhead.db")
        rows = measure(list(opts.strategies), int(opts.limit), int(opts.max_new_tokens), db, int(opts.repeats))
    keys = list(rows[0])
    print("  ".join(keys))
    for r in rows:
        print("  ".join(str(r[k]) for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
