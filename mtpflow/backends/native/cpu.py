"""The ``native_cpu`` backend: a float32 model's forwards through mtpflow's C kernels, for every model its layer
description (``description``: Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3, Phi-3, SmolLM3) describes.

On a CPU at small batch a decode step is bound by reading the weights. Here:
- every verify forward (a plain step, a chain, a tree; one sequence or the engine's whole batch) runs all decoder
  layers in ONE call into ``mtpflow_llama_rows`` (``rows_float.c``), over only the real rows, with the
  hidden-state taps its strategies read (any layer's output);
- prefills of a Llama run the lean forward's layers in Python (``mtpflow.forward``, through ``torch_forward``: an
  ``hf`` backend over the same model) with this backend's products (the native row and panel kernels over the
  fused q/k/v and gate/up weights), several prompts packed into one forward; every other family prefills through
  ``mtpflow_llama_rows`` in chunks of ``rows.PREFILL_ROWS`` rows;
- a verify the kernel declines (a weight was replaced) runs the torch forward as a named fallback: counted in
  ``stats()`` and in the run's stats (``backend_fallbacks``), never silently;
- greedy sequences whose stages read only each row's argmax get the certified int8 LM head
  (``certified_head``): the argmax exact at a quarter of the head's bytes;
- ``self_draft`` drafts with the target's own layers over an int8 copy of their weights (``int8_draft``).

A model loaded with ``model.quantize=int8`` is the int8 model: ``mtpflow.backends.native.int8`` runs it.

The rule that chooses kernels is fixed, not timed per host: native products for every row count where the C
kernel builds; otherwise the backend does not apply and ``auto`` picks ``hf`` (the per-host plan timings it
replaces chose native for every verify size on every host in docs/bench; see docs/kernels.md).

The user's model stays as loaded: no attribute is added and no class swapped. Its q/k/v and gate/up weights
become views into one concatenated weight each (the same values, names, dtypes and state dict; no extra
memory), which the fused products read; panel copies, int8 copies, fused biases, ``1 + w`` norm scales and the
certified head belong to this object.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from mtpflow import forward as lean_forward
from mtpflow.backends.base import Backend
from mtpflow.backends.hf import HFBackend
from mtpflow.backends.native import kernel, openmp, products
from mtpflow.backends.native.certified_head import CertifiedHead, applies as certified_applies, softcap
from mtpflow.backends.native.head_products import HeadProduct
from mtpflow.backends.native.description import describe, fused_bias, not_described
from mtpflow.backends.native.rows import (VerifyRows, call_members, one_row, optional, prefill_through,
                                          tap_outputs, verify_through)
from mtpflow.backends.native.threads import GOVERNOR


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
    reason = not_described(model)
    if reason is not None:
        return f"{type(model).__name__}: {reason}"
    return None


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
        self.description = describe(model)
        layers = self.description.layers
        self.qkv = [_Fused(list(layer.qkv)) for layer in layers]
        self.gate_up = [_Fused(list(layer.gate_up)) for layer in layers]
        self.certified = bool(certified_head)
        # the torch forward over the same model: the lean forward with this backend's products for a Llama (its
        # prefills, packed), the model's own forward for the other families; and every verify the kernel declines
        # (named fallbacks)
        self.products = NativeProducts(self)
        self.torch_forward = HFBackend(model)
        self.torch_forward.products = self.products
        self.prefill_in_torch = lean_forward.supports(model)
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
        """The LM head over ``normed`` [..., rows, hidden] (soft-capped where the model caps its logits): the
        certified int8 head where every row's reader takes only the argmax and it applies, else the native
        float32 product."""
        head = self.model.lm_head
        cap = self.description.logit_softcap
        rows = normed.numel() // normed.shape[-1]
        if not (argmax_only and self.certified and certified_applies(head, rows)):
            return softcap(self.module(head, normed), cap)
        weight = head.weight
        if self._head is None or self._head.key != (weight.data_ptr(), weight._version):
            self._head = CertifiedHead(weight)
        return self._head.logits(normed, cap).view(*normed.shape[:-1], -1)

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
        held += self._rows.int8_bytes + self._rows.copies_bytes
        return {**super().stats(), "backend_copies_mb": round(held / 2**20, 1)}

    @torch.inference_mode()
    def prefill(self, targets, prompts, prefix_cache=None, starts=None):
        if self.prefill_in_torch or not self._rows.ready():
            return self.torch_forward.prefill(targets, prompts, prefix_cache, starts)
        return prefill_through(lambda pool, rows, taps, last: self._rows.run_groups(pool, rows, taps, head_from=last),
                               targets, prompts, starts)

    def declines(self, targets) -> str | None:
        """Why the kernel cannot run this verify (a fallback's name), or None where it runs it."""
        if not self._rows.ready():
            return "a weight was replaced"
        return None

    @torch.inference_mode()
    def verify(self, targets, roots, drafts, root_positions):
        reason = self.declines(targets)
        if reason is not None:
            return self.fall_back(reason, self.torch_forward.verify(targets, roots, drafts, root_positions))
        argmax_only = all(t.argmax_only for t in targets)
        run = lambda pool, rows, taps: self._rows.run_groups(pool, rows, taps, argmax_only=argmax_only)  # noqa: E731
        return verify_through(run, targets, roots, drafts, root_positions)

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
        length, token, drafted = target.cache_len, root, []
        for i in range(steps):
            step = one_row(token, position + i, target.kv.slot, length + i)
            logits, _ = rows.run_groups(target.pool, step, argmax_only=True, int8=True)
            token = int(logits[-1].argmax())
            drafted.append(token)
        return drafted

    def head_product(self, weight, bias=None, int8=False):
        """A draft head's linear through the native products (``head_products.HeadProduct``)."""
        return HeadProduct(weight, bias, int8, self.lib)


class _RowSpec:
    """What ``mtpflow_llama_rows`` is given for one model: its description's dimensions and constants, the weights'
    pointer arrays, this backend's copies (fused biases, ``1 + w`` norm scales: made again when their parameters
    change in place), and what to check before each call that the weights are still the ones pointed at."""

    def __init__(self, backend: NativeCPUBackend):
        self.backend = backend
        desc = backend.description
        layers = desc.layers
        self.dims = dict(L=len(layers), H=desc.hidden, nh=desc.heads, nkv=desc.kv_heads, d=desc.head_dim,
                         I=desc.intermediate)
        self.constants = dict(eps=desc.eps, scale=desc.scale, rot=desc.rotary_dims, act=desc.activation,
                              softcap=desc.attn_softcap)
        self.rope_keys = [layer.rope for layer in layers]
        windows = desc.windows
        self.window = torch.tensor(windows, dtype=torch.int32) if any(windows) else None
        # every parameter the kernel reads in place, with where it lay when the spec was built: ``ready`` compares
        # them (a norm whose scale is its weight itself; the fused products check their parts themselves)
        scales = {id(t) for t in self._norm_tensors(desc)}
        norms = [m for m in desc.norm_modules if id(m.weight) in scales]
        plain = [m for layer in layers for m in (layer.o, layer.down)] + norms
        self.watched = [(m._parameters, m._parameters["weight"].data_ptr()) for m in plain]
        # what this spec's copies are made from (``copies``): the norms whose scale is ``1 + w``, every bias
        self.copy_sources = [(m._parameters, "weight") for m in desc.norm_modules if id(m.weight) not in scales]
        self.copy_sources += [(m._parameters, "bias") for layer in layers
                              for m in (*layer.qkv, layer.o, *layer.gate_up, layer.down) if m.bias is not None]
        self.fused = backend.qkv + backend.gate_up
        # the products in the kernel's order: fused q/k/v, o_proj, fused gate/up, down_proj
        self.weights_by_product = [[f.weight for f in backend.qkv], [layer.o.weight for layer in layers],
                                   [f.weight for f in backend.gate_up], [layer.down.weight for layer in layers]]
        # what tells each product's weight changed in place (a fused weight: its parts' counters too)
        self.version_of = [[f for f in backend.qkv], [layer.o for layer in layers],
                           [f for f in backend.gate_up], [layer.down for layer in layers]]
        qkv, o, gu, down = (kernel.pointers(ws) for ws in self.weights_by_product)
        self.weights = dict(wqkv=qkv, wo=o, wgu=gu, wd=down)
        self.kv = kernel.PoolPointers()  # the pool's key and value pointer arrays
        self._panels = None  # (the weights' versions, the panel pointer arrays)
        self._q8 = None  # (the weights' versions, int8 copies, their pointer arrays): ``int8`` builds it
        self._copies = None  # (the copies' sources' versions, the copies, their struct members): ``copies``

    @staticmethod
    def _norm_tensors(desc) -> list:
        return [desc.norm] + [t for layer in desc.layers for t in (layer.ln1, layer.post_attention, layer.ln2,
                                                                 layer.post_mlp, layer.q_norm, layer.k_norm)
                              if t is not None]

    def copies(self) -> dict:
        """The struct members read from this spec's copies (the norms' scales, the biases), made again when a
        source changed in place (its version)."""
        versions = tuple((id(owner[name]), owner[name]._version) for owner, name in self.copy_sources)
        if self._copies is None or self._copies[0] != versions:
            desc = describe(self.backend.model) if self._copies is not None else self.backend.description
            self.backend.description = desc
            layers = desc.layers
            held = {"ln1": [layer.ln1 for layer in layers], "ln2": [layer.ln2 for layer in layers],
                    "post_attn": [layer.post_attention for layer in layers],
                    "post_mlp": [layer.post_mlp for layer in layers], "qn": [layer.q_norm for layer in layers],
                    "kn": [layer.k_norm for layer in layers],
                    "bqkv": [fused_bias(layer.qkv) for layer in layers],
                    "bo": [fused_bias((layer.o,)) for layer in layers],
                    "bgu": [fused_bias(layer.gate_up) for layer in layers],
                    "bd": [fused_bias((layer.down,)) for layer in layers]}
            members = {"ln1": kernel.pointers(held["ln1"]), "ln2": kernel.pointers(held["ln2"]),
                       **{k: optional(v) for k, v in held.items() if k not in ("ln1", "ln2")},
                       "norm_w": desc.norm.data_ptr()}
            self._copies = (versions, (held, desc.norm), members)
        return self._copies[2]

    @property
    def copies_bytes(self) -> int:
        """Bytes of this spec's own copies (``1 + w`` scales, fused biases; the norms that are the model's own
        parameters are not counted)."""
        if self._copies is None:
            return 0
        own = {id(m.weight) for m in self.backend.description.norm_modules}
        held, norm = self._copies[1]
        tensors = [t for ts in held.values() for t in ts if t is not None] + [norm]
        return sum(t.numel() * 4 for t in tensors if id(t) not in own)

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

    def run_groups(self, pool, rows: VerifyRows, taps=(), argmax_only=False, int8=False, head_from: int | None = 0):
        """``mtpflow_llama_rows`` over ``rows`` (``verify_rows``, ``prefill_rows``): only real rows are computed (no
        padding). Returns (the LM head's logits [rows - head_from, vocab], None where ``head_from`` is None; the
        taps [rows, hidden * len(taps)] or None: layer outputs, -1 the final-normed state). ``int8``: the products
        through the int8 copy (``int8``)."""
        backend = self.backend
        pool.ensure(max(w + 1 for w in rows.wpos))  # the pool has the weights' dtype and device: float32, CPU
        keys, values = self.kv(pool)
        h = backend.description.embedding(rows.ids).contiguous()
        normed = torch.empty_like(h)
        members, tapped, held = call_members(rows, backend.description.rope, self.rope_keys, taps, h)
        threads, start = GOVERNOR.threads(), time.perf_counter()
        code = kernel.llama_rows(backend.lib, h=h.data_ptr(), normed=normed.data_ptr(), **members, **self.dims,
                                 **self.weights, **self.copies(), **self.constants,
                                 **(self.int8() if int8 else self.panels(members["M"])),
                                 window=None if self.window is None else self.window.data_ptr(), kc=keys, vc=values,
                                 cap=pool.capacity, threads=threads)
        GOVERNOR.observe(backend, members["M"], time.perf_counter() - start, threads, kind=int8)
        if code != 0:
            raise MemoryError("mtpflow_llama_rows: out of memory")
        del held
        logits = None if head_from is None else backend.head_logits(normed[head_from:], argmax_only)
        return logits, tap_outputs(tapped, normed, taps)
