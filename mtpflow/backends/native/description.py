"""The layer description of a causal LM: what the native decoder stacks (``rows_float.c``, ``rows_int8.c``) compute
for it, read once from the Hugging Face config and modules.

A description names, per model and per layer: the norms (RMSNorm, their epsilon, a scale of ``w`` or ``1 + w``,
before and after the attention and the MLP, on each query and key head), the biases of each product, the activation
of the gated MLP (SiLU or GELU-tanh), the rotary part (the cos / sin tables from the model's own ``rotary_emb``, so
every static rope scaling stays Hugging Face's; the rotary dimensions of a head; layers without rotary), attention
(heads, KV heads, head size, scale, the sliding window of each layer, soft-capped scores), the final logits'
soft-cap, the embedding scale, a tied or separate head and fused or split products. Llama, Mistral, Qwen2, Qwen3,
Gemma, Gemma 2, Gemma 3, Phi-3 and SmolLM3 are descriptions, not code paths: ``FAMILIES`` says what each model
class's forward does around its layers (where its norms stand, which layers slide); the modules say the rest.

What a description cannot say is one named reason (``not_described``): ``model.backend=auto`` then runs ``hf`` and
says it once, an explicit native backend or ``model.quantize=int8`` refuses with that line.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

SILU, GELU_TANH = 0, 1  # the activation of the gated MLP, as the kernels number it (``act``)


@dataclass(frozen=True)
class Family:
    """What a model class's own forward does around the modules: ``sandwich``: a norm after the attention and
    after the MLP as well as before each (Gemma 2 / 3: ``post_attention_layernorm`` then norms the attention's
    output, ``pre_feedforward_layernorm`` the MLP's input), else Llama's order (``post_attention_layernorm`` is the
    MLP's input norm); ``window``: which layers slide: ``"layer_types"`` (those ``config.layer_types`` marks
    ``sliding_attention``), ``"all"`` (every layer, where ``config.sliding_window`` is set) or ``"none"``;
    ``attn_softcap``: its attention soft-caps scores by ``config.attn_logit_softcapping`` (Gemma 2; Gemma 3's
    config has the key, its attention does not read it); ``logit_softcap``: its head soft-caps the logits by
    ``config.final_logit_softcapping``."""
    sandwich: bool = False
    window: str = "none"
    attn_softcap: bool = False
    logit_softcap: bool = False


FAMILIES = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(window="all"),
    "Qwen2ForCausalLM": Family(window="layer_types"),
    "Qwen3ForCausalLM": Family(window="layer_types"),
    "Phi3ForCausalLM": Family(window="all"),
    "SmolLM3ForCausalLM": Family(window="layer_types"),
    "GemmaForCausalLM": Family(),
    "Gemma2ForCausalLM": Family(sandwich=True, window="layer_types", attn_softcap=True, logit_softcap=True),
    "Gemma3ForCausalLM": Family(sandwich=True, window="layer_types", logit_softcap=True),
}
# RMSNorm classes by their scale: ``w * x / rms(x)`` or ``(1 + w) * x / rms(x)`` (both in float32 for a float32
# model; the scale 1 + w is computed once, as HF's ``1.0 + weight.float()``)
NORMS_W = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm", "SmolLM3RMSNorm"}
NORMS_ONE_PLUS_W = {"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"}
# rope types whose tables change with the length of the sequence (``dynamic_rope_update``): a cached key would
# hold another table's rotation than a new one
DYNAMIC_ROPE = ("dynamic", "longrope")


class NotDescribed(Exception):
    """A model the description cannot say; ``str()`` is the one line naming the feature."""


@dataclass
class Layer:
    """One decoder layer as the kernels compute it. Norm weights are the scale each applies (``w``, or ``1 + w``
    computed once); ``None`` where the layer has no such part."""
    ln1: torch.Tensor                   # [H] the attention's input norm
    post_attention: torch.Tensor | None  # [H] the norm of the attention's output, before its residual (sandwich)
    ln2: torch.Tensor                   # [H] the MLP's input norm
    post_mlp: torch.Tensor | None       # [H] the norm of the MLP's output, before its residual (sandwich)
    q_norm: torch.Tensor | None         # [d] the norm of each query head, before the rotary
    k_norm: torch.Tensor | None         # [d] the norm of each key head
    qkv: tuple                          # the q, k, v linears (or the one fused q/k/v linear), in that order
    o: torch.nn.Linear
    gate_up: tuple                      # the gate and up linears (or the one fused linear: gate rows, then up rows)
    down: torch.nn.Linear
    window: int                         # 0: every earlier key; w: a query at position p sees keys at p - w + 1 .. p
    rope: str | None                    # the key of its rotary table in ``Description.rope`` (None: no rotary)
    norm_modules: tuple = ()            # the norm modules the scales above come from


@dataclass
class Description:
    """A decoder-only model as the native stacks compute it (see the module docstring)."""
    family: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    scale: float            # attention scores: q . k * scale
    activation: int         # SILU or GELU_TANH, of the gate; times up
    attn_softcap: float     # scores -> c * tanh(score / c) (0: none)
    logit_softcap: float    # logits -> c * tanh(logit / c) (0: none)
    embed_scale: float | None  # the embedding times this (float32, as the model's embedding module applies it)
    rotary_dims: int        # the first rotary_dims of each head rotate (head_dim: all)
    layers: list
    norm: torch.Tensor      # [H] the final norm's scale
    norm_module: torch.nn.Module
    embedding: torch.nn.Module
    head: torch.nn.Module
    tied: bool
    rope: dict              # {key: RopeTable}

    @property
    def windows(self) -> list[int]:
        return [layer.window for layer in self.layers]

    @property
    def norm_modules(self) -> list:
        return [self.norm_module] + [m for layer in self.layers for m in layer.norm_modules]

    def has(self, part: str) -> bool:
        """Whether any layer has ``part`` (a ``Layer`` field that may be None)."""
        return any(getattr(layer, part) is not None for layer in self.layers)


class RopeTable:
    """cos / sin [positions, rotary_dims] of one of the model's rotary tables, computed by its own ``rotary_emb`` in
    fixed chunks of positions (the same values whichever rows ask for them: torch's vectorized cos / sin may round
    a tensor's tail differently)."""

    STEP = 1024

    def __init__(self, rotary_emb, layer_type: str | None = None, dtype=torch.float32):
        self.rotary_emb, self.layer_type, self.dtype = rotary_emb, layer_type, dtype
        self.cos = self.sin = torch.empty(0, 0)

    def rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [len(positions), rotary_dims] float32, contiguous."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        while self.cos.shape[0] < need:
            start = self.cos.shape[0]
            pos = torch.arange(start, start + self.STEP)[None]
            extra = () if self.layer_type is None else (self.layer_type,)
            with torch.no_grad():
                cos, sin = self.rotary_emb(torch.empty(1, dtype=self.dtype), pos, *extra)
            self.cos = torch.cat([self.cos.reshape(-1, cos.shape[-1]), cos[0].float()])
            self.sin = torch.cat([self.sin.reshape(-1, sin.shape[-1]), sin[0].float()])
        return self.cos[positions].contiguous(), self.sin[positions].contiguous()

    @property
    def dims(self) -> int:
        return int(self.rows(torch.zeros(1, dtype=torch.long))[0].shape[-1])


def fused_bias(linears) -> torch.Tensor | None:
    """One float32 bias over ``linears``' outputs, in their order (zeros where one has none): the bias of their fused
    product (or of one product alone, a copy), as both decoder stacks read it; None where none has a bias."""
    if all(m.bias is None for m in linears):
        return None
    with torch.no_grad():
        return torch.cat([m.bias.detach().float() if m.bias is not None else torch.zeros(m.out_features)
                          for m in linears]).contiguous()


def not_described(model) -> str | None:
    """Why ``model`` has no description (one line naming the feature), or None where ``describe`` gives one."""
    try:
        describe(model)
    except NotDescribed as why:
        return str(why)
    return None


def _norm(module, what: str) -> tuple[torch.Tensor, float]:
    """(the scale it applies [n] float32: its weight itself, or a copy where the scale is ``1 + w`` or the weight
    is not float32; its epsilon)."""
    name = type(module).__name__
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if eps is None or weight is None or name not in NORMS_W | NORMS_ONE_PLUS_W:
        raise NotDescribed(f"its {what} norm is a {name}, which the layer description does not know")
    if name in NORMS_ONE_PLUS_W:
        with torch.no_grad():
            scale = (1.0 + weight.detach().float()).contiguous()
    else:
        scale = weight if weight.dtype == torch.float32 else weight.detach().float().contiguous()
    return scale, float(eps)


def _activation(mlp) -> int:
    from transformers.activations import GELUTanh, SiLUActivation

    act = getattr(mlp, "act_fn", getattr(mlp, "activation_fn", None))
    if isinstance(act, (SiLUActivation, torch.nn.SiLU)):
        return SILU
    if isinstance(act, GELUTanh):
        return GELU_TANH
    raise NotDescribed(f"its MLP activation is {type(act).__name__}, not SiLU or GELU-tanh")


def _linears(owner, fused: str | None, parts: tuple[str, ...], what: str) -> tuple:
    """The linears ``parts`` of ``owner``, or its one ``fused`` linear where it has that instead."""
    if fused is not None and hasattr(owner, fused) and not any(hasattr(owner, p) for p in parts):
        found = (getattr(owner, fused),)
    else:
        found = tuple(getattr(owner, p, None) for p in parts)
    if not all(isinstance(m, torch.nn.Linear) for m in found):
        raise NotDescribed(f"its {what} products are not plain linears")
    return found


def _windows(model, family: Family) -> list[int]:
    cfg = model.config
    layers = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if family.window == "all":
        return [int(window or 0)] * layers
    if family.window == "layer_types":
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * layers
        if any(t not in ("full_attention", "sliding_attention") for t in types):
            raise NotDescribed(f"its layer types {sorted(set(types))} are not full or sliding attention")
        if "sliding_attention" in types and not window:
            raise NotDescribed("it marks sliding layers without a sliding window")
        return [int(window) if t == "sliding_attention" else 0 for t in types[:layers]]
    return [0] * layers


def _rope_keys(model, inner, layers) -> tuple[list, dict]:
    """(each layer's rotary key or None, {key: RopeTable})."""
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None:
        raise NotDescribed("it has no rotary embedding module")
    kind = getattr(rotary, "rope_type", "default")
    types = kind if isinstance(kind, dict) else {None: kind}
    for kind in types.values():
        if any(d in str(kind) for d in DYNAMIC_ROPE):
            raise NotDescribed(f"its rope scaling ({kind}) changes with the sequence length")
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    cfg = model.config
    keys = []
    for index, block in enumerate(layers):
        if not bool(getattr(block.self_attn, "use_rope", True)):
            keys.append(None)
        elif per_type:
            keys.append(cfg.layer_types[index])
        else:
            keys.append("default")
    tables = {key: RopeTable(rotary, key if per_type else None) for key in set(keys) if key is not None}
    return keys, tables


def describe(model) -> Description:
    """The description of ``model`` (a ``*ForCausalLM`` of ``FAMILIES``); ``NotDescribed`` (one line) otherwise."""
    name = type(model).__name__
    family = FAMILIES.get(name)
    if family is None:
        raise NotDescribed(f"its family is not one the layer description knows ({', '.join(sorted(FAMILIES))})")
    cfg = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise NotDescribed(f"{name} has no decoder layers where its family keeps them")
    if int(getattr(cfg, "pretraining_tp", 1) or 1) != 1:
        raise NotDescribed("it splits its products for tensor parallelism (pretraining_tp > 1)")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise NotDescribed("its attention is bidirectional")
    blocks = list(inner.layers[: cfg.num_hidden_layers])
    first = blocks[0].self_attn
    heads, kv_heads = int(cfg.num_attention_heads), int(cfg.num_key_value_heads or cfg.num_attention_heads)
    head_dim = int(first.head_dim)
    hidden, intermediate = int(cfg.hidden_size), int(cfg.intermediate_size)
    windows = _windows(model, family)
    rope_keys, rope = _rope_keys(model, inner, blocks)
    rotary_dims = {table.dims for table in rope.values()}
    if len(rotary_dims) > 1 or (rotary_dims and (min(rotary_dims) % 2 or max(rotary_dims) > head_dim)):
        raise NotDescribed(f"its rotary tables cover {sorted(rotary_dims)} of {head_dim} head dimensions")
    eps = set()
    layers = []
    for index, block in enumerate(blocks):
        attn, mlp = block.self_attn, block.mlp
        if getattr(attn, "scaling", None) != first.scaling or int(attn.head_dim) != head_dim:
            raise NotDescribed("its layers' attention differs in scale or head size")
        if not getattr(attn, "is_causal", True):
            raise NotDescribed("its attention is not causal")
        norms = {"ln1": block.input_layernorm}
        if family.sandwich:
            norms.update(post_attention=block.post_attention_layernorm, ln2=block.pre_feedforward_layernorm,
                         post_mlp=block.post_feedforward_layernorm)
        else:
            norms["ln2"] = block.post_attention_layernorm
        for part in ("q_norm", "k_norm"):
            if getattr(attn, part, None) is not None:
                norms[part] = getattr(attn, part)
        made = {}
        for part, module in norms.items():
            made[part], epsilon = _norm(module, part.replace("ln1", "input").replace("ln2", "MLP input"))
            eps.add(epsilon)
        for part in ("q_norm", "k_norm"):
            if part in made and made[part].numel() != head_dim:
                raise NotDescribed(f"its {part} covers {made[part].numel()} values, not one head's {head_dim}")
        qkv = _linears(attn, "qkv_proj", ("q_proj", "k_proj", "v_proj"), "attention input")
        gate_up = _linears(mlp, "gate_up_proj", ("gate_proj", "up_proj"), "MLP input")
        (o,), (down,) = _linears(attn, None, ("o_proj",), "attention output"), _linears(mlp, None, ("down_proj",),
                                                                                         "MLP output")
        if sum(m.out_features for m in qkv) != (heads + 2 * kv_heads) * head_dim:
            raise NotDescribed("its query, key and value products do not match its heads")
        if sum(m.out_features for m in gate_up) != 2 * intermediate:
            raise NotDescribed("its gate and up products do not match its intermediate size")
        if _activation(mlp) != _activation(blocks[0].mlp):
            raise NotDescribed("its layers differ in activation")
        layers.append(Layer(made["ln1"], made.get("post_attention"), made["ln2"], made.get("post_mlp"),
                            made.get("q_norm"), made.get("k_norm"), qkv, o, gate_up, down, windows[index],
                            rope_keys[index], tuple(norms.values())))
    norm, epsilon = _norm(inner.norm, "final")
    eps.add(epsilon)
    if len(eps) > 1:
        raise NotDescribed(f"its norms differ in epsilon ({sorted(eps)})")
    if head_dim % 2 or heads % kv_heads:
        raise NotDescribed(f"{heads} query heads over {kv_heads} KV heads of size {head_dim}")
    embedding, head = inner.embed_tokens, model.lm_head
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        raise NotDescribed("its LM head is not a linear without bias")
    if not isinstance(embedding, torch.nn.Embedding):
        raise NotDescribed("its embedding is not a plain lookup table")
    scale_buffer = getattr(embedding, "embed_scale", None)
    embed_scale = None if scale_buffer is None else float(scale_buffer.to(embedding.weight.dtype).float())
    attn_softcap = float(getattr(cfg, "attn_logit_softcapping", None) or 0.0) if family.attn_softcap else 0.0
    if attn_softcap and getattr(cfg, "_attn_implementation", None) == "sdpa":
        raise NotDescribed("its SDPA attention drops the soft-cap of its scores (load it with eager attention)")
    logit_softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0) if family.logit_softcap else 0.0
    return Description(
        family=name, hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim, intermediate=intermediate,
        vocab=int(head.out_features), eps=eps.pop(), scale=float(first.scaling), activation=_activation(blocks[0].mlp),
        attn_softcap=attn_softcap, logit_softcap=logit_softcap,
        embed_scale=embed_scale, rotary_dims=rotary_dims.pop() if rotary_dims else 0, layers=layers, norm=norm,
        norm_module=inner.norm, embedding=embedding, head=head,
        tied=embedding.weight.data_ptr() == head.weight.data_ptr(), rope=rope)
