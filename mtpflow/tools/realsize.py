"""A real-size check of the int8 model: a Llama-shaped model of about 1B parameters (Llama 3.2 1B's shape, random
weights built in code), float32 against int8, each in a process of its own.

    python -m mtpflow.tools.realsize                       # writes bench-results/realsize/{realsize.csv,manifest.json}
    python -m mtpflow.tools.realsize context=64 repeats=2  # quicker

Per precision: the verify step's time through the backend ``auto`` picks (``native_cpu``; ``model.quantize=int8``:
the int8 model) at batch 1 and 16, one row per sequence (a plain decode step) and four (a chain of three drafts),
over caches of ``context`` tokens (``cost_model.measure_batch_costs``: the fastest of ``repeats``); and the
process's resident size once the model is ready (``VmRSS``), after the steps, and at its peak (``VmHWM``: the float
weights exist at first, the int8 ones are made layer by layer as they are freed).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

# Llama 3.2 1B: 16 layers of 2048, 32 query and 8 key/value heads of 64, MLP 8192, a tied 128,256-token head
SHAPE = {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
         "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True,
         "max_position_embeddings": 4096, "rope_theta": 500000.0}
DEFAULTS = {"out": "bench-results/realsize", "context": 128, "repeats": 3, "precisions": ["float32", "int8"],
            "shape": SHAPE}  # shape.KEY=VALUE changes one dimension (the tests run a tiny one)
BATCHES, ROWS = (1, 16), (1, 4)


def _status(field: str) -> float:
    """A ``/proc/self/status`` size in MB (0 where there is none)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def one(precision: str, context: int, repeats: int, shape: dict) -> dict:
    """Build, (quantize,) time and measure one precision in this process."""
    import time

    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpflow import backends
    from mtpflow.cost_model import measure_batch_costs

    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.no_grad():
        model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    params = sum(p.numel() for p in model.parameters())
    int8 = backends.quantize_int8(model) if precision == "int8" else None
    backend = backends.create(model, int8=int8)
    ready_seconds = time.perf_counter() - t0
    rss_ready = _status("VmRSS")
    times = measure_batch_costs(backend, BATCHES, ROWS, context=context, repeats=repeats, argmax_only=True)
    row = {"precision": precision, "backend": backend.describe(), "parameters": params,
           "weight_mb": round((int8.nbytes if int8 is not None else params * 4) / 2**20, 1),
           "build_seconds": round(ready_seconds, 1), "rss_ready_mb": round(rss_ready, 1),
           "rss_after_steps_mb": round(_status("VmRSS"), 1), "peak_rss_mb": round(_status("VmHWM"), 1),
           "context": context}
    for (b, q), seconds in sorted(times.items()):
        row[f"ms_b{b}_rows{q}"] = round(1000 * min(seconds), 2)
    row["decode_tokens_per_s_b1"] = round(1000 / row["ms_b1_rows1"], 2)
    row["decode_tokens_per_s_b16"] = round(16000 / row["ms_b16_rows1"], 2)
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--one"]:
        precision, context, repeats, shape = argv[1], int(argv[2]), int(argv[3]), json.loads(argv[4])
        print(json.dumps(one(precision, context, repeats, shape)), flush=True)
        return 0
    import pandas as pd

    from mtpflow.errors import writable_folder
    from mtpflow.tools import manifest

    opts = OmegaConf.merge(OmegaConf.create(DEFAULTS), OmegaConf.from_dotlist(argv))
    shape = OmegaConf.to_container(opts.shape)
    out = Path(str(opts.out))
    writable_folder(out)
    rows = []
    for precision in opts.precisions:
        done = subprocess.run([sys.executable, "-m", "mtpflow.tools.realsize", "--one", str(precision),
                               str(int(opts.context)), str(int(opts.repeats)), json.dumps(shape)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            print(f"mtpflow.tools.realsize: error: {precision}: {done.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
            return 1
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    table = pd.DataFrame(rows)
    if {"float32", "int8"} <= set(table["precision"]):
        f32, i8 = (table[table["precision"] == p].iloc[0] for p in ("float32", "int8"))
        print(f"int8 / float32: resident {i8['rss_after_steps_mb'] / f32['rss_after_steps_mb']:.2f}, "
              f"batch-1 step {f32['ms_b1_rows1'] / i8['ms_b1_rows1']:.2f}x faster, "
              f"batch-16 step {f32['ms_b16_rows1'] / i8['ms_b16_rows1']:.2f}x faster")
    table.to_csv(out / "realsize.csv", index=False)
    record = manifest.collect("realsize", argv, model={"shape": shape, "weights": "random (torch.manual_seed(0))"},
                              settings=OmegaConf.to_container(opts))
    record["command"] = " ".join(["python", "-m", "mtpflow.tools.realsize", *argv])
    manifest.write(out, record, ["realsize.csv"])
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
