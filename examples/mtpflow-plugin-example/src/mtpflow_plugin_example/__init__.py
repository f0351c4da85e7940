"""mtpflow-plugin-example: a SuffixDecoding-style proposer that drafts from the earlier outputs of the same
process, and the ``suffix`` strategy using it. mtpflow finds this module through the entry point
``example`` in group ``mtpflow`` and asks it for its strategy folder; the stage classes join a run only through
the strategy's ``_target_`` names."""
from __future__ import annotations

from pathlib import Path

from mtpflow.plugins import hookimpl

__version__ = "0.1.0"


@hookimpl
def mtpflow_strategy_dirs() -> list[Path]:
    return [Path(__file__).resolve().parent / "conf" / "strategy"]
