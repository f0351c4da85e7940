"""mtpflow's native CPU kernel, seen from Python: how it is built and loaded, and the one mirror of each struct its
entry points take.

The C sources (``gemm.c``: the float products and their entry point; ``w8a8.c``: the int8 model's; ``rows_float.c``
and ``rows_int8.c``: a float32 and the int8 model's decoder stacks; ``logit_stats.c``: what a verify step reads from
its logits; ``native.h``, ``rows_common.h``) ship in the package and are compiled on first use with the system C
compiler (``$CC``, else ``cc``/``gcc``; ``-O3 -march=native -fopenmp``) into one library under
``~/.cache/mtpflow/native``, keyed by the sources, the compiler and the CPU, then loaded with ctypes. Where there is
no compiler, or the build fails, ``available()`` is False and the native backend does not apply
(``model.backend=auto`` runs ``hf`` and says why).

Every entry point takes one versioned struct: ``mtpflow_linear`` (``LinearArgs``: every product kind),
``mtpflow_llama_rows`` (``RowsArgs``: a float32 model's verify rows), ``mtpflow_w8a8_rows`` (``W8A8Args``: the
int8 model's) and ``mtpflow_logit_stats`` (``LogitStatsArgs``: each verify row's argmax, log-normalizer and top
ids). Each is mirrored here once and filled by keyword (``linear``/``llama_rows``/``w8a8_rows``/``logit_stats``);
``load`` refuses a build whose ABI version or struct size differs from a mirror's, with one line. What the
products compute, and the torch-side layouts they read (panels, packed int8), are ``products``'.
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

HERE = Path(__file__).parent
# the translation units of the one library (native.h and rows_common.h are included by them)
SOURCES = tuple(HERE / name for name in ("gemm.c", "w8a8.c", "rows_float.c", "rows_int8.c", "logit_stats.c"))
HEADERS = tuple(HERE / name for name in ("native.h", "rows_common.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")
# builds for a fixed instruction set (the harness, tests/kernels/test_native_harness.py, builds each one this CPU
# runs): their -march flags, and the /proc/cpuinfo flags a CPU needs to run them. the kernel takes 16-float
# vectors where the compiler targets AVX-512 (__AVX512F__), else 8-float ones; the generic build is plain x86-64
# (SSE2: its 8-float vectors compile to pairs of 4-float operations).
ISA_FLAGS = {"generic": ("-march=x86-64", "-mtune=generic"), "avx2": ("-march=haswell",),
             "avx512": ("-march=skylake-avx512",)}
ISA_CPU_FLAGS = {"generic": (), "avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl")}


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(cc: str, out: Path, flags: tuple[str, ...] = FLAGS, sources: tuple[Path, ...] = SOURCES) -> bool:
    """Compile ``sources`` (SOURCES, or other versions of them to compare; the headers are found beside this
    module) into the shared library ``out``; False when the compiler fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}.so")
    try:
        done = subprocess.run([cc, *flags, "-I", str(HERE), *map(str, sources), "-o", str(tmp)], capture_output=True,
                              timeout=300)
        if done.returncode != 0:
            return False
        tmp.replace(out)  # atomic: a concurrent process loads a whole library or builds its own
        return True
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        tmp.unlink(missing_ok=True)


def build_replacing(out: Path, name: str, text: str, cc: str | None = None, flags: tuple[str, ...] = FLAGS) -> bool:
    """The library with the source ``name`` (one of SOURCES) replaced by ``text``, into ``out`` (the edited source
    written beside it): A/B builds of one file's variants, and the tests' edited builds. False when it fails."""
    cc = cc or compiler()
    if cc is None:
        return False
    edited = out.parent / f"{out.stem}-{name}"
    edited.parent.mkdir(parents=True, exist_ok=True)
    edited.write_text(text)
    return build(cc, out, flags, tuple(edited if p.name == name else p for p in SOURCES))


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


def build_variant(isa: str, out: Path, cc: str | None = None, sources: tuple[Path, ...] = SOURCES) -> bool:
    """Compile ``sources`` for instruction set ``isa`` (a key of ``ISA_FLAGS``) into ``out``; False when there is no
    compiler or it fails. Whether this CPU can run the result is ``runnable_isas``' question."""
    cc = cc or compiler()
    if cc is None:
        return False
    return build(cc, out, ("-O3", *ISA_FLAGS[isa], "-fopenmp", "-shared", "-fPIC"), sources)


def source_hash() -> str:
    """The kernels' version: part of every cache key whose measurement depends on them."""
    digest = hashlib.sha1()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build_path(cc: str) -> Path | None:
    """Where the build for compiler ``cc`` on this CPU is cached (None when ``cc`` cannot even report its
    version)."""
    from mtpflow.machine import cpu_name, measurement_path

    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return measurement_path("native", source_hash(), cc, version.splitlines()[:1], cpu_name(), FLAGS).with_suffix(".so")


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, then cached on disk), or None where they cannot be built."""
    cc = compiler()
    path = build_path(cc) if cc is not None else None
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


BAD_ABI = -2  # what an entry point returns for a struct of another version or size (MTPFLOW_ROWS_BAD_ABI)


def _members(*spec) -> list[tuple[str, type]]:
    """ctypes fields from (type, names...) groups: every pointer a ``c_void_p`` (callers pass tensors'
    ``data_ptr()``, ctypes pointer arrays or None for NULL)."""
    return [(name, kind) for kind, *names in spec for name in names]


INT, FLOAT, LONG, PTR = ctypes.c_int, ctypes.c_float, ctypes.c_long, ctypes.c_void_p


class LinearArgs(ctypes.Structure):
    """``struct mtpflow_linear_args`` of gemm.c, member for member (names, order, types): its one mirror."""
    _fields_ = _members((INT, "version", "size", "kind", "M", "N", "K", "kp", "threads"),
                        (PTR, "x", "w", "panels", "b", "q", "scale", "wsum", "y"))


# the members both rows structs hold after their own weights, in order (MTPFLOW_DESCRIPTION_MEMBERS, rows_common.h)
_DESCRIPTION = ((PTR, "post_attn", "post_mlp", "qn", "kn", "bqkv", "bo", "bgu", "bd", "window", "cos", "sin"),
                (INT, "rot", "act"), (FLOAT, "softcap"), (PTR, "norm_w"), (FLOAT, "eps"), (PTR, "kc", "vc"),
                (LONG, "cap"), (PTR, "slot", "wpos", "prefix", "first", "count", "pos", "allowed"), (INT, "qmax"),
                (FLOAT, "scale"), (INT, "threads"))


class RowsArgs(ctypes.Structure):
    """``struct mtpflow_rows_args`` of rows_float.c (a float32 model's verify rows), member for member: its one
    mirror."""
    _fields_ = _members((INT, "version", "size"), (PTR, "h", "normed", "taps"),
                        (INT, "M", "L", "H", "nh", "nkv", "d", "I"),
                        (PTR, "ln1", "wqkv", "wo", "ln2", "wgu", "wd", "pqkv", "po", "pgu", "pd"),
                        *_DESCRIPTION,
                        (PTR, "qqkv", "sqkv", "qo", "so", "qgu", "sgu", "qd", "sd"))


class W8A8Args(ctypes.Structure):
    """``struct mtpflow_w8a8_args`` of rows_int8.c (the int8 model's rows), member for member: its one mirror."""
    _fields_ = _members((INT, "version", "size"), (PTR, "h", "normed", "taps"),
                        (INT, "M", "L", "H", "nh", "nkv", "d", "I", "kp_h", "kp_q", "kp_i"),
                        (PTR, "ln1", "ln2", "wqkv", "wo", "wgu", "wd", "sqkv", "so", "sgu", "sd", "zqkv", "zo", "zgu",
                         "zd"),
                        *_DESCRIPTION, (PTR, "head_q", "head_s", "head_z"),
                        (INT, "vocab", "head_from"), (PTR, "logits"))


class W8A8GreedyArgs(ctypes.Structure):
    """``struct mtpflow_w8a8_greedy_args`` of rows_int8.c (the int8 model's greedy loop over ``W8A8Args`` rows, one per
    step), member for member: its one mirror."""
    _fields_ = _members((INT, "version", "size"), (PTR, "rows"), (INT, "steps", "token"), (PTR, "out", "embed"),
                        (FLOAT, "embed_scale"))


class LogitStatsArgs(ctypes.Structure):
    """``struct mtpflow_logit_stats_args`` of logit_stats.c (each verify row's argmax, log-normalizer and top ids),
    member for member: its one mirror."""
    _fields_ = _members((INT, "version", "size", "rows", "vocab", "threads", "top"), (LONG, "stride"),
                        (PTR, "logits", "argmax", "log_norm", "top_ids"))


# each entry point: (C function, its struct's mirror, the ABI version both sides must agree on: MTPFLOW_*_ABI in
# the C file beside the struct; change both together). The C side reports its own through mtpflow_<name>_abi()
# and mtpflow_<name>_args_size().
ENTRY_POINTS = {"linear": ("mtpflow_linear", LinearArgs, 1),
                "rows": ("mtpflow_llama_rows", RowsArgs, 2),
                "w8a8": ("mtpflow_w8a8_rows", W8A8Args, 2),
                "w8a8_greedy": ("mtpflow_w8a8_greedy", W8A8GreedyArgs, 1),
                "logit_stats": ("mtpflow_logit_stats", LogitStatsArgs, 1)}


def call(lib: ctypes.CDLL, entry: str, **members) -> int:
    """Entry point ``entry`` (a key of ENTRY_POINTS) over its struct filled from ``members`` (every member but
    version and size, by name; ctypes pointer arrays are passed by address). Returns the function's code: 0, -1 out
    of memory (``BAD_ABI`` cannot happen for a build ``load`` accepted)."""
    function, struct, abi = ENTRY_POINTS[entry]
    given = {k: ctypes.addressof(v) if isinstance(v, ctypes.Array) else v for k, v in members.items()}
    args = struct(version=abi, size=ctypes.sizeof(struct), **given)
    return getattr(lib, function)(ctypes.byref(args))


def llama_rows(lib: ctypes.CDLL, **members) -> int:
    """``mtpflow_llama_rows`` over ``RowsArgs`` members by name (``call``)."""
    return call(lib, "rows", **members)


def w8a8_rows(lib: ctypes.CDLL, **members) -> int:
    """``mtpflow_w8a8_rows`` over ``W8A8Args`` members by name (``call``)."""
    return call(lib, "w8a8", **members)


def w8a8_greedy(lib: ctypes.CDLL, steps: int, token: int, out: int, embed: int | None, embed_scale: float,
                **rows) -> int:
    """``mtpflow_w8a8_greedy``: ``steps`` greedy tokens of the int8 model after ``token`` into ``out`` (an int32
    buffer's address), over ``W8A8Args`` rows by name (one per step)."""
    function, struct, abi = ENTRY_POINTS["w8a8_greedy"]
    members = W8A8Args(version=ENTRY_POINTS["w8a8"][2], size=ctypes.sizeof(W8A8Args),
                       **{k: ctypes.addressof(v) if isinstance(v, ctypes.Array) else v for k, v in rows.items()})
    args = struct(version=abi, size=ctypes.sizeof(struct), rows=ctypes.addressof(members), steps=steps, token=token,
                  out=out, embed=embed, embed_scale=embed_scale)
    return getattr(lib, function)(ctypes.byref(args))


TOP_IDS_MAX = 16  # the most top ids logit_stats gives a row (TOP_MAX in logit_stats.c)


def logit_stats(logits: torch.Tensor, threads: int, lib: ctypes.CDLL | None = None,
                top: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """Each row's argmax (torch.argmax's choice: the first index among ties, a NaN the largest), log-normalizer
    (torch.logsumexp's value, to float rounding) and, with ``top`` > 0, the ids of its ``top`` largest entries
    (largest first, the lower id first among equals: torch.topk's set, its order where no two are equal; None where
    a row has a NaN) of ``logits`` [rows, vocab], in one pass per row (``logit_stats.c``). None where it does not
    apply: no library, or logits that are not a CPU float32 tensor with contiguous rows."""
    lib = library() if lib is None else lib
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32 or logits.device.type != "cpu"
            or logits.stride(-1) != 1 or logits.shape[1] == 0):
        return None
    rows, vocab = logits.shape
    top = max(0, min(int(top), TOP_IDS_MAX, vocab))
    argmax, log_norm = torch.empty(rows, dtype=torch.long), torch.empty(rows, dtype=torch.float32)
    top_ids = torch.empty(rows, top, dtype=torch.long) if top else None
    nans = call(lib, "logit_stats", rows=rows, vocab=vocab, threads=threads, top=top, stride=logits.stride(0),
                logits=logits.data_ptr(), argmax=argmax.data_ptr(), log_norm=log_norm.data_ptr(),
                top_ids=None if top_ids is None else top_ids.data_ptr())
    return argmax, log_norm, None if nans else top_ids


def load(path: Path) -> ctypes.CDLL:
    """Open a build of SOURCES and declare its functions' signatures. A build whose entry points have another ABI
    (version or struct size), or one without them, is refused with a one-line UserError; one that is not a shared
    library raises OSError."""
    lib = ctypes.CDLL(str(path))
    for name, (function, struct, abi) in ENTRY_POINTS.items():
        mine = f"v{abi} ({ctypes.sizeof(struct)} bytes)"
        try:
            version, size = getattr(lib, f"mtpflow_{name}_abi"), getattr(lib, f"mtpflow_{name}_args_size")
            entry = getattr(lib, function)
        except AttributeError:
            raise UserError(f"native kernel {path} lacks {function} or its ABI version, this mtpflow expects {mine}: "
                            "delete it to rebuild") from None
        version.restype = size.restype = ctypes.c_int
        version.argtypes = size.argtypes = []
        theirs = (version(), size())
        if theirs != (abi, ctypes.sizeof(struct)):
            raise UserError(f"native kernel {path} has {function} ABI v{theirs[0]} ({theirs[1]} bytes), this mtpflow "
                            f"expects {mine}: delete it to rebuild")
        entry.argtypes, entry.restype = [ctypes.POINTER(struct)], ctypes.c_int
    try:
        for info in (lib.mtpflow_vector_width, lib.mtpflow_panel_min_rows, lib.mtpflow_q8_isa, lib.mtpflow_q8_amx_built):
            info.argtypes, info.restype = [], ctypes.c_int
        lib.mtpflow_q8_amx.argtypes, lib.mtpflow_q8_amx.restype = [ctypes.c_int], ctypes.c_int
    except AttributeError as missing:
        raise UserError(f"native kernel {path} lacks a function ({missing}): delete it to rebuild") from None
    return lib


def available() -> bool:
    return library() is not None


@functools.lru_cache(maxsize=None)
def panel_min_rows(lib: ctypes.CDLL | None = None) -> int:
    """From how many rows the panel kernel runs (where the caller has panels): the build's own threshold
    (``PANEL_MIN_ROWS`` in gemm.c: 1 with AVX-512, 3 with 8-float vectors)."""
    lib = library() if lib is None else lib
    return lib.mtpflow_panel_min_rows() if lib is not None else 0


Q8_ISAS = {0: "plain C", 1: "AVX-512 VNNI", 2: "AVX2", 3: "AMX"}  # mtpflow_q8_isa()


def q8_isa(lib: ctypes.CDLL | None = None) -> str:
    """What computes the int8 model's dot products in this build on this CPU (``Q8_ISAS``; AMX: products of two
    rows or more, one row on AVX-512 VNNI)."""
    lib = library() if lib is None else lib
    return Q8_ISAS[lib.mtpflow_q8_isa()]
