"""The third-party plugins: installed distributions that declare an entry point in group ``mtpflow``. Each entry
point names a module (or object) holding plugin-level hooks (``mtpflow.plugins.hookspecs.PLUGIN_LEVEL``, e.g.
the strategy folders it ships) and possibly stage hooks, which join a run only when a strategy lists the plugin
under ``strategy.plugins`` (stage classes named by ``_target_`` are built per run as usual).

``MTPFLOW_LOAD_PLUGINS`` picks which plugins load: unset loads all, empty loads none, ``a,b`` loads those.
A broken plugin is skipped with one warning line; it fails with a one-line ``PluginError`` only where it is used.
The config reads the strategy folders from here (``plugin_strategy_dirs``); this module reads no config.
"""
from __future__ import annotations

import functools
import importlib.metadata
import inspect
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import pluggy

from mtpflow.errors import PluginError, UserError
from mtpflow.plugins import hookspecs

ENTRY_POINT_GROUP = "mtpflow"
SELECT_ENV = "MTPFLOW_LOAD_PLUGINS"
log = logging.getLogger("mtpflow.plugins")


@dataclass(frozen=True)
class ThirdPartyPlugin:
    """One entry point of group ``mtpflow`` and what loading it gave."""

    name: str  # the entry point name (what MTPFLOW_LOAD_PLUGINS and strategy.plugins refer to)
    value: str  # "module" or "module:attribute"
    distribution: str  # "name version" of the distribution declaring it
    obj: object | None = None  # the loaded module or object; None when broken or not selected
    hooks: tuple[str, ...] = ()  # hooks the object implements
    strategy_dirs: tuple[Path, ...] = ()
    strategies: tuple[str, ...] = ()
    error: str | None = None  # one line saying why the plugin is broken
    selected: bool = True  # False when MTPFLOW_LOAD_PLUGINS leaves it out
    problems: tuple[str, ...] = field(default=())  # non-fatal notes (e.g. a shadowed strategy)

    @property
    def label(self) -> str:
        return f"plugin {self.name!r} ({self.distribution})"

    @property
    def package(self) -> str:
        """The top-level import package of the entry point, used to tell which classes belong to it."""
        return self.value.split(":", 1)[0].split(".", 1)[0]


def selected_names(raw: str | None) -> frozenset[str] | None:
    """None (load all) when the variable is unset, else the set of names it lists (empty: load none)."""
    if raw is None:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def third_party_plugins() -> tuple[ThirdPartyPlugin, ...]:
    """Every entry point of the group, loaded when selected (cached per value of MTPFLOW_LOAD_PLUGINS)."""
    return _load_all(os.environ.get(SELECT_ENV))


def loaded_plugins() -> tuple[ThirdPartyPlugin, ...]:
    return tuple(p for p in third_party_plugins() if p.selected and p.error is None)


def clear_cache() -> None:
    """Forget loaded plugins (after installing one, or in tests that fake a distribution)."""
    _load_all.cache_clear()
    _distribution_of_package.cache_clear()


def plugin_strategy_dirs() -> list[Path]:
    """Strategy folders (each named ``strategy``) contributed by the loaded third-party plugins."""
    return [d for p in loaded_plugins() for d in p.strategy_dirs]


def plugin_object(name: str) -> object:
    """The loaded object of entry point ``name`` (for ``strategy.plugins: [name]``); a class is instantiated
    so each run gets fresh state."""
    for p in third_party_plugins():
        if p.name == name:
            if p.error:
                raise PluginError(f"{p.label}: {p.error}")
            if not p.selected:
                raise PluginError(f"plugin {name!r} is installed but {SELECT_ENV} does not load it")
            return p.obj() if inspect.isclass(p.obj) else p.obj
    raise UserError(f"no mtpflow plugin named {name!r} is installed (entry point group {ENTRY_POINT_GROUP!r})")


def trouble_note() -> str:
    """A clause for 'unknown strategy' errors: broken plugins and installed plugins that were not loaded."""
    found = third_party_plugins()
    broken = [f"{p.label} is broken: {p.error}" for p in found if p.selected and p.error]
    skipped = [p.name for p in found if not p.selected]
    notes = broken + ([f"{SELECT_ENV} does not load {', '.join(skipped)}"] if skipped else [])
    return ("; " + "; ".join(notes)) if notes else ""


def owner_label(module: str) -> str | None:
    """'plugin NAME (dist version)' for a module that belongs to a third-party plugin or distribution, None
    for mtpflow's own modules and modules no installed distribution ships (e.g. a test file)."""
    top = module.split(".", 1)[0]
    if top == "mtpflow":
        return None
    for p in third_party_plugins():
        if p.package == top:
            return p.label
    dist = _distribution_of_package(top)
    return f"package {dist}" if dist else None


@functools.lru_cache(maxsize=4)
def _load_all(raw_selection: str | None) -> tuple[ThirdPartyPlugin, ...]:
    wanted = selected_names(raw_selection)
    seen: dict[str, ThirdPartyPlugin] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = f"{ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else "unknown distribution"
        if ep.name in seen:
            if seen[ep.name].value != ep.value:
                log.warning("mtpflow: warning: two distributions declare plugin %r; using %s, ignoring %s",
                            ep.name, seen[ep.name].distribution, dist)
            continue
        if wanted is not None and ep.name not in wanted:
            seen[ep.name] = ThirdPartyPlugin(ep.name, ep.value, dist, selected=False)
            continue
        seen[ep.name] = _load_one(ep, dist)
    found = list(seen.values())
    if wanted:
        for name in sorted(wanted - set(seen)):
            log.warning("mtpflow: warning: %s names %r, but no installed distribution declares it", SELECT_ENV, name)
    found = _drop_shadowed_strategies(found)
    for p in found:
        if p.selected and p.error:
            log.warning("mtpflow: warning: %s skipped: %s", p.label, p.error)
    return tuple(found)


def _load_one(ep, dist: str) -> ThirdPartyPlugin:
    base = ThirdPartyPlugin(ep.name, ep.value, dist)

    def broken(problem: str) -> ThirdPartyPlugin:
        return ThirdPartyPlugin(ep.name, ep.value, dist, error=problem)

    try:
        obj = ep.load()
    except Exception as exc:  # an import error, or any exception the module raises while importing
        return broken(f"cannot import {ep.value}: {one_line(exc)}")
    hooks = hookspecs.hooks_of(obj)
    if misspelled := hookspecs.unknown_hooks(obj):
        return broken(f"{ep.value} implements unknown hook {', '.join(misspelled)}")
    instance = obj
    if inspect.isclass(obj):
        try:
            instance = obj()
        except Exception as exc:
            return broken(f"cannot instantiate {ep.value}: {one_line(exc)}")
    pm = hookspecs.new_manager()
    try:
        pm.register(instance, name=ep.name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        return broken(one_line(exc))
    dirs: list[Path] = []
    try:
        for found in pm.hook.mtpflow_strategy_dirs():
            dirs.extend(Path(d) for d in (found or ()))
    except Exception as exc:
        return broken(f"hook mtpflow_strategy_dirs raised {one_line(exc)}")
    for d in dirs:
        if not d.is_dir():
            return broken(f"mtpflow_strategy_dirs returned {d}, which is not a folder")
        if d.name != "strategy":
            return broken(f"mtpflow_strategy_dirs returned {d}: the folder must be named 'strategy'")
    strategies = tuple(sorted({p.stem for d in dirs for p in d.glob("*.yaml")}))
    return ThirdPartyPlugin(base.name, base.value, dist, obj=obj, hooks=hooks, strategy_dirs=tuple(dirs),
                            strategies=strategies)


def _drop_shadowed_strategies(found: list[ThirdPartyPlugin]) -> list[ThirdPartyPlugin]:
    """A plugin may not replace a built-in strategy or another plugin's: Hydra would pick one silently."""
    from mtpflow.conf import conf_dir

    taken = {p.stem: "mtpflow" for p in (conf_dir() / "strategy").glob("*.yaml")}
    out = []
    for p in found:
        if not p.strategies:
            out.append(p)
            continue
        clashes = [f"{s} (already from {taken[s]})" for s in p.strategies if s in taken]
        if clashes:
            problem = f"ships strategies that already exist: {', '.join(clashes)}"
            p = ThirdPartyPlugin(p.name, p.value, p.distribution, error=problem)
        else:
            taken.update({s: p.label for s in p.strategies})
        out.append(p)
    return out


@functools.lru_cache(maxsize=None)
def _distribution_of_package(top: str) -> str | None:
    dists = importlib.metadata.packages_distributions().get(top) or []
    return dists[0] if dists else None


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
