"""``python -m mtpflow.tune [key=value ...]``: measure on this machine what the cost model needs for the configured
model and backend, and write it to the tuning profile (``mtpflow.host``): the verify-cost curve of one sequence's
forward by draft length, K = 0..32 (``cost_model.CURVE_KS``; for sequences that read logits, and for greedy ones
that read only the argmax where the backend has a cheaper head for them) and the batch grid of the engine's shared
forward; with ``strategy=mtp`` (a strategy chosen by measurement) it also times mtp's candidates and stores the
winner (``tools.tune_choice``). ``shape=1b|3b|8b`` measures the curve of a random Llama of that size instead (``tools.tune_shape``). Runs read the profile;
one that finds no entry measures it once, with a one-line notice.

Hydra overrides as for ``python -m mtpflow``: ``model.name=``, ``model.backend=``, ``model.dtype=``, ``strategy=``
(a strategy's own ``cost_context`` / ``auto_ks`` are measured too), ``profile=PATH`` (else ``MTPFLOW_PROFILE``, else
this host's file under the cache directory).
"""
from __future__ import annotations

import sys

USAGE = """usage: python -m mtpflow.tune [key=value ...]

  Measures verify-forward costs for the configured model on this machine (a minute or less for the
  default model) and writes them to the tuning profile, which every later run reads.

  model.name=ID|PATH   model.backend=auto|hf|native_cpu   model.dtype=...   (as for python -m mtpflow)
  strategy=NAME        also measure the strategy's own cost_context / auto_ks; strategy=mtp also times mtp's
                       candidates (a few minutes) and stores the fastest lossless one, which strategy=mtp runs
  profile=PATH         the profile file to write (default: $MTPFLOW_PROFILE, else one per host in the cache)

  shape=1b|3b|8b       instead: the verify-cost curve (K = 0..32) of a random Llama 3 of that size, float32 and
                       int8 where memory allows (precisions=[int8] for one), each in a process of its own
"""
VERIFY_REPEATS = 5  # as the loaders measure (mtpflow.cost_model): the fastest repeat counts
BATCH_REPEATS = 2


def verify_settings(strategy) -> dict[int, list[int]]:
    """{cost context: the Ks to measure there}: the whole curve (CURVE_KS, K = 0..32) at VERIFY_CONTEXT plus what
    a stage of ``strategy`` asks for with its own ``cost_context`` / ``auto_ks`` (``hardware_aware``)."""
    from omegaconf import OmegaConf

    from mtpflow.cost_model import COST_KS, CURVE_KS, VERIFY_CONTEXT

    wanted: dict[int, set[int]] = {VERIFY_CONTEXT: set(CURVE_KS)}

    def visit(node):
        if isinstance(node, dict):
            if "cost_context" in node or "auto_ks" in node:
                context = int(node.get("cost_context") or VERIFY_CONTEXT)
                wanted.setdefault(context, set()).update(int(k) for k in (node.get("auto_ks") or COST_KS))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(OmegaConf.to_container(strategy, resolve=True) if OmegaConf.is_config(strategy) else strategy)
    return {context: sorted(ks) for context, ks in sorted(wanted.items())}


def tune(engine, cfg) -> dict:
    """Measure and store every entry the cost model reads for ``engine``'s model and backend; returns
    {"path", "verify": {(argmax_only, context): {K: seconds}}, "batch": (argmax_only, context, BatchCostModel)}."""
    import torch
    from tqdm import tqdm

    from mtpflow.cost_model import (
        BATCH_CONTEXT, cost_key, device_name, profile_setting, tune_batch_costs, tune_verify_costs, verify_cost_context,
    )
    from mtpflow.host import profile_path
    from mtpflow.kernels.dispatch import use_impl

    backend, loaded = engine.backend, engine.loaded
    profile = profile_setting(cfg)
    device = device_name(str(loaded.device))
    reads = [False, True] if backend.takes_argmax_only() else [False]
    settings = verify_settings(cfg.strategy)
    out: dict = {"path": profile_path(profile), "verify": {}, "batch": None}
    batch_argmax = backend.takes_argmax_only()  # what the engine's batch cap reads (load_batch_costs)
    steps = len(reads) * len(settings) + 1
    with use_impl(cfg.get("kernels") or "auto"), backend.running(), torch.inference_mode(), \
            tqdm(total=steps, desc="tuning", unit="measurement") as bar:
        for argmax_only in reads:
            key = cost_key(backend, loaded.model_id, device, argmax_only)
            for context, ks in settings.items():
                ctx = verify_cost_context(loaded.model, context, ks)
                out["verify"][(argmax_only, ctx)] = tune_verify_costs(backend, key, ks, ctx, VERIFY_REPEATS,
                                                                      argmax_only, profile)
                bar.update()
        key = cost_key(backend, loaded.model_id, device, batch_argmax)
        out["batch"] = (batch_argmax, BATCH_CONTEXT,
                        tune_batch_costs(backend, key, BATCH_CONTEXT, BATCH_REPEATS, batch_argmax, profile))
        bar.update()
        backend.thread_idle()
    return out


def format_report(result: dict, backend, model_id: str) -> str:
    """Where the profile went and a short table of what was measured (milliseconds)."""
    from mtpflow.host import load_profile

    host = load_profile(str(result["path"]), quiet=True).get("host", {})
    lines = [f"mtpflow.tune: wrote {result['path']}",
             f"  host {host.get('cpu')} ({host.get('threads')} threads, torch {host.get('torch')}); "
             f"{model_id} on {backend.describe()}"]
    for (argmax_only, context), costs in result["verify"].items():
        ks = sorted(costs)
        lines.append(f"  verify forward, one sequence ({'argmax only' if argmax_only else 'logits'}, "
                     f"{context}-token context), ms by draft length K:")
        lines.append("    " + " ".join(f"{'K=' + str(k):>7}" for k in ks))
        lines.append("    " + " ".join(f"{1000 * costs[k]:7.2f}" for k in ks))
    argmax_only, context, model = result["batch"]
    lines.append(f"  batch verify forward ({'argmax only' if argmax_only else 'logits'}, {context}-token context), "
                 "ms by sequences B and rows per sequence q:")
    lines.append("    " + f"{'B':>4}" + "".join(f"{'q=' + str(q):>9}" for q in model.rows))
    for b in model.batch_sizes:
        lines.append("    " + f"{b:>4}" + "".join(f"{1000 * model.table[(b, q)]:9.2f}" for q in model.rows))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from mtpflow.errors import run_command

    return run_command("mtpflow.tune", measure, argv, USAGE,
                       interrupted="interrupted (the profile keeps what was measured before)")


def measure(argv: list[str]) -> int:
    """The command itself: compose and check the config, then tune the engine it builds."""
    from mtpflow.config import compose, validate
    from mtpflow.cost_model import profile_setting
    from mtpflow.engine import Engine
    from mtpflow.host import check_named_profile
    from mtpflow.strategy_choice import choice_settings

    if any(a.startswith("shape=") for a in argv):
        from mtpflow.tools import tune_shape

        return tune_shape.main(argv)
    cfg = compose(argv)
    validate(cfg)
    check_named_profile(profile_setting(cfg))  # a damaged or foreign named profile: one line, before the load
    choosing = choice_settings(cfg.strategy)
    engine_cfg = cfg
    if choosing is not None:  # the engine runs the default, not a choice it is about to measure (and no notice)
        engine_cfg = cfg.copy()
        engine_cfg.strategy = compose([f"strategy={choosing[1]}"]).strategy
    with Engine(engine_cfg, run_plugins=()) as engine:
        result = tune(engine, cfg)
        print(format_report(result, engine.backend, engine.loaded.model_id))
        if choosing is not None:
            from mtpflow.tools.tune_choice import format_choice, measure_choice

            print(format_choice(measure_choice(engine, cfg)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
