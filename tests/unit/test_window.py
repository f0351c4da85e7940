"""Sliding windows: proposers see only the last W tokens; the attention-sink KV window re-rotates kept
RoPE keys so a model with a 64-token context generates 200 tokens."""
from __future__ import annotations

import pytest
import torch

from helpers import count_runs, hf_greedy, make_pipeline, make_tiny_model, make_tiny_tokenizer
from mtpflow.errors import ConfigError
from mtpflow.plugins import hookimpl
from mtpflow.model import LoadedModel
from mtpflow.strategies.window import AttentionSinkWindow
from mtpflow.target import Target

WINDOW = "+strategy.window={_target_: mtpflow.strategies.window.AttentionSinkWindow, room: 8, headroom: 24}"


@pytest.fixture(scope="module")
def short_context():
    """A tiny Llama whose context is 64 positions."""
    tok = make_tiny_tokenizer()
    model = make_tiny_model(len(tok), seed=2)
    model.config.max_position_embeddings = 64
    return LoadedModel(model, tok, "tiny-llama-ctx64", torch.device("cpu"), torch.float32, 64, (0,))


def test_kept_keys_are_rerotated_to_cache_positions(short_context):
    """Layer-0 keys do not depend on the context, so after eviction they must equal the keys of a fresh
    prefill of the kept tokens at positions 0..n-1."""
    ids = torch.randint(1, 300, (40,), generator=torch.Generator().manual_seed(0))
    keep = torch.cat([torch.arange(4), torch.arange(25, 40)])
    evicted = Target(short_context.model)
    evicted.prefill(ids)
    evicted.keep(keep)
    fresh = Target(short_context.model)
    fresh.prefill(ids[keep])
    assert evicted.position_shift == 40 - keep.numel() and evicted.cache_len == keep.numel()
    torch.testing.assert_close(evicted.cache.layers[0].keys, fresh.cache.layers[0].keys, atol=1e-5, rtol=1e-4)


def test_runs_past_the_context_length(short_context):
    ids = list(range(1, 21))
    without = make_pipeline(short_context, "pld", "max_new_tokens=200", "trace=off")(prompt_ids=ids)
    assert without.stats["stop_reason"] == "context_full"
    result = make_pipeline(short_context, "pld", "max_new_tokens=200", "trace=off", WINDOW)(prompt_ids=ids)
    assert len(result.token_ids) == 200 and result.stats["stop_reason"] == "max_new_tokens"
    assert result.stats["window_evictions"] >= 5
    # before the first eviction nothing changed: the output starts as plain greedy decoding
    first = 64 - 8 - len(ids)
    assert result.token_ids[:first] == hf_greedy(short_context.model, ids, first)


class ContextSpy:
    """Records how many tokens the proposer was allowed to see each step."""

    def __init__(self):
        self.seen = []

    @hookimpl
    def propose(self, state, k):
        self.seen.append(int(state.proposer_context().numel()))
        return None  # abstain: the strategy's proposer drafts


def test_proposer_context_window(tiny):
    spy = ContextSpy()
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=24", "trace=off", "+strategy.context_window=16")
    pipe(prompt_ids=list(range(1, 40)), extra_plugins=(spy,))
    assert spy.seen and max(spy.seen) == 16


def test_validation():
    with pytest.raises(ConfigError):
        AttentionSinkWindow(sink_tokens=4, cache_size=40, headroom=40)
    with pytest.raises(ConfigError):
        AttentionSinkWindow(room=8, headroom=4)
    with pytest.raises(ConfigError):
        AttentionSinkWindow(sink_tokens=-1)


def test_native_rows_keep_windowed_decoding_as_it_was(monkeypatch):
    """After evictions (kept keys re-rotated, later positions shifted) the native_cpu backend's verify forwards
    (mtpflow_llama_rows) decode what the hf backend decodes."""
    from mtpflow.backends.native import cpu as native_cpu
    from mtpflow.backends.native import kernel, products

    if not kernel.available():
        pytest.skip("the native kernel cannot be built here")
    tok = make_tiny_tokenizer()
    model = make_tiny_model(len(tok), seed=2)
    model.config.max_position_embeddings = 64
    loaded = LoadedModel(model, tok, "tiny-llama-ctx64-native", torch.device("cpu"), torch.float32, 64, (0,))
    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")
    outputs = []
    for backend in ("native_cpu", "hf"):
        ran.clear()
        pipe = make_pipeline(loaded, "pld", "max_new_tokens=120", "trace=off", f"model.backend={backend}", WINDOW)
        result = pipe(prompt_ids=list(range(1, 21)))
        assert result.stats["window_evictions"] >= 2
        assert (len(ran) == result.stats["verify_forwards"]) if backend == "native_cpu" else not ran
        outputs.append(result.token_ids)
    assert outputs[0] == outputs[1]  # the rows ran every verify and changed nothing
