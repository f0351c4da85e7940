"""Would the int8 draft gain from starting its cache from the float32 target's entries? For the bench's first N
prompts: the float32 greedy answer; then, at every answer position, the int8 model's next token after one forward
over a cache holding (a) the float32 model's own keys and values of every earlier token, quantized into the int8
cache's entries (``NativeInt8Backend.write_entries``: per entry int8 values, scale max|x| / 127, rounded half to
even), or (b) its own entries (the int8 model's prefill of the same tokens). Prints the share of positions where each picks the float32 token.

    python docs/bench/step_dec07/agree_float_cache.py [N]
"""
import json
import sys

import torch

import mtpflow
from mtpflow.backends.native import int8
from mtpflow.backends.native.rows import one_row
from mtpflow.target import Target


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
        n0 = len(seq) - 1  # the float entries quantized as the int8 draft copies a prompt (``write_entries``)
        draft.write_entries(mixed.pool, mixed.kv.slot, 0, [k[target.kv.slot, :, :n0] for k in target.pool.keys],
                            [v[target.kv.slot, :, :n0] for v in target.pool.values])
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
