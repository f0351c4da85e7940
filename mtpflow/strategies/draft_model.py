"""Draft-model proposer: a smaller causal LM with the same tokenizer drafts K tokens autoregressively on its
own KV cache. With ``layers: N`` and no model, the draft model is the target's own first N layers plus its
LM head (self-speculative, LayerSkip style), which needs no second model on disk, and no cache of its own
either: the target's cache already holds those layers' keys and values for every committed token, so the
self-draft writes its few draft entries there and crops them before the verify forward (no catch-up
forward over the tokens committed since the last draft). With ``quantize: int8`` (and neither) the draft model is
the whole target with int8 weights: the backend's self-draft (``state.extras["self_draft"]``; the ``native_cpu``
backend's runs every layer's products over an int8 copy of its weights, a quarter of the bytes a float32 step
reads, on the target's own KV cache, whose committed entries the float32 verify forwards wrote); it agrees with
the float32 model on nearly every token, so long chains are accepted. With ``kv: own`` (``int8_draft``'s default) the
draft is the int8 model of ``model.quantize=int8`` instead (int8 weights and activations: the integer products of
``mtpflow_w8a8_rows``, about half the time of the int8 copy's float products) on an int8 KV cache of its own, which
keeps its accepted draft tokens' entries and feeds the rest of what was committed in each step's first draft forward
(``Int8ModelDraft``): it agrees with the float32 model a little less often, and costs about half as much per draft
token. What a draft token and a verify
forward cost is measured as it runs (``draft_seconds``, ``base_seconds``); the figures of one host are in
docs/strategies.md."""
from __future__ import annotations

import collections
import copy
import time
from dataclasses import replace

import torch
from transformers import DynamicCache

from mtpflow.errors import ConfigError, UserError, check_k, check_range
from mtpflow.plugins import hookimpl
from mtpflow.sampling import sample, target_probs
from mtpflow.cost_model import (
    CostCurve, DecayedAcceptance, ProbeSchedule, check_costs, expected_tokens, load_verify_costs,
)
from mtpflow.types import DecodeState, Draft


def truncated_model(model, layers: int):
    """A view of ``model`` that runs only its first ``layers`` decoder layers (weights shared, not copied)."""
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers"):
        raise UserError("strategy.propose.layers needs a Llama-style model (model.model.layers)")
    if not 1 <= layers <= len(inner.layers):
        raise ConfigError(f"strategy.propose.layers must be in [1, {len(inner.layers)}], got {layers}")
    view = copy.copy(model)
    view_inner = copy.copy(inner)
    view_inner._modules = dict(inner._modules)
    view_inner._modules["layers"] = torch.nn.ModuleList(list(inner.layers)[:layers])
    view._modules = dict(model._modules)
    view._modules["model"] = view_inner
    view.config = copy.copy(model.config)
    view.config.num_hidden_layers = layers
    view_inner.config = view.config
    return view


class DraftModelProposer:
    """Drafts up to K tokens with the draft model, greedily or by sampling its distribution.

    ``cost_aware`` (default): drafting costs draft-model forwards plus a wider verify forward, so each step
    drafts the length L (0 = none) with the most expected tokens, 1 + a + ... + a^L, per second, where a is
    the run's decayed per-token acceptance, the verify cost per L comes from the measured, cached cost curve
    (``mtpflow.strategies.hardware.load_verify_costs``) and a draft forward's time is measured as it runs.
    With L = 0 the draft model does not run at all (its cache catches up in one forward later); every
    ``probe_every`` steps without a draft it drafts one token to refresh the acceptance estimate (backing off
    while probes are rejected: ``ProbeSchedule``). A weak drafter therefore costs about one plain decode
    step instead of slowing decoding down.
    """

    def __init__(self, model: str | None = None, layers: int | None = None, dtype: str = "auto",
                 cost_aware: bool = True, probe_every: int = 8, acceptance_prior: float = 0.5,
                 decay: float = 0.9, costs=None, quantize: str | None = None, kv: str = "target",
                 prompt_kv: str = "target"):
        if quantize not in (None, "int8"):
            raise ConfigError(f"strategy.propose.quantize must be null or int8, got {quantize!r}")
        if kv not in ("target", "own"):
            raise ConfigError(f"strategy.propose.kv must be target or own, got {kv!r}")
        if prompt_kv not in ("target", "own"):
            raise ConfigError(f"strategy.propose.prompt_kv must be target or own, got {prompt_kv!r}")
        if quantize and (model is not None or layers is not None):
            raise ConfigError("strategy.propose.quantize drafts with the whole target: leave model and layers null")
        if model is None and layers is None and quantize is None:
            raise ConfigError("strategy.propose needs a draft model (model=<HF id or path>), layers=<N> or "
                              "quantize=int8")
        self.model_name, self.layers, self.dtype, self.quantize, self.kv = model, layers, dtype, quantize, kv
        self.own: Int8ModelDraft | None = None  # kv=own over a float target: the int8 model on its own cache
        # kv=own: a request's prompt entries copied from the float target's cache (target) or read by the int8 model
        self.prompt_kv = prompt_kv
        self.cost_aware = bool(cost_aware)
        self.probe_every = check_k("strategy.propose.probe_every", probe_every)
        self._acceptance = DecayedAcceptance(check_range("strategy.propose.acceptance_prior", acceptance_prior, 0, 1),
                                             check_range("strategy.propose.decay", decay, 0, 1))
        self.given_costs = check_costs(costs)
        self.draft = None
        self.cache = None
        self.cached = 0  # committed tokens in a separate draft model's cache
        self.curve: CostCurve | None = None
        self.base_seconds = 0.0  # a one-token target forward: the profile's, then the fastest of this run's
        self.draft_seconds: float | None = None  # time of one draft forward: the fastest of the recent ones
        self._draft_times: collections.deque[float] = collections.deque(maxlen=8)
        self._base_times: collections.deque[float] = collections.deque(maxlen=8)
        self.probes = ProbeSchedule(self.probe_every)
        self.skipped = 0

    @hookimpl
    def on_run_start(self, context):
        # the backend drafts with the target's first layers itself where the model's modules cannot (the int8 model)
        self.backend_layers = bool(not self.quantize and not self.model_name and context.backend is not None
                                   and context.backend.drafts_layers)
        self.own = None
        if self.quantize and self.kv == "own" and _float_native(context):
            self.draft = None
            from mtpflow.model import model_max_context

            self.own = Int8ModelDraft(_int8_model(context), max_context=model_max_context(context.model))
        elif self.quantize or self.backend_layers:
            self.draft = None  # the target's own layers through the backend's self-draft
        elif self.model_name:
            from mtpflow.model import load_model

            loaded = load_model(self.model_name, dtype=self.dtype, device=str(context.model.device))
            if loaded.model.config.vocab_size != context.model.config.vocab_size:
                raise UserError(f"draft model {self.model_name} has a different vocabulary from the target")
            self.draft = loaded.model
        else:
            self.draft = truncated_model(context.model, int(self.layers))
        # a separate draft model keeps its own cache; the self-draft uses the target's (``_shared_draft``)
        self.cache = DynamicCache(config=self.draft.config) if self.model_name and self.draft is not None else None
        self.cached = 0
        facts = {"draft_model": "int8 model, own cache" if self.own is not None else (
            self.model_name or (f"target[:{self.layers} layers]" if self.layers else "target int8"))}
        if self.cost_aware:
            costs, source = (self.given_costs, "given") if self.given_costs else load_verify_costs(context)
            self.curve, self.base_seconds = CostCurve(costs), float(costs[0])
            facts["draft_costs"] = source
        return facts

    def unavailable(self, model_config) -> str | None:
        """Why an int8 draft cannot pay here (``mtp``'s candidates, ``strategy_choice``), or None: over the int8
        model there is no cheaper int8 copy, and only the native CPU backend drafts with one."""
        if not self.quantize:
            return None
        if model_config.get("quantize") == "int8":
            return "the target is the int8 model itself: no cheaper int8 draft"
        if str(model_config.get("backend") or "auto") not in ("auto", "native_cpu"):
            return "the int8 draft runs on the native_cpu backend"
        if str(model_config.get("device") or "auto").startswith("cuda"):
            return "the int8 draft runs on the CPU"
        from mtpflow.backends import native_kernels_available

        return None if native_kernels_available() else "the native CPU kernels could not be built"

    @hookimpl
    def run_stats(self):
        stats = {} if self.own is None else {"draft_entries_from_target": self.own.seeded}
        if self.cost_aware:
            ms = None if self.draft_seconds is None else round(1000 * self.draft_seconds, 2)
            stats.update({"draft_skipped_steps": self.skipped, "draft_acceptance": round(self.acceptance, 4),
                          "draft_forward_ms": ms})
        return stats or None

    @property
    def acceptance(self) -> float:
        return self._acceptance.value

    def draft_length(self, k: int) -> int:
        """How many tokens to draft this step (at most ``k``) under the cost model."""
        if not self.cost_aware or self.curve is None or k == 0:
            return k
        a = min(self.acceptance, 0.999)
        per_draft = self.draft_seconds if self.draft_seconds is not None else 0.0
        best = max(range(k + 1), key=lambda n: (
            expected_tokens(a, n) / (self.curve(n) * self.base_seconds + n * per_draft), -n))
        if best == 0 and self.probes.should_probe():
            best = 1  # probe: one cheap draft keeps the acceptance estimate alive
        return best

    @hookimpl
    def on_step_end(self, record) -> None:
        if not self.cost_aware:
            return
        n = record.draft.num_nodes
        self.probes.observe(n, record.decision.num_accepted if n else 0)
        if n:
            self._acceptance.update(record.decision.num_accepted, n)
        # the one-token forward as this run sees it: the draft's time is measured as it runs, so the verify's must be
        # too (a profile measured at another time of a shared or drifting machine, set against a draft timed now,
        # skewed every choice); the profile's curve still says what n draft rows add to it. The fastest of the
        # last 8, as for the draft: load only ever adds time
        seconds = getattr(record, "forward_seconds", 0.0)  # a record a plugin made may not say
        if seconds > 0 and self.curve is not None:
            self._base_times.append(seconds / self.curve(n))
            self.base_seconds = min(self._base_times)

    @torch.inference_mode()
    def _forward(self, ids: list[int], start: int) -> torch.Tensor:
        dev = next(self.draft.parameters()).device
        out = self.draft(input_ids=torch.tensor([ids], device=dev),
                         position_ids=torch.arange(start, start + len(ids), device=dev)[None],
                         cache=self.cache, use_cache=True, logits_to_keep=1)  # a catch-up of n tokens needs
        return out.logits[0, -1].float().cpu()  # only the last row's logits, not n rows of the 49k-way LM head

    @hookimpl
    def propose(self, state: DecodeState, k: int) -> Draft:
        k = self.draft_length(k)
        if k == 0:
            self.skipped += 1
            return Draft.empty("draft_model")
        if self.own is not None:
            return self._own_draft(state, k)
        if self.quantize or self.backend_layers:
            return self._int8_draft(state, k)
        if self.model_name is None:
            return self._shared_draft(state, k, state.extras["slot_cache"]())  # the loop's view of its KV slot
        tokens = state.tokens.tolist()
        # The draft cache holds committed tokens only; catch up on everything committed since last time.
        logits = self._forward(tokens[self.cached :], self.cached)
        self.cached = len(tokens)
        drafted, dists = [], []
        for i in range(k):
            tok = _pick(logits, state, dists)
            drafted.append(tok)
            if i + 1 < k:
                t0 = time.perf_counter()
                logits = self._forward([tok], len(tokens) + i)
                self._time_draft(time.perf_counter() - t0)
        if k == 1 and self.draft_seconds is None:
            t0 = time.perf_counter()  # a one-token draft has no timed forward yet: time one (cache rolled back)
            self._forward([drafted[0]], len(tokens))
            self._time_draft(time.perf_counter() - t0)
        drop = self.cache.get_seq_length() - self.cached
        if drop > 0:
            self.cache.crop(-drop)
        return _chain(drafted, dists)

    @torch.inference_mode()
    def _shared_draft(self, state: DecodeState, k: int, slot) -> Draft:
        """Draft ``k`` tokens with the target's first layers on the target's own cache (which holds every
        committed token but the root), then crop those layers back so the cache is as the verify expects.
        ``slot``: (the slot's HF ``Cache`` view, its length, the root's position as the model sees it)."""
        cache, start, position = slot
        dev = next(self.draft.parameters()).device
        token, drafted, dists = state.root_token, [], []
        try:
            for i in range(k):
                t0 = time.perf_counter()
                out = self.draft(input_ids=torch.tensor([[token]], device=dev),
                                 position_ids=torch.tensor([[position + i]], device=dev),
                                 cache=cache, use_cache=True, logits_to_keep=1)
                self._time_draft(time.perf_counter() - t0)
                token = _pick(out.logits[0, -1].float().cpu(), state, dists)
                drafted.append(token)
        finally:
            for layer in cache.layers[: int(self.layers)]:
                extra = int(layer.keys.shape[-2]) - start if getattr(layer, "keys", None) is not None else 0
                if extra > 0:
                    layer.crop(-extra)
        return _chain(drafted, dists)

    def _int8_draft(self, state: DecodeState, k: int) -> Draft:
        """``k`` tokens from the target's int8 copy over its own cache (greedy: under sampling the chain is a
        deterministic draft, which the speculative-sampling gate accepts in distribution)."""
        t0 = time.perf_counter()
        drafted = state.extras["self_draft"](k, **({"layers": int(self.layers)} if self.backend_layers else {}))
        if drafted is None:
            raise UserError("strategy.propose.quantize=int8 needs the native_cpu backend's self-draft: a "
                            "Llama-family float32 model on a CPU with the native kernels built (model.backend=auto)")
        self._time_draft((time.perf_counter() - t0) / k)
        return _chain(drafted, [])

    def _own_draft(self, state: DecodeState, k: int) -> Draft:
        """``k`` greedy tokens of the int8 model on its own cache (``Int8ModelDraft``); its one-row forwards are timed
        (a first forward that also catches up on what was committed since the last draft is not)."""
        source = state.extras.get("committed_entries") if self.prompt_kv == "target" else None
        drafted, seconds = self.own.draft(state.tokens, k, source)
        if seconds is not None:
            self._time_draft(seconds)
        return _chain(drafted, [])

    def _time_draft(self, seconds: float) -> None:
        # the fastest of the last 8: load only ever adds time, and a process's first draft forward pays one-time
        # costs, many times a later one's (measured: docs/bench/code-figures.md#draft_model-_time_draft), which a
        # decayed mean carried through a whole run of rare probes
        self._draft_times.append(seconds)
        self.draft_seconds = min(self._draft_times)


def _pick(logits: torch.Tensor, state: DecodeState, dists: list[torch.Tensor]) -> int:
    """The next draft token: greedy, or sampled from the draft distribution (appended to ``dists``, which
    speculative sampling needs)."""
    if state.sampling.greedy:
        return int(logits.argmax())
    q = target_probs(logits, state.sampling)
    dists.append(q)
    return sample(q, state.extras.get("rng"))


def _chain(drafted: list[int], dists: list[torch.Tensor]) -> Draft:
    draft = Draft.chain(drafted, source="draft_model")
    return replace(draft, dists=torch.stack(dists)) if dists else draft


class Int8ModelDraft:
    """One sequence's draft by the int8 model of the float target (``model.quantize=int8``'s model: int8 weights and
    activations, the native ``mtpflow_w8a8_rows``) on an int8 KV cache of its own (a ``Target`` on the int8 model's
    backend, which the engine's requests share; the cache slot is this sequence's). The cache keeps the entries of
    the last draft's tokens: an entry depends only on the tokens up to it, so where the target accepted them they
    are the committed tokens' entries already, and each draft's first forward feeds only what follows the longest
    prefix the cache holds (the root last; typically the root alone, or with the one accepted token the last draft
    forward did not feed): a prefill from there, the head on its last row only, or with the root alone a row of the
    backend's native greedy loop, which drafts every later token one row each. A long catch-up (a request's prompt)
    is copied from the float target's cache where the loop gives it (``_seed``). Positions are the sequence's own
    (0 at its first token): a target that evicts entries (a sliding window) does not change what the draft sees."""

    def __init__(self, backend, max_context: int):
        from mtpflow.target import Target

        self.target = Target(backend, pool=backend.make_pool(1))
        self.max_context = int(max_context)
        self.ids: list[int] = []  # the token of each cache entry, in position order
        self.committed = 0  # entries known to hold committed tokens (the sequence's length at the last draft)
        self.seeded = 0  # entries taken from the float target's cache (``_seed``)

    @torch.inference_mode()
    def draft(self, tokens: torch.Tensor, k: int, committed=None) -> tuple[list[int], float | None]:
        """``k`` greedy tokens after ``tokens`` (the sequence so far, the root last) and the seconds per one-row draft
        forward (None where only a first forward over more than the root ran); fewer tokens near the model's context.
        ``committed``: the loop's ``committed_entries`` call (the float target's cache), from which a long catch-up
        (a request's prompt) is taken instead of read through the int8 model."""
        t = self.target
        n = int(tokens.numel())
        k = min(int(k), self.max_context - n)
        if k <= 0:
            return [], None
        keep = min(self.committed, n - 1)
        ahead = tokens[keep:min(len(self.ids), n - 1)].tolist()  # past what was committed: the last draft's tokens
        for token in ahead:
            if token != self.ids[keep]:
                break
            keep += 1
        if committed is not None:
            keep = self._seed(committed(), tokens, keep, n - 1)
        fed = tokens[keep:n]
        t.cache_len = keep
        start = time.perf_counter()
        if len(fed) == 1:  # the root alone: every draft token one row of the backend's loop (one native call)
            drafted = t.backend.self_draft(t, int(fed[0]), keep, k)
            seconds = (time.perf_counter() - start) / k
        else:  # the root and what precedes it in one forward, then the loop
            logits, _ = t.prefill(fed, start_position=keep)
            drafted, seconds = [int(logits[-1].argmax())], None
            if k > 1:  # the loop's entries go after the cache's length, which is set below
                start = time.perf_counter()
                drafted += t.backend.self_draft(t, drafted[0], n, k - 1)
                seconds = (time.perf_counter() - start) / (k - 1)
        t.cache_len = n + k - 1
        del self.ids[keep:]
        self.ids += fed.tolist() + drafted[:-1]  # the last draft token was not fed: no entry
        self.committed = n
        return drafted, seconds

    def _seed(self, source, tokens: torch.Tensor, keep: int, end: int) -> int:
        """Entries ``keep`` .. of this cache from the float target's (``source``: its pool, slot and length, or None),
        quantized as the int8 model quantizes its own: a request's prompt costs a copy rather than an int8 prefill.
        The int8 model then drafts over the float32 model's keys and values of those tokens, which it agrees with the
        float32 greedy after a little more often than over its own (measured: docs/bench/step_dec07.md). Returns the
        new ``keep``."""
        if source is None:
            return keep
        pool, slot, length = source
        end = min(end, length)
        if end - keep < SEED_MIN:
            return keep
        self.target.backend.write_entries(self.target.pool, self.target.kv.slot, keep,
                                          [k[slot, :, keep:end] for k in pool.keys],
                                          [v[slot, :, keep:end] for v in pool.values])
        del self.ids[keep:]
        self.ids += tokens[keep:end].tolist()
        self.seeded += end - keep
        return end


def _float_native(context) -> bool:
    """Whether the run's target is a float model on the native CPU backend (not the int8 model itself, whose own
    greedy is no cheaper draft), which is what ``kv: own`` drafts for."""
    backend = getattr(context, "backend", None)
    return backend is not None and backend.name == "native_cpu" and not backend.drafts_layers


def _int8_model(context):
    """The int8 model of the run's float target and its native backend, made once per engine (``context.shared``)
    from the target's weights in memory (the target is not changed); a one-line UserError where it cannot run."""
    from mtpflow.backends import int8_draft_backend

    shared = getattr(context, "shared", None)
    if shared is None:
        return int8_draft_backend(context.model)
    return shared.get(INT8_MODEL_KEY, lambda: int8_draft_backend(context.model))


# catch-ups at least this long are copied from the float target's cache (``Int8ModelDraft._seed``); shorter ones (the
# root and an accepted token or two, every step) go through the int8 model's forward, which reads them in one pass
SEED_MIN = 8
INT8_MODEL_KEY = "int8_model:draft"  # made from the model, not learned from requests: ``mtpflow.shared.prepared``
