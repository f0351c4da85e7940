"""Where a long Spec-Bench prompt's request goes: the first N questions of one Spec-Bench category (first turn, 128
new tokens, greedy, trace off) through each strategy named, after a short warm-up request: the prompt's tokens, the
request's wall time, its prefill, the steps, the mean verify forward and propose stage per step, and the mean step
after the prefill.

    python docs/bench/step_dec07b/long_prompts.py QUESTION_JSONL CATEGORY N STRATEGY [STRATEGY ...]
"""
import json, sys, time, collections, mtpflow
qs = [json.loads(l) for l in open(sys.argv[1])]
cat = sys.argv[2]; n = int(sys.argv[3])
sel = [q for q in qs if q["category"] == cat][:n]
for strat in sys.argv[4:]:
    pipe = mtpflow.pipeline(strat, overrides=["max_new_tokens=128", "trace=off"])
    pipe("Hello there, how are you?")
    for q in sel:
        t0 = time.perf_counter(); r = pipe(q["turns"][0]); wall = time.perf_counter() - t0
        st = collections.Counter(); fw = 0.0
        for s in r.steps:
            fw += s.forward_seconds
            for k, v in s.stage_seconds.items(): st[k] += v
        ns = len(r.steps)
        prefill = r.stats["prefill_seconds"]
        print(f"{strat:10s} prompt {len(pipe.encode(q['turns'][0]))} tok, wall {wall:.2f}s prefill {prefill:.2f}s, "
              f"{len(r.token_ids)} tokens in {ns} steps, verify fwd {1000*fw/ns:.1f} ms, "
              f"propose {1000*st['propose']/ns:.1f} ms, step {1000*(wall - prefill)/ns:.1f} ms")
