"""The heads' training text never comes from the benchmarks: the shipped training prompts share no word 8-gram with
the bench's 32 prompts, and none is a Spec-Bench question or carries one of its fingerprinted 8-grams (a one-in-16
sample, ``tests/fixtures/specbench_fingerprint.txt.gz``: a copied passage of 30 words or more almost surely shows);
and a user's prompt file that overlaps the bench's prompts is one line."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from mtpflow.errors import UserError
from mtpflow.tools.head_data import benchmark_overlap, load_prompts

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
sys.path.insert(0, str(FIXTURES))
from specbench_fingerprint import kept, short_hash, shingles, whole  # noqa: E402


def specbench_hits(prompts: list[str]) -> list[str]:
    """The prompts whose whole text is a Spec-Bench turn or that carry a fingerprinted 8-gram of one."""
    pairs = [line.split() for line in gzip.decompress((FIXTURES / "specbench_fingerprint.txt.gz").read_bytes())
             .decode().splitlines()]
    wholes = {h for kind, h in pairs if kind == "whole"}
    grams = {h for kind, h in pairs if kind == "shingle"}
    hits = []
    for p in prompts:
        marks = {short_hash(s) for s in shingles(p)}
        if short_hash(whole(p)) in wholes or {h for h in marks if kept(h)} & grams:
            hits.append(p)
    return hits


def test_the_shipped_training_prompts_are_not_benchmark_prompts():
    prompts = load_prompts(None)
    assert len(prompts) > 1400
    assert benchmark_overlap(prompts) == []
    assert specbench_hits(prompts) == []


def test_the_overlap_checks_find_benchmark_text():
    """The checks above are not vacuous: the bench's own prompts and a Spec-Bench question (MT-bench's first) are
    found, also inside a longer prompt; a prompt merely on the same topic is not."""
    bench = [json.loads(line)["prompt"] for line in
             (Path(__file__).resolve().parents[2] / "mtpflow" / "data" / "bench_prompts.jsonl").read_text().splitlines()]
    assert benchmark_overlap(bench) == bench
    assert benchmark_overlap(["Please help. " + bench[3][:400]]) != []
    question = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences "
                "and must-see attractions.")
    assert specbench_hits([question]) == [question]
    assert specbench_hits(["Write a travel blog post about a trip to Iceland."]) == []


def test_a_prompt_file_with_benchmark_prompts_is_one_line(tmp_path):
    bench = json.loads((Path(__file__).resolve().parents[2] / "mtpflow" / "data" / "bench_prompts.jsonl")
                       .read_text().splitlines()[0])["prompt"]
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"prompt": "Tell me about rivers."}) + "\n" + json.dumps({"text": bench}) + "\n")
    with pytest.raises(UserError, match="1 prompt\\(s\\) overlap the benchmark's prompts") as info:
        load_prompts(str(path))
    assert "\n" not in str(info.value)
