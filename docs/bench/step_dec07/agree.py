"""How often the int8 model (``model.quantize=int8``: int8 weights and activations, int8 KV cache) picks the float32
model's greedy next token, each on its own cache: the acceptance an int8 draft with a cache of its own can reach
(``int8_draft``'s ``kv: own``). The float32 pipeline decodes the bench's first N prompts (128 new tokens, greedy);
the int8 model then reads each prompt and answer in one forward and its argmax after every answer position is
compared with the next answer token. Prints the share that agree and the mean run of agreeing tokens.

    python docs/bench/step_dec07/agree.py [N]
"""
import json
import sys

import torch

import mtpflow
from mtpflow import backends
from mtpflow.model import load_model
from mtpflow.target import Target
from mtpflow.types import Draft

n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=128", "trace=off"])
prompts = [json.loads(line)["prompt"] for line in open("mtpflow/data/bench_prompts.jsonl")][:n]
answers = [(pipe.encode(p), pipe(p).token_ids) for p in prompts]
loaded = load_model(quantize="int8", dtype="float32")
backend = backends.create(loaded.model, "native_cpu", int8=loaded.int8)
total = hits = 0
runs = []
for ids, out in answers:
    t = Target(backend, pool=backend.make_pool(1))
    t.prefill(ids[:-1])
    chain = [int(ids[-1])] + list(out)
    v = t.verify(chain[0], Draft.chain(torch.tensor(chain[1:])), root_position=t.cache_len)
    argmax = v.target_argmax().tolist()
    agree = [argmax[i] == chain[i + 1] for i in range(len(chain) - 1)]
    total, hits = total + len(agree), hits + sum(agree)
    run = 0
    for a in agree:
        run = run + 1 if a else (runs.append(run) or 0)
    runs.append(run)
print(f"{n} prompts: the int8 model agrees with float32 greedy on {hits}/{total} = {hits / total:.4f} of the answer "
      f"tokens; mean run {sum(runs) / len(runs):.2f}")
