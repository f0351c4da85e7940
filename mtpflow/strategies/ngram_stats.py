"""Bigram co-occurrence statistics over token ids, the composite gate's *global consistency* evidence.

Two sources, both outside the benchmark suite: shipped request text (``--text``: JSONL files with a ``prompt`` or ``text``
field) and the model's own greedy answers to generated prompts (topics x tasks below, ``--tasks N`` per
topic). The shipped table (``mtpflow/data/ngram_smollm2.npz``) was built from text only, because generating
answers on the shared 2-core CPU was too slow for this release
(docs/bench/code-figures.md#ngram_stats-module-docstring):
``python -m mtpflow.strategies.ngram_stats --tasks 0 --text mtpflow/data/domain_prompts.jsonl
mtpflow/data/head_train_prompts.jsonl``; add ``--tasks 5`` on a free machine for the answer corpus.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from mtpflow.errors import UserError

DEFAULT_TABLE = "ngram_smollm2.npz"

# The corpus prompts: every topic under every task (200 requests), so the answers cover everyday,
# technical and numeric text without reusing the benchmark prompts.
TOPICS = [
    "photosynthesis", "the French Revolution", "compound interest", "a binary search", "the water cycle",
    "climate change", "how vaccines work", "the stock market", "a Python list comprehension", "black holes",
    "healthy sleep habits", "the causes of inflation", "machine learning", "the human heart",
    "recycling plastic", "a job interview", "learning a new language", "the Roman Empire", "electric cars",
    "saving for retirement", "a SQL join", "the immune system", "writing a cover letter", "volcanoes",
    "time management", "the theory of evolution", "a REST API", "budgeting for a family", "the moon landing",
    "diabetes", "renewable energy", "a linked list", "the Great Depression", "meditation",
    "planning a wedding", "the speed of light", "supply and demand", "git branches", "healthy eating",
    "the printing press",
]
TASKS = [
    "Explain {topic} to a beginner in a short paragraph.",
    "Write three bullet points about {topic}.",
    "What are the most common misconceptions about {topic}?",
    "Write a short email to a colleague about {topic}.",
    "Give a step-by-step overview of {topic}.",
]


def corpus_prompts(tasks: int = len(TASKS)) -> list[str]:
    return [task.format(topic=topic) for task in TASKS[:tasks] for topic in TOPICS]


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the vocabulary, so a table is never used with a tokenizer it was not built for."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha1(repr(vocab).encode("utf-8")).hexdigest()[:16]


class BigramTable:
    """Counts of (previous token, token) pairs and of single tokens, scored on a log scale in [0, 1]."""

    def __init__(self, keys: np.ndarray, counts: np.ndarray, unigram_ids: np.ndarray, unigram_counts: np.ndarray,
                 vocab_size: int, fingerprint: str = ""):
        self.vocab_size = int(vocab_size)
        self.fingerprint = fingerprint
        order = np.argsort(keys)
        self.keys = keys[order].astype(np.int64)  # prev * vocab_size + token, sorted
        self.counts = counts[order].astype(np.int64)
        self.unigram = dict(zip(unigram_ids.tolist(), unigram_counts.tolist()))
        self.unigram_max = max(self.unigram.values(), default=1)
        prev = self.keys // self.vocab_size
        self.prev_max: dict[int, int] = {}
        for p, c in zip(prev.tolist(), self.counts.tolist()):
            self.prev_max[p] = max(self.prev_max.get(p, 0), c)

    @staticmethod
    def from_sequences(sequences, vocab_size: int, fingerprint: str = "") -> BigramTable:
        pairs: dict[int, int] = {}
        unigram: dict[int, int] = {}
        for seq in sequences:
            seq = [int(t) for t in seq]
            for t in seq:
                unigram[t] = unigram.get(t, 0) + 1
            for a, b in zip(seq, seq[1:]):
                key = a * vocab_size + b
                pairs[key] = pairs.get(key, 0) + 1
        keys = np.array(list(pairs), dtype=np.int64)
        return BigramTable(keys, np.array(list(pairs.values()), dtype=np.int64),
                           np.array(list(unigram), dtype=np.int64), np.array(list(unigram.values()), dtype=np.int64),
                           vocab_size, fingerprint)

    def count(self, prev: int, token: int) -> int:
        key = int(prev) * self.vocab_size + int(token)
        i = int(np.searchsorted(self.keys, key))
        return int(self.counts[i]) if i < self.keys.size and self.keys[i] == key else 0

    def score(self, prev: int, token: int) -> float:
        """log(1 + c(prev, token)) / log(1 + max_y c(prev, y)); an unseen ``prev`` backs off to the token's
        unigram count against the most frequent token. Log scale because counts are heavy-tailed."""
        top = self.prev_max.get(int(prev))
        if top:
            return math.log1p(self.count(prev, token)) / math.log1p(top)
        return math.log1p(self.unigram.get(int(token), 0)) / math.log1p(self.unigram_max)

    def save(self, path: str | Path) -> None:
        np.savez_compressed(
            path, keys=self.keys, counts=self.counts.astype(np.int32),
            unigram_ids=np.array(list(self.unigram), dtype=np.int64),
            unigram_counts=np.array(list(self.unigram.values()), dtype=np.int32),
            vocab_size=np.array(self.vocab_size), fingerprint=np.array(self.fingerprint),
        )

    @staticmethod
    def load(path: str | Path) -> BigramTable:
        try:
            with np.load(path) as z:
                return BigramTable(z["keys"], z["counts"], z["unigram_ids"], z["unigram_counts"],
                                   int(z["vocab_size"]), str(z["fingerprint"]))
        except (OSError, KeyError, ValueError) as exc:
            raise UserError(f"cannot read n-gram table {path}: {exc}") from None


def default_table_path() -> Path:
    return Path(str(resources.files("mtpflow.data").joinpath(DEFAULT_TABLE)))


def generate_corpus(loaded, prompts: list[str], max_new_tokens: int, batch_size: int) -> list[list[int]]:
    """The model's greedy answers (prompt + answer ids, chat template applied), batched with left padding."""
    from tqdm import tqdm

    from mtpflow.request import encode_prompt

    tokenizer, model = loaded.tokenizer, loaded.model
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else loaded.eos_token_ids[0]
    eos = set(loaded.eos_token_ids)
    sequences = []
    for start in tqdm(range(0, len(prompts), batch_size), desc="corpus batches"):
        batch = [encode_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)
        for b, row in zip(batch, out[:, width:].tolist()):
            answer = []
            for t in row:
                if t in eos:
                    break
                answer.append(t)
            sequences.append(b + answer)
    return sequences


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the composite gate's bigram table from the default model's answers.")
    parser.add_argument("--out", default="mtpflow/data/" + DEFAULT_TABLE)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tasks", type=int, default=len(TASKS), help="tasks per topic to answer (0 = none)")
    parser.add_argument("--text", nargs="*", default=[], help="JSONL files whose prompt (or text) fields join the corpus")
    args = parser.parse_args(argv)
    from mtpflow.model import load_model

    loaded = load_model(args.model)
    prompts = corpus_prompts(args.tasks)
    sequences = generate_corpus(loaded, prompts, args.max_new_tokens, args.batch_size) if prompts else []
    for path in args.text:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                sequences.append(loaded.tokenizer(row.get("prompt") or row.get("text") or "")["input_ids"])
    vocab_size = max(len(loaded.tokenizer), int(loaded.model.config.vocab_size))
    table = BigramTable.from_sequences(sequences, vocab_size, tokenizer_fingerprint(loaded.tokenizer))
    table.save(args.out)
    print(f"{len(sequences)} sequences, {sum(map(len, sequences))} tokens, {table.keys.size} bigrams -> {args.out}")


if __name__ == "__main__":
    main()
