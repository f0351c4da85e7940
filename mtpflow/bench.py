"""The benchmark: mtpflow strategies against plain HF ``model.generate`` (greedy) in the same process, on the
prompt suite shipped in ``mtpflow/data/bench_prompts.jsonl``; a table per class and overall (tokens/s,
speedup vs HF, MAL, forward passes per token, token identity), a CSV and a PNG chart.

    python -m mtpflow.bench strategies=[baseline,pld,jacobi] max_new_tokens=128
    python -m mtpflow.bench mode=cost            # per-forward cost of the verify pass for K = 0..16
"""
from __future__ import annotations

import json
import sys
import time
from importlib import resources
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mtpflow.errors import UserError

DEFAULTS = {
    "strategies": ["baseline", "pld"],
    "max_new_tokens": 128,
    "prompts": None,  # a JSONL file (id, class, prompt); default: the shipped suite
    "classes": None,  # only these classes
    "limit": 0,  # prompts per class (0 = all)
    "out": "bench-results",
    "mode": "decode",  # decode | cost
    "overrides": [],  # extra config overrides for every strategy, e.g. ["trace=off"]
    "model": None,  # model.name override
    "cost_context": 256,
    "cost_ks": [0, 1, 2, 4, 8, 16],
    "repeats": 1,
}


def load_prompt_suite(path: str | None = None, classes=None, limit: int = 0) -> list[dict]:
    """The benchmark prompts as dicts with id, class and prompt."""
    if path:
        text = Path(path).read_text(encoding="utf-8")
    else:
        text = resources.files("mtpflow.data").joinpath("bench_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
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


def run_decode_bench(opts) -> "pandas.DataFrame":
    import pandas as pd
    from tqdm import tqdm

    from mtpflow.api import Pipeline
    from mtpflow.config import compose
    from mtpflow.runplugins import default_run_plugins

    suite = load_prompt_suite(opts.prompts, opts.classes, int(opts.limit))
    if not suite:
        raise UserError("no benchmark prompts selected")
    common = [f"max_new_tokens={int(opts.max_new_tokens)}", *list(opts.overrides)]
    if opts.model:
        common.append(f"model.name={opts.model}")
    pipes = {}
    for name in opts.strategies:
        cfg = compose([f"strategy={name}", *common])
        pipes[name] = Pipeline(cfg, run_plugins=default_run_plugins(cfg))
    first = next(iter(pipes.values()))
    loaded = first.loaded
    # warm-up: first calls pay one-time costs (allocator, kernels) that would bias whoever runs first
    warm = first.encode("Hello")
    hf_generate(loaded.model, warm, 8, loaded.eos_token_ids)
    for pipe in pipes.values():
        pipe(prompt_ids=warm)

    rows = []
    bar = tqdm(total=len(suite) * (len(pipes) + 1) * int(opts.repeats), desc="bench", unit="run", file=sys.stderr)
    for item in suite:
        ids = first.encode(item["prompt"])
        for _ in range(int(opts.repeats)):
            ref, hf_seconds = hf_generate(loaded.model, ids, int(opts.max_new_tokens), loaded.eos_token_ids)
            bar.update()
            rows.append({"id": item["id"], "class": item["class"], "strategy": "hf_generate", "tokens": len(ref),
                         "seconds": hf_seconds, "steps": len(ref), "mal": 1.0, "identical": True,
                         "hf_seconds": hf_seconds})
            for name, pipe in pipes.items():
                t0 = time.perf_counter()
                result = pipe(prompt_ids=ids)
                seconds = time.perf_counter() - t0
                bar.update()
                s = result.stats
                rows.append({
                    "id": item["id"], "class": item["class"], "strategy": name, "tokens": len(result.token_ids),
                    "seconds": seconds, "steps": s["verify_forwards"] + 1, "mal": s["mal"],
                    "identical": result.token_ids == ref, "hf_seconds": hf_seconds,
                    "acceptance_rate": s["acceptance_rate"], "avg_k": s["mtp_avg_k_used"],
                    "error_propagation_rate": s["mtp_error_propagation_rate"],
                    "compression_rate": s.get("compression_rate", 1.0),
                })
    bar.close()
    return pd.DataFrame(rows)


def summarize(df) -> "pandas.DataFrame":
    """Per class and overall: tokens/s, speedup vs HF (ratio of summed time per token), MAL, identity."""
    import pandas as pd

    out = []
    for (strategy, cls), g in list(df.groupby(["strategy", "class"])) + [
        ((s, "overall"), g) for s, g in df.groupby("strategy")
    ]:
        tokens, seconds = g["tokens"].sum(), g["seconds"].sum()
        hf = df[(df["strategy"] == "hf_generate") & df["id"].isin(g["id"])]
        hf_rate = hf["tokens"].sum() / hf["seconds"].sum()
        rate = tokens / seconds
        steps = g["steps"].sum() - len(g)  # verify forwards (the prefill is not a verify forward)
        out.append({
            "strategy": strategy, "class": cls, "prompts": len(g), "tokens": int(tokens),
            "tokens_per_s": round(rate, 2), "speedup_vs_hf": round(rate / hf_rate, 3),
            "mal": round((tokens - len(g)) / max(steps, 1), 3),
            "forwards_per_token": round(g["steps"].sum() / tokens, 3),
            "identical": f"{int(g['identical'].sum())}/{len(g)}",
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
    ax = data.plot.bar(figsize=(9, 4.5), rot=0)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speedup vs HF generate (greedy)")
    ax.set_title("mtpflow strategies vs plain HF generate, same process")
    plt.tight_layout()
    plt.savefig(path, dpi=110)
    plt.close()


def measure_verify_cost(loaded, ks=(0, 1, 2, 4, 8, 16), context: int = 256, repeats: int = 8) -> list[dict]:
    """Seconds per verify forward feeding the root plus K draft tokens on a ``context``-token cache."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    g = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    prompt = torch.randint(0, vocab, (context,), generator=g)
    target = Target(loaded.model)
    target.prefill(prompt)
    rows = []
    for k in ks:
        draft = Draft.chain(torch.randint(0, vocab, (k,), generator=g))
        times = []
        for i in range(repeats + 2):
            start = target.cache_len
            v = target.verify(1, draft, root_position=start)
            target.commit(start, draft.num_nodes, torch.zeros(0, dtype=torch.long))
            target.cache.crop(-1)
            target.cache_len = start
            if i >= 2:
                times.append(v.forward_seconds)
        times.sort()
        rows.append({"k": k, "tokens_per_forward": k + 1, "median_ms": round(1000 * times[len(times) // 2], 2),
                     "min_ms": round(1000 * times[0], 2)})
    base = rows[0]["median_ms"]
    for r in rows:
        r["cost_vs_k0"] = round(r["median_ms"] / base, 3)
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
    out = Path(str(opts.out))
    try:
        out.mkdir(parents=True, exist_ok=True)
        if opts.mode == "cost":
            import pandas as pd

            from mtpflow.model import load_model

            loaded = load_model(opts.model)
            table = pd.DataFrame(measure_verify_cost(loaded, tuple(opts.cost_ks), int(opts.cost_context)))
            print(table.to_string(index=False))
            table.to_csv(out / "verify_cost.csv", index=False)
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            plt.figure(figsize=(6, 3.5))
            plt.plot(table["k"], table["median_ms"], marker="o")
            plt.xlabel("K (draft tokens in the verify forward)")
            plt.ylabel("ms per verify forward")
            plt.title(f"verify-forward cost, {loaded.model_id}, {loaded.device}")
            plt.grid(alpha=0.3)
            plt.tight_layout()
            plt.savefig(out / "verify_cost.png", dpi=110)
            print(f"\nwrote {out / 'verify_cost.csv'} and {out / 'verify_cost.png'}")
            return 0
        if opts.mode != "decode":
            raise UserError(f"mode must be decode or cost, got {opts.mode!r}")
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
