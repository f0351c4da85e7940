"""Backend selection (auto / torch / triton, scoped per run and per thread, validated in the config) and the
decode loop producing identical tokens whichever implementation runs the gate and prompt-lookup kernels."""
from __future__ import annotations

import random
import threading

import pytest
import torch

from mtpflow.errors import ConfigError, UserError
from mtpflow.plugins import hookimpl
from mtpflow.kernels import requested_impl, resolve_impl, set_default_impl, use_impl
from mtpflow.kernels.dispatch import interpreter_enabled
from mtpflow.strategies.pld import find_ngram_continuation
from mtpflow.types import Draft


def test_auto_uses_the_reference_for_cpu_tensors():
    assert resolve_impl("auto", "cpu") == "torch"
    assert resolve_impl("torch", "cpu") == "torch"
    # CPU tensors run the interpreter when it is on (this folder's conftest turns it on without CUDA); on a
    # CUDA machine it is off and host-resident data falls back to the reference
    expected = "triton" if interpreter_enabled() else "torch"
    assert resolve_impl("triton", "cpu") == expected
    with pytest.raises(ConfigError):
        resolve_impl("cuda-please", "cpu")


def test_scoped_impl_is_per_thread_and_restored():
    seen = {}
    with use_impl("triton"):
        assert requested_impl() == "triton"
        worker = threading.Thread(target=lambda: seen.setdefault("other", requested_impl()))
        worker.start()
        worker.join()
        with use_impl("torch"):
            assert requested_impl() == "torch"
        assert requested_impl() == "triton"
    assert seen["other"] == "auto" and requested_impl() == "auto"


def test_default_setter_validates():
    with pytest.raises(ConfigError):
        set_default_impl("fast")
    set_default_impl("torch")
    try:
        assert requested_impl() == "torch"
    finally:
        set_default_impl("auto")


def test_config_key_is_validated(tiny):
    from helpers import make_pipeline

    with pytest.raises(UserError, match="kernels must be one of"):
        make_pipeline(tiny, "pld", "kernels=fast")


class PromptLookupTree:
    """A tree around prompt lookup: the n-gram continuation as one branch plus random siblings and dead ends,
    so the gate's tree path and the n-gram kernel both run every step."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.rng = vocab, random.Random(seed)

    @hookimpl
    def propose(self, state, k):
        chain = find_ngram_continuation(state.tokens, 1, 3, k).tolist() or [self.rng.randrange(1, self.vocab)]
        tokens, parents, parent = [], [], -1
        for tok in chain:
            for _ in range(self.rng.randrange(0, 3)):
                tokens.append(self.rng.randrange(1, self.vocab))
                parents.append(parent)
            tokens.append(tok)
            parents.append(parent)
            parent = len(tokens) - 1
        return Draft(torch.tensor(tokens), torch.tensor(parents), source="lookup_tree")


def test_decode_tokens_identical_with_either_impl(tiny):
    from helpers import hf_greedy, make_pipeline

    vocab = len(tiny.tokenizer)
    ids = [5, 9, 12, 40, 5, 9, 12, 7, 5, 9]
    reference = hf_greedy(tiny.model, ids, 14)
    outputs = {}
    for impl in ("torch", "triton"):  # plain PLD with both implementations runs in test_tree_attention_kernel
        tree = make_pipeline(tiny, "baseline", "max_new_tokens=14", "k=4", f"kernels={impl}")(
            prompt_ids=ids, extra_plugins=(PromptLookupTree(vocab, seed=1),))
        assert any(not r.draft.is_chain for r in tree.steps)
        outputs[impl] = (tree.token_ids, [r.decision.accepted.tolist() for r in tree.steps])
    assert outputs["torch"] == outputs["triton"]
    assert outputs["torch"][0] == reference
