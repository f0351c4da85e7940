"""In-process A/B of whole native source trees on a random Llama of ``tune shape=`` size, int8: the model is built
and quantized once (as ``mtpflow.tools.tune_shape`` builds it, bfloat16 weights before quantization), then
docs/bench/step_dec06/ab_tree.py's comparison runs over it (each tree its own library and KV pool prefilled with
CONTEXT random tokens, ROUNDS rounds alternating the trees, 10 timed verify forwards per draft length).

    python docs/bench/step_dec06b/ab_shape.py SHAPE ROUNDS CONTEXT K,K,... NAME=REV NAME=REV ...

REV is a commit, or ``work`` for the working tree.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "step_dec06"))
import ab_tree  # noqa: E402

from mtpflow import backends  # noqa: E402
from mtpflow.tools.tune_shape import COMMON, SHAPES  # noqa: E402


def shape_backend(shape: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.no_grad():
            model = LlamaForCausalLM(LlamaConfig(**{**SHAPES[shape], **COMMON})).eval()
    finally:
        torch.set_default_dtype(default)
    return backends.create(model, int8=backends.quantize_int8(model))


if __name__ == "__main__":
    a = sys.argv[1:]
    ab_tree.main(int(a[1]), int(a[2]), [int(x) for x in a[3].split(",")], dict(x.split("=", 1) for x in a[4:]),
                 backend=shape_backend(a[0]), timed=10)
