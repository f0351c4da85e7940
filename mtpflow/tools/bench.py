"""The benchmark: mtpflow strategies against plain HF ``model.generate`` (greedy) in the same process, on the
prompt suite shipped in ``mtpflow/data/bench_prompts.jsonl``; a table per class and overall (tokens/s,
speedup vs HF, MAL, forward passes per token, token identity), a CSV and a PNG chart.

    python -m mtpflow.bench strategies=[baseline,pld,jacobi] max_new_tokens=128
    python -m mtpflow.bench "strategies=[mtp,'mtp|strategy.propose.suffix=null']" repeats=2 "repeated=[mtp]"  # variants
    python -m mtpflow.bench mode=cost            # per-forward cost of the verify pass for K = 0..16
    python -m mtpflow.bench mode=batch strategies=[baseline,pld,mtp]   # engine vs HF batched, batch 1..16
    python -m mtpflow.bench mode=serve           # python -m mtpflow.serve under 1/4/8/16 clients
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mtpflow.config import check_batch_k
from mtpflow.errors import ConfigError, UserError, check_int, writable_folder

DEFAULTS = {
    "strategies": ["baseline", "pld"],
    "max_new_tokens": 128,
    "prompts": None,  # a JSONL file (id, class, prompt); default: the shipped suite
    "classes": None,  # only these classes
    "limit": 0,  # prompts per class (0 = all)
    "out": "bench-results",
    "mode": "decode",  # decode | cost | batch
    "batch_sizes": [1, 2, 4, 8, 16],  # mode=batch: engine max_batch_size / HF batch sizes
    "batch_k": ["off", "auto"],  # mode=batch: each strategy without and with the engine's batch-aware K
    "overrides": [],  # extra config overrides for every strategy, e.g. ["trace=off"]
    "model": None,  # model.name override
    "cost_context": 256,
    "cost_ks": [0, 1, 2, 4, 8, 16],
    "repeats": 1,  # passes over the prompts (order rotated, shared caches cleared); the summary keeps the fastest
    "repeated": [],  # these strategies run every prompt once more at the end, caches kept: repeated requests
    "cpu_linear": "both",  # mode=cost: both | packed | stock (see mtpflow.kernels.cpu_linear)
}


def load_prompt_suite(path: str | None = None, classes=None, limit: int = 0) -> list[dict]:
    """The benchmark prompts as dicts with id, class and prompt."""
    if path:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the prompt file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    else:
        text = resources.files("mtpflow.data").joinpath("bench_prompts.jsonl").read_text(encoding="utf-8")
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in rows):
            raise ValueError
        rows = [{"id": str(r.get("id", i)), "class": str(r.get("class", "all")), **{k: v for k, v in r.items()
                 if k not in ("id", "class")}} for i, r in enumerate(rows)]
    except ValueError:
        raise UserError(f"{path}: every line must be a JSON object with a 'prompt' (and optionally 'id', "
                        "'class')") from None
    if classes:
        rows = [r for r in rows if r["class"] in set(classes)]
    if limit:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["class"]] = seen.get(r["class"], 0) + 1
            if seen[r["class"]] <= limit:
                kept.append(r)
        rows = kept
    return rows


def hf_generate(model, ids: torch.Tensor, max_new_tokens: int, eos_ids) -> tuple[list[int], float]:
    x = ids[None].to(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=list(eos_ids), pad_token_id=eos_ids[0])
    return out[0, x.shape[1]:].tolist(), time.perf_counter() - t0


def lookup_ceiling_steps(prompt_ids, output_ids, max_ngram: int = 4, max_draft: int = 16) -> int:
    """Decode steps an *oracle* prompt-lookup proposer would need for ``output_ids``: at each step it may
    draft the continuation of any earlier occurrence of the last n tokens (1 <= n <= max_ngram, up to
    ``max_draft`` tokens) and is told which one matches the real output longest. No lookup proposer (PLD,
    suffix trees, n-gram trees) can beat it, so (tokens - 1) / (steps - 1) bounds their MAL on this output.
    The first token comes from the prefill, as in the decode loop."""
    context, out = list(prompt_ids) + list(output_ids[:1]), list(output_ids)
    i = steps = min(1, len(out))
    while i < len(out):
        best = 0
        for n in range(1, max_ngram + 1):
            if len(context) <= n:
                break
            suffix = context[-n:]
            for j in range(len(context) - n):
                if context[j:j + n] == suffix:
                    length = 0
                    while (length < max_draft and i + length < len(out) and j + n + length < len(context)
                           and context[j + n + length] == out[i + length]):
                        length += 1
                    best = max(best, length)
        take = min(best, len(out) - i - 1) + 1  # accepted drafts plus the target's own token
        context += out[i:i + take]
        i += take
        steps += 1
    return steps


def strategy_variant(entry: str) -> tuple[str, list[str]]:
    """A ``strategies`` entry: a strategy name, optionally followed by config overrides for it alone, separated
    by ``|`` (``mtp|+strategy.propose.suffix={}``); the whole entry labels its rows."""
    name, *overrides = [part.strip() for part in str(entry).split("|")]
    if not name or not all(overrides):
        raise ConfigError(f"strategies: {entry!r} must be a strategy name, optionally followed by |override|...")
    return name, overrides


def run_decode_bench(opts) -> "pandas.DataFrame":
    """Every prompt through HF ``generate`` and every strategy, ``repeats`` passes over the suite. State a
    strategy keeps across requests on purpose (the suffix cache, the token-recycling table) is cleared before each
    pass, so every pass measures first-time requests (earlier prompts of the pass are in the cache, this one is
    not). ``repeated=[labels]`` adds a last pass in which those strategies see every prompt a second time,
    without clearing: the figures for repeated requests (rows labelled ``<label>, repeated``)."""
    import pandas as pd
    from tqdm import tqdm

    from mtpflow.api import Pipeline
    from mtpflow.config import compose
    from mtpflow.runplugins import default_run_plugins

    suite = load_prompt_suite(opts.prompts, opts.classes, int(opts.limit))
    if not suite:
        raise UserError("no benchmark prompts selected")
    # the prefix KV cache off unless an override turns it on: the figures compare decoding with HF's, which
    # prefills every prompt whole (overrides=[prefix_cache_mb=256] measures it on)
    common = [f"max_new_tokens={int(opts.max_new_tokens)}", "prefix_cache_mb=0", *list(opts.overrides)]
    if opts.model:
        common.append(f"model.name={opts.model}")
    pipes = {}
    for entry in opts.strategies:
        name, own = strategy_variant(entry)
        cfg = compose([f"strategy={name}", *common, *own])
        pipes[str(entry)] = Pipeline(cfg, run_plugins=default_run_plugins(cfg))
    repeated = [str(r) for r in opts.repeated]
    first = next(iter(pipes.values()))
    loaded = first.loaded
    # warm-up: first calls pay one-time costs (allocator, kernels) that would bias whoever runs first
    warm = first.encode("Hello")
    hf_generate(loaded.model, warm, 8, loaded.eos_token_ids)
    for pipe in pipes.values():
        pipe(prompt_ids=warm)
    encoded = [first.encode(item["prompt"]) for item in suite]

    def run(label: str, item: dict, ids, rep: int) -> dict:
        t0 = time.perf_counter()
        result = pipes[label](prompt_ids=ids)
        seconds = time.perf_counter() - t0
        s = result.stats
        return {
            "id": item["id"], "class": item["class"], "strategy": label, "repeat": rep,
            "tokens": len(result.token_ids), "seconds": seconds, "steps": s["verify_forwards"] + 1,
            "mal": s["mal"], "token_ids": list(result.token_ids),
            "acceptance_rate": s["acceptance_rate"], "avg_k": s["mtp_avg_k_used"],
            "error_propagation_rate": s["mtp_error_propagation_rate"],
            "compression_rate": s.get("compression_rate", 1.0),
        }

    rows = []
    total = len(suite) * ((len(pipes) + 1) * int(opts.repeats) + len(repeated))
    bar = tqdm(total=total, desc="bench", unit="run", file=sys.stderr)
    for rep in range(int(opts.repeats)):
        for pipe in pipes.values():
            pipe.shared.clear()
        for item, ids in zip(suite, encoded):
            # rotate the order each repeat, so no strategy always runs right after the same one
            order = ["hf_generate", *pipes]
            order = order[rep % len(order):] + order[:rep % len(order)]
            for name in order:
                if name == "hf_generate":
                    ref, hf_seconds = hf_generate(loaded.model, ids, int(opts.max_new_tokens), loaded.eos_token_ids)
                    rows.append({"id": item["id"], "class": item["class"], "strategy": "hf_generate",
                                 "repeat": rep, "tokens": len(ref), "seconds": hf_seconds, "steps": len(ref),
                                 "mal": 1.0, "token_ids": ref,
                                 "lookup_ceiling_steps": lookup_ceiling_steps(ids.tolist(), ref)})
                else:
                    rows.append(run(name, item, ids, rep))
                bar.update()
    for item, ids in zip(suite, encoded):  # every prompt has been seen: the same requests again
        for label in repeated:
            row = run(label, item, ids, 0)  # compared with the first pass's HF run
            rows.append({**row, "strategy": f"{label}, repeated"})
            bar.update()
    bar.close()
    df = pd.DataFrame(rows)
    ref_ids = {(r.id, r.repeat): r.token_ids for r in df[df["strategy"] == "hf_generate"].itertuples()}
    df["identical"] = [r.token_ids == ref_ids[(r.id, r.repeat)] for r in df.itertuples()]
    hf = df[df["strategy"] == "hf_generate"].set_index(["id", "repeat"])["seconds"]
    df["hf_seconds"] = [hf[(r.id, r.repeat)] for r in df.itertuples()]
    return df.drop(columns="token_ids")


def best_of_repeats(df) -> "pandas.DataFrame":
    """One row per (prompt, strategy): the fastest of its repeats (timing noise on a shared machine only ever
    adds time), token identity only if every repeat was identical."""
    if "repeat" not in df or df["repeat"].nunique() <= 1:
        return df
    fastest = df.loc[df.groupby(["id", "strategy"])["seconds"].idxmin()].copy()
    identical = df.groupby(["id", "strategy"])["identical"].all()
    fastest["identical"] = [identical[(r.id, r.strategy)] for r in fastest.itertuples()]
    return fastest.reset_index(drop=True)


def summarize(df) -> "pandas.DataFrame":
    """Per class and overall: tokens/s, speedup vs HF (ratio of summed time per token), MAL, identity. With
    ``repeats`` > 1 each prompt counts with its fastest repeat for every strategy, HF included."""
    import pandas as pd

    df = best_of_repeats(df)

    out = []
    for (strategy, cls), g in list(df.groupby(["strategy", "class"])) + [
        ((s, "overall"), g) for s, g in df.groupby("strategy")
    ]:
        tokens, seconds = g["tokens"].sum(), g["seconds"].sum()
        hf = df[(df["strategy"] == "hf_generate") & df["id"].isin(g["id"])]
        hf_rate = hf["tokens"].sum() / hf["seconds"].sum()
        rate = tokens / seconds
        steps = g["steps"].sum() - len(g)  # verify forwards (the prefill is not a verify forward)
        ceiling = None
        if strategy == "hf_generate" and "lookup_ceiling_steps" in g:  # MAL bound of any lookup proposer
            ceiling = round((tokens - len(g)) / max(g["lookup_ceiling_steps"].sum() - len(g), 1), 3)
        out.append({
            "strategy": strategy, "class": cls, "prompts": len(g), "tokens": int(tokens),
            "tokens_per_s": round(rate, 2), "speedup_vs_hf": round(rate / hf_rate, 3),
            "mal": round((tokens - len(g)) / max(steps, 1), 3),
            "forwards_per_token": round(g["steps"].sum() / tokens, 3),
            "identical": f"{int(g['identical'].sum())}/{len(g)}",
            "lookup_ceiling_mal": ceiling,
        })
    table = pd.DataFrame(out)
    order = {c: i for i, c in enumerate(sorted(df["class"].unique()))}
    order["overall"] = len(order)
    table["_o"] = table["class"].map(order)
    return table.sort_values(["strategy", "_o"]).drop(columns="_o").reset_index(drop=True)


def plot_speedups(table, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = table[table["strategy"] != "hf_generate"].pivot(index="class", columns="strategy", values="speedup_vs_hf")
    ax = data.plot.bar(figsize=(10, 4.5), rot=0)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.legend(title="strategy", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not over them
    ax.set_ylabel("speedup vs HF generate (greedy)")
    ax.set_title("mtpflow strategies vs plain HF generate, same process")
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def measure_verify_cost(loaded, ks=(0, 1, 2, 4, 8, 16), context: int = 256, repeats: int = 8) -> list[dict]:
    """Milliseconds per verify forward feeding the root plus K draft tokens on a ``context``-token cache:
    median and fastest of ``repeats`` interleaved rounds (``time_verify_forwards``, as the cost models
    measure); ``cost_vs_k0`` is the ratio of the fastest (load on a shared machine only ever adds time)."""
    from mtpflow.cost_model import time_verify_forwards

    times = time_verify_forwards(loaded.model, list(ks), context, repeats)
    rows = [{"k": k, "tokens_per_forward": k + 1, "median_ms": round(1000 * statistics.median(t), 2),
             "min_ms": round(1000 * min(t), 2)} for k, t in times.items()]
    base = rows[0]["min_ms"]
    for r in rows:
        r["cost_vs_k0"] = round(r["min_ms"] / base, 3)
    return rows


def cost_table(loaded, which: str, ks, context: int):
    """``measure_verify_cost`` for the stock and / or oneDNN-packed linears (``which``: both, packed, stock)."""
    import pandas as pd

    from mtpflow.kernels import cpu_linear

    if which not in ("both", "packed", "stock"):
        raise UserError(f"cpu_linear must be both, packed or stock, got {which!r}")
    can_pack = cpu_linear.prepare(loaded.model, "packed")
    if which == "packed" and not can_pack:
        raise UserError("packed linears need a float32 CPU model and a torch build with oneDNN")
    modes = {"stock": ["stock"], "packed": ["packed"], "both": ["stock"] + (["packed"] if can_pack else [])}[which]
    frames = []
    for mode in modes:
        with cpu_linear.packed(mode == "packed"):
            frame = pd.DataFrame(measure_verify_cost(loaded, ks, context))
        frames.append(frame.assign(linear=mode))
    return pd.concat(frames, ignore_index=True)


def check_options(opts) -> None:
    """Every option checked before the model loads (one line naming the option). A single strategy or class
    may be given without brackets (``strategies=pld``)."""
    from omegaconf import ListConfig

    if opts.mode not in ("decode", "cost", "batch"):
        raise UserError(f"mode must be decode, cost, batch or serve, got {opts.mode!r}")
    for name in ("strategies", "classes", "cost_ks", "overrides", "batch_sizes", "batch_k", "repeated"):
        value = opts[name]
        if value is not None and not isinstance(value, ListConfig):
            opts[name] = [value]
    if not opts.strategies:
        raise ConfigError("strategies must name at least one strategy, e.g. strategies=[baseline,pld]")
    for entry in opts.strategies:
        strategy_variant(entry)
    unknown = sorted({str(r) for r in opts.repeated} - {str(e) for e in opts.strategies})
    if unknown:
        raise ConfigError(f"repeated names {unknown}, which strategies does not list")
    check_int("max_new_tokens", opts.max_new_tokens, 1)
    check_int("limit", opts.limit, 0)
    check_int("repeats", opts.repeats, 1)
    check_int("cost_context", opts.cost_context, 1)
    for k in opts.cost_ks:
        check_int("cost_ks", k, 0)
    for b in opts.batch_sizes:
        check_int("batch_sizes", b, 1, 256)
    opts.batch_k = [check_batch_k(k) for k in opts.batch_k]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "mode=serve" in argv:  # the server load benchmark has options of its own
        from mtpflow.tools.bench_serve import main as serve_main

        return serve_main(argv)
    try:
        opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    except Exception as exc:
        print(f"mtpflow.bench: error: bad arguments: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    unknown = set(opts.keys()) - set(DEFAULTS)
    if unknown:
        print(f"mtpflow.bench: error: unknown option(s) {', '.join(sorted(unknown))}; known: {', '.join(DEFAULTS)}",
              file=sys.stderr)
        return 2
    out = Path(str(opts.out)).expanduser()
    try:
        check_options(opts)
        writable_folder(out)
        if opts.mode == "cost":
            import pandas as pd

            from mtpflow.model import load_model

            loaded = load_model(opts.model)
            table = cost_table(loaded, str(opts.cpu_linear), tuple(opts.cost_ks), int(opts.cost_context))
            print(table.to_string(index=False))
            table.to_csv(out / "verify_cost.csv", index=False)
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            plt.figure(figsize=(6, 3.5))
            for mode, part in table.groupby("linear", sort=False):
                plt.plot(part["k"], part["min_ms"], marker="o", label=f"{mode} linears")
            plt.xlabel("K (draft tokens in the verify forward)")
            plt.ylabel("ms per verify forward (fastest)")
            plt.title(f"verify-forward cost, {loaded.model_id}, {loaded.device}", fontsize=9)
            plt.legend()
            plt.grid(alpha=0.3)
            plt.tight_layout()
            plt.savefig(out / "verify_cost.png", dpi=110)
            print(f"\nwrote {out / 'verify_cost.csv'} and {out / 'verify_cost.png'}")
            return 0
        if opts.mode == "batch":
            from mtpflow.tools.bench_batch import plot_batch, run_batch_bench

            table = run_batch_bench(opts, load_prompt_suite)
            table.to_csv(out / "batch_summary.csv", index=False)
            plot_batch(table, out / "batch_throughput.png")
            print(table.to_string(index=False))
            print(f"\nwrote {out / 'batch_summary.csv'} and {out / 'batch_throughput.png'}")
            return 0
        df = run_decode_bench(opts)
        table = summarize(df)
        df.to_csv(out / "bench_runs.csv", index=False)
        table.to_csv(out / "bench_summary.csv", index=False)
        plot_speedups(table, out / "bench_speedup.png")
        print(table.to_string(index=False))
        print(f"\nwrote {out / 'bench_summary.csv'}, {out / 'bench_runs.csv'} and {out / 'bench_speedup.png'}")
        return 0
    except UserError as exc:
        print(f"mtpflow.bench: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
