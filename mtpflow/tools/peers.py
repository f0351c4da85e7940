"""The peers in the same benchmark run (``python -m mtpflow.bench peers=[vllm,llamacpp]``): vLLM's CPU build and
llama.cpp (through llama-cpp-python), each in its own virtual environment, run one after the other on the
prompts mtpflow just decoded, at batch 1 plain, batch 1 with the peer's own speculative mode (vLLM's n-gram
drafter, llama.cpp's prompt lookup) and batch 16, so their rows land in the same table as mtpflow's.

Protocol: mtpflow starts the peer's python (``MTPFLOW_VLLM_PYTHON`` / ``MTPFLOW_LLAMACPP_PYTHON``) on this
very file, from a neutral folder, and writes one job as JSON on its stdin (prompt token ids, rendered by
mtpflow's tokenizer, so every engine sees the same tokens; max tokens; stop ids; threads; batch; speculative
mode). The worker answers with lines ``MTPFLOW-PEER {json}`` on stdout: ``ready`` (engine and version),
``loaded``, ``progress``, then ``result`` (token ids per prompt, seconds per prompt at batch 1 or in all at
batch 16, verify steps where the engine tells them) or ``error``. Anything else it prints (engines log a lot)
is ignored. ``--check`` only imports the engine and answers ``ready``: mtpflow runs it for every peer before
it loads its own model, so a peer that is not set up stops the run before anything is written.

This file imports only the standard library at the top: the worker half runs in the peer's python, which has
neither mtpflow nor mtpflow's versions of torch and transformers.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MARK = "MTPFLOW-PEER "
PROTOCOL = 1
PEERS = {
    # name: environment variable with the peer's python, module it must import, its speculative mode
    "vllm": {"variable": "MTPFLOW_VLLM_PYTHON", "module": "vllm", "spec": "ngram", "spec_label": "n-gram"},
    "llamacpp": {"variable": "MTPFLOW_LLAMACPP_PYTHON", "module": "llama_cpp", "spec": "prompt_lookup",
                 "spec_label": "prompt lookup"},
}
# what a peer's python runs: this file, by path, without putting its folder on sys.path (mtpflow/tools holds
# modules whose names could shadow packages of the peer's environment)
BOOT = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__peer__')"
DOCS = "docs/benchmarks.md, 'Peers'"
NUM_SPECULATIVE_TOKENS = 10  # as mtpflow's pld: K = 10, n-grams of 2-4 tokens
BATCH = 16


# ---- mtpflow's side -------------------------------------------------------------------------------------------

def check_names(names) -> list[str]:
    from mtpflow.errors import UserError

    names = [str(n) for n in names or ()]
    for name in names:
        if name not in PEERS:
            raise UserError(f"peers: unknown peer {name!r}; known: {', '.join(PEERS)}")
    if len(set(names)) != len(names):
        raise UserError(f"peers: {names} names a peer twice")
    return names


def peer_python(name: str, environ=None) -> str:
    """The peer's python from its environment variable: set, and an executable file."""
    from mtpflow.errors import UserError

    environ = os.environ if environ is None else environ
    variable = PEERS[name]["variable"]
    python = environ.get(variable)
    if not python:
        raise UserError(f"peer {name}: set {variable} to the python of {name}'s own virtual environment ({DOCS})")
    path = Path(python).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise UserError(f"peer {name}: {variable}={python} is not an executable python ({DOCS})")
    return str(path)


def _command(python: str, *args: str) -> list[str]:
    return [python, "-c", BOOT, str(Path(__file__).resolve()), *args]


def _events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        if line.startswith(MARK):
            try:
                event = json.loads(line[len(MARK):])
            except ValueError:
                continue
            if isinstance(event, dict):
                out.append(event)
    return out


def probe(name: str, environ=None, timeout: float = 300) -> dict:
    """Check that the peer's python imports its engine: its ``ready`` answer (engine version), or a
    UserError naming the peer and the variable to set."""
    from mtpflow.errors import UserError

    python = peer_python(name, environ)
    spec = PEERS[name]
    try:
        done = subprocess.run(_command(python, "--check", name), capture_output=True, text=True, timeout=timeout,
                              cwd=tempfile.gettempdir(), stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(f"peer {name}: {spec['variable']}={python} did not run: {exc}") from None
    events = _events(done.stdout)
    ready = next((e for e in events if e.get("event") == "ready"), None)
    if done.returncode != 0 or ready is None:
        error = next((e.get("message") for e in events if e.get("event") == "error"), None)
        tail = (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise UserError(f"peer {name}: {spec['variable']}={python} cannot import {spec['module']} "
                        f"({error or tail}); build its venv as {DOCS} says")
    return {**ready, "python": python, "variable": spec["variable"]}


def runs_for(name: str) -> list[dict]:
    """The three runs of a peer: batch 1, batch 1 with its speculative mode, batch 16."""
    spec = PEERS[name]
    return [{"label": name, "batch": 1, "spec": "none"},
            {"label": f"{name} {spec['spec_label']}", "batch": 1, "spec": spec["spec"]},
            {"label": f"{name}, batch {BATCH}", "batch": BATCH, "spec": "none"}]


class PeerFailed(Exception):
    """A peer's run failed after its check passed: the engine itself, not the user's input."""


def run_job(name: str, python: str, job: dict, log_path: Path, progress=None) -> dict:
    """One worker process for one run; its ``result`` event (token ids, seconds, steps)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result, error, lines = None, None, []
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(_command(python, "--run"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log, cwd=tempfile.gettempdir(), env=env, text=True)
        try:
            proc.stdin.write(json.dumps(job))
            proc.stdin.close()
            for line in proc.stdout:
                lines.append(line)
                for event in _events(line):
                    kind = event.get("event")
                    if kind == "progress" and progress is not None:
                        progress(event)
                    elif kind == "result":
                        result = event
                    elif kind == "error":
                        error = event.get("message")
            proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        log.write("".join(lines).encode("utf-8", "replace"))
    if result is None or proc.returncode != 0:
        tail = error or (log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()
                         or [f"exit status {proc.returncode}"])[-1]
        raise PeerFailed(f"peer {name} ({job['label']}) failed: {tail} (log {log_path})")
    return result


def job_for(name: str, run: dict, prompts: list[list[int]], *, max_tokens: int, stop_ids, threads: int,
            model_folder: str | None, gguf: str | None) -> dict:
    longest = max(len(p) for p in prompts) + max_tokens + 16
    try:
        cpus = sorted(os.sched_getaffinity(0))[:threads]
    except (AttributeError, OSError):
        cpus = list(range(threads))
    return {"protocol": PROTOCOL, "peer": name, **run, "prompts": [list(map(int, p)) for p in prompts],
            "max_tokens": int(max_tokens), "stop_ids": [int(i) for i in stop_ids], "threads": int(threads),
            "cpus": cpus, "max_model_len": max(2048, longest), "model": model_folder, "gguf": gguf,
            "num_speculative_tokens": NUM_SPECULATIVE_TOKENS, "warmup": True}


def run_rows(label: str, result: dict, units: list[dict]) -> list[dict]:
    """Batch-1 results as bench run rows, one per prompt, compared with HF's tokens for it (``reference``)."""
    rows = []
    ids, seconds = result["token_ids"], result["seconds"]
    steps = result.get("steps") or [None] * len(ids)
    for unit, out, secs, n_steps in zip(units, ids, seconds, steps):
        rows.append({**{k: unit[k] for k in ("id", "class", "question_id", "turn") if k in unit},
                     "strategy": label, "repeat": 0, "tokens": len(out), "seconds": float(secs),
                     "steps": float("nan") if n_steps is None else n_steps, "mal": float("nan"),
                     "identical": list(out) == list(unit["reference"]), "hf_seconds": unit["hf_seconds"]})
    return rows


def batch_mal(result: dict, tokens: int) -> float | None:
    """Tokens per decode step of a peer's batched run (its first token of each prompt comes from the prefill,
    not a step); None where the peer reports no step count."""
    steps, n = result.get("total_steps"), len(result["token_ids"])
    return None if not steps else round((tokens - n) / max(steps - n, 1), 3)


def throughput_row(label: str, result: dict, units: list[dict]) -> dict:
    """A batch-16 result as one summary row: total tokens/s over every prompt, at most 16 at once."""
    ids = result["token_ids"]
    tokens = sum(len(o) for o in ids)
    same = sum(list(o) == list(u["reference"]) for u, o in zip(units, ids))
    return {"strategy": label, "class": "overall", "prompts": len(ids), "tokens": tokens,
            "tokens_per_s": round(tokens / result["total_seconds"], 2), "speedup_vs_hf": None,
            "mal": batch_mal(result, tokens),
            "forwards_per_token": None, "identical": f"{same}/{len(ids)}", "lookup_ceiling_mal": None}


def _peer_record(ready: dict) -> dict:
    """The manifest's entry for a peer: its version, python and variable; its runs filled in as they end."""
    return {"version": ready.get("version"), "python": ready["python"], "variable": ready["variable"], "runs": {}}


def _run_reported(name: str, ready: dict, job: dict, log_dir: Path, runs: dict) -> dict | None:
    """One run with a progress bar; its result, or None when it failed (the warning on stderr, the error in
    ``runs`` under the run's label): mtpflow's own results are never lost to a peer's crash."""
    from tqdm import tqdm

    bar = tqdm(total=len(job["prompts"]), desc=job["label"], unit="prompt", file=sys.stderr)

    def advance(event):
        bar.n = int(event.get("done", bar.n + 1))
        bar.refresh()

    try:
        return run_job(name, ready["python"], job, log_dir / f"peer-{name}.log", advance)
    except PeerFailed as exc:
        print(f"mtpflow.bench: warning: {exc}", file=sys.stderr)
        runs[job["label"]] = {"error": str(exc)}
        return None
    finally:
        bar.close()


def run_peers(checked: dict[str, dict], units: list[dict], *, max_tokens: int, stop_ids, threads: int,
              model_folder, gguf, log_dir: Path):
    """Every run of every peer, one after the other, on the units mtpflow decoded (``ids``; HF's answer in
    ``reference``): (bench run rows, batch-16 summary rows, what each run reported, for the manifest). A run
    that fails is reported on stderr and in the manifest and the others go on: mtpflow's own results are
    never lost to a peer's crash."""
    prompts = [[int(t) for t in (u["ids"].tolist() if hasattr(u["ids"], "tolist") else u["ids"])] for u in units]
    ggufs = list(gguf) if isinstance(gguf, (list, tuple)) else [gguf]
    rows, summary_rows, record = [], [], {}
    for name, ready in checked.items():
        record[name] = _peer_record(ready)
        # llama.cpp over several GGUFs (precisions of one model): every run once per file, labelled by its name
        files = ggufs if name == "llamacpp" else ggufs[:1]
        runs = [({**run, "label": f"{run['label']} [{Path(g).stem}]"} if len(files) > 1 else run, g)
                for g in files for run in runs_for(name)]
        for run, one_gguf in runs:
            job = job_for(name, run, prompts, max_tokens=max_tokens, stop_ids=stop_ids, threads=threads,
                          model_folder=model_folder, gguf=one_gguf)
            result = _run_reported(name, ready, job, log_dir, record[name]["runs"])
            if result is None:
                continue
            if result.get("skipped"):
                print(f"mtpflow.bench: note: {run['label']}: {result['skipped']}", file=sys.stderr)
                record[name]["runs"][run["label"]] = {"skipped": result["skipped"]}
                continue
            record[name]["runs"][run["label"]] = {
                k: result.get(k) for k in ("config", "load_seconds", "total_seconds", "acceptance", "threads")}
            if run["batch"] == 1:
                rows += run_rows(run["label"], result, units)
            else:
                summary_rows.append(throughput_row(run["label"], result, units))
    return rows, summary_rows, record


def run_batch_peers(checked: dict[str, dict], prompts: list[list[int]], sizes, hf_outputs: dict, reference, *,
                    max_tokens: int, stop_ids, threads: int, model_folder, gguf, log_dir: Path):
    """``mode=batch``: each peer once per batch size on the engine's prompts, every prompt at t = 0 and at most
    that many at once, after mtpflow: (rows in the batch table's columns, what each run reported, for the
    manifest). Identity is counted against ``reference`` (HF batch 1) when the run has it, else against HF
    ``generate``'s own outputs at that batch size (``hf_outputs[b]``). A run that fails is reported and the
    others go on, as in the decode benchmark."""
    rows, record = [], {}
    first_gguf = gguf[0] if isinstance(gguf, (list, tuple)) else gguf
    for name, ready in checked.items():
        record[name] = _peer_record(ready)
        one_gguf = first_gguf if name == "llamacpp" else None
        for b in sizes:
            run = {"label": f"{name}, batch {b}", "batch": int(b), "spec": "none"}
            job = job_for(name, run, prompts, max_tokens=max_tokens, stop_ids=stop_ids, threads=threads,
                          model_folder=model_folder, gguf=one_gguf)
            result = _run_reported(name, ready, job, log_dir, record[name]["runs"])
            if result is None:
                continue
            record[name]["runs"][run["label"]] = {
                k: result.get(k) for k in ("config", "load_seconds", "total_seconds", "threads")}
            ids, seconds = result["token_ids"], float(result["total_seconds"])
            tokens = sum(len(o) for o in ids)
            want, against = (reference, "hf_generate") if reference is not None else (
                hf_outputs.get(b), f"hf_generate, batch {b}")
            rows.append({"batch_size": int(b), "setting": name, "tokens": tokens, "seconds": round(seconds, 3),
                         "tokens_per_second": round(tokens / seconds, 2), "latency_p50": float("nan"),
                         "latency_p95": float("nan"), "mal": batch_mal(result, tokens),
                         "identical_to_hf": None if want is None else
                         sum(list(o) == list(w) for o, w in zip(ids, want)) / len(ids), "reference": against})
    return rows, record


# ---- the peer's side (runs in the peer's python: standard library and the engine only) -----------------------

def _emit(event: str, **fields) -> None:
    print(MARK + json.dumps({"event": event, **fields}), flush=True)


def _progress(done: int, total: int) -> None:
    _emit("progress", done=done, total=total)


def spec_counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (empty without speculation)."""
    out: dict = {}
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - metrics are optional
        return out
    for m in metrics:
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                      "vllm:spec_decode_num_accepted_tokens"):
            key = m.name.split("spec_decode_")[1]
            out[key] = out.get(key, 0) + int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            prev = out.get("accepted_per_pos", [])
            vals = list(m.values)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev + [0] * len(vals), vals)] if prev else vals
    return out


def spec_delta(before: dict, after: dict) -> dict | None:
    """What the counters moved by between two readings; acceptance rate and mean acceptance length."""
    if not after:
        return None
    d = {k: after.get(k, 0) - before.get(k, 0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    pos_a, pos_b = after.get("accepted_per_pos", []), before.get("accepted_per_pos", [])
    pos_b = pos_b + [0] * (len(pos_a) - len(pos_b))
    d["accepted_per_pos"] = [a - b for a, b in zip(pos_a, pos_b)]
    if d["num_draft_tokens"]:
        d["acceptance_rate"] = round(d["num_accepted_tokens"] / d["num_draft_tokens"], 4)
    if d["num_drafts"]:
        # tokens per verify step = accepted drafts + the target's own token
        d["mean_acceptance_length"] = round(1 + d["num_accepted_tokens"] / d["num_drafts"], 4)
    return d


def vllm_environment(job: dict) -> None:
    """vLLM's CPU settings, read at import: the cores its OpenMP threads are bound to (mtpflow's own thread
    count), the KV cache size, engine and worker in this process. The caller's environment wins."""
    cpus = job.get("cpus") or list(range(int(job["threads"])))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(str(c) for c in cpus))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(job["threads"]))


def worker_vllm(job: dict) -> dict:
    vllm_environment(job)
    import vllm
    from vllm import LLM, SamplingParams

    _emit("ready", peer="vllm", version=vllm.__version__)
    spec = None
    if job["spec"] == "ngram":
        spec = {"method": "ngram", "num_speculative_tokens": int(job["num_speculative_tokens"]),
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    config = {"dtype": "float32", "max_num_seqs": int(job["batch"]), "max_model_len": int(job["max_model_len"]),
              "seed": 0, "enable_prefix_caching": False, "speculative_config": spec,
              "distributed_executor_backend": "uni"}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], disable_log_stats=False, **config)
    load_seconds = time.perf_counter() - t0
    _emit("loaded", seconds=round(load_seconds, 1))
    # greedy, ending at the model's EOS or mtpflow's stop ids, as mtpflow's bench ends
    params = SamplingParams(temperature=0.0, max_tokens=int(job["max_tokens"]), stop_token_ids=job["stop_ids"])
    inputs = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    if job.get("warmup"):
        llm.generate(inputs[:2], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    token_ids, seconds, steps = [], [], []
    before = first = spec_counters(llm)
    t_all = time.perf_counter()
    if int(job["batch"]) == 1:
        for i, one in enumerate(inputs):
            t = time.perf_counter()
            out = llm.generate([one], params, use_tqdm=False)[0]
            seconds.append(time.perf_counter() - t)
            ids = [int(x) for x in out.outputs[0].token_ids]
            token_ids.append(ids)
            after = spec_counters(llm)
            moved = spec_delta(before, after) or {}
            before = after
            # every step emits its accepted drafts plus one token: steps (prefill included) = tokens - accepted
            steps.append(len(ids) - int(moved.get("num_accepted_tokens", 0)))
            _progress(i + 1, len(inputs))
    else:
        outputs = llm.generate(inputs, params, use_tqdm=False)
        token_ids = [[int(x) for x in o.outputs[0].token_ids] for o in outputs]
        _progress(len(inputs), len(inputs))
    total = time.perf_counter() - t_all
    acceptance = spec_delta(first, spec_counters(llm)) if spec else None
    accepted = int((acceptance or {}).get("num_accepted_tokens", 0))
    return {"token_ids": token_ids, "seconds": seconds or None, "steps": steps or None, "total_seconds": total,
            "total_steps": sum(len(t) for t in token_ids) - accepted, "acceptance": acceptance,
            "load_seconds": round(load_seconds, 1), "threads": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
            "config": {**{k: v for k, v in config.items() if k != "speculative_config"}, "speculative": spec}}


def _llamacpp_one(llm, prompt: list[int], max_tokens: int, stop: set) -> tuple[list[int], int]:
    """Greedy tokens for one prompt (ending at EOS or max_tokens) and the forwards it took (prefill included):
    every ``eval`` is one forward, of one token or of a token and its drafts."""
    forwards = [0]
    real_eval = llm.eval

    def counting_eval(tokens):
        forwards[0] += 1
        return real_eval(tokens)

    llm.eval = counting_eval
    llm.reset()  # no KV reuse from the previous prompt (mtpflow's bench runs without a prefix cache too)
    out: list[int] = []
    try:
        for token in llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                  reset=True):
            out.append(int(token))
            if int(token) in stop or len(out) >= max_tokens:
                break
    finally:
        llm.eval = real_eval
    return out, forwards[0]


def _llamacpp_batched(llm, llama_cpp, prompts: list[list[int]], job: dict, stop: set) -> tuple[list, int]:
    """At most ``batch`` sequences at once in one llama.cpp context (llama-cpp-python's ``Llama`` decodes one
    sequence, so this drives the context through its low-level calls): each new prompt is prefilled alone,
    then every running sequence gets its next greedy token from one shared ``llama_decode``; a finished
    sequence's KV is dropped and the next prompt takes its place."""
    import numpy as np
    from llama_cpp import _internals as internals

    batch_size, max_tokens = int(job["batch"]), int(job["max_tokens"])
    per_sequence = max(len(p) for p in prompts) + max_tokens + 8
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = per_sequence * batch_size
    params.n_batch = params.n_ubatch = max(512, batch_size)
    params.n_seq_max = batch_size
    params.n_threads = params.n_threads_batch = int(job["threads"])
    if hasattr(params, "kv_unified"):
        params.kv_unified = True  # one buffer of n_ctx cells for all sequences
    ctx = internals.LlamaContext(model=llm._model, params=params, verbose=False)
    batch = internals.LlamaBatch(n_tokens=max(512, batch_size), embd=0, n_seq_max=1, verbose=False)
    n_vocab = llm.n_vocab()

    def decode(entries):  # [(token, position, sequence, wants logits)] -> the argmax of each entry asking
        b = batch.batch
        b.n_tokens = len(entries)
        for j, (token, pos, seq, want) in enumerate(entries):
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, want
            b.seq_id[j][0] = seq
        ctx.decode(batch)
        return {j: int(np.ctypeslib.as_array(ctx.get_logits_ith(j), shape=(n_vocab,)).argmax())
                for j, e in enumerate(entries) if e[3]}

    outputs: list = [None] * len(prompts)
    waiting = list(range(len(prompts)))
    running: dict[int, dict] = {}  # slot -> {"prompt": index, "pos": next position, "out": tokens}
    forwards = 0

    def retire():  # sequences that ended (EOS or max_tokens) leave; their KV cells are freed
        for slot, seq in list(running.items()):
            if seq["out"][-1] in stop or len(seq["out"]) >= max_tokens:
                outputs[seq["prompt"]] = seq["out"]
                llama_cpp.llama_memory_seq_rm(ctx.memory, slot, 0, -1)
                del running[slot]
                _progress(sum(o is not None for o in outputs), len(prompts))

    while waiting or running:
        for slot in range(batch_size):
            if slot in running or not waiting:
                continue
            index = waiting.pop(0)
            prompt, chunk = prompts[index], int(params.n_batch)
            for start in range(0, len(prompt), chunk):
                part = prompt[start:start + chunk]
                last = start + len(part) == len(prompt)
                picked = decode([(t, start + k, slot, last and k == len(part) - 1) for k, t in enumerate(part)])
                forwards += 1
            running[slot] = {"prompt": index, "pos": len(prompt), "out": [next(iter(picked.values()))]}
        retire()  # a first token may already end a sequence
        if not running:
            continue
        slots = list(running)
        picked = decode([(running[s]["out"][-1], running[s]["pos"], s, True) for s in slots])
        forwards += 1
        for j, slot in enumerate(slots):
            running[slot]["pos"] += 1
            running[slot]["out"].append(picked[j])
        retire()
    ctx.close()
    batch.close()
    return outputs, forwards


def worker_llamacpp(job: dict) -> dict:
    import llama_cpp
    from llama_cpp import Llama

    _emit("ready", peer="llamacpp", version=getattr(llama_cpp, "__version__", None))
    threads = int(job["threads"])
    config = {"n_ctx": int(job["max_model_len"]), "n_threads": threads, "n_threads_batch": threads, "seed": 0}
    draft = None
    if job["spec"] == "prompt_lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=int(job["num_speculative_tokens"]))
        config["draft"] = {"kind": "LlamaPromptLookupDecoding", "max_ngram_size": 4,
                           "num_pred_tokens": int(job["num_speculative_tokens"])}
    t0 = time.perf_counter()
    llm = Llama(model_path=job["gguf"], verbose=False, draft_model=draft,
                **{k: v for k, v in config.items() if k != "draft"})
    load_seconds = time.perf_counter() - t0
    _emit("loaded", seconds=round(load_seconds, 1))
    stop = {int(i) for i in job["stop_ids"]} | {int(llm.token_eos())}
    max_tokens, prompts = int(job["max_tokens"]), job["prompts"]
    if job.get("warmup"):
        _llamacpp_one(llm, prompts[0], 8, stop)
    token_ids, seconds, steps = [], [], []
    t_all = time.perf_counter()
    if int(job["batch"]) == 1:
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            out, forwards = _llamacpp_one(llm, prompt, max_tokens, stop)
            seconds.append(time.perf_counter() - t)
            token_ids.append(out)
            steps.append(forwards)
            _progress(i + 1, len(prompts))
        total_steps = sum(steps)
    else:
        token_ids, total_steps = _llamacpp_batched(llm, llama_cpp, prompts, job, stop)
    total = time.perf_counter() - t_all
    return {"token_ids": token_ids, "seconds": seconds or None, "steps": steps or None, "total_seconds": total,
            "total_steps": total_steps, "acceptance": None, "load_seconds": round(load_seconds, 1),
            "threads": threads, "config": config}


WORKERS = {"vllm": worker_vllm, "llamacpp": worker_llamacpp}


def worker_main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--check":
        name = argv[1]
        try:
            module = __import__(PEERS[name]["module"])
        except Exception as exc:  # noqa: BLE001 - reported to mtpflow as one line
            _emit("error", message=f"{type(exc).__name__}: {exc}".splitlines()[0])
            return 3
        _emit("ready", peer=name, version=getattr(module, "__version__", None))
        return 0
    if argv != ["--run"]:
        _emit("error", message=f"usage: --check NAME | --run (job on stdin), got {argv}")
        return 2
    try:
        job = json.loads(sys.stdin.read())
        if job.get("protocol") != PROTOCOL:
            raise ValueError(f"protocol {job.get('protocol')!r}, this worker speaks {PROTOCOL}")
        result = WORKERS[job["peer"]](job)
    except Exception as exc:  # noqa: BLE001 - one line to mtpflow, the traceback to the log
        import traceback

        traceback.print_exc()
        _emit("error", message=f"{type(exc).__name__}: {exc}".splitlines()[0])
        return 1
    _emit("result", **result)
    return 0


if __name__ in ("__peer__", "__main__"):
    sys.exit(worker_main(sys.argv[1:]))
