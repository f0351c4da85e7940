"""The domain classifier and DomainAwareK: held-out accuracy and latency of the shipped artifact, the labeled
prompt set, the k_map configuration, adaptive moves, and domain / confidence / K in stats and JSON output."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from mtpflow.tools.domain_prompts import DOMAINS, load_prompts
from mtpflow.errors import ConfigError
from mtpflow.types import Draft
from mtpflow.strategies.domain import (CHARS_PER_TOKEN_BOUND, DEFAULT_K_MAP, DomainAwareK, load_classifier,
                                      request_text)
from helpers import hf_greedy, make_pipeline

CODE_PROMPT = "Why does my Python script raise KeyError when I read the JSON response from the API?"
HEALTH_PROMPT = "My son has had a fever of 39 C for two days and a rash. Should we see a doctor?"


def context(prompt: str):
    return SimpleNamespace(prompt=prompt, tokenizer=None, device="cpu", prompt_tokens=torch.zeros(3))


def test_prompt_set_is_large_varied_and_split():
    rows = load_prompts()
    for domain in DOMAINS:
        mine = [r for r in rows if r["domain"] == domain]
        assert len(mine) >= 150
        held = [r for r in mine if r["split"] == "heldout"]
        assert 0.15 <= len(held) / len(mine) <= 0.3
        # the split is by source group: no template or hand-written request is on both sides
        assert not {r["group"] for r in held} & {r["group"] for r in mine if r["split"] == "train"}
    texts = [r["text"].lower() for r in rows]
    assert len(set(texts)) == len(texts)


def test_heldout_accuracy_of_shipped_classifier():
    classifier = load_classifier()
    held = load_prompts("heldout")
    correct = sum(classifier.predict(r["text"])[0] == r["domain"] for r in held)
    assert correct / len(held) >= 0.9


def test_a_pasted_document_is_cut_before_tokenizing(monkeypatch):
    """What keeps the classifier fast on any request: it tokenizes at most CHARS_PER_TOKEN_BOUND * max_tokens
    characters. (Its speed itself, well under 10 ms, is a measurement for the benchmark, not a test.)"""
    classifier = load_classifier()

    class Counting:  # the real tokenizer, noting how much text it was handed
        def __init__(self, inner):
            self.inner, self.lengths = inner, []

        def encode(self, text, **kwargs):
            self.lengths.append(len(text))
            return self.inner.encode(text, **kwargs)

    counting = Counting(classifier.tokenizer)
    monkeypatch.setattr(classifier, "tokenizer", counting)
    document = " ".join(r["text"] for r in load_prompts("heldout")) * 5
    limit = CHARS_PER_TOKEN_BOUND * classifier.max_tokens
    assert len(document) > 10 * limit
    assert classifier.predict(document) == classifier.predict(document[:limit])
    assert counting.lengths == [limit, limit]


def test_classifier_reads_the_user_turn_of_a_chat_prompt():
    templated = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
                 f"<|im_start|>user\n{CODE_PROMPT}<|im_end|>\n<|im_start|>assistant\n")
    assert request_text(templated) == CODE_PROMPT
    assert request_text("plain text") == "plain text"
    domain, confidence = load_classifier().predict(request_text(templated))
    assert domain == "code" and 0.2 < confidence <= 1.0


def test_domain_sets_k_with_configurable_map():
    sel = DomainAwareK()
    facts = sel.on_run_start(context(CODE_PROMPT))
    assert facts["domain"] == "code" and facts["domain_k"] == DEFAULT_K_MAP["code"] == 6
    assert 0 < facts["domain_confidence"] <= 1 and sel.select_k(state=None) == 6
    custom = DomainAwareK(k_map={"code": 9, "healthcare": 0})
    assert custom.on_run_start(context(CODE_PROMPT))["domain_k"] == 9
    assert custom.on_run_start(context(HEALTH_PROMPT))["domain_k"] == 0
    assert custom.k_map["finance"] == DEFAULT_K_MAP["finance"]  # unlisted domains keep the defaults
    fixed = DomainAwareK(k=5)
    assert fixed.on_run_start(context(HEALTH_PROMPT))["domain_k"] == 5
    assert DomainAwareK(k_min=2).on_run_start(context(HEALTH_PROMPT))["domain_k"] == 2  # clamped up from 1


@pytest.mark.parametrize("kwargs", [dict(k_map={"legal": 3}), dict(k_map={"code": -1}), dict(adaptive="yes"),
                                    dict(k_min=5, k_max=2)])
def test_domain_rejects_bad_settings(kwargs):
    with pytest.raises(ConfigError):
        DomainAwareK(**kwargs)


def test_adaptive_starts_at_the_domain_k_and_moves():
    sel = DomainAwareK(adaptive=True, k_max=10)
    sel.on_run_start(context(CODE_PROMPT))
    assert sel.select_k(state=None) == 6
    full = SimpleNamespace(draft=Draft.chain(list(range(6))),
                           decision=SimpleNamespace(num_accepted=6))
    sel.on_step_end(full)
    assert sel.select_k(state=None) == 8
    missed = SimpleNamespace(draft=Draft.chain(list(range(8))),
                             decision=SimpleNamespace(num_accepted=1))
    sel.on_step_end(missed)
    assert sel.select_k(state=None) == 7
    still = DomainAwareK()  # without adaptive the domain's K never moves
    still.on_run_start(context(CODE_PROMPT))
    still.on_step_end(full)
    assert still.select_k(state=None) == 6


DOMAIN_K = ["~strategy.select_k.k", "strategy.select_k._target_=mtpflow.strategies.domain.DomainAwareK"]


def test_domain_in_stats_end_to_end_lossless(tiny):
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=16", "chat=false", "trace=off", *DOMAIN_K)
    result = pipe(CODE_PROMPT)
    assert result.stats["domain"] == "code" and result.stats["domain_k"] == 6
    assert 0 < result.stats["domain_confidence"] <= 1
    assert result.stats["mtp_avg_k_used"] <= 6
    assert result.token_ids == hf_greedy(tiny.model, pipe.encode(CODE_PROMPT), 16)


def test_domain_and_length_in_json_output(tiny, tmp_path, monkeypatch, capsys):
    import mtpflow.model
    from mtpflow.cli import main

    monkeypatch.setenv("MTPFLOW_CACHE", str(tmp_path))
    monkeypatch.setattr(mtpflow.model, "load_model", lambda *a, **k: tiny)
    assert main(["strategy=pld", f"prompt={HEALTH_PROMPT}", "output=json", "max_new_tokens=6", "chat=false",
                 "trace=off", *DOMAIN_K]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["domain"] == "healthcare" and doc["stats"]["domain_k"] == 1
    assert main(["strategy=length_dynamic", f"prompt={HEALTH_PROMPT}", "output=json", "max_new_tokens=6",
                 "chat=false", "trace=off"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["stats"]["length_k"] == 4 and doc["stats"]["prompt_length_tokens"] > 0
