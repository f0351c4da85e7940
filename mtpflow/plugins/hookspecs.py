"""Every hook mtpflow calls, as pluggy hookspecs, and the markers a plugin uses (``hookimpl``).

Stage hooks (per run): the loop (``mtpflow.loop``) is their only caller. Read top to bottom, they are the step
diagram: select_k -> propose -> prune -> verify -> gate -> dedup -> rescore -> commit (KV rollback) -> window,
with on_step_end after every step and on_run_start / on_run_end around the run.

Plugin-level hooks (``PLUGIN_LEVEL``, at the end): what an installed third-party plugin (entry point group
``mtpflow``) contributes to the process as a whole; called once, when ``mtpflow.plugins.entry_points`` loads it.
"""
from __future__ import annotations

import difflib
import inspect
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mtpflow.types import DecodeResult, DecodeState, Decision, Draft, RunContext, StepRecord, Verification

PROJECT = "mtpflow"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def on_run_start(context: RunContext) -> dict[str, Any] | None:
    """Called once after the prompt is tokenized, before the prefill. Return facts to merge into
    ``DecodeState.extras`` and the run's stats (e.g. ``{"domain": "code", "domain_confidence": 0.93}``)."""


@hookspec(firstresult=True)
def select_k(state: DecodeState) -> int | None:
    """How many draft positions to propose this step (0 = plain autoregressive step)."""


@hookspec(firstresult=True)
def propose(state: DecodeState, k: int) -> Draft | None:
    """Draft up to ``k`` positions after the root token, as a chain or a tree. An empty draft is allowed."""


@hookspec
def prune(state: DecodeState, draft: Draft) -> torch.Tensor | None:
    """Return a keep-mask ``[num_nodes]`` bool. The loop ANDs all masks and drops the descendants of
    dropped nodes, so a filter need not close its mask over the tree."""


@hookspec(firstresult=True)
def verify(state: DecodeState, draft: Draft, target: Any) -> Verification | None:
    """Run ONE target forward over the root and all draft nodes on the shared KV cache. ``target`` is the
    sequence's ``mtpflow.target.Target`` (its KV slot and the engine's backend); it is not imported here, so the
    hooks, which every stage imports, sit below everything that runs them."""


@hookspec(firstresult=True)
def gate(state: DecodeState, draft: Draft, verification: Verification) -> Decision | None:
    """Pick the accepted root-to-node path; set ``next_token`` when the gate knows it (else the re-scorer)."""


@hookspec
def dedup(state: DecodeState, draft: Draft, decision: Decision) -> torch.Tensor | None:
    """Return a keep-mask ``[n_accepted]`` over the accepted path; the loop cuts the path at the first
    False and asks the re-scorer for the token at the cut."""


@hookspec(firstresult=True)
def rescore(state: DecodeState, draft: Draft, verification: Verification, decision: Decision) -> Decision | None:
    """Return the final decision: fill ``next_token`` if it is None (the target's own token at the first
    rejected position), or re-score low-confidence positions of a lossy accept."""


@hookspec(firstresult=True)
def window(state: DecodeState, cache_len: int) -> torch.Tensor | None:
    """After commit: return cache indices ``[n_keep]`` (long, ascending) to keep in the KV cache, or None
    to keep everything (e.g. a sliding window with attention sinks)."""


@hookspec
def on_step_end(record: StepRecord) -> None:
    """Feedback after every step: adaptive K, Jacobi guesses, metrics, traces."""


@hookspec
def run_stats() -> dict[str, Any] | None:
    """Extra run-level numbers a stage kept (e.g. the re-scorer's recovered tokens), merged into the run's
    stats each time the loop builds a result."""


@hookspec
def on_run_end(result: DecodeResult, status: str) -> None:
    """Called once when the run ends; status is complete, failed or interrupted."""


# ----- plugin-level hooks: implemented by an entry point's object, called once when the plugin loads ----------
PLUGIN_LEVEL = ("mtpflow_strategy_dirs",)


@hookspec
def mtpflow_strategy_dirs() -> list[str | Path]:
    """Folders of strategy YAML files this plugin ships. Each folder must be named ``strategy`` (Hydra finds
    ``strategy=<name>`` through the folder's parent); a strategy's stages name their classes with ``_target_``."""


def specs() -> dict[str, object]:
    """{hook name: its spec function}, stage hooks first, in definition order."""
    return {name: f for name, f in globals().items() if callable(f) and hasattr(f, f"{PROJECT}_spec")}


def new_manager() -> pluggy.PluginManager:
    """An empty manager that knows every hook (the plugin-level ones too, so an entry point module registers)."""
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(sys.modules[__name__])
    return pm


def hooks_of(obj: object) -> tuple[str, ...]:
    """Names of the hook implementations an object (module, class or instance) carries, in definition order."""
    marker = f"{PROJECT}_impl"
    names = []
    # an instance's hooks are its class's functions: read them there, so no property of the instance runs
    owner = obj if inspect.ismodule(obj) or inspect.isclass(obj) else type(obj)
    for name in dir(owner):
        try:
            attr = getattr(owner, name)
        except Exception:  # a descriptor that fails on the class
            continue
        if callable(attr) and getattr(attr, marker, None) is not None:
            names.append(name)
    return tuple(names)


def unknown_hooks(obj: object) -> list[str]:
    """'name (did you mean X?)' for every hook implementation whose name is no hookspec (a misspelling)."""
    known = set(specs())
    out = []
    for name in hooks_of(obj):
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1)
            out.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return out
