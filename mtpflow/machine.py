"""What this machine is and where mtpflow keeps what it measures on it: the cache folder (``cache_dir``,
``MTPFLOW_CACHE``), a measurement's or a build's path keyed by what it depends on (``measurement_path``), the CPU's
name and features (``cpu_name``, ``cpu_flags``, ``host_facts``).

The ground floor: it imports nothing from mtpflow, so the native kernel's build (``backends/native/kernel.py``) and
the tuning profile (``mtpflow.host``) both read it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

# CPU features that decide which kernels run (recorded in the profile, and keyed by the native build)
FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
         "avx_vnni", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve")


def cache_dir() -> Path:
    """Where mtpflow keeps converted models, traces and measurements (``MTPFLOW_CACHE`` overrides)."""
    root = os.environ.get("MTPFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mtpflow"
    )
    return Path(root)


def measurement_path(kind: str, *key) -> Path:
    """``cache_dir()/kind/<hash of key>.json``: where a measurement or build (CPU linear plans, the native kernel)
    keyed by ``key`` (JSON-serialisable) is kept."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / kind / f"{digest}.json"


def _cpuinfo_field(*names: str) -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.split(":", 1)[0].strip() in names:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, else ``platform``): measurements of CPU speed are kept per CPU."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The CPU features of FLAGS this CPU has (``/proc/cpuinfo``; empty where it cannot be read)."""
    have = set((_cpuinfo_field("flags", "Features") or "").split())
    return [f for f in FLAGS if f in have]


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def host_facts() -> dict:
    """What a profile records about the machine it was measured on."""
    import torch

    return {"cpu": cpu_name(), "flags": cpu_flags(), "cores": os.cpu_count() or 1, "threads": torch_threads(),
            "torch": torch.__version__}
