"""Would the int8 draft gain from starting its cache from the float32 target's entries? For the bench's first N
prompts: the float32 greedy answer; then, at every answer position, the int8 model's next token after one forward
over a cache holding (a) the float32 model's own keys and values of every earlier token, quantized into the int8
cache's entries (per entry: int8 values, scale max|x| / 127, rounded half to even), or (b) its own entries (the
int8 model's prefill of the same tokens). Prints the share of positions where each picks the float32 token.

    python docs/bench/step_dec07/agree_float_cache.py [N]
"""
import json
import sys

import torch

import mtpflow
from mtpflow.backends.native import int8
from mtpflow.backends.native.rows import one_row
from mtpflow.target import Target


def entries(x: torch.Tensor) -> torch.Tensor:
    """float keys or values [heads, tokens, d] -> the int8 pool's entries [heads, tokens, d + 4]"""
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], -1)


@torch.inference_mode()
def main(n: int) -> None:
    pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=128", "trace=off"])
    prompts = [json.loads(line)["prompt"] for line in open("mtpflow/data/bench_prompts.jsonl")][:n]
    answers = [(pipe.encode(p), pipe(p).token_ids) for p in prompts]
    draft = int8.NativeInt8Backend(pipe.loaded.model, int8.int8_model(pipe.loaded.model, None))
    total = from_float = own_hits = 0
    for ids, out in answers:
        seq = torch.cat([ids, torch.tensor(out)])
        target = Target(pipe.backend, pool=pipe.backend.make_pool(1))
        target.prefill(seq[:-1])
        mixed = Target(draft, pool=draft.make_pool(1))
        mixed.pool.ensure(len(seq) + 1)
        for layer in range(len(target.pool.keys)):
            for src, dst in ((target.pool.keys, mixed.pool.keys), (target.pool.values, mixed.pool.values)):
                dst[layer][0, :, :len(seq) - 1] = entries(src[layer][target.kv.slot, :, :len(seq) - 1].float())
        own = Target(draft, pool=draft.make_pool(1))
        own.prefill(seq[:-1])
        for j in range(len(ids) - 1, len(seq) - 1):  # token j fed, positions before it cached; seq[j + 1] wanted
            a, _ = draft.run(mixed.pool, one_row(int(seq[j]), j, mixed.kv.slot, j))
            b, _ = draft.run(own.pool, one_row(int(seq[j]), j, own.kv.slot, j))
            total += 1
            from_float += int(a[0].argmax()) == int(seq[j + 1])
            own_hits += int(b[0].argmax()) == int(seq[j + 1])
    print(f"{n} prompts, {total} answer tokens: the int8 model picks the float32 token {from_float / total:.4f} of "
          f"the time over the float32 entries (quantized), {own_hits / total:.4f} over its own")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 8)
