"""``python -m mtpflow.bench mode=batch``: throughput and latency of the engine at batch sizes 1..16 against
HF ``generate`` with the same prompts batched (left padding, greedy), in one process.

Every request arrives at t = 0. HF decodes them in static batches of B (one ``generate`` call per B prompts,
in order); the engine takes them all and runs at most B at a time (continuous batching). Latency is the
time from t = 0 to a request's last token; tokens/s counts each request's tokens up to its EOS. Token
identity is checked against HF's batch-1 run (no padding). One engine serves every setting: its model, KV
pool and batch cost model are loaded once.

Over the int8 model (``overrides=[model.quantize=int8]``) HF ``generate`` runs on the float model, loaded
beside it (the int8 model frees its float weights), and the engine's answers are checked against the int8
reference's greedy (``mtpflow.backends.int8_reference``), as the decode bench does.
"""
from __future__ import annotations

import sys
import time

import torch

from mtpflow.shared import prepared


def hf_batched(model, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids, pad_id: int):
    """Greedy ``generate`` over left-padded prompts: (token ids per prompt, cut at the first EOS; seconds)."""
    width = max(int(p.numel()) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        mask[i, width - p.numel():] = 1
    eos = set(eos_ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, eos_token_id=list(eos) or None)
    seconds = time.perf_counter() - t0
    results = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:cut])
    return results, seconds


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def run_batch_bench(opts, load_prompt_suite, context: dict | None = None) -> "pandas.DataFrame":
    """Per batch size: HF ``generate`` batched (left padding, greedy) over the suite, then every strategy
    (without and with the batch-aware K) through one engine at that ``max_batch_size``. State shared across
    requests is cleared before each setting, so every figure is for first-time requests. ``context`` (a dict)
    receives the engine's config and loaded model, for the run's manifest, and the prompt ids and HF's answers,
    for the peers' runs."""
    import pandas as pd
    from tqdm import tqdm

    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request

    suite = load_prompt_suite(opts.prompts, opts.classes, int(opts.limit))
    sizes = sorted({int(b) for b in opts.batch_sizes})
    # the prefix KV cache off unless an override turns it on (overrides=[prefix_cache_mb=256]): HF batched
    # prefills every prompt whole
    common = [f"max_new_tokens={int(opts.max_new_tokens)}", "trace=off", f"max_batch_size={max(sizes)}",
              "prefix_cache_mb=0", *list(opts.overrides)]
    if opts.model:
        common.append(f"model.name={opts.model}")
    cfg = compose(["strategy=baseline", *common])
    engine = Engine(cfg)
    loaded = engine.loaded
    if context is not None:
        context.update(cfg=cfg, loaded=loaded)
    tokenizer = loaded.tokenizer
    prompts = [engine.prepare(Request(prompt=item["prompt"]))[0].prompt_ids for item in suite]
    hf_model, engine_reference = loaded.model, None
    if loaded.int8 is not None:
        from mtpflow import backends
        from mtpflow.model import load_configured

        hf_model = load_configured(compose(["strategy=baseline", *common, "model.quantize=null"]).model).model
        int8 = backends.int8_reference(loaded.int8)
        engine_reference = [int8.greedy(p, int(opts.max_new_tokens), loaded.eos_token_ids) for p in prompts]
    n_new = int(opts.max_new_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else loaded.eos_token_ids[0]
    settings = [(name, "off") for name in opts.strategies]
    settings += [(name, "auto") for name in opts.strategies if name != "baseline" and "auto" in opts.batch_k]
    # warm-up (allocator, kernels, cost measurements) outside the timed runs
    hf_batched(hf_model, prompts[:2], 8, loaded.eos_token_ids, pad)
    engine.batch_k = "auto"
    engine.generate([Request(prompt_ids=p, strategy=s, max_new_tokens=8) for p in prompts[:2]
                     for s, _ in settings])
    rows = []
    reference: list[list[int]] | None = None
    hf_outputs: dict[int, list[list[int]]] = {}  # batch size -> HF's outputs at it (the peers' rows compare)
    bar = tqdm(total=len(sizes) * (1 + len(settings)), desc="batch bench", unit="run", file=sys.stderr)
    for b in sizes:
        outputs, ends, t0 = [], [], time.perf_counter()
        for start in range(0, len(prompts), b):
            chunk, _ = hf_batched(hf_model, prompts[start:start + b], n_new, loaded.eos_token_ids, pad)
            outputs += chunk
            ends += [time.perf_counter() - t0] * len(chunk)
        total = time.perf_counter() - t0
        if reference is None and b == 1:
            reference = outputs
        hf_outputs[b] = outputs
        rows.append(_row(b, "hf_generate", "-", outputs, ends, total, reference, mal=1.0))
        bar.update()
        for name, batch_k in settings:
            engine.max_batch_size, engine.batch_k = b, batch_k
            # first-time requests: what an earlier setting decoded must not sit in the suffix cache or the
            # recycling table (mtp grafts both), or a later setting would draft the outputs it has seen
            engine.shared.clear(keep=prepared)
            t0 = time.perf_counter()
            handles = engine.submit_many([Request(prompt_ids=p, strategy=name) for p in prompts])
            results = [h.result() for h in handles]
            ends = [h.finished_at - t0 for h in handles]
            total = time.perf_counter() - t0
            steps = sum(r.stats["verify_forwards"] for r in results)
            mal = (sum(r.stats["new_tokens"] for r in results) - len(results)) / max(steps, 1)
            rows.append(_row(b, name, batch_k, [r.token_ids for r in results], ends, total,
                             engine_reference or reference, mal=mal,
                             against="int8_reference" if engine_reference else "hf_generate"))
            bar.update()
    bar.close()
    if context is not None:  # what the peers' runs need (mode=batch peers=[...]): the same prompts and answers
        context.update(prompts=[p.tolist() for p in prompts], hf_outputs=hf_outputs, reference=reference,
                       eos_token_ids=list(loaded.eos_token_ids))
    df = pd.DataFrame(rows)
    hf = df[df["setting"] == "hf_generate"].set_index("batch_size")["tokens_per_second"]
    df["vs_hf_batched"] = [round(r.tokens_per_second / hf[r.batch_size], 3) for r in df.itertuples()]
    return df


def _row(batch_size, setting, batch_k, outputs, ends, total, reference, mal, against="hf_generate"):
    tokens = sum(len(o) for o in outputs)
    identical = None if reference is None else sum(o == r for o, r in zip(outputs, reference)) / len(outputs)
    return {"batch_size": batch_size, "setting": setting if batch_k in ("-", "off") else f"{setting}+batch_k",
            "tokens": tokens, "seconds": round(total, 3), "tokens_per_second": round(tokens / total, 2),
            "latency_p50": round(percentile(ends, 0.5), 3), "latency_p95": round(percentile(ends, 0.95), 3),
            "mal": round(mal, 3), "identical_to_hf": identical, "reference": against}


def plot_batch(df, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for setting, part in df.groupby("setting", sort=False):
        style = "--" if setting == "hf_generate" else "-"
        left.plot(part["batch_size"], part["tokens_per_second"], style, marker="o", label=setting)
        right.plot(part["batch_size"], part["latency_p95"], style, marker="o", label=setting)
    for ax, title in ((left, "total tokens/s"), (right, "p95 latency (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
