"""The int8 model's draft tokens through the native greedy loop (``NativeInt8Backend.self_draft``, one C call) and
through one ``run`` and one torch argmax per token (the loop before it), on the default model's int8 model after the
bench's sixth prompt: the same 40 tokens over all layers and over the first 12 (printed True), then ms per token of
100 tokens each way, four rounds.

    python docs/bench/step_dec07b/greedy_eq.py
"""
import time, torch, mtpflow, json
from mtpflow.backends import int8_draft_backend
from mtpflow.strategies.draft_model import Int8ModelDraft
pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=8", "trace=off"])
be = int8_draft_backend(pipe.loaded.model)
d = Int8ModelDraft(be, 8192)
prompt = [json.loads(l)["prompt"] for l in open("mtpflow/data/bench_prompts.jsonl")][5]
ids = pipe.encode(prompt)
d.draft(ids, 2)
t = d.target
def pyloop(root, position, steps, layers=None):  # one run and one torch argmax per token
    return be.greedy_per_token(t, root, position, steps, layers)
for layers in (None, 12):
    t.cache_len = len(ids)
    a = pyloop(int(ids[-1]), len(ids), 40, layers)
    t.cache_len = len(ids)
    b = be.self_draft(t, int(ids[-1]), len(ids), 40, layers)
    print(layers, a == b, a[:10], b[:10])
for r in range(4):
    t.cache_len = len(ids)
    s = time.perf_counter(); pyloop(int(ids[-1]), len(ids), 100); p = time.perf_counter() - s
    t.cache_len = len(ids)
    s = time.perf_counter(); be.self_draft(t, int(ids[-1]), len(ids), 100); c = time.perf_counter() - s
    print(f"python loop {p*10:.3f} ms/token, native loop {c*10:.3f} ms/token")
