"""The composite confidence gate: its three scores, the accept walk over chains and trees, validation, the
bigram table, and that the run's lossy-gate stats (error propagation, hit rate, average K) are right."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import TINY_CORPUS, hf_greedy, make_pipeline
from mtpflow.errors import ConfigError, UserError
from mtpflow.strategies.composite_gate import CompositeConfidenceGate
from mtpflow.strategies.ngram_stats import BigramTable, tokenizer_fingerprint
from mtpflow.types import BONUS, RECOVERED, DecodeState, Draft, SamplingParams, Verification


@pytest.fixture(scope="module")
def tiny_table(tiny, tmp_path_factory):
    tok = tiny.tokenizer
    table = BigramTable.from_sequences([tok(t)["input_ids"] for t in TINY_CORPUS], len(tok), tokenizer_fingerprint(tok))
    path = tmp_path_factory.mktemp("ngram") / "tiny.npz"
    table.save(path)
    return str(path)


def test_bigram_table_scores_and_roundtrip(tmp_path):
    table = BigramTable.from_sequences([[1, 2, 3], [1, 2, 4], [1, 3]], vocab_size=10, fingerprint="x")
    assert table.count(1, 2) == 2 and table.count(2, 3) == 1 and table.count(3, 1) == 0
    assert table.score(1, 2) == pytest.approx(1.0)  # the most frequent follower of 1
    assert table.score(1, 3) == pytest.approx(math.log(2) / math.log(3))
    assert table.score(1, 9) == 0.0
    assert table.score(7, 1) == pytest.approx(math.log(4) / math.log(4))  # unseen prev: unigram back-off
    table.save(tmp_path / "t.npz")
    again = BigramTable.load(tmp_path / "t.npz")
    assert again.fingerprint == "x" and again.score(1, 3) == table.score(1, 3)
    with pytest.raises(UserError):
        BigramTable.load(tmp_path / "missing.npz")


def test_validation(tiny_table):
    with pytest.raises(ConfigError):
        CompositeConfidenceGate(threshold=1.2, ngram_table=tiny_table)
    with pytest.raises(ConfigError):
        CompositeConfidenceGate(local_weight=-0.1, ngram_table=tiny_table)
    with pytest.raises(ConfigError):
        CompositeConfidenceGate(local_weight=0, global_weight=0, semantic_weight=0, ngram_table=tiny_table)
    with pytest.raises(ConfigError):
        CompositeConfidenceGate(ngram_table=None)  # global weight needs a table
    with pytest.raises(ConfigError):
        CompositeConfidenceGate(local_confidence="vibes", ngram_table=tiny_table)
    gate = CompositeConfidenceGate(local_weight=3, global_weight=1, semantic_weight=0, ngram_table=tiny_table)
    assert (gate.local_weight, gate.global_weight) == (0.75, 0.25)


def state_of(tokens, temperature=0.0):
    t = torch.tensor(tokens)
    return DecodeState(tokens=t, prompt_len=1, step=0, next_position=len(tokens),
                       sampling=SamplingParams(temperature=temperature), max_new_tokens=64)


def probs_logits(rows, vocab=6):
    out = torch.full((len(rows), vocab), 1e-6)
    for i, row in enumerate(rows):
        for tok, p in row.items():
            out[i, tok] = p
    return (out / out.sum(-1, keepdim=True)).log()


def test_local_only_walk_chain_and_tree():
    gate = CompositeConfidenceGate(threshold=0.5, local_weight=1, global_weight=0, semantic_weight=0,
                                   ngram_table=None, local_confidence="probability")
    chain = Draft.chain([2, 3, 4])
    logits = probs_logits([{2: 0.9, 1: 0.1}, {3: 0.6, 1: 0.4}, {4: 0.3, 5: 0.7}, {1: 1.0}])
    d = gate.gate(state_of([1, 1]), chain, Verification(logits, None, 0.0))
    assert d.accepted.tolist() == [0, 1] and d.next_token is None and d.next_kind == RECOVERED
    torch.testing.assert_close(d.gate_scores, torch.tensor([0.9, 0.6, 0.3]), atol=1e-4, rtol=0)
    # relative: 0.3 / 0.7 still fails 0.5, but a runner-up at 0.4 / 0.6 of the top passes
    rel = CompositeConfidenceGate(threshold=0.6, local_weight=1, global_weight=0, semantic_weight=0, ngram_table=None)
    lossy = Draft.chain([2, 1])
    d = rel.gate(state_of([1, 1]), lossy, Verification(probs_logits([{2: 0.9, 1: 0.1}, {3: 0.6, 1: 0.4}, {1: 1.0}]), None, 0.0))
    assert d.accepted.tolist() == [0, 1] and d.next_kind == BONUS
    # tree: children 0 (token 2, p 0.3) and 1 (token 3, p 0.7) of the root; node 2 (token 4) under node 1
    tree = Draft(torch.tensor([2, 3, 4]), torch.tensor([-1, -1, 1]))
    logits = probs_logits([{2: 0.3, 3: 0.7}, {1: 1.0}, {4: 0.8, 1: 0.2}, {1: 1.0}])
    d = gate.gate(state_of([1, 1]), tree, Verification(logits, None, 0.0))
    assert d.accepted.tolist() == [1, 2] and d.next_kind == BONUS


def test_global_and_semantic_parts(tiny, tiny_table):
    tok = tiny.tokenizer
    ids = tok("the quick brown fox jumps over the lazy dog")["input_ids"]
    gate = CompositeConfidenceGate(threshold=0.0, local_weight=0, global_weight=1, semantic_weight=1,
                                   ngram_table=tiny_table)

    class Ctx:
        tokenizer, model = tok, tiny.model

    gate.on_run_start(Ctx)
    state = state_of(ids[:4])
    seen = Draft.chain(ids[4:6])  # continues the corpus sentence
    logits = torch.zeros(3, tiny.model.config.vocab_size)
    parts = gate.node_scores(state, seen, Verification(logits, None, 0.0))
    assert parts["global"][0] == pytest.approx(gate.table.score(ids[3], ids[4]))
    assert float(parts["global"][0]) > 0
    assert ((parts["semantic"] >= 0) & (parts["semantic"] <= 1)).all()
    # the semantic part of a path is the cosine of its mean (centred) embedding with the context's
    emb = tiny.model.get_input_embeddings().weight.detach().float()
    mu = emb.mean(0)
    want = torch.nn.functional.cosine_similarity(emb[ids[4:6]].mean(0) - mu, emb[ids[:4]].mean(0) - mu, dim=0)
    assert float(parts["semantic"][1]) == pytest.approx(max(0.0, float(want)), abs=1e-5)


def test_rejects_a_table_from_another_tokenizer(tiny):
    pipe = make_pipeline(tiny, "composite_gate", "max_new_tokens=8", "trace=off")
    with pytest.raises(UserError, match="another tokenizer"):
        pipe(prompt_ids=[1, 2, 3])


def test_lossy_stats_are_right(tiny, tiny_table):
    """error propagation rate = emitted tokens that differ from the target's greedy choice; hit rate = steps
    that emitted more than one token; average K = the K chosen per step."""
    ids = [5] + [7, 8, 9] * 6
    pipe = make_pipeline(tiny, "composite_gate", "max_new_tokens=40", "trace=off", f"strategy.gate.ngram_table={tiny_table}",
                         "strategy.gate.threshold=0.3", "strategy.propose.min_ngram=1")
    result = pipe(prompt_ids=ids)
    steps = result.steps
    differ = sum(e != t for r in steps for e, t in zip(r.emitted, r.target_tokens))
    assert result.stats["mtp_error_propagation_rate"] == pytest.approx(differ / result.stats["new_tokens"], abs=1e-4)
    assert differ > 0  # a low threshold on a random model accepts tokens the target would not pick
    assert result.token_ids != hf_greedy(tiny.model, ids, 40)  # so the output leaves plain greedy decoding
    assert result.stats["mtp_hit_rate"] == pytest.approx(sum(len(r.emitted) > 1 for r in steps) / len(steps), abs=1e-4)
    assert result.stats["mtp_avg_k_used"] == pytest.approx(sum(r.k for r in steps) / len(steps), abs=1e-4)
    for r in steps:
        if r.draft.num_nodes:
            assert r.decision.gate_scores.shape == (r.draft.num_nodes,)
            assert (r.decision.gate_scores[r.decision.accepted] >= 0.3).all()


@pytest.mark.default_model
def test_composite_gate_on_the_default_model(default_loaded):
    pipe = make_pipeline(default_loaded, "composite_gate", "max_new_tokens=32", "trace=off")
    result = pipe("Continue this list exactly: red, green, blue, red, green, blue, red, green,")
    steps = result.steps
    differ = sum(e != t for r in steps for e, t in zip(r.emitted, r.target_tokens))
    assert result.stats["mtp_error_propagation_rate"] == pytest.approx(differ / result.stats["new_tokens"], abs=1e-4)
    assert result.stats["accepted_tokens"] > 0
    assert all(r.decision.gate_scores is not None for r in steps if r.draft.num_nodes)
