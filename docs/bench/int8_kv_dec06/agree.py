"""What the int8 KV cache costs in agreement with float32: along each of the bench's prompts' float32 greedy answer
(128 tokens, the native float32 backend: token-identical to HF greedy), the share of positions where the int8
model's next token is float32's, for the int8 reference at ``before`` (float32 keys and values in its cache) and the
working tree's (int8 entries), as int8_bench's agreement table measures it; and how often the two int8 models agree.

    python docs/bench/int8_kv_dec06/agree.py [lo] [hi] [before-commit]
"""
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import mtpflow
from mtpflow.backends.native import int8_reference, kernel
from mtpflow.model import load_model
from mtpflow.tools.specbench import load_prompt_suite


def reference_at(commit: str, folder: Path):
    """int8_reference.py as it was at ``commit``, loaded as a module of its own."""
    path = folder / "int8_reference_before.py"
    path.write_text(subprocess.run(["git", "show", f"{commit}:mtpflow/backends/native/int8_reference.py"],
                                   capture_output=True, text=True, check=True, cwd=kernel.HERE).stdout)
    spec = importlib.util.spec_from_file_location("int8_reference_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@torch.inference_mode()
def main(lo: int, hi: int, before: str) -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        old = reference_at(before, Path(tmp))
    floats = load_model(dtype="float32")
    int8 = load_model(quantize="int8", dtype="float32")
    refs = {"before": old.Int8Reference(int8.int8), "after": int8_reference.Int8Reference(int8.int8)}
    pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=128", "trace=off"])
    same = {k: [0, 0] for k in refs}
    firsts: dict[str, list[int]] = {k: [] for k in refs}
    both = [0, 0]
    for item in load_prompt_suite()[lo:hi]:
        ids = pipe.encode(item["prompt"])
        answer = list(pipe(prompt_ids=ids).token_ids)
        full = torch.cat([ids, torch.tensor(answer[:-1], dtype=torch.long)])
        n = int(ids.numel())
        float_next = floats.model(full[None]).logits[0, n - 1:].argmax(-1)
        nexts = {}
        for name, ref in refs.items():
            ref.reset()
            nexts[name] = ref.forward(full)[0][n - 1:].argmax(-1)
            agree = nexts[name] == float_next
            same[name][0] += int(agree.sum())
            same[name][1] += agree.numel()
            differ = (~agree).nonzero()
            if differ.numel():
                firsts[name].append(int(differ[0]))
        agree = nexts["before"] == nexts["after"]
        both[0] += int(agree.sum())
        both[1] += agree.numel()
        print(item["id"], {k: round(float((v == float_next).float().mean()), 3) for k, v in nexts.items()}, flush=True)
    for name in refs:
        print(f"{name}: next token equal to float32's at {same[name][0] / same[name][1]:.4f} of {same[name][1]} "
              f"positions; first difference, median {statistics.median(firsts[name]) if firsts[name] else None}; "
              f"answers that never differ {hi - lo - len(firsts[name])}")
    print(f"before and after agree with each other at {both[0] / both[1]:.4f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 0, int(args[1]) if len(args) > 1 else 32, args[2] if len(args) > 2 else "4813f4e")
