"""The int8 self-draft (strategy ``int8_draft``): the target's own layers over an int8 copy of their weights draft
on the target's KV cache (``kv: target``: ``NativeCPUBackend.self_draft``, native rows), or the int8 model on a cache
of its own (``kv: own``: ``draft_model.Int8ModelDraft``); the float32 target verifies. Lossless on the tiny model and
the default model, what each draft computes, its memory, its errors, the cost model's live base."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from helpers import hf_greedy, make_pipeline, make_tiny_model
from mtpflow import backends
from mtpflow.errors import ConfigError, UserError
from mtpflow.backends.native import kernel, products
from mtpflow.strategies.draft_model import SEED_MIN, DraftModelProposer, Int8ModelDraft
from mtpflow.target import Target

pytestmark = pytest.mark.skipif(not kernel.available(), reason="the native CPU kernels could not be built")

PROMPTS = [[5, 17, 23, 8, 42, 11, 9], [3, 3, 7, 19, 2], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]


def native_pipeline(loaded, strategy, *overrides):
    pipe = make_pipeline(loaded, strategy, "trace=off", "model.backend=native_cpu", *overrides)
    assert pipe.engine.backend.name == "native_cpu"
    return pipe


def dequantized(weight: torch.Tensor) -> torch.Tensor:
    q, scale = products.quantize_int8(weight)
    return q.float() * scale[:, None]


@torch.inference_mode()
def test_int8_rows_compute_the_dequantized_model_on_the_float_cache(tiny):
    """The self-draft's tokens are HF's greedy tokens from a copy of the model whose products hold the int8 weights
    (dequantized), continuing from the float32 model's cache of the prompt (the committed entries are the float
    target's), the LM head, embeddings and norms float32."""
    pipe = native_pipeline(tiny, "baseline", "max_new_tokens=2")
    model = pipe.loaded.model
    backend = pipe.engine.backend
    pipe(prompt_ids=PROMPTS[0])
    prompt = torch.tensor(PROMPTS[2])
    target = Target(backend)
    target.prefill(prompt[:-1])
    drafted = backend.self_draft(target, int(prompt[-1]), len(prompt) - 1, 6)
    assert drafted is not None and len(drafted) == 6
    reference = make_tiny_model(len(tiny.tokenizer), seed=0)
    assert torch.equal(reference.lm_head.weight, model.lm_head.weight)
    cache = DynamicCache(config=reference.config)
    reference(input_ids=prompt[None, :-1], cache=cache, use_cache=True)  # float32 prefix
    for layer in reference.model.layers:
        for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                       layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            linear.weight.copy_(dequantized(linear.weight))
    token, expected = int(prompt[-1]), []
    for i in range(6):
        out = reference(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[len(prompt) - 1 + i]]),
                        cache=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        expected.append(token)
    assert drafted == expected
    spec = backend._rows
    layers, hidden, inter = model.config.num_hidden_layers, model.config.hidden_size, model.config.intermediate_size
    qkv = backend.qkv[0].weight.shape[0]
    per_layer = (qkv + hidden + 2 * inter) * hidden + inter * hidden  # int8 weights of the four products
    assert spec.int8_bytes == layers * (per_layer + 4 * (qkv + hidden + 2 * inter + hidden))  # + float scales


@pytest.mark.parametrize("kv,prompt_kv,named", [("target", "target", "target int8"),
                                                ("own", "target", "int8 model, own cache"),
                                                ("own", "own", "int8 model, own cache")])
def test_int8_draft_is_lossless_and_drafts(tiny, kv, prompt_kv, named):
    """Lossless whichever cache drafts; with ``kv: own`` and ``prompt_kv: target`` a prompt of at least SEED_MIN
    tokens starts the draft's cache from the float target's entries, a shorter one is read by the int8 model."""
    pipe = native_pipeline(tiny, "int8_draft", "max_new_tokens=40", "strategy.propose.cost_aware=false",
                           f"strategy.propose.kv={kv}", f"strategy.propose.prompt_kv={prompt_kv}")
    for prompt in PROMPTS:
        result = pipe(prompt_ids=prompt)
        assert result.token_ids == hf_greedy(pipe.loaded.model, prompt, 40)
        assert result.stats["draft_tokens"] > 0 and result.stats["accepted_tokens"] > 0
        assert result.stats["draft_model"] == named
        # the first draft's sequence is the prompt and the first token (its root): the prompt's entries are copied
        seeded = len(prompt) if (kv, prompt_kv) == ("own", "target") and len(prompt) >= SEED_MIN else 0
        assert result.stats.get("draft_entries_from_target", 0) == seeded


def test_the_prompt_entries_come_from_the_float_cache_quantized(tiny):
    """``prompt_kv: target``: the draft cache's entries of the prompt are the float target's keys and values, each
    quantized as the int8 kernel stores its own (int8 values, then the float32 scale); the root is fed through the
    int8 model, and the next draft keeps those entries (only what was committed since is fed)."""
    from mtpflow.backends.native.int8_reference import quantize_rows

    model = make_tiny_model(len(tiny.tokenizer), seed=0)
    draft = Int8ModelDraft(backends.create(model, "native_cpu", int8=backends.quantize_int8(model)), max_context=64)
    float_backend = backends.create(make_tiny_model(len(tiny.tokenizer), seed=0), "native_cpu")
    prompt = torch.tensor(PROMPTS[2])
    target = Target(float_backend)
    target.prefill(prompt[:-1])
    source = (target.pool, target.kv.slot, target.cache_len)
    drafted, _ = draft.draft(prompt, 4, lambda: source)
    n = len(prompt) - 1
    assert draft.seeded == n and len(drafted) == 4 and draft.ids[:len(prompt)] == prompt.tolist()
    d = draft.target.pool.head_dim
    for layer in range(len(target.pool.keys)):
        for float_side, int8_side in ((target.pool.keys, draft.target.pool.keys),
                                      (target.pool.values, draft.target.pool.values)):
            x = float_side[layer][target.kv.slot, :, :n].float()
            got = int8_side[layer][draft.target.kv.slot, :, :n]
            q, scale = quantize_rows(x)
            assert torch.equal(got[..., :d], q.to(torch.int8))
            assert torch.equal(got[..., d:].contiguous().view(torch.float32)[..., 0], scale)
            assert (got[..., :d].float() * scale[..., None] - x).abs().max() <= scale.max() / 2 + 1e-6
    longer = torch.cat([prompt, torch.tensor(drafted[:2])])  # two draft tokens accepted: no copy, nothing re-read
    draft.draft(longer, 3, lambda: (target.pool, target.kv.slot, len(longer) - 1))
    assert draft.seeded == n and draft.ids[:len(longer)] == longer.tolist()


def test_a_short_or_missing_source_is_read_by_the_int8_model(tiny):
    """No float entries (a target that evicted some: ``committed_entries`` gives None) or fewer than SEED_MIN: the
    draft reads the tokens itself, and drafts what the int8 model's reference decodes."""
    model = make_tiny_model(len(tiny.tokenizer), seed=0)
    weights = backends.quantize_int8(model)
    want = backends.int8_reference(weights).greedy(torch.tensor(PROMPTS[2]), 4)
    float_backend = backends.create(make_tiny_model(len(tiny.tokenizer), seed=0), "native_cpu")
    for source in (lambda: None, "short"):
        draft = Int8ModelDraft(backends.create(model, "native_cpu", int8=weights), max_context=64)
        prompt = torch.tensor(PROMPTS[2])
        if source == "short":
            target = Target(float_backend)
            target.prefill(prompt[:SEED_MIN - 1])
            source = (lambda t: lambda: (t.pool, t.kv.slot, t.cache_len))(target)
        assert draft.draft(prompt, 4, source)[0] == want and draft.seeded == 0


def test_own_cache_draft_in_an_engine_batch(tiny):
    """Several sequences at once, each with its own draft cache slot over the one shared int8 model: each output is
    HF's greedy, and the int8 model is made once for the engine."""
    pipe = native_pipeline(tiny, "int8_draft", "max_new_tokens=24", "strategy.propose.cost_aware=false")
    handles = pipe.engine.submit_many([pipe.request(prompt_ids=p) for p in PROMPTS])
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result().token_ids == hf_greedy(pipe.loaded.model, prompt, 24)
    assert [n for n in pipe.shared.names() if n.startswith("int8_model:")] == ["int8_model:draft"]


def test_own_cache_draft_is_the_int8_models_greedy(tiny):
    """``Int8ModelDraft`` drafts what the int8 model's reference decodes greedily from the same tokens, on the first
    draft (the whole prompt caught up), after a draft whose tokens were rejected (its entries dropped) and after more
    tokens were committed (caught up in one forward); near the context's end it drafts fewer."""
    model = make_tiny_model(len(tiny.tokenizer), seed=0)
    weights = backends.quantize_int8(model)
    reference = backends.int8_reference(weights)
    draft = Int8ModelDraft(backends.create(model, "native_cpu", int8=weights), max_context=64)
    prompt = torch.tensor(PROMPTS[2])
    want = reference.greedy(prompt, 12)
    drafted, seconds = draft.draft(prompt, 5)
    assert drafted == want[:5] and seconds is not None and seconds > 0
    drafted, _ = draft.draft(prompt, 3)  # the same root again: the last draft's entries were dropped
    assert drafted == want[:3]
    longer = torch.cat([prompt, torch.tensor(want[:4])])  # four tokens committed since
    assert draft.draft(longer, 6)[0] == want[4:10]
    # the entries of the accepted draft tokens were kept: the cache holds the sequence and the fed draft tokens
    assert draft.target.cache_len == len(draft.ids) == len(longer) + 5 and draft.ids[len(prompt):] == want[:9]
    drafted, seconds = draft.draft(longer, 1)  # the root alone: one row of the backend's loop, timed
    assert drafted == [want[4]] and seconds > 0
    assert len(draft.draft(torch.cat([longer, torch.zeros(64 - 16, dtype=torch.long)]), 8)[0]) == 2


@pytest.mark.parametrize("kv", ["target", "own"])
def test_int8_copy_is_built_once_and_bounded_after_200_requests(tiny, kv):
    """The int8 weights are the draft's only extra memory: built once per model (``kv: target``: the backend's int8
    copy; ``kv: own``: the int8 model, shared by the engine's requests, and no copy), the same after 200 requests."""
    pipe = native_pipeline(tiny, "int8_draft", "max_new_tokens=6", "strategy.propose.cost_aware=false",
                           f"strategy.propose.kv={kv}")
    g = torch.Generator().manual_seed(3)
    built = None
    for i in range(200):
        pipe(prompt_ids=torch.randint(1, len(tiny.tokenizer), (int(torch.randint(3, 20, (1,), generator=g)),),
                                      generator=g).tolist())
        spec = pipe.engine.backend._rows
        if kv == "target":
            now = (spec.int8_bytes, id(spec._q8[1]))
        else:
            assert spec.int8_bytes == 0
            own = pipe.shared.get("int8_model:draft", lambda: None)
            now = (own.w.buffer.numel(), id(own))
        built = built or now
        assert now == built
    assert built[0] > 0


def test_draft_cost_uses_this_runs_forward_times():
    """The one-token forward the draft length is weighed against comes from this run's verify forwards (each over
    the profile curve's factor for its draft length), the fastest of the last 8, not from the profile alone: a
    profile measured on a faster moment of the machine made every draft look dear against a draft timed now."""
    from types import SimpleNamespace
    from mtpflow.cost_model import CostCurve

    p = DraftModelProposer(quantize="int8", acceptance_prior=0.9)
    p.curve, p.base_seconds, p.draft_seconds = CostCurve({0: 0.010, 4: 0.012, 8: 0.015}), 0.010, 0.009
    assert p.draft_length(8) == 0  # against a 10 ms step a 9 ms draft token does not pay
    for n, seconds in [(0, 0.031), (8, 0.045), (4, 0.036)]:  # this run: a one-token forward of 30 ms
        p.on_step_end(SimpleNamespace(draft=SimpleNamespace(num_nodes=n), decision=SimpleNamespace(num_accepted=n),
                                      forward_seconds=seconds))
    assert p.base_seconds == pytest.approx(0.030)
    assert p.draft_length(8) >= 3


def test_int8_draft_says_where_it_cannot_pay():
    p = DraftModelProposer(quantize="int8")
    assert "int8 model itself" in p.unavailable({"quantize": "int8"})
    assert "native_cpu" in p.unavailable({"backend": "hf"})
    assert "CPU" in p.unavailable({"device": "cuda"})
    assert p.unavailable({"backend": "auto"}) is None
    assert DraftModelProposer(layers=2).unavailable({"quantize": "int8"}) is None


def test_int8_draft_errors():
    with pytest.raises(ConfigError, match="quantize must be null or int8"):
        DraftModelProposer(quantize="int4")
    with pytest.raises(ConfigError, match="kv must be target or own"):
        DraftModelProposer(quantize="int8", kv="mine")
    with pytest.raises(ConfigError, match="prompt_kv must be target or own"):
        DraftModelProposer(quantize="int8", kv="own", prompt_kv="mine")
    with pytest.raises(ConfigError, match="leave model and layers null"):
        DraftModelProposer(quantize="int8", layers=2)
    with pytest.raises(ConfigError, match="quantize=int8"):
        DraftModelProposer()


def test_int8_draft_needs_the_native_forward(tiny):
    pipe = make_pipeline(tiny, "int8_draft", "max_new_tokens=8", "trace=off", "model.backend=hf",
                         "strategy.propose.cost_aware=false")
    with pytest.raises(UserError, match="needs the native_cpu backend's self-draft"):
        pipe(prompt_ids=PROMPTS[0])


@pytest.mark.default_model
def test_int8_draft_on_the_default_model(default_loaded):
    """Token for token HF greedy on the embedded model, with long accepted chains: drafting 8 tokens every step
    (no cost model, so the figure does not depend on this machine's timings), MAL at least 3 (6.3 on the benchmark)."""
    pipe = make_pipeline(default_loaded, "int8_draft", "max_new_tokens=48", "trace=off",
                         "strategy.propose.cost_aware=false")
    for prompt in ("Summarize: The meeting moved from Tuesday to Thursday at 3 pm because the client asked for more "
                   "time to review the proposal.", "What is the capital of France? Answer in one sentence."):
        ids = pipe.encode(prompt).tolist()
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(default_loaded.model, ids, 48)
        assert result.stats["mal"] >= 3.0, result.stats
