"""The cost model: what a verify forward costs on this machine and what drafting is expected to gain.

- ``load_verify_costs`` reads the cost of one sequence's verify forward per draft length from the host's tuning
  profile (``mtpflow.host``; ``python -m mtpflow.tune``), measuring a missing entry once; ``cost_key`` names the
  entry; ``CostCurve`` turns it into relative costs;
- ``expected_tokens`` / ``best_k`` / ``CostCurve.best_length``: the expected-tokens-per-second rule used by
  K selectors (``hardware_aware``, ``jacobi``), pruners (PFS) and proposers (cost-aware prompt lookup,
  ``draft_model``);
- ``DecayedAcceptance``: the one acceptance estimator; ``ProbeSchedule``: when an idle drafter probes;
- ``BatchCostModel``: the cost of ONE batched verify forward by (sequences, rows per sequence), which the
  engine uses to cap every sequence's draft where a bigger forward no longer pays for itself.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from mtpflow.errors import ConfigError, UserError
from mtpflow.host import load_profile, profile_entry, profile_path, tuning_notice, update_profile

AUTO = "auto"
COST_KS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # the K set whose verify cost is measured (into the profile) for cost models
# ... and the verify-cost curve ``python -m mtpflow.tune`` measures and stores: K = 0..32 (the curve a host's docs
# report, and the Ks past 16 that a tree's node count reaches)
CURVE_KS = (*COST_KS, 20, 24, 28, 32)
VERIFY_CONTEXT = 256  # the cached prefix length verify costs are measured on (``strategy.select_k.cost_context``)
BATCH_CONTEXT = 128  # ... and the batch grid


def device_name(device: str) -> str:
    """A readable name of a torch device: the CUDA product name, or "cpu" / the device type."""
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(dev)
    return dev.type


def expected_tokens(acceptance: float, k: int) -> float:
    """Expected tokens per step with K drafts, each accepted with probability ``acceptance`` given the previous
    one was: 1 + a + ... + a^K (the bonus or recovered token included)."""
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(costs: dict[int, float], acceptance: float) -> int:
    """The K (a key of ``costs``, seconds per verify forward) with the most expected tokens per second;
    ties go to the smaller K."""
    return max(sorted(costs), key=lambda k: expected_tokens(acceptance, k) / costs[k])


@torch.inference_mode()
def time_verify_forwards(backend, ks, context: int, repeats: int, argmax_only: bool = False) -> dict[int, list[float]]:
    """{K: ``repeats`` timings in seconds} of a verify forward feeding the root plus K random draft tokens on a
    ``context``-token cache; the Ks are interleaved so background load drifts hit them alike, after one
    warm-up round, through ``backend`` (``mtpflow.backends``). ``argmax_only``: time the forward a greedy
    sequence runs (``Target.argmax_only``)."""
    from tqdm import tqdm

    from mtpflow.target import Target
    from mtpflow.types import Draft

    g = torch.Generator().manual_seed(0)
    vocab = int(backend.model.config.vocab_size)
    target = Target(backend)
    target.argmax_only = argmax_only
    target.prefill(torch.randint(0, vocab, (context,), generator=g))
    drafts = {k: Draft.chain(torch.randint(0, vocab, (k,), generator=g)) for k in ks}
    cuda = target.device.type == "cuda"
    times: dict[int, list[float]] = {k: [] for k in ks}
    start = target.cache_len
    for i in tqdm(range(repeats + 1), desc="measuring verify cost", unit="round", leave=False):
        for k in ks:
            target.cache_len = start  # roll back by position: the draft entries are simply overwritten
            if cuda:
                torch.cuda.synchronize(target.device)
            t0 = time.perf_counter()
            target.verify(1, drafts[k], root_position=start)
            if cuda:
                torch.cuda.synchronize(target.device)
            seconds = time.perf_counter() - t0
            if i:  # the first round warms up kernels and allocators
                times[k].append(seconds)
    return times


def context_backend(context):
    """The backend a run's forwards go through (``RunContext.backend``; a context built without an engine gets
    the ``hf`` backend over its model)."""
    backend = getattr(context, "backend", None)
    if backend is None:
        from mtpflow.backends.hf import reference

        backend = reference(context.model)
    return backend


def profile_setting(config) -> str | None:
    """The config key ``profile`` (a profile file named for this run) of a resolved config, or None."""
    return (config or {}).get("profile") or None if hasattr(config or {}, "get") else None


def cost_key(backend, model_id: str, device: str, argmax_only: bool) -> str:
    """The tuning-profile key of a target's forward costs: model id, dtype, device name (``device_name``), what
    computes the forwards (``backend.describe()``), and whether the timed sequences read only the argmax (greedy
    ones: the certified LM head where the backend has one). The one place that describes a forward for cost
    measurements."""
    dtype = str(backend.model.dtype).removeprefix("torch.")
    reads = "argmax-only" if argmax_only else "logits"
    return " | ".join((model_id, dtype, device, backend.describe(), reads))


def cost_cache_path(profile: str | None = None) -> Path:
    """Where cost measurements are kept: the tuning profile (``mtpflow.host.profile_path``)."""
    return profile_path(profile)


def verify_cost_context(model, cost_context: int, ks) -> int:
    """The cached prefix length a verify cost is measured on: ``cost_context`` within the model's context."""
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 2048) - max(ks) - 2
    return max(1, min(int(cost_context), limit))


def stored_verify_costs(entry: dict | None, exact: bool, context: int, ks) -> dict[int, float] | None:
    """{K: seconds} for ``ks`` at ``context`` from a profile entry (``mtpflow.host.profile_entry``), or None
    where it lacks them. A fallback entry (``exact`` false) serves any context and K: its nearest context's
    curve, interpolated (``CostCurve``) between its Ks."""
    curves = {int(c): {int(k): float(v) for k, v in curve.items()} for c, curve in (entry or {}).get("verify", {}).items()}
    if exact:
        curve = curves.get(int(context))
        return {k: curve[k] for k in ks} if curve and set(ks) <= set(curve) else None
    if not curves:
        return None
    curve = curves[min(curves, key=lambda c: (abs(c - context), c))]
    relative = CostCurve(curve)
    return {k: curve[k] if k in curve else curve[0] * relative(k) for k in ks}


def load_verify_costs(context, ks=COST_KS, cost_context: int = VERIFY_CONTEXT, repeats: int = 5,
                      name: str | None = None) -> tuple[dict[int, float], str]:
    """({K: seconds per verify forward}, "cached" | "measured") for the run's model and device, from the tuning
    profile (``mtpflow.host``; ``python -m mtpflow.tune`` fills it), keyed by ``cost_key``. Shared by
    ``HardwareAwareK``, the cost-aware prompt lookup, the PFS pruner and ``draft_model``. A key the profile lacks
    is measured once, with a one-line notice, and stored. A greedy run on a backend with a cheaper head for
    sequences that read only the argmax (the certified LM head, ``model.certified_head``) reads that forward's
    curve, others the full head's. ``name`` replaces the device's name (``strategy.select_k.device_name``)."""
    backend = context_backend(context)
    config = getattr(context, "config", None)
    ks = sorted(set(int(k) for k in ks))
    ctx = verify_cost_context(backend.model, cost_context, ks)
    greedy = getattr(getattr(context, "sampling", None), "greedy", True)  # a context without sampling: greedy
    argmax_only = bool(greedy and backend.takes_argmax_only())
    key = cost_key(backend, context.model_id, name or device_name(context.device), argmax_only)
    explicit = profile_setting(config)
    costs = stored_verify_costs(*profile_entry(load_profile(explicit), key), ctx, ks)
    if costs is not None:
        return costs, "cached"
    tuning_notice()
    return tune_verify_costs(backend, key, ks, ctx, repeats, argmax_only, explicit, strict=False), "measured"


def tune_verify_costs(backend, key: str, ks, context: int, repeats: int, argmax_only: bool,
                      profile: str | None = None, strict: bool = True) -> dict[int, float]:
    """Measure {K: seconds} (``time_verify_forwards``, the fastest repeat) and store it in the profile under
    ``key`` at ``context`` (measured Ks replace stored ones, others stay). ``strict``: a profile that cannot be
    written is a UserError; otherwise one line, and the run goes on with what it measured."""
    times = time_verify_forwards(backend, ks, context, repeats, argmax_only)
    fastest = {k: min(v) for k, v in times.items()}

    def change(data):
        curves = data["entries"].setdefault(key, {}).setdefault("verify", {})
        curves[str(context)] = {**curves.get(str(context), {}), **{str(k): v for k, v in sorted(fastest.items())}}

    _store(change, profile, strict)
    return fastest


def _store(change, profile: str | None, strict: bool) -> None:
    try:
        update_profile(change, profile)
    except UserError as exc:
        if strict:
            raise
        print(f"mtpflow: {exc}: measured again next run", file=sys.stderr)


class CostCurve:
    """Relative cost of a verify forward with L draft tokens (1.0 = a plain one-token forward), from measured
    {K: seconds}: non-decreasing (a running maximum irons out timing noise), linear between measured Ks and
    extended beyond the largest one with the slope of the last two."""

    def __init__(self, costs: dict[int, float]):
        ks = sorted(costs)
        if not ks or ks[0] != 0:
            raise ConfigError("verify costs must include K=0")
        base = costs[0]
        self.ks, self.rel, top = ks, [], 0.0
        for k in ks:
            top = max(top, costs[k] / base)
            self.rel.append(top)

    def __call__(self, length: int) -> float:
        ks, rel = self.ks, self.rel
        if length <= ks[0]:
            return rel[0]
        for i in range(1, len(ks)):
            if length <= ks[i]:
                f = (length - ks[i - 1]) / (ks[i] - ks[i - 1])
                return rel[i - 1] + f * (rel[i] - rel[i - 1])
        if len(ks) == 1:
            return rel[0]
        slope = (rel[-1] - rel[-2]) / (ks[-1] - ks[-2])
        return rel[-1] + slope * (length - ks[-1])

    def best_length(self, acceptance: float, longest: int) -> int:
        """The draft length in 0..longest with the most expected tokens per unit of cost (ties: shorter)."""
        return max(range(longest + 1), key=lambda n: (expected_tokens(acceptance, n) / self(n), -n))


def check_costs(costs):
    """A stage's ``costs`` setting: None (off), ``auto`` (measured, ``load_verify_costs``) or a {K: seconds}
    mapping including K=0."""
    if costs is None or costs == AUTO:
        return costs
    if hasattr(costs, "items"):
        try:
            table = {int(k): float(v) for k, v in costs.items()}
        except (TypeError, ValueError):
            table = {}
        if 0 in table and all(v > 0 for v in table.values()):
            return table
    raise ConfigError(f"strategy costs must be null, auto or a {{K: seconds}} mapping with K=0, got {costs!r}")


class DecayedAcceptance:
    """Per-position draft acceptance a, from decayed counts of accepted draft tokens and of rejection events
    (a geometric model: each draft token is accepted with probability a given the previous one was), with
    ``prior`` counting as ``prior_weight`` observations that never decay."""

    def __init__(self, prior: float = 0.5, memory: float = 0.9, prior_weight: float = 2.0):
        self.prior, self.memory, self.prior_weight = float(prior), float(memory), float(prior_weight)
        self.accepted = self.rejected = 0.0

    @property
    def value(self) -> float:
        w = self.prior_weight
        return (self.accepted + w * self.prior) / (self.accepted + self.rejected + w)

    def update(self, accepted: int, drafted_depth: int) -> None:
        """One verified draft: ``accepted`` of its ``drafted_depth`` positions were accepted."""
        self.accepted = self.memory * self.accepted + accepted
        self.rejected = self.memory * self.rejected + (1 if accepted < drafted_depth else 0)

    def forget_rejections(self) -> None:
        """A step where the draft was not tried: rejections fade a little, so a skipped drafter retries."""
        self.rejected *= self.memory



class ProbeSchedule:
    """When a cost model picks "no draft", its acceptance estimate stops learning; so after ``every`` idle
    steps it probes (drafts once anyway). Each rejected probe doubles the gap, up to ``max_factor * every``;
    an accepted draft resets it, so a useless drafter costs almost nothing and a useful one is found again.
    ``every = 0`` never probes."""

    def __init__(self, every: int, max_factor: int = 8):
        self.every, self.max_gap = int(every), int(every) * int(max_factor)
        self.gap, self.idle, self.probing = self.every, 0, False

    def should_probe(self) -> bool:
        """Ask when the cost model chose no draft: True (this step is a probe) once the gap has passed."""
        self.probing = self.every > 0 and self.idle >= self.gap
        return self.probing

    def observe(self, drafted: int, accepted: int) -> None:
        """After each step: ``drafted`` nodes verified, ``accepted`` of them kept."""
        probed, self.probing = self.probing, False
        if drafted == 0:
            self.idle += 1
            return
        self.idle = 0
        if accepted:
            self.gap = self.every
        elif probed:
            self.gap = min(2 * self.gap, self.max_gap)


# ----- the batch: one verify forward for every running sequence --------------------------------------------------
# measured; sizes between are interpolated (the first batched step pays a one-time warm-up; host figure:
# docs/bench/code-figures.md#cost_model-batch_sizes)
BATCH_SIZES = (1, 4, 16)
BATCH_ROWS = (1, 3, 9, 17)  # rows per sequence in a forward: the root plus 0, 2, 8, 16 draft nodes


@torch.inference_mode()
def measure_batch_costs(backend, batch_sizes=BATCH_SIZES, rows=BATCH_ROWS, context: int = 128,
                        repeats: int = 2, argmax_only: bool = False) -> dict[tuple[int, int], list[float]]:
    """{(sequences, rows per sequence): seconds of each repeat} of ``backend.verify`` over caches of ``context``
    tokens, rows interleaved so background load hits them alike (after one warm-up round)."""
    from tqdm import tqdm

    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = backend.model
    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    times: dict[tuple[int, int], list[float]] = {}
    for b in tqdm(batch_sizes, desc="measuring batch verify cost", unit="batch size", leave=False):
        pool = backend.make_pool(b)
        targets = [Target(backend, pool=pool) for _ in range(b)]
        for t in targets:
            t.argmax_only = argmax_only  # greedy sequences (the certified LM head where it applies)
            t.prefill(torch.randint(0, vocab, (context,), generator=g))
        for i in range(repeats + 1):
            for q in rows:
                drafts = [Draft.chain(torch.randint(0, vocab, (q - 1,), generator=g)) for _ in targets]
                t0 = time.perf_counter()
                backend.verify(targets, [1] * b, drafts, [context] * b)
                seconds = time.perf_counter() - t0
                for t in targets:
                    t.cache_len = context  # roll back by position
                if i:
                    times.setdefault((b, q), []).append(seconds)
        for t in targets:
            t.release()
    return times


class BatchCostModel:
    """Seconds of one batched verify forward as a function of (sequences B, rows per sequence q), from a
    measured grid (``measure_batch_costs``), interpolated linearly in q and in B and extended linearly past
    the grid; non-decreasing in both (a running maximum irons out timing noise)."""

    def __init__(self, grid: dict[tuple[int, int], float]):
        self.batch_sizes = sorted({b for b, _ in grid})
        self.rows = sorted({q for _, q in grid})
        self.table = {}
        for b in self.batch_sizes:
            top = 0.0
            for q in self.rows:
                top = max(top, grid[(b, q)])
                self.table[(b, q)] = top
        for q in self.rows:  # more sequences never cost less
            top = 0.0
            for b in self.batch_sizes:
                top = max(top, self.table[(b, q)])
                self.table[(b, q)] = top

    @staticmethod
    def _interp(xs, x, f):
        if x <= xs[0]:
            return f(xs[0])
        for lo, hi in zip(xs, xs[1:]):
            if x <= hi:
                w = (x - lo) / (hi - lo)
                return f(lo) + w * (f(hi) - f(lo))
        lo, hi = xs[-2], xs[-1]
        return f(hi) + (x - hi) * (f(hi) - f(lo)) / (hi - lo) if len(xs) > 1 else f(hi)

    def seconds(self, batch: int, rows: int) -> float:
        if len(self.rows) == 1:
            per_b = lambda b: self.table[(b, self.rows[0])]  # noqa: E731
            return self._interp(self.batch_sizes, batch, per_b)
        at = lambda b: self._interp(self.rows, rows, lambda q: self.table[(b, q)])  # noqa: E731
        return self._interp(self.batch_sizes, batch, at) if len(self.batch_sizes) > 1 else at(self.batch_sizes[0])

    def best_rows(self, acceptances: list[float], drafted: list[int]) -> int:
        """The rows per sequence (1 + draft nodes kept) that maximise the batch's expected tokens per second,
        when sequence i drafted ``drafted[i]`` nodes accepted at rate ``acceptances[i]`` each (a chain
        estimate: a tree's extra branches only add). 1 means no speculation this step."""
        longest = max(drafted, default=0)
        batch = len(drafted)
        best, best_rate = 1, 0.0
        for q in range(1, longest + 2):
            tokens = sum(expected_tokens(a, min(n, q - 1)) for a, n in zip(acceptances, drafted))
            rate = tokens / self.seconds(batch, q)
            if rate > best_rate * 1.0001:
                best, best_rate = q, rate
        return best


def stored_batch_costs(entry: dict | None, exact: bool, context: int) -> dict[tuple[int, int], float] | None:
    """{(B, q): seconds} at ``context`` from a profile entry, or None where it has none (a fallback entry: its
    nearest context's grid)."""
    grids = {int(c): grid for c, grid in (entry or {}).get("batch", {}).items()}
    if not grids or (exact and int(context) not in grids):
        return None
    grid = grids[int(context)] if int(context) in grids else grids[min(grids, key=lambda c: (abs(c - context), c))]
    return {(int(b), int(q)): float(seconds) for b, q, seconds in grid}


def load_batch_costs(loaded, backend, context: int = BATCH_CONTEXT, repeats: int = 2, argmax_only: bool | None = None,
                     profile: str | None = None) -> tuple[BatchCostModel, str]:
    """(the batch cost model, "cached" | "measured") for a loaded model's ``backend`` on this machine, from the
    tuning profile (``profile``: the config key ``profile``, else ``MTPFLOW_PROFILE`` or the host's default
    file), keyed by ``cost_key``; a key the profile lacks is measured once, with a one-line notice, and stored.
    ``argmax_only`` (default: where the backend takes it): of greedy sequences' verify forwards."""
    argmax_only = backend.takes_argmax_only() if argmax_only is None else bool(argmax_only)
    key = cost_key(backend, loaded.model_id, device_name(str(loaded.device)), argmax_only)
    grid = stored_batch_costs(*profile_entry(load_profile(profile), key), context)
    if grid is not None:
        return BatchCostModel(grid), "cached"
    tuning_notice()
    return tune_batch_costs(backend, key, context, repeats, argmax_only, profile, strict=False), "measured"


def tune_batch_costs(backend, key: str, context: int, repeats: int, argmax_only: bool, profile: str | None = None,
                     strict: bool = True) -> BatchCostModel:
    """Measure the batch grid (``measure_batch_costs``, the fastest repeat) and store it in the profile under
    ``key`` at ``context`` (replacing a stored one); ``strict`` as for ``tune_verify_costs``."""
    fastest = {case: min(v) for case, v in measure_batch_costs(backend, context=context, repeats=repeats,
                                                               argmax_only=argmax_only).items()}

    def change(data):
        grid = [[b, q, s] for (b, q), s in sorted(fastest.items())]
        data["entries"].setdefault(key, {}).setdefault("batch", {})[str(context)] = grid

    _store(change, profile, strict)
    return BatchCostModel(fastest)
