"""The native small-batch linear (``small_gemm.c``) for multi-row CPU verify forwards.

Why: on a CPU a verify forward of 1 + K rows is bound by reading the weights, yet MKL's and oneDNN's
float32 paths for 2 to 17 rows read them far slower than for one row, and these kernels beat them there
(measured: docs/bench/code-figures.md#native_linear-module-docstring). Up to ``panel_min_rows() - 1``
rows the kernel reads each weight row once for all input rows and prefetches the next rows while it
computes; from ``panel_min_rows()`` rows (``PANEL_MIN_ROWS`` in the C file: 1 on AVX-512, 3 on AVX2), a
second kernel runs over a copy of the weight laid out in panels (``pack_panels``, built on first use by the
caller); see the C file for how.

How: the C source ships in the package and is compiled on first use with the system C compiler
(``$CC``, else ``cc``/``gcc``; ``-O3 -march=native -fopenmp``) into ``~/.cache/mtpflow/native``, keyed by the
source, the compiler and the CPU, then loaded with ctypes. Where there is no compiler, or the build fails,
``available()`` is False and the ``native_cpu`` backend does not apply (``model.backend=auto`` runs ``hf``). ``MTPFLOW_NATIVE=0`` turns it off. The pure-torch reference is ``F.linear``
(``native_reference`` holds every entry point's).

``mtpflow_llama_rows`` takes one versioned struct (``struct mtpflow_rows_args``), mirrored here once as
``RowsArgs`` and filled by ``llama_rows``; ``load`` refuses a build whose ABI version or struct size differs from
the mirror's, with one line.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from mtpflow.errors import UserError

SOURCE = Path(__file__).with_name("small_gemm.c")
PANEL = 64  # output features per panel (small_gemm.c)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# builds for a fixed instruction set (the harness, tests/kernels/test_native_harness.py, builds each one this CPU
# runs): their -march flags, and the /proc/cpuinfo flags a CPU needs to run them. small_gemm.c takes 16-float
# vectors where the compiler targets AVX-512 (__AVX512F__), else 8-float ones; the generic build is plain x86-64
# (SSE2: its 8-float vectors compile to pairs of 4-float operations).
ISA_FLAGS = {"generic": ("-march=x86-64", "-mtune=generic"), "avx2": ("-march=haswell",),
             "avx512": ("-march=skylake-avx512",)}
ISA_CPU_FLAGS = {"generic": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl")}


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


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the ``flags`` line of /proc/cpuinfo; empty where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def runnable_isas() -> tuple[str, ...]:
    """The ``ISA_FLAGS`` builds this CPU can run (none off x86-64, where those flags do not apply)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return ()
    have = cpu_flags()
    return tuple(isa for isa, need in ISA_CPU_FLAGS.items() if have.issuperset(need))


def build_variant(isa: str, out: Path, cc: str | None = None, source: Path = SOURCE) -> bool:
    """Compile ``source`` for instruction set ``isa`` (a key of ``ISA_FLAGS``) into ``out``; False when there is no
    compiler or it fails. Whether this CPU can run the result is ``runnable_isas``' question."""
    cc = cc or compiler()
    if cc is None:
        return False
    return build(cc, out, ("-O3", *ISA_FLAGS[isa], "-fopenmp", "-shared", "-fPIC"), source)


def source_hash() -> str:
    """The kernels' version: part of every cache key whose measurement depends on them."""
    return hashlib.sha1(SOURCE.read_bytes()).hexdigest() if SOURCE.exists() else ""


def build_path(cc: str) -> Path | None:
    """Where the build for compiler ``cc`` on this CPU is cached (None when ``cc`` cannot even report its
    version)."""
    from mtpflow.host import cpu_name, measurement_path

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
    # a build that is no shared library (one cut short) is built again, once; one that loads but has another ABI is
    # not ours (the path is keyed by the source's hash): load's one-line UserError propagates rather than a silent
    # fall back to the slower paths
    for attempt in range(2):
        if not path.exists() and not build(cc, path):
            return None
        try:
            return load(path)
        except OSError:
            path.unlink(missing_ok=True)
    return None


def pointers(tensors) -> ctypes.Array:
    """A C array of the tensors' data pointers (a struct member of type ``const T *const *``)."""
    return (ctypes.c_void_p * len(tensors))(*[t.data_ptr() for t in tensors])


class PoolPointers:
    """The pointer arrays of a KV pool's per-layer key and value buffers, made again only when the pool grows (its
    buffers are then new tensors)."""

    def __init__(self):
        self._held = (None, None, None)  # (the pool's key list, key pointers, value pointers)

    def __call__(self, pool) -> tuple[ctypes.Array, ctypes.Array]:
        keys, k, v = self._held
        if keys is not pool.keys:
            k, v = pointers(pool.keys), pointers(pool.values)
            self._held = (pool.keys, k, v)
        return k, v


ROWS_ABI = 1  # MTPFLOW_ROWS_ABI in small_gemm.c, of the struct RowsArgs mirrors: change both together
ROWS_BAD_ABI = -2  # what mtpflow_llama_rows returns for a struct of another version or size (MTPFLOW_ROWS_BAD_ABI)


class RowsArgs(ctypes.Structure):
    """``struct mtpflow_rows_args`` of small_gemm.c, member for member (names, order, types): the one mirror of it.
    Every pointer is a ``c_void_p`` (``llama_rows`` passes tensors' ``data_ptr()`` and ctypes pointer arrays)."""

    _fields_ = [("version", ctypes.c_int), ("size", ctypes.c_int),
                ("h", ctypes.c_void_p), ("normed", ctypes.c_void_p),
                *[(name, ctypes.c_int) for name in ("M", "L", "H", "nh", "nkv", "d", "I")],
                *[(name, ctypes.c_void_p) for name in ("ln1", "wqkv", "wo", "ln2", "wgu", "wd",
                                                        "pqkv", "po", "pgu", "pd", "norm_w")],
                ("eps", ctypes.c_float),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("cap", ctypes.c_long),
                *[(name, ctypes.c_void_p) for name in ("slot", "wpos", "prefix", "first", "count", "allowed")],
                ("qmax", ctypes.c_int),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int),
                *[(name, ctypes.c_void_p) for name in ("qqkv", "sqkv", "qo", "so", "qgu", "sgu", "qd", "sd")]]


ROWS_VALUES = len(RowsArgs._fields_) - 2  # what llama_rows takes after the library: every member but version, size


def llama_rows(lib: ctypes.CDLL, *values) -> int:
    """``mtpflow_llama_rows`` over ``values``: the struct's members after version and size, in their order (h,
    normed, M, L, H, nh, nkv, d, I, ln1 ... sd; tensors' addresses, ctypes pointer arrays, None for NULL). Returns
    the function's code: 0, -1 out of memory (``ROWS_BAD_ABI`` cannot happen for a build ``load`` accepted)."""
    if len(values) != ROWS_VALUES:
        raise TypeError(f"llama_rows takes {ROWS_VALUES} values, got {len(values)}")
    args = RowsArgs(ROWS_ABI, ctypes.sizeof(RowsArgs),
                    *[ctypes.addressof(v) if isinstance(v, ctypes.Array) else v for v in values])
    return lib.mtpflow_llama_rows(ctypes.byref(args))


W8A8_ABI = 1  # MTPFLOW_W8A8_ABI in small_gemm.c, of the struct W8A8Args mirrors: change both together


class W8A8Args(ctypes.Structure):
    """``struct mtpflow_w8a8_args`` of small_gemm.c (the int8 model's rows), member for member: its one mirror."""

    _fields_ = [("version", ctypes.c_int), ("size", ctypes.c_int),
                ("h", ctypes.c_void_p), ("normed", ctypes.c_void_p), ("taps", ctypes.c_void_p),
                *[(name, ctypes.c_int) for name in ("M", "L", "H", "nh", "nkv", "d", "I", "kp_h", "kp_q", "kp_i")],
                *[(name, ctypes.c_void_p) for name in ("ln1", "ln2", "wqkv", "wo", "wgu", "wd", "sqkv", "so", "sgu",
                                                        "sd", "zqkv", "zo", "zgu", "zd", "norm_w")],
                ("eps", ctypes.c_float),
                ("kc", ctypes.c_void_p), ("vc", ctypes.c_void_p),
                ("cap", ctypes.c_long),
                *[(name, ctypes.c_void_p) for name in ("slot", "wpos", "prefix", "count", "allowed")],
                ("qmax", ctypes.c_int),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("scale", ctypes.c_float), ("threads", ctypes.c_int),
                ("head_q", ctypes.c_void_p), ("head_s", ctypes.c_void_p), ("head_z", ctypes.c_void_p),
                ("vocab", ctypes.c_int), ("head_from", ctypes.c_int), ("logits", ctypes.c_void_p)]


def w8a8_rows(lib: ctypes.CDLL, **members) -> int:
    """``mtpflow_w8a8_rows`` over ``members`` (every member of ``W8A8Args`` but version and size, by name; ctypes
    pointer arrays are passed by address). Returns 0, or -1 when out of memory."""
    given = {k: ctypes.addressof(v) if isinstance(v, ctypes.Array) else v for k, v in members.items()}
    args = W8A8Args(version=W8A8_ABI, size=ctypes.sizeof(W8A8Args), **given)
    return lib.mtpflow_w8a8_rows(ctypes.byref(args))


def load(path: Path) -> ctypes.CDLL:
    """Open a build of SOURCE and declare its functions' signatures. A build of another ``mtpflow_llama_rows``
    ABI (version or struct size), or one without the functions, is refused with a one-line UserError; one that
    is not a shared library raises OSError."""
    lib = ctypes.CDLL(str(path))
    mine = f"v{ROWS_ABI} ({ctypes.sizeof(RowsArgs)} bytes)"
    try:
        lib.mtpflow_rows_abi.restype = lib.mtpflow_rows_args_size.restype = ctypes.c_int
        lib.mtpflow_rows_abi.argtypes = lib.mtpflow_rows_args_size.argtypes = []
    except AttributeError:
        raise UserError(f"native kernel {path} has no ABI version (built before the versioned entry point), "
                        f"this mtpflow expects {mine}: delete it to rebuild") from None
    abi, size = lib.mtpflow_rows_abi(), lib.mtpflow_rows_args_size()
    if (abi, size) != (ROWS_ABI, ctypes.sizeof(RowsArgs)):
        raise UserError(f"native kernel {path} has ABI v{abi} ({size} bytes), this mtpflow expects {mine}: "
                        "delete it to rebuild")
    try:
        lib.mtpflow_w8a8_abi.restype = lib.mtpflow_w8a8_args_size.restype = ctypes.c_int
        w8a8 = (lib.mtpflow_w8a8_abi(), lib.mtpflow_w8a8_args_size())
    except AttributeError:
        w8a8 = None
    if w8a8 != (W8A8_ABI, ctypes.sizeof(W8A8Args)):
        raise UserError(f"native kernel {path} has int8 rows ABI {w8a8}, this mtpflow expects "
                        f"{(W8A8_ABI, ctypes.sizeof(W8A8Args))}: delete it to rebuild")
    try:
        _declare(lib)
    except AttributeError as missing:
        raise UserError(f"native kernel {path} lacks a function ({missing}), this mtpflow expects {mine}: "
                        "delete it to rebuild") from None
    return lib


def _declare(lib: ctypes.CDLL) -> None:
    for fn in (lib.mtpflow_small_gemm, lib.mtpflow_panel_gemm):
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
        fn.restype = None
    lib.mtpflow_small_gemm_q8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4
    lib.mtpflow_small_gemm_q8.restype = None
    lib.mtpflow_vector_width.restype = ctypes.c_int
    lib.mtpflow_panel_min_rows.restype = ctypes.c_int
    lib.mtpflow_llama_rows.argtypes = [ctypes.POINTER(RowsArgs)]
    lib.mtpflow_llama_rows.restype = ctypes.c_int
    lib.mtpflow_w8a8_rows.argtypes = [ctypes.POINTER(W8A8Args)]
    lib.mtpflow_w8a8_rows.restype = ctypes.c_int
    lib.mtpflow_gemm_w8a8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 5
    lib.mtpflow_gemm_w8a8.restype = ctypes.c_int
    lib.mtpflow_q8_isa.restype = ctypes.c_int


def available() -> bool:
    return library() is not None


@functools.lru_cache(maxsize=None)
def panel_min_rows(lib: ctypes.CDLL | None = None) -> int:
    """From how many rows the panel kernel runs (where the caller has panels): the build's own threshold
    (``PANEL_MIN_ROWS`` in small_gemm.c: 1 with AVX-512, 3 with 8-float vectors)."""
    lib = library() if lib is None else lib
    return lib.mtpflow_panel_min_rows() if lib is not None else 0


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


Q8_STEP = 64  # Q8_STEP in small_gemm.c: the int8 model's weight rows are padded with zeros to a multiple of it
Q8_NB = 4  # Q8_NB in small_gemm.c: weight rows per packed block
Q8_ISAS = {0: "plain C", 1: "AVX-512 VNNI", 2: "AVX2"}  # mtpflow_q8_isa()


def q8_isa(lib: ctypes.CDLL | None = None) -> str:
    """What computes the int8 model's dot products in this build (``Q8_ISAS``)."""
    lib = library() if lib is None else lib
    return Q8_ISAS[lib.mtpflow_q8_isa()]


def pack_q8(q: torch.Tensor) -> torch.Tensor:
    """int8 weights [N, K] as the W8A8 kernel reads them: zero columns up to kp (a multiple of Q8_STEP), zero rows
    up to a multiple of Q8_NB, each block of Q8_NB rows laid out [kp / Q8_STEP][Q8_NB][Q8_STEP] (so a block is one
    sequential read). Returns [blocks, kp / Q8_STEP, Q8_NB, Q8_STEP]."""
    n, k = q.shape
    kp, np_ = -(-k // Q8_STEP) * Q8_STEP, -(-n // Q8_NB) * Q8_NB
    padded = torch.nn.functional.pad(q, (0, kp - k, 0, np_ - n))
    return padded.view(np_ // Q8_NB, Q8_NB, kp // Q8_STEP, Q8_STEP).transpose(1, 2).contiguous()


def unpack_q8(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The weights [n, k] that ``pack_q8`` packed."""
    blocks, steps, nb, step = packed.shape
    return packed.transpose(1, 2).reshape(blocks * nb, steps * step)[:n, :k]


def gemm_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, wsum: torch.Tensor, k: int,
              lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The int8 model's product (``int8_reference.linear``): float32 ``x`` [..., k], the packed int8 weight ``q``
    (``pack_q8``), float32 ``scale`` [N], int32 ``wsum`` [N] (the weight rows' sums). Callers check
    ``available()``."""
    lib = library() if lib is None else lib
    x = x.contiguous()
    n = int(scale.numel())
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    kp = q.shape[1] * q.shape[3]
    if lib.mtpflow_gemm_w8a8(x.data_ptr(), q.data_ptr(), scale.data_ptr(), wsum.data_ptr(), y.data_ptr(),
                             x.numel() // k, n, k, kp, torch.get_num_threads()) != 0:
        raise MemoryError("mtpflow_gemm_w8a8: out of memory")
    return y
