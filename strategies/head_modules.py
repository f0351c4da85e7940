"""Trainable draft heads that sit on a frozen target model, and their files on disk.

Medusa heads map the target's last hidden state to K future-token features (one residual block each);
the EAGLE drafter is one small transformer layer over (hidden state, next token embedding) that predicts
the next hidden state. Both score tokens with the target's own LM head, restricted to a *draft
vocabulary* (the most frequent tokens of the training text, as in EAGLE-3) so drafting and training avoid
the full-vocabulary matmul. Heads are saved as safetensors plus a JSON config keyed to the base model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtpflow.errors import UserError
from mtpflow.kernels import native_linear

CONFIG_NAME = "heads.json"
WEIGHTS_NAME = "heads.safetensors"
KINDS = ("medusa", "eagle")


class ResidualBlock(nn.Module):
    """x + SiLU(W x); W starts at zero so an untrained head reproduces the target's own next-token guess."""

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K independent heads: head i maps the hidden state at t (which produced token t+1) to a feature for
    token t+2+i, scored by the target's LM head."""

    def __init__(self, hidden: int, num_heads: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResidualBlock(hidden) for _ in range(num_heads))

    @property
    def num_heads(self) -> int:
        return len(self.blocks)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> [num_heads, ..., hidden]"""
        return torch.stack([block(hidden) for block in self.blocks])


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x [..., T, heads, head_dim] at positions [..., T]."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    angles = positions.float()[..., None] * freqs  # [..., T, half]
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class EagleDrafter(nn.Module):
    """fc(concat(hidden state f_j, embedding of token j+1)) -> one pre-norm attention + SwiGLU layer ->
    predicted hidden state f_{j+1}. Keys/values of committed positions depend only on their own input, so
    they can be cached exactly; attention looks back over at most ``window`` positions."""

    def __init__(self, hidden: int, heads: int, intermediate: int, window: int):
        super().__init__()
        if hidden % heads:
            raise UserError(f"EAGLE drafter: hidden size {hidden} is not divisible by {heads} heads")
        self.hidden, self.heads, self.head_dim, self.window = hidden, heads, hidden // heads, window
        self.fc = nn.Linear(2 * hidden, hidden)
        self.norm_in = RMSNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.norm_mlp = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def project(self, features: torch.Tensor, token_embeddings: torch.Tensor, positions: torch.Tensor):
        """Inputs [..., T, hidden] x2, positions [..., T] -> (x, q, k, v); q/k/v are [..., T, heads, head_dim]."""
        x = self.fc(torch.cat([features, token_embeddings], -1))
        q, k, v = self.qkv(self.norm_in(x)).split(self.hidden, -1)
        shape = (*q.shape[:-1], self.heads, self.head_dim)
        q, k, v = q.reshape(shape), k.reshape(shape), v.reshape(shape)
        return x, rotate(q, positions), rotate(k, positions), v

    def finish(self, x, q, keys, values, mask) -> torch.Tensor:
        """Attention of queries [B, Tq, h, d] over keys/values [B, Tk, h, d] (mask [B, Tq, Tk] bool), then MLP."""
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                              attn_mask=mask[:, None])
        x = x + self.out(attn.transpose(1, 2).reshape(*x.shape))
        gate, up = self.gate_up(self.norm_mlp(x)).chunk(2, -1)
        return x + self.down(F.silu(gate) * up)

    def forward(self, features, token_embeddings, positions) -> torch.Tensor:
        """Teacher-forced training pass over whole sequences [B, T, hidden] with a sliding-window causal mask."""
        x, q, k, v = self.project(features, token_embeddings, positions)
        t = features.shape[1]
        i = torch.arange(t, device=features.device)
        offset = i[:, None] - i[None, :]
        mask = ((offset >= 0) & (offset < self.window))[None].expand(features.shape[0], t, t)
        return self.finish(x, q, k, v, mask)


class DraftVocabHead:
    """The target's LM head restricted to the draft vocabulary: features -> logits over draft tokens."""

    def __init__(self, lm_head_weight: torch.Tensor, draft_ids: torch.Tensor):
        self.draft_ids = draft_ids.long()  # [draft_vocab] target token id of each draft token
        self.weight = lm_head_weight.detach()[self.draft_ids].float()  # [draft_vocab, hidden]

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        x = features.float()
        if x.device.type == "cpu" and not torch.is_grad_enabled() and native_linear.available():
            # a few rows against 4096 x hidden: bound by reading the weight, which the native row kernel does
            # at close to memory speed (MKL's few-row path reads it once per row)
            return native_linear.linear(x, self.weight)
        return x @ self.weight.T


def draft_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] position of each target token in the draft vocabulary, -100 (ignored by the loss) if absent."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[draft_ids.long()] = torch.arange(draft_ids.numel())
    return index


def build_module(config: dict) -> nn.Module:
    kind = config["kind"]
    if kind == "medusa":
        return MedusaHeads(config["hidden_size"], config["num_heads"])
    if kind == "eagle":
        return EagleDrafter(config["hidden_size"], config["attention_heads"], config["intermediate_size"],
                            config["window"])
    raise UserError(f"unknown head kind {kind!r}; expected one of {', '.join(KINDS)}")


def save_heads(folder: str | Path, module: nn.Module, draft_ids: torch.Tensor, config: dict,
               dtype: torch.dtype = torch.float16) -> Path:
    """Write ``heads.safetensors`` (weights in ``dtype`` + the draft vocabulary) and ``heads.json``."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in module.state_dict().items()}
    tensors["draft_ids"] = draft_ids.to(torch.int32).contiguous()
    save_file(tensors, str(folder / WEIGHTS_NAME))
    full = {**config, "draft_vocab_size": int(draft_ids.numel())}
    (folder / CONFIG_NAME).write_text(json.dumps(full, indent=2) + "\n", encoding="utf-8")
    return folder


def load_heads(folder: str | Path) -> tuple[nn.Module, torch.Tensor, dict]:
    """(module in float32, eval mode; draft token ids; config) from a folder written by ``save_heads``."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    if not (folder / CONFIG_NAME).exists() or not (folder / WEIGHTS_NAME).exists():
        raise UserError(f"no trained heads in {folder} (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    config = json.loads((folder / CONFIG_NAME).read_text(encoding="utf-8"))
    tensors = load_file(str(folder / WEIGHTS_NAME))
    draft_ids = tensors.pop("draft_ids").long()
    module = build_module(config)
    module.load_state_dict({k: v.float() for k, v in tensors.items()})
    return module.eval(), draft_ids, config


def check_matches(config: dict, model, where: str) -> None:
    """UserError when heads were trained for a model of another shape."""
    hidden = int(model.config.hidden_size)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if config.get("hidden_size") != hidden or config.get("vocab_size") != vocab:
        raise UserError(f"heads in {where} were trained for {config.get('model_id')!r} (hidden "
                        f"{config.get('hidden_size')}, vocab {config.get('vocab_size')}); this model has hidden "
                        f"{hidden}, vocab {vocab}: train heads for it with python -m mtpflow.train_heads")


def default_attention_heads(hidden: int) -> int:
    """A head count dividing ``hidden`` with head_dim near 64."""
    best = 1
    for h in range(1, hidden + 1):
        if hidden % h == 0 and abs(hidden / h - 64) < abs(hidden / best - 64):
            best = h
    return best


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dimension."""
    return -(probs * probs.clamp(min=1e-20).log()).sum(-1)


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy divided by log(vocab): 0 = certain, 1 = uniform."""
    return entropy(probs) / math.log(max(probs.shape[-1], 2))
