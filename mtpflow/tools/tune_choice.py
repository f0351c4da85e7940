"""``python -m mtpflow.tune strategy=mtp``: time every candidate of a strategy chosen by measurement
(``mtpflow.strategy_choice``) on this host for the configured model, backend and precision, and store the fastest
lossless one with every candidate's tokens/s in the tuning profile, where ``strategy=mtp`` reads it.

How: one held-out prompt per domain of ``mtpflow/data/domain_prompts.jsonl`` (never the benchmark's
``bench_prompts.jsonl``), one request at a time, greedy; before each candidate's pass the state an engine learns from
requests (suffix cache, recycling table, prefix KV) is cleared, so every request is a first-time one; the candidates
are interleaved, their order rotated each round, and the fastest of ``repeats`` rounds counts. A candidate whose
output differs from ``baseline``'s (where baseline is a candidate) is not lossless here and cannot win; one faster than
the default by ``MARGIN`` or less leaves the default in place.
"""
from __future__ import annotations

import time

from mtpflow.errors import UserError
from mtpflow.shared import prepared

MAX_NEW_TOKENS = 128  # as the benchmark decodes (python -m mtpflow.bench max_new_tokens=128)
REPEATS = 3
# A candidate replaces the default only when faster by more than this share: the default (suffix_cache) also drafts
# repeated and templated requests from the engine's earlier outputs, which first-time timing cannot see, and a
# difference under a few percent is within the spread of passes on a shared CPU.
MARGIN = 0.03


def tuning_prompts() -> list[str]:
    """One held-out prompt per domain of the shipped domain prompts (first of each, file order)."""
    from mtpflow.tools.domain_prompts import load_prompts

    first: dict[str, str] = {}
    for row in load_prompts("heldout"):
        first.setdefault(row["domain"], row["text"])
    return list(first.values())


def measure_choice(engine, cfg, prompts: list[str] | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
                   repeats: int = REPEATS) -> dict:
    """Time the candidates of ``cfg.strategy`` on ``engine`` and store the winner; returns {"path", "key", "name",
    "chosen", "tokens_per_second": {candidate: tokens/s}, "left_out": {candidate: why}, "prompts",
    "max_new_tokens", "repeats", "measured_at"}."""
    from omegaconf import OmegaConf
    from tqdm import tqdm

    from mtpflow.cost_model import profile_setting
    from mtpflow.host import update_profile
    from mtpflow.plugins.manager import build_stages
    from mtpflow.request import Request
    from mtpflow.strategy_choice import candidate_problem, choice_key, choice_settings

    name = str(cfg.strategy.get("name"))
    candidates, default = choice_settings(cfg.strategy)
    model_config = OmegaConf.to_container(cfg.model, resolve=True)
    left_out = {c: p for c in candidates
                if (p := candidate_problem(c, candidates, model_config, build_stages)) is not None}
    ids = [engine.prepare(Request(prompt=p))[0].prompt_ids for p in (prompts or tuning_prompts())]

    def run(candidate: str, n: int, prompt_ids) -> list:
        return [engine.submit(Request(prompt_ids=p, strategy=candidate, max_new_tokens=n, temperature=0.0)).result()
                for p in prompt_ids]

    for c in [c for c in candidates if c not in left_out]:  # warm-up: cost curves, heads, allocators
        try:
            run(c, 8, ids[:1])
        except UserError as exc:
            left_out[c] = f"cannot run: {exc}"
    runnable = [c for c in candidates if c not in left_out]
    if not runnable:
        raise UserError(f"no candidate of strategy {name} can run here: "
                        + "; ".join(f"{c} {why}" for c, why in left_out.items()))
    best: dict[str, float] = {c: 0.0 for c in runnable}
    outputs: dict[str, list[list[int]]] = {}
    with tqdm(total=repeats * len(runnable), desc=f"timing {name}'s candidates", unit="pass") as bar:
        for r in range(repeats):
            shift = r % len(runnable)
            for c in runnable[shift:] + runnable[:shift]:
                engine.shared.clear(keep=prepared)  # first-time requests
                t0 = time.perf_counter()
                results = run(c, max_new_tokens, ids)
                seconds = time.perf_counter() - t0
                best[c] = max(best[c], sum(len(x.token_ids) for x in results) / seconds)
                outputs.setdefault(c, [x.token_ids for x in results])
                bar.update()
    reference = outputs.get("baseline")
    for c in [c for c in runnable if reference is not None and outputs[c] != reference]:
        left_out[c] = "differed from baseline's output (not lossless here)"
    timed = {c: round(v, 2) for c, v in best.items()}
    chosen = max((c for c in runnable if c not in left_out), key=lambda c: best[c])
    if default in runnable and default not in left_out and best[chosen] <= best[default] * (1 + MARGIN):
        chosen = default
    record = {"chosen": chosen, "tokens_per_second": timed, "left_out": left_out, "margin": MARGIN, "prompts": len(ids),
              "max_new_tokens": int(max_new_tokens), "repeats": int(repeats),
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    key = choice_key(engine.backend, engine.loaded)

    def change(data):
        data["entries"].setdefault(key, {}).setdefault("choice", {})[name] = record

    path = update_profile(change, profile_setting(cfg))
    return {"path": path, "key": key, "name": name, **record}


def format_choice(result: dict) -> str:
    """The winner, where it went, and every candidate's tokens/s."""
    lines = [f"mtpflow.tune: {result['name']} -> {result['chosen']} (stored in {result['path']})",
             f"  {result['key']}",
             f"  tokens/s, fastest of {result['repeats']} interleaved passes over {result['prompts']} prompts x "
             f"{result['max_new_tokens']} new tokens, first-time requests (the default stays unless another is "
             f"faster by over {100 * result['margin']:g}%):"]
    for c, v in sorted(result["tokens_per_second"].items(), key=lambda kv: -kv[1]):
        mark = "  <- chosen" if c == result["chosen"] else ""
        lines.append(f"    {c:<14} {v:8.2f}{mark}")
    for c, why in result["left_out"].items():
        lines.append(f"  left out: {c} {why}")
    return "\n".join(lines)
