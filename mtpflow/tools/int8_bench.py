"""The int8 model against the float32 one and llama.cpp, in one run with one manifest (``model.quantize=int8``).

    python -m mtpflow.tools.int8_bench                                   # all 32 prompts, 128 new tokens
    python -m mtpflow.tools.int8_bench "peer_gguf=[Q8_0.gguf,Q4_1.gguf]" # llama.cpp at those precisions too
    python -m mtpflow.tools.int8_bench limit=2 max_new_tokens=32 out=/tmp/int8   # a quick look

What it runs, in this order, in one process (llama.cpp in its own, one after the other):
1. the host's memory bandwidth: ``torch.sum`` over 1 GiB of float32 at the run's threads, the fastest of 5, on 4 KB
   pages and on huge pages (``memory_bandwidth``), the faster of the two;
2. the decode benchmark (``mtpflow.bench``'s, batch 1, greedy): HF generate and float32 ``baseline``, then every
   strategy of ``strategies`` over the int8 model, each checked token for token against the int8 reference's
   greedy (``mtpflow.backends.int8_reference``); llama.cpp (``MTPFLOW_LLAMACPP_PYTHON``) on each ``peer_gguf``;
3. the batch: ``batch`` requests at once through one engine, float32 ``baseline`` and int8 ``baseline`` and the best
   int8 strategy of step 2, tokens/s over every prompt, checked against their references;
4. what int8 costs in agreement with float32, per prompt: the float32 greedy (HF generate's answer from step 2) fed
   to both models in one forward each: next-token agreement along it and the first position they disagree;
5. the decode phase alone at batch 1, float32 and int8 ``baseline``: each prompt to its first token and to the end,
   the difference per token after the first; the bytes a step streams (weights, KV cache) over that time, against
   the bandwidth of step 1.

Writes bench_runs.csv, bench_summary.csv, bench_speedup.png (step 2), int8_batch.csv, int8_agreement.csv,
int8_decode_steps.csv and
manifest.json (with the bandwidth, the int8 weight bytes per token and the backend's describe line: the kernel's
instruction set).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

from mtpflow.errors import UserError

DEFAULTS = {
    "strategies": ["baseline", "pld", "mtp", "suffix_cache", "adaptive", "mtp_heads"],  # over the int8 model
    "max_new_tokens": 128,
    "prompts": None,
    "classes": None,
    "limit": 0,
    "repeats": 1,
    "batch": 16,
    "out": "bench-results/int8",
    "overrides": ["trace=off"],
    "peers": [],  # [llamacpp] with MTPFLOW_LLAMACPP_PYTHON set
    "peer_gguf": None,  # one file or a list (Q8_0 and Q4_1 of the default model)
    "model": None,
}


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """GB/s of ``torch.sum`` over ``gib`` GiB of float32 at torch's threads, the fastest of ``repeats`` (the bytes a
    pass must read, over its time; a shared machine only ever adds time), over two buffers: ``plain`` on the pages
    torch's allocator gives (4 KB), ``huge`` on huge pages where the system grants them
    (``backends.streamed_empty``, where the int8 weights lie). ``best``, the larger, is what each
    decode step is compared with: the host's own fastest read, not a slower one the weights no longer take."""
    from mtpflow.backends import streamed_empty

    n = int(gib * 2**30 // 4)
    rates = {}
    for name, make in (("plain", lambda: torch.ones(n)), ("huge", lambda: streamed_empty(n, torch.float32).fill_(1.0))):
        data = make()
        data.sum()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            data.sum()
            best = min(best, time.perf_counter() - t0)
        rates[name] = data.numel() * 4 / best / 1e9
        del data
    rates["best"] = max(rates["plain"], rates["huge"])
    return rates


def batch_rows(loaded_runs, prompts, references, n_new: int, batch: int) -> list[dict]:
    """Every prompt through one engine at ``max_batch_size=batch`` for each (label, strategy, overrides) of
    ``loaded_runs``: tokens/s over the whole suite and how many outputs equal ``references[label]``."""
    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request

    rows = []
    for label, strategy, overrides, reference in loaded_runs:
        cfg = compose([f"strategy={strategy}", f"max_new_tokens={n_new}", f"max_batch_size={batch}",
                       "prefix_cache_mb=0", *overrides])
        engine = Engine(cfg)
        try:
            engine.generate([Request(prompt_ids=p, max_new_tokens=8) for p in prompts[:2]])  # warm-up
            t0 = time.perf_counter()
            results = engine.generate([Request(prompt_ids=p) for p in prompts])
            seconds = time.perf_counter() - t0
        finally:
            engine.close()
        tokens = sum(len(r.token_ids) for r in results)
        same = sum(r.token_ids == want for r, want in zip(results, references[reference]))
        rows.append({"setting": label, "strategy": strategy, "batch": batch, "prompts": len(prompts),
                     "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
                     "identical": f"{same}/{len(prompts)}", "reference": reference})
    return rows


def decode_step_rows(settings, units, n_new: int, bandwidth: float) -> list[dict]:
    """The decode phase alone, batch 1, per (label, overrides, bytes a step reads of weights): each prompt once to
    its first token (the prefill) and once to ``n_new`` tokens; a step's time is the difference over the tokens
    after the first. The bytes a step reads: the weights it streams, and its KV cache at the mean context."""
    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request

    rows = []
    for label, overrides, weight_bytes in settings:
        engine = Engine(compose(["strategy=baseline", f"max_new_tokens={n_new}", "prefix_cache_mb=0", *overrides]))
        try:
            engine.generate([Request(prompt_ids=units[0]["ids"], max_new_tokens=8)])  # warm-up
            steps_seconds, steps, contexts = 0.0, 0, []
            for u in units:
                t0 = time.perf_counter()
                engine.generate([Request(prompt_ids=u["ids"], max_new_tokens=1)])
                first = time.perf_counter() - t0
                t0 = time.perf_counter()
                result = engine.generate([Request(prompt_ids=u["ids"])])[0]
                full = time.perf_counter() - t0
                n = len(result.token_ids)
                if n > 1:
                    steps_seconds += max(full - first, 0.0)
                    steps += n - 1
                    contexts.append(int(u["ids"].numel()) + n / 2)
            context = sum(contexts) / max(len(contexts), 1)
            kv_bytes = int(engine.pool.token_bytes() * context)
        finally:
            engine.close()
        # the decode phase is the difference of two timings: on a tiny model and a busy machine it can come out
        # zero or less, which is no measurement (NaN), not a division by zero
        step = steps_seconds / steps if steps and steps_seconds > 0 else float("nan")
        rows.append({"setting": label, "decode_steps": steps, "step_ms": round(1000 * step, 3),
                     "decode_tokens_per_s": round(1 / step, 2), "weight_mb_per_step": round(weight_bytes / 1e6, 1),
                     "mean_context": round(context, 1), "kv_mb_per_step": round(kv_bytes / 1e6, 1),
                     "weights_gbs": round(weight_bytes / step / 1e9, 2),
                     "weights_and_kv_gbs": round((weight_bytes + kv_bytes) / step / 1e9, 2),
                     "share_of_bandwidth": round((weight_bytes + kv_bytes) / step / 1e9 / bandwidth, 3)})
    return rows


@torch.inference_mode()
def agreement_rows(float_loaded, int8_loaded, units) -> list[dict]:
    """Per prompt: along the float32 greedy answer, the share of positions where the int8 model's next token is
    the float32 model's, and the first position they differ (None: never)."""
    from mtpflow import backends

    reference = backends.int8_reference(int8_loaded.int8)
    rows = []
    for u in units:
        answer = list(u["reference"])
        ids = torch.cat([u["ids"], torch.tensor(answer[:-1], dtype=torch.long)])
        n = int(u["ids"].numel())
        float_next = float_loaded.model(ids[None]).logits[0, n - 1:].argmax(-1)
        reference.reset()
        int8_next = reference.forward(ids)[0][n - 1:].argmax(-1)
        same = (float_next == int8_next)
        differ = (~same).nonzero()
        rows.append({"id": u["id"], "class": u["class"], "positions": int(same.numel()),
                     "next_token_agreement": round(float(same.float().mean()), 4),
                     "first_divergence": int(differ[0]) if differ.numel() else None})
    return rows


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    except Exception as exc:
        print(f"mtpflow.tools.int8_bench: error: bad arguments: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    try:
        return run(opts, argv)
    except UserError as exc:
        print(f"mtpflow.tools.int8_bench: error: {exc}", file=sys.stderr)
        return 2


def run(opts, argv: list[str]) -> int:
    import pandas as pd

    from mtpflow.errors import writable_folder
    from mtpflow.tools import bench, manifest

    out = Path(str(opts.out))
    writable_folder(out)
    strategies = [str(s) for s in opts.strategies]
    bench_opts = OmegaConf.merge(OmegaConf.create(bench.DEFAULTS), {
        "strategies": ["baseline", *[f"{s}|model.quantize=int8" for s in strategies]],
        "max_new_tokens": int(opts.max_new_tokens), "prompts": opts.prompts, "classes": opts.classes,
        "limit": int(opts.limit), "repeats": int(opts.repeats), "overrides": list(opts.overrides),
        "peers": list(opts.peers), "peer_gguf": opts.peer_gguf, "model": opts.model, "out": str(out)})
    bench.check_options(bench_opts)
    checked, gguf = {}, None
    if bench_opts.peers:
        from mtpflow.tools import peers

        gguf = bench.peer_gguf(bench_opts) if "llamacpp" in bench_opts.peers else None
        checked = {name: peers.probe(name) for name in bench_opts.peers}
    rates = memory_bandwidth()
    bandwidth = rates["best"]
    print(f"memory bandwidth: {bandwidth:.1f} GB/s (torch.sum over 1 GiB, {torch.get_num_threads()} threads; "
          f"{rates['plain']:.1f} on 4 KB pages, {rates['huge']:.1f} on huge pages)", file=sys.stderr)
    suite = bench.load_prompt_suite(bench_opts.prompts, bench_opts.classes, int(bench_opts.limit))
    kept: dict = {}
    bench.run_decode_mode(bench_opts, out, argv, suite, checked, gguf, keep=kept)
    runs = pd.read_csv(out / "bench_runs.csv")
    summary = pd.read_csv(out / "bench_summary.csv")
    units = kept["units"]  # their prompt ids, HF's answer (the float32 greedy) and the int8 reference's greedy

    from mtpflow.api import Pipeline
    from mtpflow.config import compose

    common = [f"max_new_tokens={int(opts.max_new_tokens)}", *list(opts.overrides)]
    if opts.model:
        common.append(f"model.name={opts.model}")
    float_loaded = kept["first"].loaded
    int8_pipe = Pipeline(compose(["strategy=baseline", *common, "model.quantize=int8"]))  # the run's model (cached)
    int8_loaded = int8_pipe.loaded
    int8_rows = runs[(runs["strategy"] == "baseline|model.quantize=int8") & (runs["repeat"] == 0)]
    best = (summary[(summary["class"] == "overall") & summary["strategy"].str.endswith("|model.quantize=int8")]
            .sort_values("tokens_per_s").iloc[-1]["strategy"])
    best_name, best_overrides = bench.strategy_variant(best)
    batch = batch_rows([("float32 baseline", "baseline", common, "float32"),
                        ("int8 baseline", "baseline", [*common, "model.quantize=int8"], "int8"),
                        (f"int8 {best_name}", best_name, [*common, *best_overrides], "int8")],
                       [u["ids"] for u in units],
                       {"float32": [u["reference"] for u in units], "int8": [u["int8_reference"] for u in units]},
                       int(opts.max_new_tokens), int(opts.batch))
    pd.DataFrame(batch).to_csv(out / "int8_batch.csv", index=False)
    agreement = pd.DataFrame(agreement_rows(float_loaded, int8_loaded, units))
    agreement.to_csv(out / "int8_agreement.csv", index=False)
    # the bytes a batch-1 decode step streams: the int8 model's weights; float32's decoder weights and the certified
    # int8 head it reads for greedy rows (``backends.native.certified_head``)
    layers = float_loaded.model.model.layers
    float_bytes = 4 * sum(m.weight.numel() for b in layers for m in b.modules() if isinstance(m, torch.nn.Linear))
    float_bytes += float_loaded.model.lm_head.weight.numel()  # the certified head: one byte per weight
    settings = [("float32 baseline", common, float_bytes),
                ("int8 baseline", [*common, "model.quantize=int8"], int8_loaded.int8.nbytes)]
    steps = pd.DataFrame(decode_step_rows(settings, units, int(opts.max_new_tokens), bandwidth))
    steps.to_csv(out / "int8_decode_steps.csv", index=False)

    weights = int8_loaded.int8
    facts = {"memory_bandwidth_gbs": round(bandwidth, 2),
             "memory_bandwidth_plain_pages_gbs": round(rates["plain"], 2),
             "memory_bandwidth_huge_pages_gbs": round(rates["huge"], 2),
             "bandwidth_method": f"torch.sum over 1 GiB float32, {torch.get_num_threads()} threads, fastest of 5, "
                                 "the faster of 4 KB and huge pages",
             "int8_weights_huge_pages_mb": int8_pipe.backend.stats().get("int8_weights_huge_pages_mb"),
             "int8_weight_bytes_per_token": weights.nbytes,
             "int8_backend": int8_pipe.backend.describe(),
             "int8_baseline_identical": f"{int(int8_rows['identical'].sum())}/{len(int8_rows)}",
             "best_int8_strategy": best,
             "next_token_agreement_mean": round(float(agreement["next_token_agreement"].mean()), 4),
             "prompts_never_diverging": int(agreement["first_divergence"].isna().sum())}
    record = manifest.load(out / manifest.NAME)
    record["command"] = " ".join(["python", "-m", "mtpflow.tools.int8_bench", *argv])
    record["int8"] = facts
    files = [*record["files"], "int8_batch.csv", "int8_agreement.csv", "int8_decode_steps.csv"]
    manifest.write(out, {k: v for k, v in record.items() if k != "files"}, files)
    print(pd.DataFrame(batch).to_string(index=False))
    print(steps.to_string(index=False))
    print(f"\nagreement with float32: next-token {facts['next_token_agreement_mean']:.3f} on average; "
          f"{facts['prompts_never_diverging']}/{len(agreement)} prompts never diverge; "
          f"median first divergence at position {agreement['first_divergence'].median()}")
    print(f"int8 weights: {weights.nbytes / 1e6:.1f} MB per token; bandwidth {bandwidth:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
