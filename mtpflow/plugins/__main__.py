"""``python -m mtpflow.plugins [--json]``: list the built-in and third-party plugins, the hooks each implements
and the strategies each adds. A plugin's stage classes are read from the ``_target_`` names of its strategies,
so the listing shows exactly what a run of that strategy registers."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from mtpflow.plugins import entry_points, hookspecs
from mtpflow.plugins.defaults import CoreDefaults

USAGE = "usage: python -m mtpflow.plugins [--json | --hooks]   (--hooks: every hook with its signature)"


def strategy_targets(strategy_dir: Path) -> dict[str, list[str]]:
    """strategy name -> the ``_target_`` class paths its stages name, after merging the strategies its Hydra
    ``defaults`` list builds on (``mtp`` builds on ``suffix_cache``), as composing it would."""
    out: dict[str, list[str]] = {}
    nodes: dict[str, dict] = {}
    for path in sorted(Path(strategy_dir).glob("*.yaml")):
        try:
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
        except Exception as exc:  # a malformed YAML: say so in the listing instead of failing
            out[path.stem] = [f"<unreadable: {type(exc).__name__}>"]
            continue
        nodes[path.stem] = node if isinstance(node, dict) else {}

    def merged(name: str, seen: frozenset = frozenset()) -> dict:
        node = nodes[name]
        bases = [b for b in node.get("defaults") or [] if isinstance(b, str) and b in nodes and b not in seen]
        own = {k: v for k, v in node.items() if k != "defaults"}
        parts = [merged(b, seen | {name}) for b in bases] + [own]
        return OmegaConf.to_container(OmegaConf.merge(*parts), resolve=False)

    for name in nodes:
        out[name] = sorted(set(_targets(merged(name))))
    return dict(sorted(out.items()))


def _targets(node) -> list[str]:
    if isinstance(node, dict):
        found = [str(node["_target_"])] if "_target_" in node else []
        return found + [t for v in node.values() for t in _targets(v)]
    if isinstance(node, list):
        return [t for v in node for t in _targets(v)]
    return []


def class_hooks(target: str) -> list[str] | str:
    """The hooks the class at ``target`` implements, or a one-line reason it cannot be imported."""
    from hydra.utils import get_object

    try:
        return list(hookspecs.hooks_of(get_object(target)))
    except Exception as exc:
        return f"cannot import: {entry_points.one_line(exc)}"


def _stage_classes(targets: dict[str, list[str]]) -> dict[str, object]:
    return {t: class_hooks(t) for names in targets.values() for t in names}


def describe() -> dict:
    """Everything the listing prints, as plain data."""
    from mtpflow.conf import conf_dir

    builtin_targets = strategy_targets(conf_dir() / "strategy")
    builtin = {
        "name": "mtpflow (built-in)",
        "hooks": {"mtpflow.plugins.defaults.CoreDefaults": list(hookspecs.hooks_of(CoreDefaults))},
        "stage_classes": _stage_classes(builtin_targets),
        "strategies": sorted(builtin_targets),
    }
    third = []
    for p in entry_points.third_party_plugins():
        entry = {"name": p.name, "entry_point": p.value, "distribution": p.distribution,
                 "status": "not loaded" if not p.selected else ("broken" if p.error else "loaded"),
                 "error": p.error, "hooks": list(p.hooks), "strategies": list(p.strategies),
                 "strategy_dirs": [str(d) for d in p.strategy_dirs], "stage_classes": {}}
        targets: dict[str, list[str]] = {}
        for d in p.strategy_dirs:
            targets.update(strategy_targets(d))
        # only the plugin's own classes: the built-in gate a strategy reuses is listed under mtpflow
        entry["stage_classes"] = {t: h for t, h in _stage_classes(targets).items() if not t.startswith("mtpflow.")}
        third.append(entry)
    return {"selection": os.environ.get(entry_points.SELECT_ENV), "builtin": builtin, "third_party": third}


def format_listing(info: dict) -> str:
    lines = ["Built-in plugins (mtpflow)"]
    for cls, hooks in info["builtin"]["hooks"].items():
        lines.append(f"  {cls}: {', '.join(hooks)}")
    for cls, hooks in info["builtin"]["stage_classes"].items():
        lines.append(f"  {cls}: {hooks if isinstance(hooks, str) else ', '.join(hooks)}")
    lines.append(f"  strategies: {', '.join(info['builtin']['strategies'])}")
    sel = info["selection"]
    how = "unset: all load" if sel is None else (f"{sel!r}" if sel.strip() else "empty: none load")
    lines += ["", f"Third-party plugins (entry point group {entry_points.ENTRY_POINT_GROUP!r}; "
                  f"{entry_points.SELECT_ENV} {how})"]
    if not info["third_party"]:
        lines.append("  none installed")
    for p in info["third_party"]:
        lines.append(f"  {p['name']} = {p['entry_point']}  [{p['distribution']}]  {p['status']}")
        if p["error"]:
            lines.append(f"    error: {p['error']}")
        if p["hooks"]:
            lines.append(f"    hooks: {', '.join(p['hooks'])}")
        for cls, hooks in p["stage_classes"].items():
            lines.append(f"    {cls}: {hooks if isinstance(hooks, str) else ', '.join(hooks)}")
        if p["strategies"]:
            lines.append(f"    strategies: {', '.join(p['strategies'])}")
    return "\n".join(lines)


def hook_reference() -> str:
    """Every hookspec (stage hooks, then plugin-level hooks) with its signature and docstring."""
    import inspect

    specs = hookspecs.specs()
    lines = []
    for title, names in (("Stage hooks (per run)", [n for n in specs if n not in hookspecs.PLUGIN_LEVEL]),
                         ("Plugin-level hooks (once)", list(hookspecs.PLUGIN_LEVEL))):
        lines.append(f"{title}: {hookspecs.__name__}")
        for name in names:
            fn = specs[name]
            first = " [firstresult]" if getattr(fn, f"{hookspecs.PROJECT}_spec").get("firstresult") else ""
            lines.append(f"  {name}{inspect.signature(fn)}{first}")
            lines += [f"      {line.strip()}" for line in (fn.__doc__ or "").strip().splitlines()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv) or any(a not in ("--json", "--hooks") for a in argv):
        print(USAGE)
        return 0 if any(a in ("-h", "--help") for a in argv) else 2
    if "--hooks" in argv:
        print(hook_reference())
        return 0
    info = describe()
    print(json.dumps(info, indent=2) if "--json" in argv else format_listing(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
