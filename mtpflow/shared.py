"""State shared on purpose between the requests of one engine (a suffix cache across requests, calibration).

Everything else a stage holds belongs to one sequence: the engine builds stage objects per sequence. What is
shared is named, created once by ``SharedState.get`` and must be thread-safe and bounded itself.
"""
from __future__ import annotations

import threading
from typing import Any, Callable


class SharedState:
    """A named registry of objects shared across requests; ``get`` creates each one once, thread-safely."""

    def __init__(self) -> None:
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self, name: str, factory: Callable[[], Any]) -> Any:
        """The object registered as ``name``, made with ``factory()`` the first time it is asked for."""
        with self._lock:
            if name not in self._items:
                self._items[name] = factory()
            return self._items[name]

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._items)

    def clear(self, keep: Callable[[str], bool] | None = None) -> None:
        """Forget every shared object (the next request starts them afresh), but those whose name ``keep`` holds
        true for; requests running keep theirs."""
        with self._lock:
            for name in [n for n in self._items if keep is None or not keep(n)]:
                del self._items[name]


# names of shared objects made from the model, not learned from requests (prepared draft heads, the int8 draft
# model): a benchmark that clears what requests taught (first-time requests) keeps these, so no pass times making them
PREPARED_PREFIXES = ("heads:", "int8_model:")


def prepared(name: str) -> bool:
    """Whether the shared object ``name`` was made from the model rather than learned (``PREPARED_PREFIXES``)."""
    return name.startswith(PREPARED_PREFIXES)
