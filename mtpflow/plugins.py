"""The plugin manager factory: every run gets its own ``PluginManager`` holding the core defaults, the
strategy's stage objects (built from their ``_target_``) and any run-level plugins (traces, metrics), so
two strategies can run side by side in one process.

Third-party packages declare an entry point in group ``mtpflow``; see ``plugin_strategy_dirs``.
"""
from __future__ import annotations

from pathlib import Path

import pluggy
from omegaconf import DictConfig, OmegaConf

from mtpflow import hookspecs
from mtpflow.defaults import CoreDefaults
from mtpflow.errors import UserError

STAGES = ("select_k", "propose", "prune", "gate", "dedup", "rescore", "window")
FILTER_STAGES = ("prune", "dedup")  # these take a list of implementations


def plugin_strategy_dirs() -> list[Path]:
    """Strategy folders contributed by installed third-party plugins (none yet)."""
    return []


def build_stage(node, where: str):
    """Instantiate one stage object from its config node, turning mistakes into one-line UserErrors."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, _convert_="all")
    except InstantiationException as exc:
        cause = exc.__cause__
        while cause is not None and not isinstance(cause, UserError) and cause.__cause__ is not None:
            cause = cause.__cause__
        if isinstance(cause, UserError):
            raise cause from None
        first = str(exc).strip().splitlines()[0]
        raise UserError(f"cannot build {where}: {first}") from None
    except UserError:
        raise
    except Exception as exc:  # a broken stage class: name it
        raise UserError(f"cannot build {where} ({node.get('_target_')}): {type(exc).__name__}: {exc}") from None


def build_stages(strategy: DictConfig) -> list[tuple[str, object]]:
    """(registration name, stage object) for every stage the strategy configures."""
    stages: list[tuple[str, object]] = []
    for stage in STAGES + ("plugins",):
        node = strategy.get(stage)
        if node is None:
            continue
        nodes = list(node) if OmegaConf.is_list(node) else [node]
        if stage not in FILTER_STAGES + ("plugins",) and len(nodes) > 1:
            raise UserError(f"strategy.{stage} takes one implementation, got {len(nodes)}")
        for i, item in enumerate(nodes):
            name = f"strategy.{stage}" + (f"[{i}]" if len(nodes) > 1 or OmegaConf.is_list(node) else "")
            stages.append((name, build_stage(item, name)))
    return stages


def make_plugin_manager(strategy: DictConfig, extra_plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.register(CoreDefaults(), name="mtpflow.core")
    for name, obj in build_stages(strategy):
        _register(pm, obj, name)
    for i, obj in enumerate(extra_plugins):
        _register(pm, obj, f"run.plugin[{i}]:{type(obj).__name__}")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UserError(f"plugin {exc.plugin_name}: {exc}") from None
    return pm


def _register(pm: pluggy.PluginManager, obj: object, name: str) -> None:
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as exc:
        raise UserError(f"plugin {name} ({type(obj).__name__}): {exc}") from None
