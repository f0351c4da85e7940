"""One float32 verify forward at a long context, timed: the first Spec-Bench summarization question (first turn) and
64 greedy tokens of the default model, the cache holding all but the last 12, then ``loops`` verify forwards of the
root and a chain of K of the following tokens (argmax only, as a greedy gate reads them). Prints the context and the
fastest and median forward.

    python docs/bench/step_dec07b/verify_long.py PATH/question.jsonl K LOOPS
"""
import sys, time, json, torch, mtpflow
from mtpflow.types import Draft
from mtpflow.target import Target
pipe = mtpflow.pipeline("baseline", overrides=["max_new_tokens=64", "trace=off"])
backend = pipe.engine.backend
qs = [json.loads(l) for l in open(sys.argv[1])]
prompt = [q for q in qs if q["category"] == "summarization"][0]["turns"][0]
p = pipe.encode(prompt); out = pipe(prompt).token_ids
seq = torch.cat([p, torch.tensor(out)]); at = len(seq) - 12
t = Target(backend); t.argmax_only = True; t.prefill(seq[:at])
K = int(sys.argv[2]); loops = int(sys.argv[3])
d = Draft.chain(seq[at + 1:at + 1 + K].tolist(), source="x") if K else Draft.empty("x")
tt = []
for i in range(loops):
    t.cache_len = at
    s = time.perf_counter(); t.verify(int(seq[at]), d, at); tt.append(time.perf_counter() - s)
tt.sort(); print(f"context {at} K={K} fastest {tt[0]*1e3:.2f} median {tt[len(tt)//2]*1e3:.2f} ms")
