"""The ``native_cpu`` backend: a Llama-family float32 model's forwards through mtpflow's C kernels.

On a CPU at small batch a decode step is bound by reading the weights. Here:
- every verify forward (a plain step, a chain, a tree; one sequence or the engine's whole batch) runs all decoder
  layers in ONE call into ``mtpflow_llama_rows`` (``rows_float.c``), over only the real rows;
- prefills run the lean forward's layers in Python (``mtpflow.forward``, through ``torch_forward``: an ``hf``
  backend over the same model) with this backend's products: the native row and panel kernels over the fused
  q/k/v and gate/up weights;
- a verify the kernel declines (a strategy wants the hidden states of inner layers, or a weight was replaced)
  runs that same torch forward as a named fallback: counted in ``stats()`` and in the run's stats
  (``backend_fallbacks``), never silently;
- greedy sequences whose stages read only each row's argmax get the certified int8 LM head
  (``certified_head``): the argmax exact at a quarter of the head's bytes;
- ``self_draft`` drafts with the target's own layers over an int8 copy of their weights (``int8_draft``).

A model loaded with ``model.quantize=int8`` is the int8 model: ``mtpflow.backends.native.int8`` runs it.

The rule that chooses kernels is fixed, not timed per host: native products for every row count where the C
kernel builds; otherwise the backend does not apply and ``auto`` picks ``hf`` (the per-host plan timings it
replaces chose native for every verify size on every host in docs/bench; see docs/kernels.md).

The user's model stays as loaded: no attribute is added and no class swapped. Its q/k/v and gate/up weights
become views into one concatenated weight each (the same values, names, dtypes and state dict; no extra
memory), which the fused products read; panel copies, int8 copies and the certified head belong to this object.
"""
from __future__ import annotations

import time
import torch
import torch.nn.functional as F

from mtpflow import forward as lean_forward
from mtpflow.backends.base import Backend
from mtpflow.backends.hf import HFBackend
from mtpflow.backends.native import kernel, openmp, products
from mtpflow.backends.native.certified_head import CertifiedHead, applies as certified_applies
from mtpflow.backends.native.rows import VerifyRows, verify_rows
from mtpflow.types import Verification

LLAMA = "transformers.models.llama.modeling_llama"


def not_applicable(model, dtypes=(torch.float32,)) -> str | None:
    """Why this backend cannot run ``model`` (one line), or None where it can. ``dtypes``: the weight dtypes
    accepted (the int8 model is made from float32, bfloat16 or float16 weights)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"it runs on the CPU and the model is on {param.device}"
    if param.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        return f"it runs {names} weights and the model is {str(param.dtype).replace('torch.', '')}"
    if param.is_inference():
        return "the weights were created under torch.inference_mode() (their in-place changes cannot be tracked)"
    if not kernel.available():
        return "mtpflow's C kernel could not be built here (no C compiler: set CC, or install cc/gcc)"
    if not lean_forward.supports(model):
        attn = getattr(model.config, "_attn_implementation", "?")
        return f"it runs Llama-family models on SDPA attention, not {type(model).__name__} on {attn}"
    try:
        inner = model.model
        layers = list(inner.layers[: model.config.num_hidden_layers])
        norms = [inner.norm] + [n for b in layers for n in (b.input_layernorm, b.post_attention_layernorm)]
        linears = [m for b in layers for m in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj,
                                               b.self_attn.o_proj, b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj)]
        ok = (getattr(model.config, "hidden_act", None) == "silu"
              and all(type(b.self_attn).__module__ == LLAMA and type(b.mlp).__module__ == LLAMA for b in layers)
              and all(type(n).__name__ == "LlamaRMSNorm"
                      and float(n.variance_epsilon) == float(inner.norm.variance_epsilon) for n in norms)
              and all(m.bias is None and m.weight.is_contiguous() for m in linears)
              and layers[0].self_attn.head_dim % 2 == 0)
    except (AttributeError, TypeError):
        ok = False
    return None if ok else "the model's layers are not plain Llama layers (norm, activation, biases or rotary differ)"


def _fuse(parts: list[torch.nn.Linear]) -> torch.Tensor:
    """One weight [sum(out), in] whose rows are ``parts``' weights, the parts' weights made views into it (the
    same values; no memory added). Idempotent: parts already laid out one after another in one storage (a
    model an earlier backend fused) give a view of that storage, so two backends never hold two copies."""
    weights = [p.weight for p in parts]
    first = weights[0]
    rows = sum(int(w.shape[0]) for w in weights)
    offsets = [first.storage_offset()]
    for w in weights[:-1]:
        offsets.append(offsets[-1] + w.numel())
    same = all(w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and w.is_contiguous()
               and w.storage_offset() == o for w, o in zip(weights, offsets))
    with torch.inference_mode(False), torch.no_grad():
        if same:
            return first.detach().new_empty(0).set_(first.untyped_storage(), first.storage_offset(),
                                                    (rows, first.shape[1]))
        fused = torch.cat([w.detach() for w in weights])  # a normal tensor: its version tracks in-place changes
        start = 0
        for p in parts:
            n = int(p.weight.shape[0])
            p.weight.data = fused[start:start + n]
            start += n
    return fused


class _Fused:
    """A layer's fused product (q/k/v or gate/up) and the parts whose weights are views into it."""

    def __init__(self, parts: list[torch.nn.Linear]):
        self.parts = parts
        self.weight = _fuse(parts)
        self.sizes = [int(p.weight.shape[0]) for p in parts]
        self.pointers = [p._parameters["weight"].data_ptr() for p in parts]

    def ready(self) -> bool:
        """Every part's weight is still the view into ``weight`` (a part given a new weight is used alone).
        Read through the parameters dict: called per layer and forward."""
        return all(p._parameters["weight"].data_ptr() == ptr for p, ptr in zip(self.parts, self.pointers))

    @property
    def version(self) -> tuple:
        """Changes whenever the values change in place: through a part (each parameter keeps its own version
        counter after its data became a view) or through the fused weight."""
        return (self.weight._version, *(p._parameters["weight"]._version for p in self.parts))


class NativeProducts(lean_forward.Products):
    """The lean forward's products through the native kernels (fused where the weights still are)."""

    def __init__(self, backend: NativeCPUBackend):
        self.backend = backend

    def attention_inputs(self, index, attn, x):
        fused = self.backend.qkv[index]
        if fused.ready():
            return self.backend.linear(fused.weight, x, version=fused.version).split(fused.sizes, dim=-1)
        return tuple(self.backend.module(m, x) for m in (attn.q_proj, attn.k_proj, attn.v_proj))

    def attention_output(self, index, attn, x):
        return self.backend.module(attn.o_proj, x)

    def mlp(self, index, mlp, x):
        fused = self.backend.gate_up[index]
        if fused.ready():
            gate, up = self.backend.linear(fused.weight, x, version=fused.version).split(fused.sizes, dim=-1)
        else:
            gate, up = self.backend.module(mlp.gate_proj, x), self.backend.module(mlp.up_proj, x)
        return self.backend.module(mlp.down_proj, mlp.act_fn(gate) * up)

    def head(self, model, h):
        return self.backend.module(model.lm_head, h)


class NativeCPUBackend(Backend):
    """Forwards through ``mtpflow_llama_rows`` and the native products; see the module docstring."""

    name = "native_cpu"

    def __init__(self, model, certified_head: bool = True):
        super().__init__(model)
        reason = not_applicable(model)
        if reason is not None:
            raise ValueError(reason)  # ``mtpflow.backends.create`` turns it into one line for the user
        self.lib = kernel.library()
        layers = list(model.model.layers[: model.config.num_hidden_layers])
        self.layers = layers
        self.qkv = [_Fused([b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj]) for b in layers]
        self.gate_up = [_Fused([b.mlp.gate_proj, b.mlp.up_proj]) for b in layers]
        self.certified = bool(certified_head)
        # the lean forward in torch over the same model with this backend's products: every prefill, and the
        # verifies the kernel declines (named fallbacks)
        self.products = NativeProducts(self)
        self.torch_forward = HFBackend(model)
        self.torch_forward.products = self.products
        self._panels: dict[int, tuple] = {}  # weight data_ptr -> (version, panel copy)
        self._head: CertifiedHead | None = None
        self._rows = _RowSpec(self)

    # ----- products -----------------------------------------------------------------------------------------
    def linear(self, weight: torch.Tensor, x: torch.Tensor, bias=None, version=None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` through the native kernels, the panel kernel from its row threshold
        (``version``: what tells an in-place change of ``weight``, its own version counter by default)."""
        rows = x.numel() // x.shape[-1]
        panels = self.panels(weight, version) if rows >= kernel.panel_min_rows(self.lib) else None
        return products.linear(x, weight, bias, panels, self.lib)

    def module(self, m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        """A linear module's product: native for float32 weights."""
        weight = m.weight
        if weight.dtype != torch.float32 or x.dtype != torch.float32 or not weight.is_contiguous():
            return F.linear(x, weight, m.bias)
        return self.linear(weight, x, m.bias)

    def linear_rows(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """A draft head's product through the native row kernel (it reads the weight once for all rows)."""
        if x.dtype == torch.float32 and weight.dtype == torch.float32 and not torch.is_grad_enabled():
            return products.linear(x, weight, lib=self.lib)
        return super().linear_rows(x, weight)

    def panels(self, weight: torch.Tensor, version=None) -> torch.Tensor:
        """The panel copy of ``weight`` (``products.pack_panels``), built on first use and again when the
        weight changed in place (``version``, else its own version counter)."""
        key = weight.data_ptr()
        version = weight._version if version is None else version
        held = self._panels.get(key)
        if held is None or held[0] != version:
            held = (version, products.pack_panels(weight))
            self._panels[key] = held
        return held[1]

    def head_logits(self, normed: torch.Tensor, argmax_only: bool) -> torch.Tensor:
        """The LM head over ``normed`` [..., rows, hidden]: the certified int8 head where every row's reader takes
        only the argmax and it applies, else the native float32 product."""
        head = self.model.lm_head
        rows = normed.numel() // normed.shape[-1]
        if not (argmax_only and self.certified and certified_applies(head, rows)):
            return self.module(head, normed)
        weight = head.weight
        if self._head is None or self._head.key != (weight.data_ptr(), weight._version):
            self._head = CertifiedHead(weight)
        return self._head.logits(normed).view(*normed.shape[:-1], -1)

    # ----- the interface ------------------------------------------------------------------------------------
    def takes_argmax_only(self) -> bool:
        return self.certified

    def kernel_identity(self) -> str:
        head = "certified-head " if self.certified else ""
        return f"{head}kernel:{kernel.source_hash()[:10]} vw{self.lib.mtpflow_vector_width()}"

    def thread_idle(self) -> None:
        openmp.release_workers()

    def stats(self) -> dict:
        held = sum(p.numel() * 4 for _, p in self._panels.values())
        held += self._head.nbytes if self._head is not None else 0
        held += self._rows.int8_bytes
        return {**super().stats(), "backend_copies_mb": round(held / 2**20, 1)}

    def prefill(self, targets, prompts, prefix_cache=None, starts=None):
        return self.torch_forward.prefill(targets, prompts, prefix_cache, starts)

    def declines(self, targets) -> str | None:
        """Why the kernel cannot run this verify (a fallback's name), or None where it runs it."""
        if any(set(t.taps) - {-1} for t in targets):
            return "hidden states of inner layers"
        if not self._rows.ready():
            return "a weight was replaced"
        return None

    @torch.inference_mode()
    def verify(self, targets, roots, drafts, root_positions):
        reason = self.declines(targets)
        if reason is not None:
            return self.fall_back(reason, self.torch_forward.verify(targets, roots, drafts, root_positions))
        t0 = time.perf_counter()
        described = verify_rows(targets, roots, drafts, root_positions)
        logits, hidden = self._rows.run_groups(targets[0].pool, described,
                                               argmax_only=all(t.argmax_only for t in targets))
        seconds = time.perf_counter() - t0
        results = []
        for target, n, start in zip(targets, described.counts, described.starts):
            target.kv.length += n
            target.forwards += 1
            h = hidden[start:start + n] if target.taps else None
            results.append(Verification(logits=logits[start:start + n].float(), hidden=h, forward_seconds=seconds))
        return results

    @torch.inference_mode()
    def self_draft(self, target, root, position, steps, layers=None):
        """``steps`` greedy tokens after ``root`` from the target's own layers with int8 weights
        (``_RowSpec.int8``): one row per token through ``mtpflow_llama_rows`` over the target's slot, whose first
        ``length`` entries (the committed tokens, written by the float32 verify forwards) every row attends to;
        the draft's own entries go after them, where the next verify forward overwrites them. The LM head is the
        certified one (its argmax is the float32 head's over these hidden states). None (no draft this step,
        counted as a fallback) where a weight was replaced."""
        rows = self._rows
        if layers is not None:
            return None
        if not rows.ready():
            self.fall_back("self-draft: a weight was replaced")
            return None
        one = torch.ones(1, 1, dtype=torch.uint8)
        length, token, drafted = target.cache_len, root, []
        for i in range(steps):
            logits, _ = rows.run(target.pool, torch.tensor([[token]]), torch.tensor([[position + i]]),
                                 [target.kv.slot], [length + i], [length + i], [0], [1], one, argmax_only=True,
                                 int8=True)
            token = int(logits[0, -1].argmax())
            drafted.append(token)
        return drafted


class _RowSpec:
    """What ``mtpflow_llama_rows`` is given for one model: its dimensions, the weights' pointer arrays, and what
    to check before each call that the weights are still the ones pointed at."""

    def __init__(self, backend: NativeCPUBackend):
        self.backend = backend
        model = backend.model
        cfg = model.config
        inner = model.model
        layers = backend.layers
        first = layers[0].self_attn
        self.dims = dict(L=len(layers), H=int(cfg.hidden_size), nh=int(cfg.num_attention_heads),
                         nkv=int(cfg.num_key_value_heads), d=int(first.head_dim), I=int(cfg.intermediate_size))
        self.eps, self.scale = float(inner.norm.variance_epsilon), float(first.scaling)
        self.norm = inner.norm.weight
        plain = [m for block in layers for m in (block.input_layernorm, block.self_attn.o_proj,
                                                 block.post_attention_layernorm, block.mlp.down_proj)] + [inner.norm]
        # every parameter the kernel reads, with where it lay when the spec was built: ``ready`` compares them
        self.watched = [(m._parameters, m._parameters["weight"].data_ptr()) for m in plain]
        self.fused = backend.qkv + backend.gate_up
        # the products in the kernel's order: fused q/k/v, o_proj, fused gate/up, down_proj
        self.weights_by_product = [[f.weight for f in backend.qkv], [b.self_attn.o_proj.weight for b in layers],
                                   [f.weight for f in backend.gate_up], [b.mlp.down_proj.weight for b in layers]]
        # what tells each product's weight changed in place (a fused weight: its parts' counters too)
        self.version_of = [[f for f in backend.qkv], [b.self_attn.o_proj for b in layers],
                           [f for f in backend.gate_up], [b.mlp.down_proj for b in layers]]
        qkv, o, gu, down = (kernel.pointers(ws) for ws in self.weights_by_product)
        self.weights = dict(ln1=kernel.pointers([b.input_layernorm.weight for b in layers]), wqkv=qkv, wo=o,
                            ln2=kernel.pointers([b.post_attention_layernorm.weight for b in layers]), wgu=gu, wd=down)
        self.kv = kernel.PoolPointers()  # the pool's key and value pointer arrays
        self._panels = None  # (the weights' versions, the panel pointer arrays)
        self._q8 = None  # (the weights' versions, int8 copies, their pointer arrays): ``int8`` builds it

    @staticmethod
    def _version(owner) -> tuple | int:
        return owner.version if isinstance(owner, _Fused) else owner._parameters["weight"]._version

    def _versions(self) -> tuple:
        return tuple(self._version(o) for os_ in self.version_of for o in os_)

    def ready(self) -> bool:
        """The weights are still those pointed at (none replaced). The dicts are read directly, not through
        nn.Module's getattr: called on every verify."""
        return (all(params["weight"].data_ptr() == ptr for params, ptr in self.watched)
                and all(f.ready() for f in self.fused))

    def int8(self) -> dict:
        """The struct members (int8 weights ``q*`` and scales ``s*``, per product) of an int8 copy of the four
        products, built on first use (``products.quantize_int8``, one scale per output feature) and again when a
        weight changed in place: what the self-draft runs."""
        versions = self._versions()
        if self._q8 is None or self._q8[0] != versions:
            copies = [[products.quantize_int8(w) for w in ws] for ws in self.weights_by_product]
            members = {}
            for name, cs in zip(("qkv", "o", "gu", "d"), copies):
                members["q" + name] = kernel.pointers([q for q, _ in cs])
                members["s" + name] = kernel.pointers([s for _, s in cs])
            self._q8 = (versions, copies, members)
        return self._q8[2]

    @property
    def int8_bytes(self) -> int:
        """Bytes held by the int8 copy (0 before ``int8`` built it)."""
        if self._q8 is None:
            return 0
        return sum(q.numel() + 4 * s.numel() for cs in self._q8[1] for q, s in cs)

    def panels(self, rows: int) -> dict:
        """The struct members ``pqkv, po, pgu, pd``: pointer arrays to each product's panel copy from
        ``kernel.panel_min_rows()`` rows, else none (the row kernel); rebuilt only when a weight changed in place
        (its version)."""
        if rows < kernel.panel_min_rows(self.backend.lib):
            return {}
        versions = self._versions()
        if self._panels is None or self._panels[0] != versions:
            self._panels = (versions, {name: kernel.pointers([self.backend.panels(w, self._version(o))
                                                              for w, o in zip(ws, os_)])
                                       for name, ws, os_ in zip(("pqkv", "po", "pgu", "pd"), self.weights_by_product,
                                                                self.version_of)})
        return self._panels[1]

    def run(self, pool, ids, positions, slots, wpos, prefix, first, count, allowed, argmax_only=False, int8=False):
        """``mtpflow_llama_rows`` over the rows described (lists of ints, one entry per row; ``allowed`` a uint8
        [rows, qmax] tensor): returns the LM head's logits [1, rows, vocab] and the normed last hidden states.
        ``int8``: the products through the int8 copy (``int8``)."""
        backend = self.backend
        pool.ensure(max(w + 1 for w in wpos))  # the pool has the weights' dtype and device: float32, CPU
        keys, values = self.kv(pool)
        inner = backend.model.model
        h = inner.embed_tokens(ids).contiguous()
        cos, sin = (t.contiguous() for t in inner.rotary_emb(h, position_ids=positions))
        normed = torch.empty_like(h)
        ints = [torch.tensor(v, dtype=torch.int32) for v in (slots, wpos, prefix, first, count)]
        m = len(slots)
        code = kernel.llama_rows(backend.lib, h=h.data_ptr(), normed=normed.data_ptr(), M=m, **self.dims, **self.weights,
                                 **(self.int8() if int8 else self.panels(m)), norm_w=self.norm.data_ptr(), eps=self.eps,
                                 kc=keys, vc=values, cap=pool.capacity, slot=ints[0].data_ptr(), wpos=ints[1].data_ptr(),
                                 prefix=ints[2].data_ptr(), first=ints[3].data_ptr(), count=ints[4].data_ptr(),
                                 allowed=allowed.data_ptr(), qmax=allowed.shape[1], cos=cos.data_ptr(),
                                 sin=sin.data_ptr(), scale=self.scale, threads=torch.get_num_threads())
        if code != 0:
            raise MemoryError("mtpflow_llama_rows: out of memory")
        return backend.head_logits(normed, argmax_only), normed

    def run_groups(self, pool, rows: VerifyRows, argmax_only=False):
        """A verify forward over ``rows`` (``verify_rows``): only real rows are computed (no padding). Returns
        (logits [rows, vocab], normed hidden [rows, hidden])."""
        logits, normed = self.run(pool, rows.ids[None], rows.positions[None], rows.slots, rows.wpos, rows.prefix,
                                  rows.first, rows.count, rows.allowed, argmax_only)
        return logits[0], normed[0]
