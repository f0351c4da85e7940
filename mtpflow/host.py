"""The tuning profile: one versioned JSON file per host that holds every cost measurement (``load_profile``,
``update_profile``), keyed by what ``mtpflow.machine`` says this machine is.

It imports nothing from mtpflow but ``mtpflow.errors`` and ``mtpflow.machine``.

The profile (written by ``python -m mtpflow.tune``, or by the first run that needs a missing entry)::

    {"version": 1,
     "host": {"cpu": "AMD EPYC", "flags": ["avx2", ...], "cores": 2, "threads": 2, "torch": "2.13.0+cpu"},
     "entries": {KEY: {"verify": {CONTEXT: {K: seconds}}, "batch": {CONTEXT: [[B, q, seconds], ...]},
                       "choice": {STRATEGY: {"chosen": CANDIDATE, "tokens_per_second": {CANDIDATE: t}, ...}}}},
     "fallback": KEY}                  # optional: the entry that serves any key the file lacks

It lives at ``cache_dir()/profiles/<cpu>-x<threads>-torch<version>.json``, or where ``MTPFLOW_PROFILE`` or the config
key ``profile=PATH`` names it. ``"cpu": "*"`` marks a profile that any host may read (the test suite's fixed
profile, a reproducible setup); with ``"fallback"`` such a file never triggers a measurement.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from pathlib import Path
from typing import Callable

from mtpflow.errors import UserError
from mtpflow.machine import cache_dir, cpu_name, host_facts, torch_threads

PROFILE_VERSION = 1
PROFILE_ENV = "MTPFLOW_PROFILE"
ANY_CPU = "*"  # a profile whose host.cpu is this is read on any host (tests, reproducible setups)
TUNING_NOTICE = ("mtpflow: no tuning profile for this host and model; measuring it once "
                 "(python -m mtpflow.tune does this ahead of time)")
def _write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


# ----- the tuning profile -----------------------------------------------------------------------------------------
def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.+" else "-" for c in text).strip("-") or "cpu"


def profile_path(explicit: str | os.PathLike | None = None) -> Path:
    """The profile file: ``explicit`` (the config key ``profile``), else ``MTPFLOW_PROFILE``, else
    ``cache_dir()/profiles/<cpu>-x<threads>-torch<version>.json`` (one per CPU, thread count and torch)."""
    named = named_profile(explicit)
    if named is not None:
        return named
    import torch

    return cache_dir() / "profiles" / f"{_slug(cpu_name())}-x{torch_threads()}-torch{_slug(torch.__version__)}.json"


def named_profile(explicit: str | os.PathLike | None = None) -> Path | None:
    """The profile path the user named (``profile=PATH``, else ``MTPFLOW_PROFILE``), or None for the default."""
    name = explicit if explicit not in (None, "") else os.environ.get(PROFILE_ENV) or None
    return None if name is None else Path(os.path.expanduser(str(name)))


def empty_profile() -> dict:
    return {"version": PROFILE_VERSION, "host": host_facts(), "entries": {}}


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _check_entry(entry) -> str | None:
    """Why an entry is unusable, or None."""
    if not isinstance(entry, dict):
        return "an entry is not an object"
    verify, batch = entry.get("verify", {}), entry.get("batch", {})
    if not isinstance(verify, dict) or not isinstance(batch, dict):
        return "an entry's verify or batch is not an object"
    choice = entry.get("choice", {})
    if not isinstance(choice, dict) or not all(isinstance(c, dict) and isinstance(c.get("chosen"), str)
                                               for c in choice.values()):
        return "an entry's choice is not {strategy: {chosen: strategy name, ...}}"
    for context, curve in verify.items():
        if not (str(context).isdigit() and isinstance(curve, dict) and "0" in curve
                and all(str(k).isdigit() and _positive(v) for k, v in curve.items())):
            return f"a verify curve (context {context}) is not {{K: seconds}} with K=0"
    for context, grid in batch.items():
        if not (str(context).isdigit() and isinstance(grid, list) and grid and all(
                isinstance(row, list) and len(row) == 3 and all(_positive(x) for x in row) for row in grid)):
            return f"a batch grid (context {context}) is not [[B, q, seconds], ...]"
        cells = {(row[0], row[1]) for row in grid}
        if len(cells) != len({row[0] for row in grid}) * len({row[1] for row in grid}) or len(cells) != len(grid):
            return f"a batch grid (context {context}) does not hold every (B, q) of its rows and sizes once"
    return None


def profile_problem(data) -> str | None:
    """Why ``data`` (a parsed profile file) may not be used on this host, or None: damaged, another version,
    or measured on another CPU or thread count (``"cpu": "*"`` is read anywhere)."""
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict) or not isinstance(data.get("host"), dict):
        return "damaged (not a profile: no host or entries)"
    if data.get("version") != PROFILE_VERSION:
        return f"of version {data.get('version')!r}; this mtpflow reads version {PROFILE_VERSION}"
    for entry in data["entries"].values():
        reason = _check_entry(entry)
        if reason:
            return f"damaged ({reason})"
    fallback = data.get("fallback")
    if fallback is not None and fallback not in data["entries"]:
        return f"damaged (fallback {fallback!r} is not an entry)"
    host = data["host"]
    if host.get("cpu") == ANY_CPU:
        return None
    if host.get("cpu") != cpu_name():
        return f"measured on another CPU ({host.get('cpu')!r}; this one is {cpu_name()!r})"
    if host.get("threads") != torch_threads():
        return f"measured with {host.get('threads')} threads; this run uses {torch_threads()}"
    return None


def load_profile(explicit: str | os.PathLike | None = None, quiet: bool = False) -> dict:
    """The profile for this host (``profile_path``), or an empty one where there is none yet. A profile the user
    named that is damaged or foreign is a UserError (one line; nothing is measured). At the default location such
    a file is never used: a one-line notice (unless ``quiet``), its entries are measured again, and the first
    entry stored replaces it."""
    path = profile_path(explicit)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return empty_profile()
    except OSError as exc:
        problem = f"unreadable ({exc.strerror or exc})"
    else:
        try:
            data = json.loads(raw)
        except ValueError:
            data = None
        problem = profile_problem(data)
        if problem is None:
            return data
    if named_profile(explicit) is not None:
        raise UserError(f"the tuning profile {path} is {problem} (run python -m mtpflow.tune profile={path} "
                        "to measure this host, or name another profile)")
    if not quiet:
        print(f"mtpflow: the tuning profile {path} is {problem}: measuring again", file=sys.stderr)
    return empty_profile()


def check_named_profile(explicit: str | os.PathLike | None = None) -> None:
    """Where the user named a profile (``profile=PATH`` / ``MTPFLOW_PROFILE``), the UserError a damaged or foreign
    one gives, raised before any slow work (the CLI, the server and ``mtpflow.tune`` call it first)."""
    if named_profile(explicit) is not None:
        load_profile(explicit)


def save_profile(data: dict, explicit: str | os.PathLike | None = None) -> Path:
    """Write ``data`` to the profile file atomically; returns its path. A folder that cannot be written is one
    line (a UserError)."""
    path = profile_path(explicit)
    try:
        _write_json(path, data)
    except OSError as exc:
        raise UserError(f"cannot write the tuning profile {path}: {exc.strerror or exc}") from None
    return path


def update_profile(change: Callable[[dict], None], explicit: str | os.PathLike | None = None) -> Path:
    """Read the profile afresh (another process may have added entries meanwhile), apply ``change`` to it in
    place and write it back."""
    data = load_profile(explicit, quiet=True)
    change(data)
    return save_profile(data, explicit)


def profile_entry(data: dict, key: str) -> tuple[dict | None, bool]:
    """(the entry for ``key``, True) where the profile has one, else (its fallback entry, False) where it names
    one, else (None, False)."""
    entries = data.get("entries", {})
    if key in entries:
        return entries[key], True
    fallback = data.get("fallback")
    return (entries[fallback], False) if fallback in entries else (None, False)


def profile_hash(explicit: str | os.PathLike | None = None) -> str | None:
    """A short hash of the profile file's bytes (recorded by benchmarks), or None where there is none."""
    try:
        return hashlib.sha1(profile_path(explicit).read_bytes()).hexdigest()[:12]
    except OSError:
        return None


def tuning_notice() -> None:
    print(TUNING_NOTICE, file=sys.stderr, flush=True)
