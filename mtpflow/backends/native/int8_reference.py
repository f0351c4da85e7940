"""The int8 model (``model.quantize=int8``): its numerics, defined once, in torch.

A model its layer description describes (``description``: every family of ``description.FAMILIES``), quantized by
``quantize_model``, is this model, and its forward is ``Int8Reference.forward``:
- every linear of the decoder layers and the LM head: int8 weights ``q [N, K]`` with one float32 scale per output
  feature (symmetric: ``scale = max|w_n| / 127``, ``q = round(w / scale)``);
- its input quantized per row: ``s = max|x| / 127`` (1 for a row of zeros), ``xq = round(x / s)`` clamped to
  +-127, ``round`` half to even;
- the product: the exact integer ``dot = sum_k xq q``, then ``y = (float(dot) * s) * scale`` (float32, that
  order), then ``+ bias`` where the product has one. Each row's result depends on that row alone: a batched verify
  gives exactly what its rows give one at a time;
- RMSNorm: the mean square summed in float64, rounded once, then ``w * (x * (1 / sqrt(ms + eps)))`` in float32
  (a correctly rounded square root; ``w`` the norm's scale: its weight, or ``1 + w`` computed once in float32); the
  same over each query and key head where the model norms them, and over the attention's and the MLP's outputs
  where it norms those;
- rotary from one table of cos / sin per position and layer kind (``description.RopeTable``: the model's own
  ``rotary_emb``), ``x * cos + rotate_half(x) * sin`` over a head's first ``rotary_dims`` values;
- the KV cache: each key and value head quantized as a product's input row is (``quantize_rows``: int8 values and
  one float32 scale per token and head);
- attention: each query head quantized the same way; scores ``((float(dot) * sq) * sk) * scale`` with ``dot`` the
  exact integer ``q . k`` (below 2^24 for head sizes up to 1024, so exact in float32 whatever the order of its sums),
  soft-capped where the model caps them
  (``tanh(s / c) * c``), over the keys the layer's sliding window reaches; softmax ``vexp(s - max)`` (the
  polynomial below) with its sum in float64, rounded once; each weight ``w = e * sv`` (float32; ``sv`` its value's
  scale) in 16-bit fixed point, ``wq = round(w * (WQ_MAX / max w))`` (half to even), and the output
  ``(float(sum wq vq) * (max w / WQ_MAX)) * (1 / float(sum e))`` with ``sum wq vq`` the exact integer sum over the
  value's int8 values ``vq``;
- the gated MLP ``act(g) * u``: SiLU ``g / (1 + vexp(-g))``, GELU-tanh ``g / (1 + vexp(t * -2))`` with
  ``t = ((((g * g) * g) * 0.044715) + g) * 0.7978845608``; ``tanh(y) = 1 - 2 / (1 + vexp(y + y))``; residuals in
  float32; the embedding: the model's float table (for a head tied to it, the int8 head's rows times their
  scales: ``Int8Weights.embedding``), times the model's embedding scale where it has one; the logits soft-capped
  where the model caps them (``softcap``).

The C kernel (``mtpflow_w8a8_rows`` and ``mtpflow_gemm_w8a8`` in gemm.c and rows_int8.c, no fused multiply-adds
between its products; ``rows_common.h`` for the activations) computes the same operations. Sums in float64 are
rounded once to float32, so their order does not matter except when a sum lies within float64 rounding of a
float32 rounding boundary (the tests measure how often that is: never, in the cases they run). "Lossless" over the
int8 model means token-identical to ``Int8Reference.greedy``: one token at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpflow.backends.native.description import GELU_TANH, SILU, describe, fused_bias
from mtpflow.backends.native.memory import streamed_empty
from mtpflow.backends.native.products import pack_q8, packed_q8_rows, packed_q8_shape, quantize_int8, unpack_q8

F32 = torch.float32
# the integer dot products run as float32 matmuls over chunks of CHUNK columns: every partial sum is an integer
# below CHUNK * 127 * 127 < 2^24, so each chunk is exact whatever order the matmul sums in
CHUNK = 1024
# a query's largest attention weight in the 16-bit fixed point of the weighted values (rows_int8.c's WQ_MAX): each
# weight within 1 / 65534 of that largest one, the sums exact integers
WQ_MAX = 32767.0


@dataclass
class Int8Linear:
    """One linear of the int8 model: ``q`` its int8 weight [N, k] packed for the kernel (``products.pack_q8``:
    zero-padded, in blocks), ``scale`` [N] float32, ``wsum`` [N] int32 (the rows' sums: the VNNI kernel's offset
    correction). ``rows()``: the weight [N, k]."""
    q: torch.Tensor
    scale: torch.Tensor
    wsum: torch.Tensor
    k: int

    @classmethod
    def of(cls, *weights: torch.Tensor) -> "Int8Linear":
        """The int8 linear of ``weights`` (float [N_i, k] each, over the same input: q/k/v, gate/up) as one, their
        rows one after another; each row quantized on its own."""
        parts = [quantize_int8(w) for w in weights]
        q = torch.cat([p[0] for p in parts])
        return cls(pack_q8(q), torch.cat([p[1] for p in parts]).contiguous(),
                   q.sum(dim=1, dtype=torch.int32).contiguous(), int(q.shape[1]))

    @property
    def n(self) -> int:
        return int(self.scale.numel())

    @property
    def kp(self) -> int:
        return int(self.q.shape[1] * self.q.shape[3])  # [panels, kp / 4, Q8_PANEL, 4]

    def rows(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """The int8 weight [N, k] (or its rows ``ids``)."""
        if ids is None:
            return unpack_q8(self.q, self.n, self.k)
        return packed_q8_rows(self.q, ids.reshape(-1))[:, :self.k]

    def dequantized(self, ids: torch.Tensor | None = None) -> torch.Tensor:
        """``q * scale`` in float32 [N, k] (or rows ``ids``): what the int8 head is as a float table."""
        scale = self.scale if ids is None else self.scale[ids.reshape(-1)]
        return self.rows(ids).to(F32) * scale[:, None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scale, self.wsum))


@dataclass
class Int8Layer:
    ln1: torch.Tensor     # [H] input RMSNorm scale (float32)
    qkv: Int8Linear       # q rows, then k rows, then v rows
    o: Int8Linear
    ln2: torch.Tensor     # [H] the MLP's input norm scale
    gate_up: Int8Linear   # gate rows, then up rows
    down: Int8Linear
    post_attention: torch.Tensor | None = None  # [H] the norm of the attention's output, before the residual
    post_mlp: torch.Tensor | None = None        # [H] the norm of the MLP's output
    q_norm: torch.Tensor | None = None          # [d] each query head's norm, before the rotary
    k_norm: torch.Tensor | None = None          # [d]
    bqkv: torch.Tensor | None = None            # biases (float32) of the four products
    bo: torch.Tensor | None = None
    bgu: torch.Tensor | None = None
    bd: torch.Tensor | None = None
    window: int = 0                             # 0: every key; w: the keys of the last w positions
    rope: str | None = "default"                # its table's key in ``Int8Weights.rope`` (None: no rotary)


@dataclass
class Int8Weights:
    """Everything the int8 model's forward reads (``quantize_model`` builds it)."""
    layers: list[Int8Layer]
    norm: torch.Tensor            # [H] final RMSNorm scale
    head: Int8Linear              # [vocab, H]
    embed: torch.Tensor | None    # [vocab, H] float32 lookup table; None: the head is tied to the embedding
    eps: float
    heads: int                    # query heads
    kv_heads: int
    head_dim: int
    intermediate: int
    attn_scale: float
    rope: dict                    # {key: description.RopeTable}
    rotary_dims: int = 0          # the rotary values of a head (its first ones; head_dim: all)
    activation: int = SILU        # of the gate: description.SILU or GELU_TANH
    attn_softcap: float = 0.0     # 0: none
    logit_softcap: float = 0.0
    embed_scale: float | None = None
    buffer: torch.Tensor | None = None  # the one buffer every Int8Linear's q is a view of (quantize_model)

    def embedding(self, ids: torch.Tensor) -> torch.Tensor:
        """The input embeddings [len(ids), H] of token ``ids``: the float table's rows, or for a head tied to the
        embedding the int8 head's rows times their scales; times the embedding scale where the model has one."""
        rows = self.head.dequantized(ids) if self.embed is None else self.embed[ids.reshape(-1)]
        return rows if self.embed_scale is None else rows * _c(self.embed_scale)

    @property
    def hidden(self) -> int:
        return int(self.norm.numel())

    @property
    def nbytes(self) -> int:
        """Bytes of the int8 linears (the decoder layers and the head)."""
        return self.head.nbytes + sum(lin.nbytes for layer in self.layers
                                      for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))


def _packed_bytes(*weights: torch.Tensor) -> int:
    """Bytes of the packed int8 weight ``Int8Linear.of(*weights)`` makes (``products.pack_q8``)."""
    shape = packed_q8_shape(sum(int(w.shape[0]) for w in weights), int(weights[0].shape[1]))
    return shape[0] * shape[1] * shape[2] * shape[3]


def _scale(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().clone()


def quantize_model(model, release=None) -> Int8Weights:
    """The int8 model of ``model`` (float32, bfloat16 or float16 weights; callers check it applies: the
    ``native_cpu`` backend's ``not_applicable``), from its layer description. The int8 weights go into one buffer,
    in the order a forward reads them: the kernel then streams one region from memory, on huge pages where the
    system grants them (``memory.streamed_empty``; docs/bench/int8_dec05.md#kernel-figures has what the layout
    measured). ``release(module)``: called with each
    decoder layer once it is quantized, then with the LM head: where the caller frees their weights, the process
    never holds the whole model twice (the buffer's pages become resident as they are filled)."""
    desc = describe(model)
    blocks = list(model.model.layers[: model.config.num_hidden_layers])
    parts = lambda layer: (tuple(m.weight for m in layer.qkv), (layer.o.weight,),  # noqa: E731
                           tuple(m.weight for m in layer.gate_up), (layer.down.weight,))
    head_weight = desc.head.weight
    sizes = [_packed_bytes(*group) for layer in desc.layers for group in parts(layer)] + [_packed_bytes(head_weight)]
    buffer = streamed_empty(sum(sizes), torch.int8)
    at = [0]

    def into_buffer(*weights) -> Int8Linear:
        lin = Int8Linear.of(*weights)
        n = lin.q.numel()
        view = buffer[at[0]:at[0] + n].view(lin.q.shape)
        view.copy_(lin.q)
        at[0] += n
        return Int8Linear(view, lin.scale, lin.wsum, lin.k)

    layers = []
    with torch.no_grad():
        for layer, block in zip(desc.layers, blocks):
            qkv, o, gate_up, down = (into_buffer(*group) for group in parts(layer))
            layers.append(Int8Layer(
                _scale(layer.ln1), qkv, o, _scale(layer.ln2), gate_up, down, _scale(layer.post_attention),
                _scale(layer.post_mlp), _scale(layer.q_norm), _scale(layer.k_norm), fused_bias(layer.qkv),
                fused_bias((layer.o,)), fused_bias(layer.gate_up), fused_bias((layer.down,)), layer.window, layer.rope))
            if release is not None:
                release(block)
        head = into_buffer(head_weight)
        embed = None if desc.tied else desc.embedding.weight.detach().float()  # tied: the int8 head's rows
        if release is not None:
            release(desc.head)
    return Int8Weights(layers, _scale(desc.norm), head, embed, desc.eps, desc.heads, desc.kv_heads, desc.head_dim,
                       desc.intermediate, desc.scale, desc.rope, desc.rotary_dims, desc.activation, desc.attn_softcap,
                       desc.logit_softcap, desc.embed_scale, buffer)


# ----- the operations ---------------------------------------------------------------------------------------------
def _c(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=F32)


_EXP = {name: _c(v) for name, v in (
    ("lo", -87.0), ("hi", 88.0), ("log2e", 1.44269504088896341), ("half", 0.5), ("one", 1.0),
    ("c1", 0.693359375), ("c2", -2.12194440e-4), ("p0", 1.9875691500e-4), ("p1", 1.3981999507e-3),
    ("p2", 8.3334519073e-3), ("p3", 4.1665795894e-2), ("p4", 1.6666665459e-1), ("p5", 5.0000001201e-1))}


def vexp(x: torch.Tensor) -> torch.Tensor:
    """e^x as gemm.c and rows_int8.c's ``vexp`` computes it (Cephes' expf: x = n ln2 + r, a degree-6 polynomial in r, times
    2^n; x clamped to [-87, 88]), one float32 rounding per operation."""
    c = _EXP
    x = torch.where(x < c["lo"], c["lo"], x)
    x = torch.where(c["hi"] < x, c["hi"], x)
    fx = x * c["log2e"] + c["half"]
    t = fx.to(torch.int32).to(F32)  # truncation, then floor
    t = t - (t > fx).to(F32)
    x = x - t * c["c1"] - t * c["c2"]
    y = c["p0"] * x + c["p1"]
    for p in ("p2", "p3", "p4", "p5"):
        y = y * x + c[p]
    y = y * (x * x) + x + c["one"]
    n = t.to(torch.int32)
    return y * ((n + 127) << 23).view(F32)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    ms = ((x.double() * x.double()).sum(-1) / x.shape[-1]).float()
    # torch.sqrt in float32 is not correctly rounded (169,053 of 1,000,000 random values differed from numpy's,
    # docs/bench/int8_dec05.md); the square root of the float64 value, rounded to float32, is: the C kernel's sqrtf
    r = _c(1.0) / torch.sqrt((ms + _c(eps)).double()).float()
    return weight * (x * r[..., None])


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [..., K] as int8 values (held in float32) and its scale [...]."""
    amax = x.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / _c(127.0), _c(1.0))
    return torch.round(x / s[..., None]).clamp_(-127, 127), s


def linear(x: torch.Tensor, lin: Int8Linear, cache: dict | None = None) -> torch.Tensor:
    """The int8 model's product over ``x`` [..., K] -> [..., N]: exact integer dot products, then the scales.
    ``cache``: where to keep the float copy of the int8 weight between calls (keyed by the weight)."""
    xq, s = quantize_rows(x)
    flat = xq.reshape(-1, lin.k)
    wf = cache.get(id(lin.q)) if cache is not None else None
    if wf is None:
        wf = lin.rows().to(F32)
        if cache is not None:
            cache[id(lin.q)] = wf
    dot = torch.zeros(flat.shape[0], wf.shape[0], dtype=torch.int64)
    for start in range(0, lin.k, CHUNK):
        dot += (flat[:, start:start + CHUNK] @ wf[:, start:start + CHUNK].T).to(torch.int64)
    y = (dot.to(F32) * s.reshape(-1)[:, None]) * lin.scale[None, :]
    return y.reshape(*x.shape[:-1], -1)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [rows, heads, d], cos / sin [rows, rot]: ``x * cos + rotate_half(x) * sin`` over each head's first ``rot``
    values, the rest as they are."""
    rot = cos.shape[-1]
    half = rot // 2
    turned = torch.cat([-x[..., half:rot], x[..., :half]], dim=-1)
    return torch.cat([x[..., :rot] * cos[:, None] + turned * sin[:, None], x[..., rot:]], dim=-1)


def tanh(y: torch.Tensor) -> torch.Tensor:
    """``1 - 2 / (1 + vexp(y + y))`` (rows_common.h's ``vtanh``)."""
    return _c(1.0) - _c(2.0) / (_c(1.0) + vexp(y + y))


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """``tanh(x / cap) * cap`` (``cap`` 0: ``x``): the soft-cap of scores and of logits."""
    if not cap:
        return x
    return tanh(x / _c(cap)) * _c(cap)


def gated(g: torch.Tensor, u: torch.Tensor, activation: int) -> torch.Tensor:
    """``act(g) * u`` (rows_common.h's ``gated``): SiLU or GELU-tanh, as the module docstring writes them."""
    if activation == SILU:
        return (g / (_c(1.0) + vexp(-g))) * u
    assert activation == GELU_TANH
    t = ((((g * g) * g) * _c(0.044715)) + g) * _c(0.7978845608)
    return (g / (_c(1.0) + vexp(t * _c(-2.0)))) * u


def attention(q: torch.Tensor, keys: torch.Tensor, key_scales: torch.Tensor, values: torch.Tensor,
              value_scales: torch.Tensor, visible: torch.Tensor, scale: float, cap: float = 0.0) -> torch.Tensor:
    """q [rows, heads, d] over the cache's int8 keys and values [kv_heads, n, d] (``quantize_rows``' values, held as
    floats) and their scales [kv_heads, n]; visible [rows, n] bool -> [rows, heads * d]. Each query head is quantized
    as the keys are; a score is the integer dot product (exact in float below 2^24) times the query's scale, the key's
    scale and ``scale``; each weight, the softmax's exponential times its value's scale, weighs the values in 16-bit
    fixed point (the module's description)."""
    rows, heads, d = q.shape
    group = heads // keys.shape[0]
    qq, sq = quantize_rows(q.transpose(0, 1))  # [heads, rows, d], [heads, rows]
    k = keys.repeat_interleave(group, dim=0).double()  # [heads, n, d]
    sk = key_scales.repeat_interleave(group, dim=0)  # [heads, n]
    v = values.repeat_interleave(group, dim=0).double()
    sv = value_scales.repeat_interleave(group, dim=0)
    dots = (qq.double() @ k.transpose(1, 2)).float()  # [heads, rows, n]: integers, exact
    scores = softcap(((dots * sq[..., None]) * sk[:, None, :]) * _c(scale), cap)
    scores = scores.masked_fill(~visible[None], -torch.inf)
    m = scores.amax(dim=-1, keepdim=True)
    e = torch.where(visible[None], vexp(scores - m), _c(0.0))
    inv = _c(1.0) / e.double().sum(dim=-1).float()
    w = e * sv[:, None, :]
    wmax = w.amax(dim=-1, keepdim=True)
    wq = torch.round(w * (_c(WQ_MAX) / wmax))  # integers up to WQ_MAX
    # the integer sums are exact in float64 (below 2^53), whatever order the product sums in
    out = ((wq.double() @ v).float() * (wmax / _c(WQ_MAX))) * inv[..., None]  # [heads, rows, d]
    return out.transpose(0, 1).reshape(rows, heads * d)


# ----- the forward ------------------------------------------------------------------------------------------------
class Int8Reference:
    """The int8 model's forward over one sequence with its own KV cache, and its greedy decoding. Slow (torch ops,
    float copies of the int8 weights): it defines what the kernel must compute."""

    def __init__(self, weights: Int8Weights):
        self.w = weights
        self.float_weights: dict = {}  # this reference's float copies of the int8 weights (``linear``'s cache)
        # the KV cache, per layer: keys and values [kv_heads, n, d] as int8 values held as floats, their scales
        # [kv_heads, n]
        self.keys: list[torch.Tensor] = []
        self.key_scales: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.value_scales: list[torch.Tensor] = []

    def reset(self) -> None:
        """An empty KV cache: the next ``forward`` starts a new sequence."""
        self.keys, self.key_scales, self.values, self.value_scales = [], [], [], []

    @property
    def length(self) -> int:
        return int(self.keys[0].shape[1]) if self.keys else 0

    @torch.no_grad()
    def forward(self, ids: torch.Tensor, taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """The next ``ids`` [n] after the cache (causal): (logits [n, vocab], final-normed hidden [n, H],
        {layer: its output [n, H]} for ``taps``)."""
        w = self.w
        n, start = int(ids.numel()), self.length
        positions = torch.arange(start, start + n)
        tables = {key: table.rows(positions) for key, table in w.rope.items()}
        causal = torch.arange(start + n)[None] <= positions[:, None]
        h = w.embedding(ids)
        nq, nk, d = w.heads * w.head_dim, w.kv_heads * w.head_dim, w.head_dim
        tapped = {}

        def plus(y, bias):
            return y if bias is None else y + bias

        def normed(x, scale):
            return x if scale is None else rmsnorm(x, scale, w.eps)

        for index, layer in enumerate(w.layers):
            qkv = plus(linear(rmsnorm(h, layer.ln1, w.eps), layer.qkv, self.float_weights), layer.bqkv)
            q = normed(qkv[:, :nq].reshape(n, w.heads, d), layer.q_norm)
            k = normed(qkv[:, nq:nq + nk].reshape(n, w.kv_heads, d), layer.k_norm)
            v = qkv[:, nq + nk:].reshape(n, w.kv_heads, d)
            if layer.rope is not None:
                cos, sin = tables[layer.rope]
                q, k = rotary(q, cos, sin), rotary(k, cos, sin)
            if len(self.keys) <= index:
                self.keys.append(torch.empty(w.kv_heads, 0, d))
                self.key_scales.append(torch.empty(w.kv_heads, 0))
                self.values.append(torch.empty(w.kv_heads, 0, d))
                self.value_scales.append(torch.empty(w.kv_heads, 0))
            for held, scales, new in ((self.keys, self.key_scales, k), (self.values, self.value_scales, v)):
                entries, scale = quantize_rows(new.transpose(0, 1))  # the cache holds each head as int8 and its scale
                held[index] = torch.cat([held[index], entries], dim=1)
                scales[index] = torch.cat([scales[index], scale], dim=1)
            visible = causal
            if layer.window:
                visible = causal & (positions[:, None] - torch.arange(start + n)[None] < layer.window)
            att = attention(q, self.keys[index], self.key_scales[index], self.values[index], self.value_scales[index],
                            visible, w.attn_scale, w.attn_softcap)
            h = h + normed(plus(linear(att, layer.o, self.float_weights), layer.bo), layer.post_attention)
            gu = plus(linear(rmsnorm(h, layer.ln2, w.eps), layer.gate_up, self.float_weights), layer.bgu)
            act = gated(gu[:, :w.intermediate], gu[:, w.intermediate:], w.activation)
            h = h + normed(plus(linear(act, layer.down, self.float_weights), layer.bd), layer.post_mlp)
            if index in taps:
                tapped[index] = h
        final = rmsnorm(h, w.norm, w.eps)
        return softcap(linear(final, w.head, self.float_weights), w.logit_softcap), final, tapped

    def greedy(self, prompt: torch.Tensor, max_new_tokens: int, eos_ids=()) -> list[int]:
        """The int8 model's greedy continuation of ``prompt`` (a fresh cache), one token per forward, stopping
        after an ``eos_ids`` token: what every lossless strategy over the int8 target must return."""
        self.reset()
        logits, _, _ = self.forward(prompt)
        out: list[int] = []
        while len(out) < max_new_tokens:
            token = int(logits[-1].argmax())
            out.append(token)
            if token in eos_ids:
                break
            logits, _, _ = self.forward(torch.tensor([token]))
        return out
