"""Export mtpflow's trained EAGLE drafter as a vLLM EAGLE draft checkpoint (``method: "eagle"``, vLLM's
``EagleLlamaForCausalLM``), so ``vllm serve <target> --speculative-config '{"method": "eagle", "model": DIR}'``
drafts with mtpflow's heads:

    python -m mtpflow.tools.export_vllm out=DIR                        # the shipped default-model EAGLE heads
    python -m mtpflow.tools.export_vllm heads=HEADS_DIR target=MODEL out=DIR num_speculative_tokens=5
    python -m mtpflow.train_heads export=vllm out=DIR [model.heads=HEADS_DIR]

The layer maps onto vLLM's exactly (same arithmetic, see ``eagle_tensors``). What does not carry over:

* the draft vocabulary: mtpflow scores drafts over the ``draft_vocab_size`` most frequent target tokens; vLLM's
  EAGLE-1 draft scores the target's full vocabulary (EAGLE-3 has a draft vocabulary, but its layer normalises
  the embedding and the hidden state separately and cannot express mtpflow's layer, so it would need other
  heads, trained as EAGLE-3). A full-vocabulary argmax can pick a token outside the draft vocabulary;
* tree drafting: vLLM drafts one chain of ``num_speculative_tokens`` greedy tokens; mtpflow's top-k tree, PFS
  pruning and K selection stay in mtpflow;
* cost: vLLM's first EAGLE layer has no input norm and its ``fc`` no bias, so the export puts a pass-through
  layer 0 in front (it only adds the bias) and mtpflow's layer becomes layer 1: one extra small layer per
  drafted token and KV-cache entries for it;
* the attention window is kept by marking both draft layers ``sliding_attention``, which needs
  ``target_layer_count``: the checkpoint is tied to targets with that many layers (it is tied to the target's
  hidden size and vocabulary anyway).
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch

from mtpflow.errors import ConfigError, UserError, check_int, writable_folder

EXPORT_NAME = "mtpflow_export.json"
METHOD = "eagle"
NOT_CARRIED = [
    "draft vocabulary: vLLM's EAGLE-1 draft scores the target's full vocabulary",
    "tree drafting, PFS pruning and K selection: vLLM drafts one greedy chain of num_speculative_tokens",
    "an extra pass-through draft layer 0 (vLLM's fc has no bias and its layer 0 no input norm)",
]


def target_config(target) -> tuple[dict, str]:
    """(config dict, name) of the target model: a ``LoadedModel``, a transformers config or model, a dict, a model
    folder / GGUF / HF id as ``model.name`` takes it, or None for the default model."""
    if hasattr(target, "model") and hasattr(target, "model_id"):  # mtpflow.model.LoadedModel
        config = target.model.config
        return config.to_dict(), str(getattr(config, "_name_or_path", "") or target.model_id)
    if hasattr(target, "config") and hasattr(target.config, "to_dict"):  # a transformers model
        return target.config.to_dict(), str(getattr(target.config, "_name_or_path", "") or "model")
    if hasattr(target, "to_dict"):  # a transformers config
        return target.to_dict(), str(getattr(target, "_name_or_path", "") or "model")
    if isinstance(target, dict):
        return dict(target), str(target.get("_name_or_path") or "model")
    from mtpflow.model import resolve_source

    source, _ = resolve_source(None if target is None else str(target), None)
    path = Path(source) / "config.json"
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8")), source
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source).to_dict(), source
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot read the config of target {target!r}: {first}") from None


def load_eagle(folder) -> tuple[torch.nn.Module, torch.Tensor, dict, Path]:
    """(EagleDrafter, draft ids, heads.json, the folder read) from a heads folder, or one holding ``eagle/`` as
    train_heads writes; a one-line error for any other kind."""
    from mtpflow.strategies.head_modules import CONFIG_NAME, load_heads

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_NAME).exists() and (folder / "eagle" / CONFIG_NAME).exists():
        folder = folder / "eagle"
    config_path = folder / CONFIG_NAME
    if config_path.exists():
        kind = json.loads(config_path.read_text(encoding="utf-8")).get("kind")
        if kind != "eagle":
            raise UserError(f"{folder} holds {kind} heads; only EAGLE heads export to vLLM (the export writes vLLM's "
                            f"EAGLE draft, a transformer layer like mtpflow's EAGLE drafter; {kind} heads are not one)")
    module, draft_ids, config = load_heads(folder)
    return module, draft_ids, config, folder.resolve()


def eagle_tensors(module) -> dict[str, torch.Tensor]:
    """mtpflow's EagleDrafter weights under vLLM EAGLE-1 names (float32).

    mtpflow: ``x = fc(cat[h, e]) + b; x += out(attn(rope(qkv(norm_in(x))))); x += down(silu(g) * u)`` with
    ``(g, u) = gate_up(norm_mlp(x))``. vLLM: ``y = fc(cat[e, h])`` (no bias), then Llama layers with a fused
    residual whose layer 0 has no input norm, then ``hidden + residual``. So ``fc``'s column blocks swap; layer 0
    has zero attention and MLP weights and ``down_proj.bias = b`` (it adds exactly ``b`` to the residual stream);
    layer 1 is mtpflow's layer with ``qkv`` and ``gate_up`` split into vLLM's q/k/v and gate/up.
    """
    state = {k: v.detach().float() for k, v in module.state_dict().items()}
    hidden = module.hidden
    intermediate = module.down.in_features
    fc = state["fc.weight"]  # [H, 2H]: columns 0:H read the hidden state, H:2H the token embedding
    q, k, v = state["qkv.weight"].split(hidden, 0)
    gate, up = state["gate_up.weight"].split(intermediate, 0)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float32)

    tensors = {
        "fc.weight": torch.cat([fc[:, hidden:], fc[:, :hidden]], 1),
        "layers.0.self_attn.q_proj.weight": zeros(hidden, hidden),
        "layers.0.self_attn.k_proj.weight": zeros(hidden, hidden),
        "layers.0.self_attn.v_proj.weight": zeros(hidden, hidden),
        "layers.0.self_attn.o_proj.weight": zeros(hidden, hidden),
        "layers.0.post_attention_layernorm.weight": torch.ones(hidden),
        "layers.0.mlp.gate_proj.weight": zeros(intermediate, hidden),
        "layers.0.mlp.gate_proj.bias": zeros(intermediate),
        "layers.0.mlp.up_proj.weight": zeros(intermediate, hidden),
        "layers.0.mlp.up_proj.bias": zeros(intermediate),
        "layers.0.mlp.down_proj.weight": zeros(hidden, intermediate),
        "layers.0.mlp.down_proj.bias": state["fc.bias"],
        "layers.1.input_layernorm.weight": state["norm_in.weight"],
        "layers.1.self_attn.q_proj.weight": q,
        "layers.1.self_attn.k_proj.weight": k,
        "layers.1.self_attn.v_proj.weight": v,
        "layers.1.self_attn.o_proj.weight": state["out.weight"],
        "layers.1.post_attention_layernorm.weight": state["norm_mlp.weight"],
        "layers.1.mlp.gate_proj.weight": gate,
        "layers.1.mlp.gate_proj.bias": zeros(intermediate),  # mlp_bias is one switch for every draft layer
        "layers.1.mlp.up_proj.weight": up,
        "layers.1.mlp.up_proj.bias": zeros(intermediate),
        "layers.1.mlp.down_proj.weight": state["down.weight"],
        "layers.1.mlp.down_proj.bias": zeros(hidden),
    }  # no embed_tokens / lm_head: vLLM shares the target's, as mtpflow does
    return {name: t.contiguous() for name, t in tensors.items()}


def draft_config(module, heads_cfg: dict, target_cfg: dict, window: bool = True) -> dict:
    """config.json of the draft: a plain Llama config that vLLM's EAGLE loader renames to EagleLlamaForCausalLM."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": module.hidden,
        "intermediate_size": module.down.in_features,
        "num_hidden_layers": 2,
        "num_attention_heads": module.heads,
        "num_key_value_heads": module.heads,
        "head_dim": module.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": module.norm_in.eps,
        "vocab_size": int(target_cfg["vocab_size"]),
        "max_position_embeddings": int(target_cfg.get("max_position_embeddings") or 8192),
        # mtpflow's drafter rotates with theta 10000 whatever the target uses; vLLM reads the draft's own value
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": True,  # layer 0 carries mtpflow's fc bias as its down_proj bias
        "tie_word_embeddings": False,
        "dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target_cfg.get(key) is not None:
            config[key] = target_cfg[key]
    if window:
        # every drafting layer must sit in one KV-cache group, so both are sliding (layer 0's attention output is
        # zero anyway); target_layer_count makes vLLM index layer_types by the draft's own layer number
        config.update({"layer_types": ["sliding_attention"] * 2, "sliding_window": int(heads_cfg["window"]),
                       "target_layer_count": int(target_cfg["num_hidden_layers"])})
    return config


def speculative_config(out: Path, num_speculative_tokens: int) -> dict:
    return {"method": METHOD, "model": str(out), "num_speculative_tokens": num_speculative_tokens}


def export_vllm(heads_folder, target, out, num_speculative_tokens: int = 5) -> Path:
    """Write ``out/{config.json, model.safetensors, mtpflow_export.json, README.md}`` from an mtpflow EAGLE heads
    folder for ``target`` (see ``target_config``); returns ``out``."""
    from safetensors.torch import save_file

    num_speculative_tokens = check_int("num_speculative_tokens", num_speculative_tokens, 1)
    module, draft_ids, heads_cfg, heads_folder = load_eagle(heads_folder)
    target_cfg, target_name = target_config(target)
    for key in ("hidden_size", "vocab_size"):
        if heads_cfg.get(key) != target_cfg.get(key):
            raise UserError(f"the heads in {heads_folder} were trained for {heads_cfg.get('model_id')!r} "
                            f"({key} {heads_cfg.get(key)}); target {target_name} has {key} {target_cfg.get(key)}")
    if not target_cfg.get("num_hidden_layers"):
        raise UserError(f"target {target_name} has no num_hidden_layers in its config")
    out = Path(out).expanduser().resolve()
    writable_folder(out)
    config = draft_config(module, heads_cfg, target_cfg)
    save_file(eagle_tensors(module), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    spec = speculative_config(out, num_speculative_tokens)
    serve = f"vllm serve {shlex.quote(target_name)} --speculative-config {shlex.quote(json.dumps(spec))}"
    facts = {
        "format": "vllm-eagle",
        "source_heads": str(heads_folder),
        "heads_model_id": heads_cfg.get("model_id"),
        "target": target_name,
        "window": int(heads_cfg["window"]),
        "draft_vocab_size": int(draft_ids.numel()),
        "speculative_config": spec,
        "vllm_serve": serve,
        "not_carried": NOT_CARRIED,
    }
    (out / EXPORT_NAME).write_text(json.dumps(facts, indent=2) + "\n", encoding="utf-8")
    (out / "README.md").write_text(
        f"# mtpflow EAGLE heads as a vLLM EAGLE draft\n\nSource heads: `{heads_folder}`\n"
        f"Target model: `{target_name}`\n\n```\n{serve}\n```\n\nNot carried over:\n\n"
        + "".join(f"- {line}\n" for line in NOT_CARRIED)
        + "\nWritten by `python -m mtpflow.tools.export_vllm` (see docs/vllm.md).\n", encoding="utf-8")
    return out


def export_from_config(cfg) -> Path:
    """``python -m mtpflow.train_heads export=vllm out=DIR``: export the EAGLE heads named by ``model.heads``
    (default: the shipped ones for ``model.name``) for the target ``model.name`` instead of training."""
    from omegaconf import OmegaConf

    from mtpflow.strategies.mtp_heads import resolve_heads

    if str(cfg.export) != "vllm":
        raise ConfigError(f"export must be vllm (or null to train), got {cfg.export!r}")
    if not cfg.out:
        raise ConfigError("export=vllm needs out=DIR, the folder for the vLLM draft checkpoint")
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    heads = resolve_heads(None, model_cfg, "eagle")
    target = model_cfg.get("name")
    if model_cfg.get("gguf_file"):
        target = str(Path(str(target)) / model_cfg["gguf_file"])
    out = export_vllm(heads, target, cfg.out, cfg.get("num_speculative_tokens", 5))
    print(json.loads((out / EXPORT_NAME).read_text(encoding="utf-8"))["vllm_serve"])
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m mtpflow.tools.export_vllm [heads=DIR] [target=MODEL] out=DIR [num_speculative_tokens=5]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    options = {"heads": None, "target": None, "out": None, "num_speculative_tokens": "5"}
    try:
        for arg in argv:
            key, sep, value = arg.partition("=")
            if not sep or key not in options:
                raise ConfigError(f"unknown argument {arg!r}; use {' '.join(k + '=...' for k in options)}")
            options[key] = value or None
        if not options["out"]:
            raise ConfigError("out=DIR is required: the folder for the vLLM draft checkpoint")
        heads = options["heads"]
        if heads is None:
            from mtpflow.strategies.mtp_heads import resolve_heads

            heads = resolve_heads(None, {"name": options["target"] or "smollm2"}, "eagle")
        out = export_vllm(heads, options["target"], options["out"], options["num_speculative_tokens"])
    except UserError as exc:
        print(f"mtpflow.export_vllm: error: {exc}", file=sys.stderr)
        return 2
    print(json.loads((out / EXPORT_NAME).read_text(encoding="utf-8"))["vllm_serve"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
