"""Plugin-level hooks: what an installed third-party plugin (entry point group ``mtpflow``) contributes to the
process as a whole, as opposed to the per-run stage hooks in ``mtpflow.hookspecs``.

They use the same marker (``from mtpflow.hookspecs import hookimpl``) and are called once, when
``mtpflow.thirdparty`` loads the plugin.
"""
from __future__ import annotations

from pathlib import Path

from mtpflow.hookspecs import hookspec


@hookspec
def mtpflow_strategy_dirs() -> list[str | Path]:
    """Folders of strategy YAML files this plugin ships. Each folder must be named ``strategy`` (Hydra finds
    ``strategy=<name>`` through the folder's parent); a strategy's stages name their classes with ``_target_``."""
