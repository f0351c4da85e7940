"""Each stage's own time per verify step (its wrapped callees taken out), int8 model, 12 Spec-Bench questions under
1500 characters (first turn), 128 new tokens, after one warm-up request. Strategy arguments take |-separated overrides.

    SPECBENCH=PATH/question.jsonl python docs/bench/step_dec07f/split_exclusive.py mtp_heads pld baseline
"""
import functools, json, os, sys, time
import mtpflow.loop as L
import mtpflow.strategies.mtp_heads as MH
import mtpflow.strategies.graft as G
import mtpflow.strategies.pfs as P
import mtpflow.strategies.token_recycling as TR
import mtpflow.strategies.suffix as SX
import mtpflow.strategies.head_drafting as HD
import mtpflow.types as T
import mtpflow.engine as E
from mtpflow.backends.native import kernel, int8 as I8, rows as R
acc, stack = {}, []
def wrap(obj, name, key=None):
    key = key or f"{getattr(obj, '__name__', obj)}.{name}"
    orig = getattr(obj, name)
    @functools.wraps(orig)
    def timed(*a, **k):
        t = time.perf_counter(); stack.append(0.0)
        try:
            return orig(*a, **k)
        finally:
            d = time.perf_counter() - t; child = stack.pop()
            acc[key] = acc.get(key, 0.0) + d - child
            if stack: stack[-1] += d
    setattr(obj, name, timed)
targets = [(L.Sequence, "plan"), (L.Sequence, "finish"), (kernel, "w8a8_rows"), (kernel, "logit_stats"),
 (MH.MTPHeadsProposer, "propose"), (MH.MTPHeadsProposer, "_propose_medusa"), (MH.MTPHeadsProposer, "on_step_end"),
 (HD.MedusaDraft if hasattr(HD, "MedusaDraft") else MH.MedusaDraft, "logits"),
 (G.GraftedTree, "add"), (G.GraftedTree, "draft"), (P.PFSPruner if hasattr(P, "PFSPruner") else None, "prune"),
 (T.Draft, "subset"), (L, "_close_under_ancestors"), (TR.TokenRecyclingProposer, "tree"), (TR.TokenRecyclingProposer, "learn"),
 (E.Engine, "_step"),
]
for obj, name in targets:
    if obj is not None and hasattr(obj, name): wrap(obj, name)
for mod in (SX,):
    for cname in dir(mod):
        c = getattr(mod, cname)
        if isinstance(c, type) and c.__module__ == mod.__name__:
            for m in ("tree", "learn"):
                if m in c.__dict__: wrap(c, m)
import importlib, pkgutil, mtpflow.strategies as S
HOOKS = ("select_k", "gate", "dedup", "rescore", "window", "on_step_end", "prune", "verify")
for info in pkgutil.iter_modules(S.__path__):
    mod = importlib.import_module("mtpflow.strategies." + info.name)
    for cname, c in list(vars(mod).items()):
        if isinstance(c, type) and c.__module__ == mod.__name__:
            for m in HOOKS:
                if m in c.__dict__ and callable(c.__dict__[m]) and not getattr(c.__dict__[m], "__wrapped__", None):
                    wrap(c, m, f"{cname}.{m}")
from mtpflow.api import pipeline
prompts = [q for q in (json.loads(l)["turns"][0] for l in open(os.environ.get("SPECBENCH", "/root/specbench/question.jsonl"))) if len(q) < 1500]
for strategy in sys.argv[1:]:
    name, *ov = strategy.split("|")
    p = pipeline(name, ["model.quantize=int8", "trace=off", "max_new_tokens=128"] + ov)
    p(prompts[0]); acc.clear()
    t = time.perf_counter(); n = steps = 0
    for q in prompts[1:13]:
        r = p(q); n += len(r.token_ids); steps += r.stats["verify_forwards"]
    wall = time.perf_counter() - t
    print(f"{strategy} tok/s {n/wall:.1f} MAL {n/steps:.2f} wall/step {wall/steps*1e3:.2f} ms")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"   {k:45s} {v/steps*1e3:7.3f}")
