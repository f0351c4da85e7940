"""The int8 draft's native greedy loop against one ``run`` per draft token (the loop before it), in one process:
``baseline``, ``int8_draft`` and ``int8_draft`` whose draft backend drafts token by token through Python, each of
the bench's first N prompts (128 new tokens, greedy, trace off) through all three, their order reversed every other
prompt, after a warm-up request each. Prints tokens/s (wall, prefills included), each side's ratio to `baseline`,
the steps and whether the two int8_draft outputs are the same.

    python docs/bench/step_dec07b/loop_ab.py [N]
"""
import json
import sys
import time

import mtpflow


n = int(sys.argv[1]) if len(sys.argv) > 1 else 32
overrides = ["max_new_tokens=128", "trace=off"]
pipes = {"baseline": mtpflow.pipeline("baseline", overrides=overrides),
         "int8_draft": mtpflow.pipeline("int8_draft", overrides=overrides),
         "int8_draft, per-token loop": mtpflow.pipeline("int8_draft", overrides=overrides)}
prompts = [json.loads(line)["prompt"] for line in open("mtpflow/data/bench_prompts.jsonl")]
for name, pipe in pipes.items():
    pipe(prompts[-1])  # warm-up: kernels built, the int8 draft model made
old = pipes["int8_draft, per-token loop"].shared.get("int8_model:draft", lambda: None)
old.self_draft = old.greedy_per_token  # the self-draft before the native loop
tokens = dict.fromkeys(pipes, 0)
seconds = dict.fromkeys(pipes, 0.0)
steps = dict.fromkeys(pipes, 0)
same = 0
for i, prompt in enumerate(prompts[:n]):
    order = list(pipes) if i % 2 == 0 else list(pipes)[::-1]
    outs = {}
    for name in order:
        t0 = time.perf_counter()
        r = pipes[name](prompt)
        seconds[name] += time.perf_counter() - t0
        tokens[name] += len(r.token_ids)
        steps[name] += len(r.steps)
        outs[name] = r.token_ids
    same += outs["int8_draft"] == outs["int8_draft, per-token loop"]
base = tokens["baseline"] / seconds["baseline"]
for name in pipes:
    rate = tokens[name] / seconds[name]
    print(f"{name:28s} {rate:7.2f} tokens/s  {rate / base:5.3f}x baseline  {steps[name]} steps")
print(f"int8_draft outputs equal with either loop: {same}/{n}")
