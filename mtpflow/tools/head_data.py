"""Self-distillation data for draft heads: the base model writes its own training text from a shipped prompt
set (batched sampling, cycling temperatures), and we keep, for every position, the last-layer hidden state
and the model's own greedy choice (plus, with ``data.taps``, the outputs of the decoder layers EAGLE-3 fuses).
Shards are written as they finish, so an interrupted run resumes.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
import time
from importlib import resources
from pathlib import Path

import torch
from tqdm import tqdm

from mtpflow.errors import UserError


def _read_prompts(text: str) -> list[str]:
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r["prompt"] if "prompt" in r else r["text"] for r in rows]


def load_prompts(path: str | None = None) -> list[str]:
    """Training prompts (JSONL with a ``prompt`` or ``text`` field). Default: the shipped head-training prompts
    (271, the benchmark's four classes) and the domain prompts (1,189 user questions in five domains), in one
    seeded shuffle so every batch mixes them."""
    if path:
        p = Path(path).expanduser()
        if not p.exists():
            raise UserError(f"prompt file not found: {p}")
        try:
            prompts = _read_prompts(p.read_text(encoding="utf-8"))
        except (ValueError, KeyError, TypeError):
            raise UserError(f"{p}: every line must be a JSON object with a 'prompt' or 'text' field") from None
        taken = benchmark_overlap(prompts)
        if taken:
            raise UserError(f"{p}: {len(taken)} prompt(s) overlap the benchmark's prompts (e.g. {taken[0][:60]!r}): "
                            "heads must not train on the text they are measured on")
    else:
        from mtpflow.tools import domain_prompts

        heads = resources.files("mtpflow.data").joinpath("head_train_prompts.jsonl").read_text(encoding="utf-8")
        prompts = _read_prompts(heads) + [r["text"] for r in domain_prompts.load_prompts()]
        random.Random(0).shuffle(prompts)
    if not prompts:
        raise UserError("the training prompt file has no prompts")
    return prompts


# word n-grams shared with a benchmark prompt mark a training prompt as taken from it (8 words: a sentence
# fragment, not a common phrase)
SHINGLE = 8


def words(text: str) -> list[str]:
    """The lower-cased words of ``text`` (runs of letters and digits)."""
    return re.findall(r"[a-z0-9]+", text.lower())


def shingles(text: str, n: int = SHINGLE) -> set[str]:
    """The lower-cased word n-grams of ``text`` (``words``)."""
    seq = words(text)
    return {" ".join(seq[i:i + n]) for i in range(len(seq) - n + 1)} or ({" ".join(seq)} if seq else set())


def benchmark_overlap(prompts: list[str]) -> list[str]:
    """The ``prompts`` that share a word 8-gram (or, when shorter, their whole text) with one of the benchmark's own
    prompts (``mtpflow/data/bench_prompts.jsonl``): training on them would measure the heads on their training text."""
    text = resources.files("mtpflow.data").joinpath("bench_prompts.jsonl").read_text(encoding="utf-8")
    bench = set().union(*(shingles(p) for p in _read_prompts(text)))
    return [p for p in prompts if shingles(p) & bench]


def settings_key(model_id: str, settings: dict) -> str:
    blob = json.dumps({"model": model_id, **settings}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


@torch.inference_mode()
def sample_batch(backend, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos: set[int],
                 generator: torch.Generator, taps: tuple[int, ...] = ()) -> list[dict]:
    """Sample continuations for a batch of prompts through ``backend`` (the engine's: the float32 model's native or
    hf forwards, or the int8 model's), every sequence in its own KV slot, one verify forward per step for the
    sequences still running. Per sequence: ``tokens`` [L] (prompt + generated), ``hidden`` [L - 1, h] (fp16, the
    last hidden state at each fed input), ``greedy`` [L - 1] (the model's argmax after each input; -1 before the
    last prompt token, where a prefill computes no logits: no label trains on those) and ``prompt_len``; with
    ``taps`` (``mtpflow.types.hidden_taps``) also ``taps`` [L - 1, len(taps) * h] (fp16, those layers' outputs
    concatenated, as a decoding forward returns them)."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    want = (*taps, -1)  # the tapped layers, then the last hidden state
    pool = backend.make_pool(len(prompts))
    targets = [Target(backend, need_hidden=want, pool=pool) for _ in prompts]
    width = None
    seqs = []
    for target, prompt, (logits, hidden) in zip(targets, prompts, backend.prefill(
            targets, [torch.tensor(p, dtype=torch.long) for p in prompts])):
        width = hidden.shape[-1] // len(want)
        seqs.append({"target": target, "tokens": list(prompt), "prompt_len": len(prompt),
                     "rows": [hidden.to(torch.float16)], "greedy": [-1] * (len(prompt) - 1),
                     "logits": logits[-1:].float()})
    running = list(seqs)
    for step in range(max_new_tokens):
        logits = torch.cat([s["logits"] for s in running])  # [running, vocab]
        for s, g in zip(running, logits.argmax(-1).tolist()):
            s["greedy"].append(g)
        if temperature > 0:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).flatten().tolist()
        else:
            nxt = logits.argmax(-1).tolist()
        still = []
        for s, token in zip(running, nxt):
            s["tokens"].append(int(token))
            if int(token) in eos or step + 1 == max_new_tokens:
                s["target"].release()
            else:
                still.append(s)
        running = still
        if not running:
            break
        results = backend.verify([s["target"] for s in running], [s["tokens"][-1] for s in running],
                                 [Draft.empty()] * len(running), [len(s["tokens"]) - 1 for s in running])
        for s, v in zip(running, results):
            s["rows"].append(v.hidden.to(torch.float16))
            s["logits"] = v.logits[-1:].float()
    records = []
    for s in seqs:
        rows = torch.cat(s["rows"])  # [L - 1, (len(taps) + 1) * h]
        record = {"tokens": torch.tensor(s["tokens"], dtype=torch.int32),
                  "hidden": rows[:, -width:].clone(),
                  "greedy": torch.tensor(s["greedy"], dtype=torch.int32),
                  "prompt_len": s["prompt_len"]}
        if taps:
            record["taps"] = rows[:, :-width].clone()
        records.append(record)
    return records


# batches sorted together by prompt length: a batch is left-padded to its longest prompt, and on a CPU every
# padded position costs a full row of compute in the prefill and in each decode step's attention
BUCKET = 8


def length_buckets(encoded: list[list[int]], batch_size: int, bucket: int = BUCKET) -> list[list[list[int]]]:
    """Split ``encoded`` prompts (in order) into batches of ``batch_size``: every ``bucket`` consecutive batches'
    prompts are sorted by length first, so each batch holds prompts of similar length (deterministic, so a
    resumed run rebuilds the same batches)."""
    if bucket < 1:
        raise UserError(f"data.bucket must be >= 1, got {bucket}")
    batches = []
    span = batch_size * bucket
    for lo in range(0, len(encoded), span):
        group = sorted(encoded[lo: lo + span], key=len)  # stable: equal lengths keep their order
        batches += [group[i: i + batch_size] for i in range(0, len(group), batch_size)]
    return batches


class Paused(Exception):
    """The run's time limit passed (``time_limit_minutes``): what it did is on disk (shards, training state), and
    the same command continues from there."""


class Deadline:
    """The time limit of one run (None: none), checked between units of work that are saved as they finish."""

    def __init__(self, minutes: float | None):
        self.end = time.monotonic() + 60 * float(minutes) if minutes else None

    def check(self, where: str) -> None:
        if self.end is not None and time.monotonic() > self.end:
            raise Paused(where)


TIMES_NAME = "seconds.json"  # in a shard folder: the seconds each shard took to write (a run's data time, summed)


def generate_data(loaded, cfg, folder: Path, encode, backend, deadline: Deadline | None = None) -> list[Path]:
    """Write (or reuse) the shards of ``cfg`` (samples, batch_size, bucket, max_new_tokens, temperatures, seed,
    taps; checked by ``train_heads.check_settings``) with the target's forwards through ``backend``; raises
    ``Paused`` between shards once ``deadline`` has passed."""
    from mtpflow.types import hidden_taps

    folder.mkdir(parents=True, exist_ok=True)
    spec = cfg.get("taps")
    try:
        taps = hidden_taps(loaded.model, list(spec) if hasattr(spec, "__len__") and not isinstance(spec, str)
                           else spec) if spec else ()
    except (TypeError, ValueError) as exc:
        raise UserError(f"data.taps: {exc}") from None
    prompts = load_prompts(cfg.prompts)
    samples, batch_size = int(cfg.samples), int(cfg.batch_size)
    temperatures = [float(t) for t in cfg.temperatures] or [0.0]
    eos = set(loaded.eos_token_ids)
    shards = []
    n_shards = (samples + batch_size - 1) // batch_size
    encoded = [encode(p) for p in prompts[:samples]]  # each prompt once; samples beyond them cycle
    batches = length_buckets([encoded[i % len(encoded)] for i in range(samples)], batch_size,
                             int(cfg.get("bucket", BUCKET)))
    times_path = folder / TIMES_NAME
    times = json.loads(times_path.read_text()) if times_path.exists() else {}
    written = 0  # by this run
    bar = tqdm(range(n_shards), desc="generate training text", unit="batch")
    for s in bar:
        path = folder / f"shard_{s:05d}.pt"
        shards.append(path)
        if path.exists():  # resume: this batch was written by an earlier run
            continue
        if written and deadline is not None:  # a run writes at least one batch, so every slice makes progress
            deadline.check(f"training text: {s}/{n_shards} batches written")
        t0 = time.perf_counter()
        generator = torch.Generator().manual_seed(int(cfg.seed) * 100003 + s)
        temperature = temperatures[s % len(temperatures)]
        records = sample_batch(backend, batches[s], int(cfg.max_new_tokens), temperature, eos, generator, taps)
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.replace(path)
        times[path.name] = round(time.perf_counter() - t0, 2)
        times_path.write_text(json.dumps(times, indent=1) + "\n")
        written += 1
        bar.set_postfix(tokens=generated_tokens(records))
    return shards


def data_seconds(folder: Path) -> float:
    """The seconds the shards of ``folder`` took to write, over every run that wrote them."""
    path = folder / TIMES_NAME
    return round(sum(json.loads(path.read_text()).values()), 1) if path.exists() else 0.0


def generated_tokens(records: list[dict]) -> int:
    """Tokens the model wrote in ``records`` (prompts not counted)."""
    return sum(int(r["tokens"].numel()) - r["prompt_len"] for r in records)


def load_shards(paths: list[Path]) -> list[dict]:
    records = []
    for p in paths:
        records.extend(torch.load(p, weights_only=True))
    return records
