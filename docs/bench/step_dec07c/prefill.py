"""One prefill of Spec-Bench's first summarization question (first turn), timed ``loops`` times on fresh targets
(the prefix cache off): the int8 model (``int8``) or the float32 one (``float``). Prints the fastest and median.

    python docs/bench/step_dec07c/prefill.py int8|float LOOPS [PATH/question.jsonl]
"""
import sys, time, json, torch, mtpflow
from mtpflow.target import Target
quant = sys.argv[1] == "int8"
loops = int(sys.argv[2])
pipe = mtpflow.pipeline("baseline", overrides=(["model.quantize=int8"] if quant else []) + ["trace=off", "max_new_tokens=1", "prefix_cache_mb=0"])
backend = pipe.engine.backend
qs = [json.loads(l) for l in open(sys.argv[3] if len(sys.argv) > 3 else "/root/specbench/question.jsonl")]
prompt = [q for q in qs if q["category"] == "summarization"][0]["turns"][0]
p = pipe.encode(prompt)
tt = []
for i in range(loops):
    t = Target(backend); t.argmax_only = True
    s = time.perf_counter(); t.prefill(p); tt.append(time.perf_counter() - s)
    t.release()  # its slot back to the pool
tt.sort(); print(f"{sys.argv[1]} prefill {len(p)} tokens: fastest {tt[0]*1e3:.1f} median {tt[len(tt)//2]*1e3:.1f} ms")
