"""Trainable draft heads that sit on a frozen target model, and their files on disk.

Medusa heads map the target's last hidden state to K future-token features (one residual block each);
the EAGLE drafter is one small transformer layer over (hidden state, next token embedding) that predicts
the next hidden state; the EAGLE-3 drafter is the same layer over a feature fused from a low, a middle and a
high layer of the target, trained on token predictions only (no feature regression) while it drafts from
its own earlier outputs (``unroll``). All score tokens with the target's own LM head, restricted to a *draft
vocabulary* (the most frequent tokens of the training text, as in EAGLE-3) so drafting and training avoid
the full-vocabulary matmul. At decoding time ``head_drafting`` runs them as products of the engine's backend.
Heads are saved as safetensors plus a JSON config keyed to the base model.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from mtpflow.errors import UserError

CONFIG_NAME = "heads.json"
WEIGHTS_NAME = "heads.safetensors"
KINDS = ("medusa", "eagle", "eagle3")


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


def rms_norm(weight: torch.Tensor, eps: float, x: torch.Tensor) -> torch.Tensor:
    """RMS norm of the rows of ``x`` scaled by ``weight`` (``RMSNorm``, and the drafting runner's norms)."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(self.weight, self.eps, x)


def rotary_freqs(head_dim: int, device=None, theta: float = 10000.0) -> torch.Tensor:
    """[head_dim / 2] the rotary frequencies of ``rotate``."""
    half = head_dim // 2
    return theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] rotated by angles whose cos / sin [..., head_dim / 2] broadcast against its halves."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of x [..., T, heads, head_dim] at positions [..., T]."""
    angles = positions.float()[..., None] * rotary_freqs(x.shape[-1], x.device, theta)  # [..., T, half]
    return apply_rotary(x, angles.cos()[..., None, :], angles.sin()[..., None, :]).to(x.dtype)


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

    def input_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """The target's hidden states as the forward returns them -> the drafter's input feature (EAGLE: the
        last hidden state itself)."""
        return target_hidden

    def head_features(self, out: torch.Tensor) -> torch.Tensor:
        """A layer output -> what the LM head scores (EAGLE: the predicted hidden state itself)."""
        return out


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 (Li et al., 2025): the EAGLE layer over ``fuse(concat of the target's tapped layers)`` [taps * hidden
    -> hidden] instead of the last hidden state, with a learned norm before the (frozen, draft-vocabulary) LM head.
    Nothing ties its output to the target's hidden state: from the second draft step on, the layer's own output
    is its input feature, and training (``unroll``) teaches it to draft from those."""

    def __init__(self, hidden: int, heads: int, intermediate: int, window: int, taps: int):
        super().__init__(hidden, heads, intermediate, window)
        self.fuse = nn.Linear(taps * hidden, hidden, bias=False)
        self.norm_out = RMSNorm(hidden)

    def input_features(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fuse(target_hidden)

    def head_features(self, out: torch.Tensor) -> torch.Tensor:
        return self.norm_out(out)


def unroll(drafter: EagleDrafter, features: torch.Tensor, token_embeddings: torch.Tensor, positions: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Training-time test (EAGLE-3): the drafter run as it drafts, ``steps`` deep from every position at once.

    ``features`` [B, T, h] are the drafter's input features from the target (``input_features``), ``token_embeddings``
    [B, T, h] the embeddings of tokens 1..T (position p's input token is token p + 1), ``positions`` [B, T].
    Step 1 is the teacher-forced pass. Step s at position p drafts from anchor a = p - s + 1 (the last position
    with target features): its input feature is step s - 1's output at p - 1 (its own earlier draft), and it
    attends to step 1's keys at positions <= a (within the window) and to step r's key at a + r - 1 for
    r = 2..s (its own drafted path), exactly what the tree drafter attends to at depth s. Returns the outputs
    [B, T, h] of steps 1..steps; step s at position p predicts what follows token p + 1 (for p >= s - 1; rows
    before that have no anchor and must be ignored by the loss)."""
    b, t, _ = features.shape
    device = features.device
    x, q, k, v = drafter.project(features, token_embeddings, positions)
    i = torch.arange(t, device=device)
    offset = i[:, None] - i[None, :]  # query position - key position
    causal = (offset >= 0) & (offset < drafter.window)
    outs = [drafter.finish(x, q, k, v, causal[None].expand(b, t, t))]
    keys, values = [k], [v]
    for s in range(2, steps + 1):
        previous = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))  # position p gets step s - 1's output at p - 1
        x, q, k, v = drafter.project(previous, token_embeddings, positions)
        keys.append(k)
        values.append(v)
        # step-1 keys at positions <= the anchor p - s + 1 (within the window), step r's key at p - s + r
        masks = [(offset >= s - 1) & (offset < drafter.window)] + [offset == s - r for r in range(2, s + 1)]
        mask = torch.cat(masks, 1)[None].expand(b, t, t * s)
        outs.append(drafter.finish(x, q, torch.cat(keys, 1), torch.cat(values, 1), mask))
    return outs


def output_size(model) -> int:
    """The model's vocabulary as its LM head has it (without reading the weight: the int8 model's head makes its
    float table on each read)."""
    head = model.get_output_embeddings()
    size = getattr(head, "out_features", None)
    return int(size) if size is not None else int(head.weight.shape[0])


def head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the model's LM head weight, float32 (the int8 model's head dequantizes only those)."""
    head = model.get_output_embeddings()
    if hasattr(head, "select"):
        return head.select(ids.long())
    return head.weight.detach()[ids.long()].float()


def draft_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab] position of each target token in the draft vocabulary, -100 (ignored by the loss) if absent."""
    index = torch.full((vocab_size,), -100, dtype=torch.long)
    index[draft_ids.long()] = torch.arange(draft_ids.numel())
    return index


def build_module(config: dict) -> nn.Module:
    """The untrained module a heads config describes (KeyError / TypeError where the config lacks a setting)."""
    kind = config["kind"]
    if kind == "medusa":
        return MedusaHeads(config["hidden_size"], config["num_heads"])
    if kind == "eagle":
        return EagleDrafter(config["hidden_size"], config["attention_heads"], config["intermediate_size"],
                            config["window"])
    if kind == "eagle3":
        return Eagle3Drafter(config["hidden_size"], config["attention_heads"], config["intermediate_size"],
                             config["window"], len(config["taps"]))
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


# what a heads.json must say, with the type of each value (a file without one of these is not a heads file)
REQUIRED = {"kind": str, "hidden_size": int, "vocab_size": int}
# the model's LM head rows whose norms a heads file records (``fingerprint``): the first ones of its draft vocabulary
FINGERPRINT_ROWS = 16
# how far a recorded norm may be from the model's: the int8 model's head rows (q * scale) are within a fraction of a
# percent of the float32 rows they were made from; another model's rows are tens of percent away
FINGERPRINT_TOLERANCE = 0.03


def fingerprint(model, draft_ids: torch.Tensor) -> list[float]:
    """The norms of the model's LM head rows of the first ``FINGERPRINT_ROWS`` draft tokens: what tells two models of
    the same shape apart (another checkpoint of the same architecture), recorded in heads.json by training."""
    rows = head_rows(model, draft_ids[:FINGERPRINT_ROWS].cpu())
    return [round(float(n), 5) for n in rows.float().norm(dim=-1)]


def load_heads(folder: str | Path) -> tuple[nn.Module, torch.Tensor, dict]:
    """(module in float32, eval mode; draft token ids; config) from a folder written by ``save_heads``. A file that
    is not what ``save_heads`` writes (unreadable, cut short, weights of another shape than its heads.json says) is a
    one-line UserError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    config_path, weights_path = folder / CONFIG_NAME, folder / WEIGHTS_NAME
    if not config_path.exists() or not weights_path.exists():
        raise UserError(f"no trained heads in {folder} (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise UserError(f"{config_path} is not a heads config: not JSON ({_first_line(exc)})") from None
    if not isinstance(config, dict):
        raise UserError(f"{config_path} is not a heads config: expected a JSON object")
    for key, kind in REQUIRED.items():
        if not isinstance(config.get(key), kind) or isinstance(config.get(key), bool):
            raise UserError(f"{config_path} is not a heads config: {key!r} is missing or not a {kind.__name__}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise UserError(f"{weights_path} cannot be read (corrupt or cut short?): {_first_line(exc)}") from None
    draft_ids = tensors.pop("draft_ids", None)
    if draft_ids is None or draft_ids.dim() != 1 or draft_ids.dtype.is_floating_point or not draft_ids.numel():
        raise UserError(f"{weights_path} has no draft vocabulary (a 'draft_ids' tensor of token ids)")
    draft_ids = draft_ids.long()
    if int(draft_ids.min()) < 0 or int(draft_ids.max()) >= config["vocab_size"]:
        raise UserError(f"{weights_path}: its draft vocabulary has token ids outside the vocabulary of "
                        f"{config['vocab_size']} its heads.json names")
    try:
        module = build_module(config)
        module.load_state_dict({k: v.float() for k, v in tensors.items()})
    except (RuntimeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{weights_path} does not hold the {config['kind']} heads its {CONFIG_NAME} describes "
                        f"(hidden {config['hidden_size']}): {_first_line(exc)}") from None
    return module.eval(), draft_ids, config


def _first_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    return (text[:200] + "...") if len(text) > 200 else (text or type(exc).__name__)


def check_matches(config: dict, model, where: str, taps: tuple[int, ...] | None = None,
                  draft_ids: torch.Tensor | None = None) -> None:
    """UserError when heads were trained for a model of another shape or vocabulary, for another model of the same
    shape (the recorded ``fingerprint`` of its LM head rows differs), or (EAGLE-3) on other layers than the ``taps``
    the strategy's forwards return."""
    hidden = int(model.config.hidden_size)
    vocab = output_size(model)
    if config.get("hidden_size") != hidden or config.get("vocab_size") != vocab:
        raise UserError(f"heads in {where} were trained for {config.get('model_id')!r} (hidden "
                        f"{config.get('hidden_size')}, vocab {config.get('vocab_size')}); this model has hidden "
                        f"{hidden}, vocab {vocab}: train heads for it with python -m mtpflow.train_heads")
    recorded = config.get("fingerprint")
    if recorded and draft_ids is not None:
        mine = fingerprint(model, draft_ids)
        if len(mine) != len(recorded) or any(abs(a - b) > FINGERPRINT_TOLERANCE * max(abs(b), 1e-6)
                                             for a, b in zip(mine, recorded)):
            raise UserError(f"heads in {where} were trained for another model, {config.get('model_id')!r}, of the same "
                            f"shape (its LM head rows differ from this model's): train heads for this model with "
                            f"python -m mtpflow.train_heads")
    if config.get("kind") == "eagle3" and taps is not None and tuple(config.get("taps") or ()) != tuple(taps):
        raise UserError(f"eagle3 heads in {where} were trained on layers {list(config.get('taps') or ())} of "
                        f"{config.get('model_id')!r}; this strategy's forwards return layers {list(taps)}: "
                        f"train heads for this model with python -m mtpflow.train_heads \"kinds=[eagle3]\"")


def default_attention_heads(hidden: int) -> int:
    """A head count dividing ``hidden`` with head_dim near 64."""
    best = 1
    for h in range(1, hidden + 1):
        if hidden % h == 0 and abs(hidden / h - 64) < abs(hidden / best - 64):
            best = h
    return best


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dimension."""
    return torch.special.entr(probs).sum(-1)  # -p log p, 0 where p = 0


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy divided by log(vocab): 0 = certain, 1 = uniform."""
    return entropy(probs) / math.log(max(probs.shape[-1], 2))
