"""Tree drafts through the real loop: the tree attention mask, the gate's path choice and the KV commit.

An oracle proposer drafts trees around the true greedy continuation (right and wrong branches, random
shapes); output must equal HF greedy generate token for token, and accepted lengths must be long.
"""
from __future__ import annotations

import torch

from helpers import OracleTreeProposer, hf_greedy, make_pipeline
from mtpflow.backends.hf import tree_allowed
from mtpflow.types import Draft


def test_tree_mask_each_node_sees_the_root_and_its_ancestors():
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    allowed = tree_allowed(parents)
    assert allowed.shape == (7, 7)
    ancestors = {0: [], 1: [0], 2: [0], 3: [0, 1], 4: [0, 1], 5: [0, 1, 3], 6: [0, 2]}  # rows: 0 = root
    for row in range(7):
        assert {int(c) for c in allowed[row].nonzero().flatten()} == set(ancestors[row]) | {row}, row


def test_tree_logits_equal_chain_logits(tiny):
    """A node's logits in a tree forward equal the logits of the same path run as a plain chain."""
    from mtpflow.target import Target

    model = tiny.model
    prompt = torch.tensor([5, 9, 12, 40, 7])
    tree = Draft(torch.tensor([11, 22, 33, 44, 55]), torch.tensor([-1, -1, 0, 1, 3]))
    t = Target(model)
    t.prefill(prompt[:-1])
    v = t.verify(int(prompt[-1]), tree, root_position=4)
    for node, path in {2: [11, 33], 4: [22, 44, 55]}.items():
        c = Target(model)
        c.prefill(prompt[:-1])
        chain = c.verify(int(prompt[-1]), Draft.chain(path), root_position=4)
        torch.testing.assert_close(v.logits[node + 1], chain.logits[-1], atol=1e-4, rtol=1e-4)


def test_oracle_trees_match_hf(tiny):
    vocab = len(tiny.tokenizer)
    g = torch.Generator().manual_seed(7)
    total_steps = total_tokens = 0
    for i in range(8):
        ids = torch.randint(1, vocab, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
        reference = hf_greedy(tiny.model, ids, 48)
        oracle = OracleTreeProposer(reference, vocab, seed=i, wrong_rate=0.1 + 0.1 * (i % 3))
        pipe = make_pipeline(tiny, "baseline", "max_new_tokens=48", f"k={2 + i % 5}")
        result = pipe(prompt_ids=ids, extra_plugins=(oracle,))
        assert result.token_ids == reference, f"prompt {i}"
        total_steps += result.stats["verify_forwards"]
        total_tokens += result.stats["new_tokens"]
        assert any(not r.draft.is_chain for r in result.steps)
    assert total_tokens / max(total_steps, 1) > 2.0  # the oracle's right branches were really accepted


def test_oracle_chains_match_hf(tiny):
    vocab = len(tiny.tokenizer)
    for i in range(6):
        ids = list(range(3 + i, 12 + 2 * i))
        reference = hf_greedy(tiny.model, ids, 40)
        oracle = OracleTreeProposer(reference, vocab, seed=100 + i, wrong_rate=0.15, branch=1)
        result = make_pipeline(tiny, "baseline", "max_new_tokens=40", "k=6")(prompt_ids=ids, extra_plugins=(oracle,))
        assert result.token_ids == reference
        assert result.stats["mal"] > 2.0


def test_prefill_sends_only_the_last_row_through_the_lm_head(tiny):
    """A prompt's prefill needs the next token's logits only: the LM head sees one row, the logits equal the
    last row of a full forward, and the cache holds the whole prompt."""
    from mtpflow.target import Target

    model = tiny.model
    prompt = torch.tensor([5, 9, 12, 40, 7, 3, 18])
    head_rows = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda mod, args, out: head_rows.append(args[0].shape[-2]))
    try:
        t = Target(model)
        logits, _ = t.prefill(prompt)
    finally:
        handle.remove()
    assert head_rows == [1] and logits.shape == (1, model.config.vocab_size)
    with torch.inference_mode():
        full = model(input_ids=prompt[None]).logits[0, -1]
    torch.testing.assert_close(logits[0], full, rtol=1e-5, atol=1e-5)
    assert t.cache_len == prompt.numel()


def test_target_argmax_is_computed_once_and_is_each_rows_argmax():
    from mtpflow.types import Verification

    logits = torch.randn(5, 40)
    v = Verification(logits=logits, hidden=None, forward_seconds=0.0)
    first = v.target_argmax()
    assert torch.equal(first, logits.argmax(-1))
    assert v.target_argmax() is first  # cached: the gate and the loop share one argmax per step
    assert v == Verification(logits=logits, hidden=None, forward_seconds=0.0)  # the cache is not a field
