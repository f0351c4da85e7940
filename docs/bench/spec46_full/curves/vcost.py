"""The default model's verify-cost curve through the native_cpu backend, as a greedy decode runs it (argmax only):
ms per verify of the root plus K drafts on a CTX-token cache, the fastest of REP interleaved rounds.

    MTPFLOW_ADAPT_THREADS=0 CTX=256,1024 KS=0,1,2,4,8,16 REP=15 python vcost.py int8|float32
"""
import os
import sys

import torch

torch.set_num_threads(2)
from mtpflow.model import load_model
from mtpflow import backends
from mtpflow.cost_model import time_verify_forwards
prec = sys.argv[1] if len(sys.argv) > 1 else "int8"
ctxs = [int(c) for c in os.environ.get("CTX", "256").split(",")]
ks = [int(k) for k in os.environ.get("KS", "0,1,2,4,8,16").split(",")]
loaded = load_model(quantize="int8" if prec == "int8" else None, dtype="float32")
b = backends.create(loaded.model, "native_cpu", int8=loaded.int8)
for ctx in ctxs:
    t = time_verify_forwards(b, ks, ctx, int(os.environ.get("REP", "15")), argmax_only=True)
    base = min(t[0])
    print(prec, "ctx", ctx, " ".join(f"K{k}:{1000*min(v):.2f}ms({min(v)/base:.2f}x)" for k, v in t.items()), flush=True)
