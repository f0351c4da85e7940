"""Self-distillation data for draft heads: the base model writes its own training text from a shipped prompt
set (batched sampling, cycling temperatures), and we keep, for every position, the last-layer hidden state
and the model's own greedy choice (plus, with ``data.taps``, the outputs of the decoder layers EAGLE-3 fuses).
Shards are written as they finish, so an interrupted run resumes.
"""
from __future__ import annotations

import hashlib
import json
import random
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
    else:
        from mtpflow.tools import domain_prompts

        heads = resources.files("mtpflow.data").joinpath("head_train_prompts.jsonl").read_text(encoding="utf-8")
        prompts = _read_prompts(heads) + [r["text"] for r in domain_prompts.load_prompts()]
        random.Random(0).shuffle(prompts)
    if not prompts:
        raise UserError("the training prompt file has no prompts")
    return prompts


def settings_key(model_id: str, settings: dict) -> str:
    blob = json.dumps({"model": model_id, **settings}, sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:10]


@torch.inference_mode()
def sample_batch(model, prompts: list[list[int]], max_new_tokens: int, temperature: float, eos: set[int],
                 generator: torch.Generator, taps: tuple[int, ...] = ()) -> list[dict]:
    """Sample continuations for a batch of prompts (left-padded). Per sequence: ``tokens`` [L] (prompt +
    generated), ``hidden`` [L - 1, h] (fp16, the hidden state at each fed input), ``greedy`` [L - 1] (the
    model's argmax after each input) and ``prompt_len``; with ``taps`` (``mtpflow.types.hidden_taps``) also
    ``taps`` [L - 1, len(taps) * h] (fp16, those layers' outputs concatenated, as a decoding forward returns
    them; free here, every forward computes all layers' outputs anyway)."""
    from transformers import DynamicCache

    batch = len(prompts)
    longest = max(len(p) for p in prompts)
    pad = 0
    ids = torch.full((batch, longest), pad, dtype=torch.long)
    attention = torch.zeros(batch, longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p):] = torch.tensor(p)
        attention[i, longest - len(p):] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    hidden_rows, greedy_rows, token_rows, tap_rows = [], [], [ids], []
    done = torch.zeros(batch, dtype=torch.bool)
    lengths = torch.full((batch,), max_new_tokens, dtype=torch.long)
    step_ids, step_pos = ids, positions
    for step in range(max_new_tokens):
        out = model(input_ids=step_ids, attention_mask=attention, position_ids=step_pos, cache=cache,
                    use_cache=True, output_hidden_states=True)
        logits = out.logits[:, -1].float()
        hidden_rows.append(out.hidden_states[-1].to(torch.float16))
        if taps:  # tap i is decoder layer i's output, HF's hidden_states[i + 1]; -1 the last (normed) one
            tap_rows.append(torch.cat([out.hidden_states[-1 if t == -1 else t + 1] for t in taps], -1)
                            .to(torch.float16))
        greedy_rows.append(out.logits.argmax(-1))
        if temperature > 0:
            nxt = torch.multinomial((logits / temperature).softmax(-1), 1, generator=generator).flatten()
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
        token_rows.append(nxt[:, None])
        finished = torch.tensor([int(t) in eos for t in nxt.tolist()]) & ~done
        lengths[finished] = step + 1
        done |= finished
        if bool(done.all()):
            break
        step_ids = nxt[:, None]
        step_pos = step_pos[:, -1:] + 1
        attention = torch.cat([attention, torch.ones(batch, 1, dtype=torch.long)], -1)
    tokens = torch.cat(token_rows, -1)
    hidden = torch.cat(hidden_rows, 1)
    greedy = torch.cat(greedy_rows, 1)
    tapped = torch.cat(tap_rows, 1) if taps else None
    records = []
    for i, p in enumerate(prompts):
        start = longest - len(p)
        end = longest + int(lengths[i])  # exclusive end of the tokens kept
        records.append({
            "tokens": tokens[i, start:end].to(torch.int32).clone(),
            "hidden": hidden[i, start:end - 1].clone(),
            "greedy": greedy[i, start:end - 1].to(torch.int32).clone(),
            "prompt_len": len(p),
        })
        if taps:
            records[-1]["taps"] = tapped[i, start:end - 1].clone()
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


def generate_data(loaded, cfg, folder: Path, encode) -> list[Path]:
    """Write (or reuse) the shards of ``cfg`` (samples, batch_size, bucket, max_new_tokens, temperatures, seed,
    taps; checked by ``train_heads.check_settings``)."""
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
    bar = tqdm(range(n_shards), desc="generate training text", unit="batch")
    for s in bar:
        path = folder / f"shard_{s:05d}.pt"
        shards.append(path)
        if path.exists():  # resume: this batch was written by an earlier run
            continue
        generator = torch.Generator().manual_seed(int(cfg.seed) * 100003 + s)
        temperature = temperatures[s % len(temperatures)]
        records = sample_batch(loaded.model, batches[s], int(cfg.max_new_tokens), temperature, eos, generator,
                               taps)
        tmp = path.with_suffix(".tmp")
        torch.save(records, tmp)
        tmp.replace(path)
        bar.set_postfix(tokens=generated_tokens(records))
    return shards


def generated_tokens(records: list[dict]) -> int:
    """Tokens the model wrote in ``records`` (prompts not counted)."""
    return sum(int(r["tokens"].numel()) - r["prompt_len"] for r in records)


def load_shards(paths: list[Path]) -> list[dict]:
    records = []
    for p in paths:
        records.extend(torch.load(p, weights_only=True))
    return records
