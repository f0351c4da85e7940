"""The native small-batch linear (``small_gemm.c``) for multi-row CPU verify forwards.

Why: on a CPU a verify forward of 1 + K rows is bound by reading the weights, yet MKL's and oneDNN's
float32 paths for 2 to 17 rows read them far slower than for one row (on the 2-core Intel Xeon this was
built on, whole-model forwards of SmolLM2-135M, fastest of 7, best of MKL / oneDNN vs these kernels: 5 rows
49 vs 36 ms, 9 rows 54 vs 47 ms, 17 rows 97 vs 76 ms; one row about 33 ms). Up to ``panel_min_rows() - 1``
rows the kernel reads each weight row once for all input rows and prefetches the next rows while it
computes; from ``panel_min_rows()`` rows (6 on AVX-512, 3 on AVX2), a second kernel runs over a copy of
the weight laid out in panels (``pack_panels``, built on first use by the caller); see the C file for how.

How: the C source ships in the package and is compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``; ``-O3 -march=native -fopenmp``) into ``~/.cache/mtpflow/native``, keyed by the
source, the compiler and the CPU, then loaded with ctypes. Where there is no compiler, or the build fails,
``available()`` is False and every caller keeps the MKL / oneDNN paths (``cpu_linear`` never offers the
``native`` plan). ``MTPFLOW_NATIVE=0`` turns it off. The pure-torch reference is ``F.linear``.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("small_gemm.c")
PANEL = 64  # output features per panel (small_gemm.c)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cc: str, out: Path, flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> bool:
    """Compile ``source`` (SOURCE, or another version of it to compare) into the shared library ``out``; False
    when the compiler fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", str(tmp)], capture_output=True, timeout=120)
        if done.returncode != 0:
            return False
        tmp.replace(out)  # atomic: a concurrent process loads a whole library or builds its own
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        tmp.unlink(missing_ok=True)


def source_hash() -> str:
    """The kernels' version: part of every cache key whose measurement depends on them."""
    return hashlib.sha1(SOURCE.read_bytes()).hexdigest() if SOURCE.exists() else ""


def build_path(cc: str) -> Path | None:
    """Where the build for compiler ``cc`` on this CPU is cached (None when ``cc`` cannot even report its
    version)."""
    from mtpflow.kernels.cpu_linear import cpu_name
    from mtpflow.model import measurement_path

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return measurement_path("native", source_hash(), cc, version.splitlines()[:1], cpu_name(), FLAGS).with_suffix(".so")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached on disk), or None where they cannot be built."""
    if os.environ.get("MTPFLOW_NATIVE", "1") == "0":
        return None
    cc = compiler()
    path = build_path(cc) if cc is not None and SOURCE.exists() else None
    if path is None:
        return None
    for attempt in range(2):
        if not path.exists() and not build(cc, path):
            return None
        try:
            return load(path)
        except (OSError, AttributeError):  # a damaged cached build: build it again, once
            path.unlink(missing_ok=True)
    return None


def load(path: Path) -> ctypes.CDLL:
    """Open a build of SOURCE and declare its functions' signatures."""
    lib = ctypes.CDLL(str(path))
    for fn in (lib.mtpflow_small_gemm, lib.mtpflow_panel_gemm):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        fn.restype = None
    lib.mtpflow_small_gemm_q8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.mtpflow_small_gemm_q8.restype = None
    lib.mtpflow_vector_width.restype = ctypes.c_int
    lib.mtpflow_panel_min_rows.restype = ctypes.c_int
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.mtpflow_llama_rows.argtypes = ([ptr, ptr] + [i32] * 7 + [ptr] * 11 + [ctypes.c_float, ptr, ptr, ctypes.c_long]
                                       + [ptr] * 6 + [i32, ptr, ptr, ctypes.c_float, i32] + [ptr] * 8)
    lib.mtpflow_llama_rows.restype = i32
    return lib


def available() -> bool:
    return library() is not None


@functools.lru_cache(maxsize=None)
def panel_min_rows(lib: ctypes.CDLL | None = None) -> int:
    """From how many rows the panel kernel runs (where the caller has panels): the build's own threshold
    (``PANEL_MIN_ROWS`` in small_gemm.c: 1 with AVX-512, 3 with 8-float vectors)."""
    lib = library() if lib is None else lib
    return lib.mtpflow_panel_min_rows() if lib is not None else 0


def rows_enabled() -> bool:
    """Whether verify forwards may go through ``mtpflow_llama_rows`` (``mtpflow.forward.native_rows``): the
    kernels build here and ``MTPFLOW_NATIVE_ROW`` is not ``0``; read per forward, so a process can switch."""
    return os.environ.get("MTPFLOW_NATIVE_ROW", "1") != "0" and available()


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (out x in) as ceil(out / PANEL) panels of in x PANEL (zero rows past ``out``): the panel
    kernel's layout, one more copy of the weight."""
    n, k = weight.shape
    padded = torch.zeros(-(-n // PANEL) * PANEL, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def _operands(x: torch.Tensor, bias: torch.Tensor | None, n: int):
    """What every kernel call takes besides the weight: contiguous x, the bias pointer (or None), the output
    [..., n] allocated in its final shape, and the rows m, outputs n and inputs k."""
    if not x.is_contiguous():
        x = x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    k = x.shape[-1]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    return x, (None if bias is None else bias.data_ptr()), y, x.numel() // k, n, k


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           panels: torch.Tensor | None = None, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors through the native kernels (x: ``(..., in)``);
    with ``panels`` (``pack_panels(weight)``) and at least ``panel_min_rows()`` rows, the panel kernel. Callers
    check ``available()`` first. Called for every linear of a verify forward (211 per forward of the default
    model), so it allocates the output in its final shape and does nothing it can skip."""
    if not weight.is_contiguous():
        weight = weight.contiguous()
    x, bias_ptr, y, m, n, k = _operands(x, bias, weight.shape[0])
    lib = library() if lib is None else lib
    if panels is not None and m >= panel_min_rows(lib):
        lib.mtpflow_panel_gemm(x.data_ptr(), panels.data_ptr(), bias_ptr, y.data_ptr(), m, n, k,
                               torch.get_num_threads())
    else:
        lib.mtpflow_small_gemm(x.data_ptr(), weight.data_ptr(), bias_ptr, y.data_ptr(), m, n, k,
                               torch.get_num_threads())
    return y


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-feature int8 of a float weight (out x in): (q int8 [out, in], scale float32 [out])
    with ``weight ~= q * scale[:, None]``; a row of zeros gets scale 1 (q = 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8).contiguous()
    return q, scale.contiguous()


def linear_int8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """``F.linear(x, q * scale[:, None], bias)`` for float32 CPU ``x`` over int8 weights ``q`` [out, in] and
    float32 ``scale`` [out] (``quantize_int8``): the weight-only int8 kernel, every row count. Callers check
    ``available()`` first."""
    x, bias_ptr, y, m, n, k = _operands(x, bias, q.shape[0])
    lib = library() if lib is None else lib
    lib.mtpflow_small_gemm_q8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), bias_ptr, y.data_ptr(), m, n, k,
                              torch.get_num_threads())
    return y
