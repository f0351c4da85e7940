"""Per-token traces of every decode: the SQLite store, the recorder plugin that fills it, metrics computed
from it (Prometheus exposition included) and the ``python -m mtpflow.traces`` command."""
from mtpflow.traces.store import TraceStore, default_db_path

__all__ = ["TraceStore", "default_db_path"]
