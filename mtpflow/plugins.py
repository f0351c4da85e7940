"""The plugin manager factory: every run gets its own ``PluginManager`` holding the core defaults, the
strategy's stage objects (built from their ``_target_``) and any run-level plugins (traces, metrics), so
two strategies can run side by side in one process.

Third-party packages declare an entry point in group ``mtpflow`` (``mtpflow.thirdparty``); their stage
classes join a run through ``_target_`` or ``strategy.plugins: [<entry point name>]``, never on their own.
``python -m mtpflow.plugins`` lists built-in and third-party plugins (``mtpflow.plugin_listing``).
"""
from __future__ import annotations

import inspect
from pathlib import Path

import pluggy
from omegaconf import DictConfig, OmegaConf

from mtpflow import hookspecs, plugin_hookspecs, thirdparty
from mtpflow.defaults import CoreDefaults
from mtpflow.errors import PluginError, UserError

STAGES = ("select_k", "propose", "prune", "gate", "dedup", "rescore", "window")
FILTER_STAGES = ("prune", "dedup")  # these take a list of implementations


def plugin_strategy_dirs() -> list[Path]:
    """Strategy folders (each named ``strategy``) contributed by the loaded third-party plugins."""
    return thirdparty.strategy_dirs()


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
        raise UserError(f"cannot build {where}: {_owner_prefix(node)}{first}") from None
    except UserError:
        raise
    except Exception as exc:  # a broken stage class: name it
        raise UserError(f"cannot build {where} ({node.get('_target_')}): {_owner_prefix(node)}"
                        f"{type(exc).__name__}: {exc}") from None


def _owner_prefix(node) -> str:
    """'plugin NAME (dist): ' when the stage class comes from a third-party plugin (and a hint if it is broken)."""
    target = str(node.get("_target_", "")) if hasattr(node, "get") else ""
    label = thirdparty.owner_label(target) if target else None
    return f"{label}: " if label else ""


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
            if stage == "plugins" and isinstance(item, str):  # an entry point name: the plugin's own hooks
                stages.append((f"{name}:{item}", thirdparty.plugin_object(item)))
            else:
                stages.append((name, build_stage(item, name)))
    return stages


def make_plugin_manager(strategy: DictConfig, extra_plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    pm.add_hookspecs(plugin_hookspecs)  # known (never called per run), so an entry point module can register
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
    module = getattr(obj, "__name__", None) if inspect.ismodule(obj) else type(obj).__module__
    label = thirdparty.owner_label(module or "")
    where = f"{label}, {name}" if label else name
    if misspelled := thirdparty.unknown_hooks(obj):  # pluggy would only say "unknown hook" without a hint
        raise PluginError(f"{where} ({_qualname(obj)}) implements unknown hook {', '.join(misspelled)}")
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as exc:
        raise UserError(f"plugin {where} ({type(obj).__name__}): {exc}") from None
    if label:  # a third-party hook that raises becomes one line naming its plugin
        thirdparty.guard_hooks(pm, obj, f"{label}, {_qualname(obj)}")


def _qualname(obj: object) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


if __name__ == "__main__":  # python -m mtpflow.plugins: list built-in and third-party plugins
    import sys

    from mtpflow.plugin_listing import main

    sys.exit(main())
