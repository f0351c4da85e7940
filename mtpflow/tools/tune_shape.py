"""``python -m mtpflow.tune shape=1b|3b|8b``: the verify-cost curve (K = 0..32 draft tokens, ``CURVE_KS``) of a
Llama of that real size on this host, random weights built in code, float32 and int8 where memory allows, each
in a process of its own. The curve goes into the tuning profile under the key ``random-llama-<shape>`` and is
printed as milliseconds and as multiples of a one-token step (K = 0).

    python -m mtpflow.tune shape=1b                     # float32 and int8
    python -m mtpflow.tune shape=8b precisions=[int8]   # context=256 repeats=3 profile=PATH also work

float32 runs where its weights take under half of the memory; the int8 model is quantized layer by layer, each
layer's float weights freed as its int8 ones exist, from float32 weights where those fit and from bfloat16 ones
otherwise (8B: 16 GB, then 8 GB of int8).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

# Llama 3.2 1B / 3B and Llama 3.1 8B: their configs' dimensions (the 1B one is ``tools.realsize``'s)
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28, "num_attention_heads": 24,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": True},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False},
}
COMMON = {"max_position_embeddings": 4096, "rope_theta": 500000.0}
DEFAULTS = {"precisions": ["float32", "int8"], "context": None, "repeats": 3, "profile": None}


def parameters(shape: dict) -> int:
    h, i, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    per_layer = h * (h + 2 * kv) + h * h + 3 * h * i
    return layers * per_layer + v * h * (1 if shape["tie_word_embeddings"] else 2)


def memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def one(name: str, precision: str, context: int | None, repeats: int, profile: str | None) -> dict:
    """Build the random model, (quantize it,) measure and store its curve; in this process."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mtpflow import backends
    from mtpflow.cost_model import (
        CURVE_KS, VERIFY_CONTEXT, cost_key, device_name, tune_verify_costs, verify_cost_context,
    )

    shape = {**SHAPES[name], **COMMON}
    source = torch.float32 if parameters(shape) * 4 < memory_bytes() // 2 else torch.bfloat16
    if precision == "float32" and source != torch.float32:
        raise SystemExit(f"float32 weights of the {name} shape do not fit in half of this host's memory")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(source)
    try:
        with torch.no_grad():
            model = LlamaForCausalLM(LlamaConfig(**shape)).eval()
    finally:
        torch.set_default_dtype(default)
    int8 = backends.quantize_int8(model) if precision == "int8" else None
    backend = backends.create(model, int8=int8)
    model_id = f"random-llama-{name}"
    ctx = verify_cost_context(model, context or VERIFY_CONTEXT, CURVE_KS)
    key = cost_key(backend, model_id, device_name("cpu"), backend.takes_argmax_only())
    with backend.running(), torch.inference_mode():
        costs = tune_verify_costs(backend, key, CURVE_KS, ctx, repeats, backend.takes_argmax_only(), profile)
    backend.thread_idle()
    return {"shape": name, "precision": precision, "backend": backend.describe(), "context": ctx,
            "ms": {k: round(1000 * s, 3) for k, s in sorted(costs.items())}}


def main(argv: list[str]) -> int:
    """``python -m mtpflow.tune shape=...`` (``tools.tune`` hands it ``argv``); bad input is a UserError."""
    from omegaconf import OmegaConf

    from mtpflow.errors import UserError

    if argv[:1] == ["--one"]:
        name, precision, context, repeats, profile = json.loads(argv[1])
        print(json.dumps(one(name, precision, context, repeats, profile)), flush=True)
        return 0
    opts = OmegaConf.merge(OmegaConf.create({**DEFAULTS, "shape": None}), OmegaConf.from_dotlist(argv))
    name = str(opts.shape).lower()
    if name not in SHAPES:
        raise UserError(f"shape={opts.shape}: choose one of {', '.join(SHAPES)}")
    fits = parameters({**SHAPES[name]}) * 4 < memory_bytes() // 2
    for precision in opts.precisions:
        if precision not in ("float32", "int8"):
            raise UserError(f"precisions: {precision} is not float32 or int8")
        if precision == "float32" and not fits:
            print(f"mtpflow.tune: {name} float32 skipped: {parameters(SHAPES[name]) * 4 / 2**30:.1f} GiB of weights, "
                  f"{memory_bytes() / 2**30:.1f} GiB of memory")
            continue
        job = json.dumps([name, str(precision), opts.context, int(opts.repeats), opts.profile])
        done = subprocess.run([sys.executable, "-m", "mtpflow.tools.tune_shape", "--one", job], text=True,
                              stdout=subprocess.PIPE)
        if done.returncode != 0:
            raise UserError(f"{name} {precision}: the measuring process failed (its error is above)")
        row = json.loads(done.stdout.strip().splitlines()[-1])
        ms = {int(k): v for k, v in row["ms"].items()}
        print(f"{name} {precision} ({row['backend']}, {row['context']}-token context), verify ms by draft tokens K "
              f"and x a one-token step:")
        print("  " + " ".join(f"{'K=' + str(k):>7}" for k in ms))
        print("  " + " ".join(f"{v:7.2f}" for v in ms.values()))
        print("  " + " ".join(f"{v / ms[0]:6.2f}x" for v in ms.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
