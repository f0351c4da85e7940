"""How the native kernels degrade on a shared CPU: a float32 ``baseline`` pipeline's tokens/s in a fresh process and
in one that has run an int8 pipeline first, on a quiet machine and with a process of our own busy on one core.

    python -m mtpflow.tools.shared_cpu                           # quiet and busy, fresh and after int8
    python -m mtpflow.tools.shared_cpu repeats=3 max_new_tokens=64 env.GOMP_SPINCOUNT=0

Each case runs in a process of its own (``env.NAME=VALUE`` goes into those processes' environment: libgomp reads
``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when torch loads it). The busy load is ``while True: pass`` in a
child process, started before and stopped after each busy case. A case prints the fastest of ``repeats`` requests
of the same prompt after one warm-up request, and the int8 pipeline's tokens/s where it ran one.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from omegaconf import OmegaConf

DEFAULTS = {"repeats": 3, "max_new_tokens": 64, "prompt": "Explain how a bicycle works.", "env": {}}
CASES = ("fresh", "after_int8")


def child(case: str, repeats: int, max_new_tokens: int, prompt: str) -> dict:
    """One case in this process: tokens/s of the float32 pipeline (fastest of ``repeats``), after an int8 pipeline's
    two requests where ``case`` is ``after_int8``."""
    import mtpflow

    def speed(pipe, n):
        pipe(prompt)  # warm-up: kernels, caches, the engine's thread
        best = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            result = pipe(prompt)
            best = max(best, len(result.token_ids) / (time.perf_counter() - t0))
        return best

    out = {"case": case}
    if case == "after_int8":
        int8 = mtpflow.pipeline("baseline", overrides=[f"max_new_tokens={max_new_tokens}", "model.quantize=int8"])
        out["int8_tokens_per_s"] = round(speed(int8, 1), 1)
    float32 = mtpflow.pipeline("baseline", overrides=[f"max_new_tokens={max_new_tokens}"])
    out["float32_tokens_per_s"] = round(speed(float32, repeats), 1)
    return out


def run_case(case: str, opts, busy: bool) -> dict:
    env = {**os.environ, **{str(k): str(v) for k, v in opts.env.items()}}
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        done = subprocess.run([sys.executable, "-m", "mtpflow.tools.shared_cpu", f"child={case}",
                               f"repeats={opts.repeats}", f"max_new_tokens={opts.max_new_tokens}",
                               f"prompt={json.dumps(opts.prompt)}"], env=env, capture_output=True, text=True,
                              timeout=900)
    finally:
        if load is not None:
            load.kill()
            load.wait()
    if done.returncode != 0:
        raise SystemExit(f"shared_cpu: case {case} failed: {done.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": "one core busy" if busy else "quiet"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts = OmegaConf.merge(OmegaConf.create({**DEFAULTS, "child": None}), OmegaConf.from_dotlist(argv))
    if opts.child:
        print(json.dumps(child(opts.child, int(opts.repeats), int(opts.max_new_tokens), str(opts.prompt))))
        return 0
    print("load  case  float32 tokens/s  int8 tokens/s  after/fresh")
    for busy in (False, True):
        rows = {case: run_case(case, opts, busy) for case in CASES}
        fresh = rows["fresh"]["float32_tokens_per_s"]
        for case, row in rows.items():
            print(f"{row['load']}  {case}  {row['float32_tokens_per_s']}  {row.get('int8_tokens_per_s', '')}  "
                  f"{row['float32_tokens_per_s'] / fresh:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
