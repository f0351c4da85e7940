"""GPU check of the K selectors on a machine without mtpflow installed: device-name mapping, a k=auto cost
measurement on a random SmolLM2-shaped model (bf16), and the domain classifier on a quiet CPU.

    cp scripts/gpu_k_selectors_check.py /tmp/g.py && cd /tmp && BASE=/path/to/mtpflow python /tmp/g.py
"""
import json, os, sys, time, statistics
BASE = os.environ.get("BASE") or os.path.dirname(os.path.abspath(__file__))
out = {}
try:
    import torch, transformers, numpy
    out["versions"] = [torch.__version__, transformers.__version__, numpy.__version__, torch.cuda.is_available()]
except Exception as e:
    print("no torch/transformers:", e); sys.exit(0)
import types
from transformers import LlamaConfig, LlamaForCausalLM  # before the source tree is on the path
sys.path.append(BASE)  # the source tree, without installing
from mtpflow.strategies import hardware
from mtpflow.strategies.hardware import HardwareAwareK, device_name
out["device_name"] = device_name("cuda:0")
sel = HardwareAwareK()
ctx = types.SimpleNamespace(device="cuda:0", prompt="x", model=None, model_id="tiny", tokenizer=None, prompt_tokens=torch.zeros(3))
out["table_facts"] = sel.on_run_start(ctx)
from transformers import LlamaConfig, LlamaForCausalLM
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048)  # SmolLM2-135M shape, random weights
model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
os.environ["MTPFLOW_CACHE"] = "/tmp/mtpcache"
ctx.model, ctx.model_id = model, "smollm2-shape-random"
auto = HardwareAwareK(k="auto")
out["auto_facts"] = auto.on_run_start(ctx)
out["costs_ms"] = {k: round(v * 1000, 3) for k, v in auto.costs.items()}
out["best_k"] = {a: hardware.best_k(auto.costs, a) for a in (0.2, 0.4, 0.6, 0.8)}
try:
    from mtpflow.strategies.domain import DomainClassifier
    c = DomainClassifier(os.path.join(BASE, "mtpflow/data/domain_classifier.npz"))
    rows = [json.loads(l) for l in open(os.path.join(BASE, "mtpflow/data/domain_prompts.jsonl"))]
    held = [r for r in rows if r["split"] == "heldout"]
    acc = sum(c.predict(r["text"])[0] == r["domain"] for r in held) / len(held)
    ts = []
    for _ in range(3):
        for r in held:
            t0 = time.perf_counter(); c.predict(r["text"]); ts.append(time.perf_counter() - t0)
    out["classifier_quiet_cpu"] = {"acc": round(acc, 4), "median_ms": round(1000 * statistics.median(ts), 4),
                                   "p95_ms": round(1000 * sorted(ts)[int(0.95 * len(ts))], 4), "max_ms": round(1000 * max(ts), 4)}
except Exception as e:
    out["classifier_error"] = repr(e)
print(json.dumps(out, indent=1))
