"""The manifest written beside every benchmark's CSVs and PNGs: which code (git commit, dirty flag), which
command, which host (CPU model and vector extensions, cores, threads, GPU and driver), which libraries and
which model a result came from, so a figure can always be traced to its run and compared only with runs
from the same host. ``docs/bench/README.md`` is generated from these files (``mtpflow.tools.tables``).

Everything here is read-only and tolerant: no git, no ``/proc/cpuinfo`` or no GPU gives ``null`` fields,
never an error.
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

SCHEMA = 1
NAME = "manifest.json"
# the fields every manifest has (tests/integration/test_bench_manifest.py checks them for each mode)
REQUIRED = ("schema", "mode", "date", "command", "argv", "git", "host", "gpu", "versions", "model",
            "profile_hash", "settings", "files")
CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "amx")


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a read-only command, or None when it is missing, fails or hangs."""
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=10, check=False,
                             env={**os.environ, "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"})
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info(folder: Path | None = None) -> dict:
    """Commit and dirty flag of the checkout that holds mtpflow (``null`` outside a git checkout). The dirty
    flag counts tracked files only: an untracked results folder does not make the code dirty. Read-only:
    ``--no-optional-locks`` keeps ``git status`` from refreshing the index of a tree others work in."""
    folder = folder or Path(__file__).resolve().parents[2]
    commit = _run(["git", "-C", str(folder), "rev-parse", "HEAD"])
    if not commit:
        return {"commit": None, "dirty": None, "describe": None}
    status = _run(["git", "--no-optional-locks", "-C", str(folder), "status", "--porcelain",
                   "--untracked-files=no"])
    return {"commit": commit, "dirty": None if status is None else bool(status),
            "describe": _run(["git", "-C", str(folder), "log", "-1", "--format=%h %cs %s"])}


def cpu_info(cpuinfo: str | None = None) -> dict:
    """CPU model and the vector extensions the kernels care about, from ``/proc/cpuinfo`` (Linux); on other
    systems the model from ``platform`` and unknown (``null``) flags."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            cpuinfo = ""
    model, flags = None, None
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model is None:
            model = value.strip()
        elif key in ("flags", "Features") and flags is None:
            flags = set(value.split())
    if flags is None:
        found = {name: None for name in CPU_FLAGS}
    else:
        found = {name: (any(f.startswith("amx") for f in flags) if name == "amx" else name in flags)
                 for name in CPU_FLAGS}
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {"model": model or platform.processor() or None, "flags": found, "logical_cpus": os.cpu_count(),
            "usable_cpus": usable, "machine": platform.machine()}


def gpu_info(device) -> dict | None:
    """Name, driver and CUDA runtime of the GPU a run used; None when it ran on the CPU."""
    if device is None or "cuda" not in str(device):
        return None
    import torch

    try:
        index = torch.device(str(device)).index or 0
        name = torch.cuda.get_device_name(index)
    except Exception:  # noqa: BLE001 - a manifest never fails the run it describes
        name = None
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    return {"name": name, "driver": driver.splitlines()[0].strip() if driver else None,
            "cuda_runtime": getattr(torch.version, "cuda", None)}


def versions() -> dict:
    from importlib import metadata

    found = {}
    for package in ("mtpflow", "torch", "transformers", "triton"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    found["python"] = platform.python_version()
    return found


def profile_hash() -> str | None:
    """The tuning profile's hash (``mtpflow.host.profile_hash``) where this checkout has one."""
    try:
        from mtpflow.host import profile_hash as host_profile_hash
    except ImportError:
        return None
    try:
        value = host_profile_hash()
    except Exception:  # noqa: BLE001 - no profile yet, or one that cannot be read: the manifest says null
        return None
    return None if value is None else str(value)


def file_record(path: Path) -> dict:
    data = Path(path).read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def model_facts(cfg=None, loaded=None, name=None) -> dict:
    """Model, dtype, device and backend from a composed config and / or a loaded model."""
    m = cfg.model if cfg is not None else None
    return {
        "name": str(m.get("name")) if m is not None and m.get("name") is not None else name,
        "id": getattr(loaded, "model_id", None),
        "dtype": str(loaded.dtype).replace("torch.", "") if loaded is not None else (
            str(m.get("dtype", "auto")) if m is not None else None),
        "device": str(loaded.device) if loaded is not None else (str(m.get("device", "auto")) if m is not None
                                                                 else None),
        "backend": str(m.get("backend", "auto")) if m is not None else "auto",
        "quantize": None if m is None or m.get("quantize") is None else str(m.get("quantize")),
    }


def collect(mode: str, bench_args: list[str], *, model: dict | None = None, settings: dict | None = None,
            device=None, extra: dict | None = None) -> dict:
    """The manifest of a run (files are added by ``write``). ``bench_args``: the arguments the bench command
    got; ``command`` is the command line that reproduces the run, ``argv`` the process's own."""
    import torch

    manifest = {
        "schema": SCHEMA,
        "mode": mode,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["python", "-m", "mtpflow.bench", *[str(a) for a in bench_args]]),
        "argv": [str(a) for a in sys.argv],
        "git": git_info(),
        "host": {"cpu": cpu_info(), "torch_threads": torch.get_num_threads(), "os": platform.platform()},
        "gpu": gpu_info(device),
        "versions": versions(),
        "model": model or {},
        "profile_hash": profile_hash(),
        "settings": settings or {},
        "files": {},
    }
    manifest.update(extra or {})
    return manifest


def write(folder, manifest: dict, files: list[str]) -> Path:
    """``manifest.json`` in ``folder`` with a size and SHA-256 for each result file (names relative to
    ``folder``), so a CSV edited after its run no longer matches the manifest it names."""
    folder = Path(folder)
    manifest = {**manifest, "files": {name: file_record(folder / name) for name in files}}
    path = folder / NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def load(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def host_line(manifest: dict) -> str:
    """One line naming the host: CPU model, usable cores, the vector extensions found, the GPU if any."""
    host = manifest.get("host") or {}
    cpu = host.get("cpu") or {}
    model = cpu.get("model") or cpu.get("model_hint") or "an unrecorded CPU"
    flags = cpu.get("flags") or {}
    named = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_vnni": "VNNI", "amx": "AMX"}
    have = [named[f] for f in CPU_FLAGS if flags.get(f)]
    if flags.get("avx512f") and "AVX2" in have:
        have.remove("AVX2")  # AVX-512 hosts have AVX2: name the wider one
    cores = cpu.get("usable_cpus")
    parts = [f"{cores} cores" if cores else None, " + ".join(have) if have else None]
    text = f"{model} ({', '.join(p for p in parts if p)})" if any(parts) else model
    gpu = manifest.get("gpu")
    if gpu and gpu.get("name"):
        text += f", {gpu['name']}" + (f" (driver {gpu['driver']})" if gpu.get("driver") else "")
    return text
