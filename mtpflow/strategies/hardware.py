"""Hardware-aware K (stage ``select_k``): K from the device's name (A100 4, H100/H200 6, L40S 2, other GPUs 3),
or ``auto``: measure the verify-forward cost for a few K on this device and model once (cached on disk),
then pick each step the K that maximises expected tokens per second at the run's recent acceptance rate,
E[tokens] = (1 - a^(K+1)) / (1 - a) over the cost of a (1 + K)-token verify forward.

On a CPU a 1-token forward is a GEMV and much cheaper than any multi-token one, so ``auto`` rightly picks a
small K, or 0, unless drafts are accepted often; the CPU default is therefore ``auto``.
"""
from __future__ import annotations

from typing import Any

import torch

from mtpflow.cost_model import (  # noqa: F401 - the cost model's names, also reachable from here
    AUTO, COST_KS, CostCurve, device_name, DecayedAcceptance, ProbeSchedule, best_k, check_costs, cost_cache_path,
    expected_tokens, load_verify_costs, time_verify_forwards,
)
from mtpflow.errors import ConfigError, check_k
from mtpflow.plugins import hookimpl
from mtpflow.types import DecodeState, StepRecord

DEFAULT_DEVICE_K = {"A100": 4, "H100": 6, "H200": 6, "L40S": 2}


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
        deepest = record.draft.max_depth()
        self._acceptance.update(record.decision.num_accepted, deepest)
