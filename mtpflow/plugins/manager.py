"""The plugin manager of a run: every run gets its own ``PluginManager`` holding the core defaults, the strategy's
stage objects (built from their ``_target_``), the entry point objects its ``strategy.plugins`` names and any
run-level plugins (traces), so two strategies can run side by side in one process (``make_plugin_manager``).

A stage that comes from a third-party plugin (``mtpflow.plugins.entry_points``) is registered with a guard: a
hook of it that raises fails the run with one line naming the plugin, not a traceback.
"""
from __future__ import annotations

import functools
import inspect

import pluggy
from omegaconf import DictConfig, OmegaConf

from mtpflow.errors import PluginError, UserError
from mtpflow.plugins import hookspecs
from mtpflow.plugins.defaults import CoreDefaults
from mtpflow.plugins.entry_points import one_line, owner_label, plugin_object

STAGES = ("select_k", "propose", "prune", "gate", "dedup", "rescore", "window")
FILTER_STAGES = ("prune", "dedup")  # these take a list of implementations


def make_plugin_manager(strategy: DictConfig, extra_plugins: tuple[object, ...] = ()) -> pluggy.PluginManager:
    """A run's manager: the strategy's stage objects are built first, then each is named by its owner (a
    third-party plugin or mtpflow), then registered against the hook specs: the work goes down the layers in
    that order (strategies, entry points, specs) and never back up (tests/unit/test_layout.py walks it)."""
    objects = [("mtpflow.core", CoreDefaults()), *build_stages(strategy),
               *((f"run.plugin[{i}]:{type(obj).__name__}", obj) for i, obj in enumerate(extra_plugins))]
    labels = [owner_label(_module_of(obj)) for _, obj in objects]
    pm = hookspecs.new_manager()
    for (name, obj), label in zip(objects, labels):
        _register(pm, obj, name, label)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        raise UserError(f"plugin {exc.plugin_name}: {exc}") from None
    return pm


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
                stages.append((f"{name}:{item}", plugin_object(item)))
            else:
                stages.append((name, build_stage(item, name)))
    return stages


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
    label = owner_label(target) if target else None
    return f"{label}: " if label else ""


def _module_of(obj: object) -> str:
    return (getattr(obj, "__name__", None) if inspect.ismodule(obj) else type(obj).__module__) or ""


def _register(pm: pluggy.PluginManager, obj: object, name: str, label: str | None) -> None:
    """Register ``obj`` as ``name``; ``label``: the third-party plugin it comes from (``owner_label``) or None."""
    where = f"{label}, {name}" if label else name
    if misspelled := hookspecs.unknown_hooks(obj):  # pluggy would only say "unknown hook" without a hint
        raise PluginError(f"{where} ({_qualname(obj)}) implements unknown hook {', '.join(misspelled)}")
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as exc:
        raise UserError(f"plugin {where} ({type(obj).__name__}): {exc}") from None
    if label:  # a third-party hook that raises becomes one line naming its plugin
        guard_hooks(pm, obj, f"{label}, {_qualname(obj)}")


def _qualname(obj: object) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def guard_hooks(pm: pluggy.PluginManager, plugin: object, label: str) -> None:
    """Make the plugin's hook implementations raise a one-line PluginError naming it instead of a traceback.

    Wrapper implementations are left alone: an exception passing through them may come from another plugin.
    """
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and not (impl.wrapper or impl.hookwrapper):
                impl.function = _guarded(impl.function, label, caller.name)


def _guarded(function, label: str, hook: str):
    @functools.wraps(function)
    def call(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except UserError:
            raise
        except Exception as exc:
            raise PluginError(f"{label}: hook {hook} raised {one_line(exc)}") from exc

    return call


def default_run_plugins(cfg: DictConfig) -> tuple:
    """Factories ``f(pipeline) -> plugin`` for the run plugins the top-level config enables (trace recording),
    added to every run of the CLI, the benchmark, the server and the playground."""
    factories = []
    trace = cfg.get("trace")
    if trace is not None and trace.get("enabled", False):
        # Opening the store here (before the model loads) turns a corrupt file or an unwritable folder
        # into one UserError line up front; trace.sample and trace.retention apply to every run plugin user.
        from mtpflow.traces.recorder import recorder_from_config

        factories.append(recorder_from_config(trace))
    return tuple(factories)
