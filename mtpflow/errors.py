"""Errors a user can cause. The CLI prints them as one line and exits non-zero; internal bugs raise others.

An internal error in a request (a stage's bug: anything that is not a ``UserError``) fails that request alone
with one line naming the stage and the exception; its traceback goes to the ``mtpflow`` logger and the run's
trace. ``MTPFLOW_DEBUG=1`` re-raises the original exception instead (``debug_enabled``).
"""
import math
import os
import sys
import traceback
from typing import Callable

DEBUG_ENV = "MTPFLOW_DEBUG"


class UserError(Exception):
    """A mistake in configuration or input that the user can fix (bad value, missing file, unknown name)."""


class ConfigError(UserError):
    """A configuration value is out of range or of the wrong kind."""


# What the engine answers a request it will not run (the server maps each to its status, without importing the
# engine): they live here, on the ground floor; mtpflow.engine re-exports them.
class QueueFull(UserError):
    """The engine's waiting queue is at its bound (``engine.max_waiting``): try again later."""


class QueueTimeout(QueueFull):
    """The request waited in the queue longer than ``engine.max_wait_seconds`` and was refused: try again later."""


class DeadlineExceeded(UserError):
    """The request ran past its deadline (its ``timeout``, else ``engine.request_timeout``) and was ended."""


class EngineClosed(UserError):
    """The engine is shutting down and takes no new requests."""


def check_range(name: str, value, low=None, high=None, low_inclusive=True, high_inclusive=True):
    """Raise ConfigError unless low <= value <= high (bounds optional, inclusivity configurable)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number, got {value!r}") from None
    if v != v:  # NaN passes every comparison
        raise ConfigError(f"{name} must be a number, got {value!r}")
    bad_low = low is not None and (v < low if low_inclusive else v <= low)
    bad_high = high is not None and (v > high if high_inclusive else v >= high)
    if bad_low or bad_high:
        lo = "" if low is None else ("[" if low_inclusive else "(") + f"{low}"
        hi = "" if high is None else f"{high}" + ("]" if high_inclusive else ")")
        raise ConfigError(f"{name} must be in {lo or '(-inf'}, {hi or 'inf)'}, got {value!r}")
    return value


def check_seconds(name: str, value) -> float:
    """A positive, finite number of seconds (a timeout, a bound on a wait): ConfigError otherwise."""
    seconds = float(check_range(name, value, 0, None, low_inclusive=False))
    if not math.isfinite(seconds):
        raise ConfigError(f"{name} must be a finite number of seconds, got {value!r}")
    return seconds


def check_int(name: str, value, low=None, high=None) -> int:
    """Raise ConfigError unless ``value`` is a whole number with low <= value <= high (bounds optional)."""
    try:
        number = None if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        number = None
    whole = number is not None and number.is_integer()
    inside = whole and (low is None or number >= low) and (high is None or number <= high)
    if not inside:
        span = {(False, False): f" in [{low}, {high}]", (False, True): f" >= {low}", (True, False): f" <= {high}",
                (True, True): ""}[(low is None, high is None)]
        raise ConfigError(f"{name} must be a whole number{span}, got {value!r}")
    return int(number)


MAX_K = 64  # upper bound on draft depth accepted from any K selector (and on any K-like count of a stage)


def check_k(name: str, k) -> int:
    """A draft depth or count a user sets (``k``, a proposer's depth): a whole number in [0, MAX_K]."""
    return check_int(name, k, 0, MAX_K)


def writable_folder(path) -> None:
    """Create the folder ``path`` and check a file can be written there: a clear error before the work whose
    results would go there, instead of a traceback after it."""
    from pathlib import Path

    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".mtpflow-write-test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"cannot write to {path}: {exc.strerror or exc}") from None


class PluginError(UserError):
    """A third-party plugin is broken: it cannot be imported, registers a hook that does not exist, or one of
    its hooks raised. The message names the plugin."""


def run_command(prog: str, run: Callable[[list[str]], int], argv: list[str] | None = None, usage: str | None = None,
                interrupted: str = "interrupted") -> int:
    """The frame every ``python -m mtpflow...`` command shares around ``run(argv)`` (which returns the exit
    status): ``-h``/``--help`` prints ``usage`` (when given) and exits 0; a ``UserError`` is one line
    ``prog: error: ...`` and exit 2; Ctrl-C one line ``prog: interrupted`` and exit 130; a reader that closed
    standard output (``| head``) a quiet exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if usage is not None and any(a in ("-h", "--help") for a in argv):
            print(usage)
            return 0
        return run(argv)
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\n{prog}: {interrupted}", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def debug_enabled() -> bool:
    """``MTPFLOW_DEBUG=1`` (or true/yes/on): a request's internal error reaches the caller as the original
    exception, traceback and all, instead of the one-line ``UserError``."""
    return os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def internal_cause(error: BaseException | None) -> BaseException | None:
    """The bug behind a failed request: the error itself when it is not a ``UserError`` (or a cancellation), the
    exception a third-party hook raised when the error is the ``PluginError`` naming it; None for the user's
    own mistakes."""
    if error is None or isinstance(error, (KeyboardInterrupt, GeneratorExit)):
        return None
    if not isinstance(error, UserError):
        return error
    cause = error.__cause__
    if isinstance(error, PluginError) and cause is not None and not isinstance(cause, UserError):
        return cause
    return None


def describe(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message`` (cut at ``limit`` characters), for one-line reports."""
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if len(first) > limit:
        first = first[: limit - 3] + "..."
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def traceback_text(error: BaseException) -> str:
    """The full traceback of ``error`` (its causes included), as Python prints it."""
    return "".join(traceback.format_exception(type(error), error, error.__traceback__))
