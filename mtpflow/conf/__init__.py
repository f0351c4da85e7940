"""The packaged Hydra configs (``config.yaml`` and its groups); ``conf_dir`` finds them."""
from __future__ import annotations

from pathlib import Path


def conf_dir() -> Path:
    """The packaged ``mtpflow/conf/`` folder."""
    path = Path(__file__).resolve().parent
    if not (path / "config.yaml").exists():
        raise RuntimeError("mtpflow's conf/ folder is missing from the installation")
    return path
