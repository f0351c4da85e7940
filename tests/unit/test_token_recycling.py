"""Token recycling's parts on hand-made values: the tree template, the adjacency table (expansion along the
template, updates from a verify forward's top-k, seeding from the prompt, a fixed byte size) and the
per-template-node acceptance it learns."""
from __future__ import annotations

import threading

import pytest
import torch

from mtpflow.errors import ConfigError
from mtpflow.strategies.token_recycling import MARK, AdjacencyTable, TokenRecyclingProposer, TreeTemplate
from mtpflow.types import Decision, DecodeState, Draft, SamplingParams, StepRecord, Verification


def test_template_is_breadth_first_and_within_bounds():
    t = TreeTemplate(max_nodes=20, max_depth=4, top_k=4)
    assert len(t) == 20 and max(t.depths) <= 4
    assert all(p < j for j, p in enumerate(t.parents))
    assert t.depths == sorted(t.depths)
    assert all(0 <= r < 4 for r in t.ranks)
    # siblings are distinct ranks of one parent, and rank r exists only after rank r - 1
    seen = {}
    for p, r in zip(t.parents, t.ranks):
        seen.setdefault(p, []).append(r)
    assert all(sorted(rs) == list(range(len(rs))) for rs in seen.values())
    assert t.ranks[0] == 0 and t.parents[0] == -1  # the root's argmax candidate comes first
    assert sum(1 for d in t.depths if d == 1) >= 2  # it branches at the root


def table_with(vocab=10, top_k=3, nodes=12, depth=3) -> AdjacencyTable:
    return AdjacencyTable(vocab, top_k, TreeTemplate(nodes, depth, top_k))


def test_expand_follows_the_table_and_drops_unknown_successors():
    table = table_with()
    assert table.expand(1, 3) == ([], [], [])  # nothing known yet
    table.update([1, 2], torch.tensor([[2, 3, 4], [5, 6, 7]]))
    tokens, parents, nodes = table.expand(1, 3)
    template = table.template
    for tok, parent, j in zip(tokens, parents, nodes):
        parent_token = 1 if parent < 0 else tokens[parent]
        assert tok == int(table.table[parent_token, template.ranks[j]])
        assert (parent < 0) == (template.parents[j] < 0)
    first = [t for t, p in zip(tokens, parents) if p < 0]
    assert first == [2, 3, 4][: len(first)] and len(first) >= 2
    # only rows 1 and 2 are known: depth 2 exists under token 2, nothing deeper
    assert max(_depth(parents, i) for i in range(len(tokens))) == 2
    assert table.expand(1, 1)[1] == [-1] * len([p for p in parents if p < 0])


def _depth(parents, i):
    d = 1
    while parents[i] >= 0:
        i, d = parents[i], d + 1
    return d


def test_update_keeps_the_last_row_of_a_repeated_token_and_ignores_out_of_range_ids():
    table = table_with()
    table.update([4, 4, 99, -1], torch.tensor([[1, 2, 3], [7, 8, 9], [0, 0, 0], [0, 0, 0]]))
    assert table.table[4].tolist() == [7, 8, 9]
    assert int((table.table >= 0).sum()) == 3


def test_seed_fills_only_rows_never_seen_newest_successor_first():
    table = table_with(top_k=2)
    table.update([3], torch.tensor([[9, 8]]))
    table.seed([1, 2, 1, 5, 1, 2, 3, 4])
    assert table.table[1].tolist() == [2, 5]  # newest first, distinct
    assert table.table[3].tolist() == [9, 8]  # the target's own candidates are not overwritten
    assert table.table[4].tolist() == [-1, -1]


def test_table_bytes_are_fixed():
    table = table_with(vocab=1000, top_k=8, nodes=40, depth=6)
    size = table.nbytes()
    assert size >= 1000 * 8 * 4
    for step in range(50):
        table.update(list(range(step, step + 10)), torch.randint(0, 1000, (10, 8)))
        table.observe([0, 1], [True, True], [True, False], 0.99)
    assert table.nbytes() == size


def state(tokens, k=8):
    t = torch.tensor(tokens)
    return DecodeState(tokens=t, prompt_len=1, step=0, next_position=len(tokens) - 1,
                       sampling=SamplingParams(), max_new_tokens=64)


def record_for(draft: Draft, accepted: list[int], logits: torch.Tensor, st: DecodeState) -> StepRecord:
    decision = Decision(torch.tensor(accepted, dtype=torch.long), 0)
    return StepRecord(step=0, k=4, draft=draft, num_proposed=draft.num_nodes, decision=decision, emitted=(),
                      emitted_kinds=(), target_tokens=(), target_probs=(), node_target_argmax=logits.argmax(-1),
                      node_target_probs=torch.zeros(draft.num_nodes), forward_seconds=0.0, step_seconds=0.0,
                      stage_seconds={}, time_since_start=0.0, state=st,
                      verification=Verification(logits, None, 0.0))


class _Context:
    def __init__(self, vocab):
        self.model, self.tokenizer, self.shared, self.model_id = None, list(range(vocab)), None, "m"
        self.prompt_tokens = torch.tensor([0, 1])


def test_the_proposer_learns_from_the_verify_forward():
    vocab = 12
    proposer = TokenRecyclingProposer(top_k=3, template_nodes=10, max_depth=3, shared=False,
                                      seed_from_prompt=False)
    proposer.on_run_start(_Context(vocab))
    st = state([0, 5])
    assert proposer.propose(st, 4).num_nodes == 0
    # a K = 0 step: the root's row teaches the table what follows token 5
    logits = torch.zeros(1, vocab)
    logits[0, [6, 7, 8]] = torch.tensor([3.0, 2.0, 1.0])
    proposer.on_step_end(record_for(Draft.empty(), [], logits, st))
    draft = proposer.propose(st, 4)
    assert draft.tokens.tolist() == [6, 7, 8] and draft.parents.tolist() == [-1, -1, -1]
    assert draft.source == "token_recycling" and draft.scores["calibrated"].tolist() == [1.0] * 3
    assert draft.scores["pfs"].tolist() == pytest.approx(draft.probs.tolist())
    before = proposer.table.acceptance()[: 3].tolist()
    # node 0 (token 6) accepted, the others rejected; rows 1..3 teach successors of 6, 7 and 8
    logits = torch.zeros(4, vocab)
    for row, succ in ((1, 9), (2, 10), (3, 11)):
        logits[row, succ] = 5.0
    proposer.on_step_end(record_for(draft, [0], logits, st))
    after = proposer.table.acceptance()[: 3].tolist()
    j = [int(m) - 1 for m in draft.scores[MARK].tolist()]
    assert after[j[0]] > before[j[0]] and after[j[1]] < before[j[1]] and after[j[2]] < before[j[2]]
    assert int(proposer.table.table[6, 0]) == 9 and int(proposer.table.table[7, 0]) == 10
    assert proposer.run_stats() == {"recycling_drafts": 1, "recycling_draft_tokens": 3, "recycling_accepted": 1}
    deeper = proposer.propose(st, 4)
    assert 9 in deeper.tokens.tolist()  # the next level now comes from token 6's row
    assert proposer.propose(st, 1).depths().max() == 1  # never deeper than K


def test_a_shared_table_is_one_object_and_thread_safe():
    from mtpflow.shared import SharedState

    shared = SharedState()
    ctx = _Context(50)
    ctx.shared = shared
    a, b = TokenRecyclingProposer(top_k=4), TokenRecyclingProposer(top_k=4)
    a.on_run_start(ctx)
    b.on_run_start(ctx)
    assert a.table is b.table and len(shared.names()) == 1
    c = TokenRecyclingProposer(top_k=4, shared=False)
    c.on_run_start(ctx)
    assert c.table is not a.table

    def hammer(seed):
        g = torch.Generator().manual_seed(seed)
        for _ in range(200):
            a.table.update(torch.randint(0, 50, (6,), generator=g).tolist(), torch.randint(0, 50, (6, 4), generator=g))
            a.table.expand(int(torch.randint(0, 50, (1,), generator=g)), 8)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(a.table.table.min()) >= -1 and int(a.table.table.max()) < 50


@pytest.mark.parametrize("bad", [{"top_k": 0}, {"max_depth": 0}, {"shared": "yes"}, {"memory": 0},
                                 {"template_nodes": 0}, {"prior_weight": -1}])
def test_bad_options_are_config_errors(bad):
    with pytest.raises(ConfigError):
        TokenRecyclingProposer(**bad)
