"""Hardware-aware K (stage ``select_k``): K from the device's name (A100 4, H100/H200 6, L40S 2, other GPUs 3),
or ``auto``: measure the verify-forward cost for a few K on this device and model once (cached on disk),
then pick each step the K that maximises expected tokens per second at the run's recent acceptance rate,
E[tokens] = (1 - a^(K+1)) / (1 - a) over the cost of a (1 + K)-token verify forward.

On a CPU a 1-token forward is a GEMV and much cheaper than any multi-token one, so ``auto`` rightly picks a
small K, or 0, unless drafts are accepted often; the CPU default is therefore ``auto``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from mtpflow.errors import ConfigError
from mtpflow.hookspecs import hookimpl
from mtpflow.strategies.k_selectors import check_k
from mtpflow.types import DecodeState, StepRecord

AUTO = "auto"
COST_KS = (0, 1, 2, 3, 4, 6, 8, 12, 16)  # the K set whose verify cost is measured (and cached) for cost models
DEFAULT_DEVICE_K = {"A100": 4, "H100": 6, "H200": 6, "L40S": 2}


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


def measure_verify_costs(model, ks: list[int], context: int, repeats: int) -> dict[int, float]:
    """Fastest seconds of a verify forward per K (``time_verify_forwards``): load on a shared machine only
    ever adds time (with medians, a 2-core host under load measured 2 draft tokens dearer than 4)."""
    return {k: min(v) for k, v in time_verify_forwards(model, ks, context, repeats).items()}


@torch.inference_mode()
def time_verify_forwards(model, ks, context: int, repeats: int) -> dict[int, list[float]]:
    """{K: ``repeats`` timings in seconds} of a verify forward feeding the root plus K random draft tokens on a
    ``context``-token cache; the Ks are interleaved so background load drifts hit them alike, after one
    warm-up round."""
    from tqdm import tqdm

    from mtpflow.target import Target
    from mtpflow.types import Draft

    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    target = Target(model)
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


def cost_cache_path(device: str, model_id: str, dtype: str, context: int, ks: list[int], host: str = "") -> Path:
    from mtpflow.model import measurement_path

    key = [device, model_id, dtype, context, sorted(ks)] + ([host] if host else [])
    return measurement_path("verify_cost", *key)


def load_verify_costs(context, ks=COST_KS, cost_context: int = 256, repeats: int = 5,
                      name: str | None = None) -> tuple[dict[int, float], str]:
    """({K: seconds per verify forward}, "cached" | "measured") for the run's model and device: measured
    once per device (on a CPU: per CPU model and thread count), model, dtype, linear kind
    (``mtpflow.kernels.cpu_linear``) and K set, then read from ``~/.cache/mtpflow/verify_cost``. Shared by
    ``HardwareAwareK`` and the cost-aware prompt lookup."""
    from mtpflow.kernels import cpu_linear
    from mtpflow.model import read_measurement, write_measurement

    model = context.model
    name = name or device_name(context.device)
    ks = sorted(set(ks))
    limit = int(getattr(model.config, "max_position_embeddings", 0) or 2048) - max(ks) - 2
    ctx = max(1, min(cost_context, limit))
    linear = cpu_linear.state(model)
    host = f"{cpu_linear.cpu_name()} x{torch.get_num_threads()}" if torch.device(context.device).type == "cpu" else ""
    path = cost_cache_path(name, context.model_id, f"{model.dtype}/{linear}/fastest", ctx, ks, host)
    stored = read_measurement(path)
    try:
        return {int(k): float(v) for k, v in stored["seconds"].items()}, "cached"
    except (TypeError, KeyError, ValueError, AttributeError):
        pass  # missing or damaged: measured again
    costs = measure_verify_costs(model, ks, ctx, repeats)
    write_measurement(path, {"device": name, "host": host, "model": context.model_id, "dtype": str(model.dtype),
                             "linear": linear, "context": ctx, "seconds": {str(k): v for k, v in costs.items()}})
    return costs, "measured"


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

def _check_k_or_auto(name: str, value) -> int | str:
    return AUTO if value == AUTO else check_k(name, value)


class HardwareAwareK:
    """K by device name, or ``auto`` (see the module docstring).

    ``k``: a fixed K or ``auto`` overriding the device table (the ``k=`` shortcut). ``device_k`` adds or
    overrides name -> K entries (matched as a case-insensitive substring of the device name, longest
    first). ``device_name`` and ``costs`` ({K: seconds}) replace what would be read or measured (tests, or
    a device whose name the table does not know).
    """

    def __init__(self, k: int | str | None = None, device_k: dict[str, int | str] | None = None,
                 other_gpu_k: int | str = 3, cpu_k: int | str = AUTO, device_name: str | None = None,
                 auto_ks: list[int] | tuple[int, ...] = COST_KS, acceptance_prior: float = 0.5,
                 acceptance_memory: float = 0.9, probe_every: int = 8, cost_context: int = 256,
                 cost_repeats: int = 5, costs: dict[int, float] | None = None):
        self.fixed = None if k is None else _check_k_or_auto("strategy.select_k.k", k)
        table = {**DEFAULT_DEVICE_K, **(device_k or {})}
        self.device_k = {str(n): _check_k_or_auto(f"strategy.select_k.device_k.{n}", v) for n, v in table.items()}
        self.other_gpu_k = _check_k_or_auto("strategy.select_k.other_gpu_k", other_gpu_k)
        self.cpu_k = _check_k_or_auto("strategy.select_k.cpu_k", cpu_k)
        self.device_name_override = device_name
        self.auto_ks = sorted({check_k("strategy.select_k.auto_ks[]", x) for x in auto_ks})
        if not self.auto_ks:
            raise ConfigError("strategy.select_k.auto_ks must list at least one K")
        for name, value in (("acceptance_prior", acceptance_prior), ("acceptance_memory", acceptance_memory)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ConfigError(f"strategy.select_k.{name} must be in [0, 1), got {value!r}")
        self.acceptance_prior, self.acceptance_memory = float(acceptance_prior), float(acceptance_memory)
        self.probe_every = check_k("strategy.select_k.probe_every", probe_every)
        for name, value in (("cost_context", cost_context), ("cost_repeats", cost_repeats)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"strategy.select_k.{name} must be a positive integer, got {value!r}")
        self.cost_context, self.cost_repeats = cost_context, cost_repeats
        self.costs = None if costs is None else {check_k("strategy.select_k.costs", int(kk)): float(v)
                                                  for kk, v in costs.items()}
        self.mode: int | str = AUTO
        self._acceptance = DecayedAcceptance(self.acceptance_prior, self.acceptance_memory)
        self.probes = ProbeSchedule(self.probe_every)

    def k_for_device(self, name: str, device_type: str) -> int | str:
        if device_type == "cpu":
            return self.cpu_k
        for key in sorted(self.device_k, key=len, reverse=True):
            if key.lower() in name.lower():
                return self.device_k[key]
        return self.other_gpu_k

    @property
    def acceptance(self) -> float:
        """Recent per-position acceptance, the prior counting as two observations."""
        return self._acceptance.value

    def _load_costs(self, context) -> tuple[dict[int, float], str]:
        return load_verify_costs(context, self.auto_ks, self.cost_context, self.cost_repeats,
                                 self.device_name_override)

    @hookimpl
    def on_run_start(self, context) -> dict[str, Any]:
        dev_type = torch.device(context.device).type
        name = self.device_name_override or device_name(context.device)
        if self.device_name_override:  # a named device stands for an accelerator unless it is called cpu
            dev_type = "cpu" if name.strip().lower() == "cpu" else "cuda"
        self.mode = self.fixed if self.fixed is not None else self.k_for_device(name, dev_type)
        facts: dict[str, Any] = {"hardware_device": name}
        if self.mode == AUTO:
            source = "given"
            if self.costs is None:
                self.costs, source = self._load_costs(context)
            k = best_k(self.costs, self.acceptance)
            facts.update({"hardware_k": "auto", "auto_start_k": k, "auto_costs": source})
            if 0 in self.costs:  # what drafting costs here, relative to a plain 1-token forward
                facts.update({f"auto_cost_k{kk}_vs_k0": round(c / self.costs[0], 3)
                              for kk, c in sorted(self.costs.items()) if kk})
        else:
            facts["hardware_k"] = self.mode
        return facts

    @hookimpl
    def select_k(self, state: DecodeState) -> int:
        if self.mode != AUTO:
            return int(self.mode)
        if self.costs is None:  # on_run_start did not run (a bare unit call): no measurement, no drafting
            return 0
        k = best_k(self.costs, self.acceptance)
        if k == 0 and self.probes.should_probe():
            # Without drafts the acceptance estimate never updates: probe with the best drafting K.
            drafting = {kk: c for kk, c in self.costs.items() if kk > 0}
            if drafting:
                k = best_k(drafting, self.acceptance)
        return k

    @hookimpl
    def on_step_end(self, record: StepRecord) -> None:
        if self.mode != AUTO:
            return
        self.probes.observe(record.draft.num_nodes, record.decision.num_accepted)
        if record.draft.num_nodes == 0:
            return
        deepest = int(record.draft.depths().max())
        self._acceptance.update(record.decision.num_accepted, deepest)
