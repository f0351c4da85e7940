"""The int8 model (``model.quantize=int8``): its torch reference (``mtpflow.kernels.int8_reference``) defines the
numerics; the W8A8 kernel (``mtpflow_gemm_w8a8``, ``mtpflow_w8a8_rows``) computes them bit for bit, each row on its
own; every lossless strategy over the int8 target equals the reference's greedy token for token, alone and in one
engine batch; the float32 weights are gone; what it does not apply to is one line."""
from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
import yaml

from helpers import make_pipeline, make_tiny_model, prompt_rows, save_tiny_gpt2, tiny_loaded
from mtpflow import backends
from mtpflow.config import available_strategies, compose
from mtpflow.errors import UserError
from mtpflow.kv_cache import KVPool
from mtpflow.backends.native import int8_reference as R, kernel, products
from mtpflow.backends.native.rows import VerifyRows
from mtpflow.request import Request

needs_native = pytest.mark.skipif(not kernel.available(), reason="no C compiler to build the native kernel")
NEW_TOKENS = 24


def int8_loaded(seed: int = 0, **kwargs):
    """``tiny_loaded`` as ``load_model(quantize="int8")`` returns it."""
    loaded = tiny_loaded(seed=seed, **kwargs)
    return dataclasses.replace(loaded, int8=backends.quantize_int8(loaded.model))


def causal(n: int) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool).tril_().to(torch.uint8)


def test_packing_round_trips():
    torch.manual_seed(0)
    for n, k in ((1, 1), (5, 7), (8, 64), (13, 130), (130, 200)):
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        packed = products.pack_q8(q)
        assert packed.shape == products.packed_q8_shape(n, k) and packed.shape[2:] == (products.Q8_PANEL, 4)
        assert packed.shape[1] * 4 % products.Q8_STEP == 0
        for f, c in ((0, 0), (n - 1, k - 1), (n // 2, k // 3)):  # weight [f, c]: step c // 4 of f's panel
            assert packed[f // products.Q8_PANEL, c // 4, f % products.Q8_PANEL, c % 4] == q[f, c]
        assert torch.equal(products.unpack_q8(packed, n, k), q)
        lin = R.Int8Linear(packed, torch.ones(n), q.sum(1, dtype=torch.int32), k)
        ids = torch.tensor([n - 1, 0, n // 2])
        assert torch.equal(lin.rows(ids), q[ids])


def test_the_reference_linear_is_exact_integer_arithmetic():
    """The reference's product against the definition written out in float64 (exact for these sizes)."""
    torch.manual_seed(1)
    x, w = torch.randn(5, 300) * 4, torch.randn(70, 300)
    lin = R.Int8Linear.of(w)
    xq, s = R.quantize_rows(x)
    assert xq.abs().max() <= 127 and torch.equal(xq, xq.round())
    dot = (xq.double() @ lin.rows().double().T).float()
    assert torch.equal(R.linear(x, lin), (dot * s[:, None]) * lin.scale[None, :])
    # an approximation of the float product: within a few quantization steps
    assert (R.linear(x, lin) - x @ w.T).abs().max() < 0.05 * (x @ w.T).abs().max()
    assert torch.equal(R.quantize_rows(torch.zeros(2, 3))[1], torch.ones(2))  # a row of zeros: scale 1


@needs_native
@pytest.mark.parametrize("rows", (1, 2, 3, 5, 6, 7, 12, 13, 17, 25, 33))
@pytest.mark.parametrize("n,k", ((1, 1), (5, 7), (48, 64), (64, 576), (130, 100), (201, 1536)))
def test_the_kernel_product_is_the_reference_bit_for_bit(rows, n, k):
    torch.manual_seed(rows * 1000 + n)
    lin = R.Int8Linear.of(torch.randn(n, k))
    x = torch.randn(rows, k) * 3
    got = products.gemm_w8a8(x, lin.q, lin.scale, lin.wsum, k)
    assert torch.equal(got, R.linear(x, lin))
    alone = torch.cat([products.gemm_w8a8(x[i:i + 1], lin.q, lin.scale, lin.wsum, k) for i in range(rows)])
    assert torch.equal(got, alone)  # each row's result is its own


@needs_native
@pytest.mark.parametrize("tied", (False, True))
def test_the_kernel_forward_is_the_reference_bit_for_bit(tied):
    """A prefill with taps of inner layers, then a verify of two sequences' trees in one call: logits and taps
    equal the reference's, which runs each sequence alone."""
    loaded = tiny_loaded(seed=4, layers=3)
    if tied:
        loaded.model.lm_head.weight = loaded.model.model.embed_tokens.weight
    weights = backends.quantize_int8(loaded.model)
    backend = backends.create(loaded.model, "auto", int8=weights)
    pool = backend.make_pool(2)
    prompts = [torch.tensor([5, 9, 33, 100, 7, 8, 9, 10, 11, 12] * 2), torch.tensor([40, 41, 300, 2])]
    refs = [R.Int8Reference(weights) for _ in prompts]
    taps = (0, 1, -1)
    for slot, (ids, ref) in enumerate(zip(prompts, refs)):
        n = len(ids)
        logits, hidden = backend.run(pool, prompt_rows(ids, slot), taps)
        ref_logits, ref_normed, ref_taps = ref.forward(ids, taps=(0, 1))
        assert torch.equal(logits, ref_logits)
        assert torch.equal(hidden, torch.cat([ref_taps[0], ref_taps[1], ref_normed], dim=-1))
    # a chain of 3 after the first prompt, a single row after the second: one call, rows of both
    chain, single = torch.tensor([17, 18, 19]), torch.tensor([77])
    lengths = [len(p) for p in prompts]
    ids = torch.cat([chain, single])
    positions = torch.cat([torch.arange(lengths[0], lengths[0] + 3), torch.tensor([lengths[1]])])
    allowed = torch.zeros(4, 3, dtype=torch.uint8)
    allowed[:3] = causal(3)
    allowed[3, 0] = 1
    rows = VerifyRows(ids, positions, allowed, [0, 0, 0, 1], [lengths[0] + i for i in range(3)] + [lengths[1]],
                      [lengths[0]] * 3 + [lengths[1]], [0, 0, 0, 3], [3, 3, 3, 1], [0, 3], [3, 1])
    logits, _ = backend.run(pool, rows)
    assert torch.equal(logits[:3], refs[0].forward(chain)[0])
    assert torch.equal(logits[3:], refs[1].forward(single)[0])


@needs_native
@pytest.mark.parametrize("hidden", (256, 320))
def test_long_weighted_sums_are_the_references_bit_for_bit(hidden):
    """The weighted values over more keys than one 32-bit span of fixed-point sums (WQ_SPAN, 512) and an odd count,
    at head sizes the vector path takes whole (64) and with a rest (80): logits equal the reference's."""
    loaded = tiny_loaded(seed=6, layers=2, hidden=hidden)
    weights = backends.quantize_int8(loaded.model)
    backend = backends.create(loaded.model, "auto", int8=weights)
    ids = torch.randint(1, len(loaded.tokenizer), (701,), generator=torch.Generator().manual_seed(6))
    logits, _ = backend.run(backend.make_pool(1), prompt_rows(ids, 0))
    assert torch.equal(logits, R.Int8Reference(weights).forward(ids)[0])


def test_the_cache_holds_the_references_int8_entries_byte_for_byte():
    """After a prefill, each layer's keys and values in the pool are the reference's int8 values and float32 scales
    (head_dim int8 bytes, then the scale's 4): a quarter of float32's bytes and a little more. A float32 pool is
    refused with one line, not written past."""
    loaded = tiny_loaded(seed=5, layers=2)
    weights = backends.quantize_int8(loaded.model)
    backend = backends.create(loaded.model, "auto", int8=weights)
    pool = backend.make_pool(1)
    ids = torch.tensor([5, 9, 33, 100, 7, 8, 9, 10, 11, 12, 13])
    n, d = len(ids), weights.head_dim
    backend.run(pool, prompt_rows(ids, 0))
    ref = R.Int8Reference(weights)
    ref.forward(ids)
    for layer in range(len(weights.layers)):
        for buffers, entries, scales in ((pool.keys, ref.keys, ref.key_scales),
                                         (pool.values, ref.values, ref.value_scales)):
            held = buffers[layer][0, :, :n]  # [kv_heads, n, d + 4] int8
            assert held.dtype == torch.int8 and held.shape[-1] == d + 4
            assert torch.equal(held[..., :d].float(), entries[layer])
            assert torch.equal(held[..., d:].contiguous().view(torch.float32)[..., 0], scales[layer])
            assert scales[layer].gt(0).all()
    # what int8_bench counts a token's cache as: the pool's bytes per entry, and a quarter of float32's plus the scales
    assert pool.token_bytes() * pool.max_slots * pool.capacity == pool.nbytes()
    assert pool.token_bytes() * 4 * d == KVPool(loaded.model, 1).token_bytes() * (d + 4)
    with pytest.raises(ValueError, match="its own KV pool"):
        backend.run(KVPool(loaded.model, 1), prompt_rows(ids, 0))


def _sweep(loaded, strategy, heads_dir):
    from strategy_sweep import sweep_overrides

    return sweep_overrides(strategy, loaded, heads_dir)


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("int8-heads")


@needs_native
def test_every_lossless_strategy_equals_the_int8_reference(heads_dir):
    """Every registered strategy over the int8 target of a tiny model: the lossless ones token-identical to the
    int8 reference's greedy on each prompt, decoded alone and then all of them in one engine batch."""
    from strategy_sweep import PROMPTS

    loaded = int8_loaded(seed=0)
    reference = R.Int8Reference(loaded.int8)
    wants = [reference.greedy(torch.tensor(p), NEW_TOKENS, loaded.eos_token_ids) for p in PROMPTS]
    lossless = [s for s in available_strategies() if compose([f"strategy={s}"]).strategy.get("lossless", False)]
    assert {"baseline", "pld", "mtp", "mtp_heads", "int8_draft"} <= set(lossless)
    drafted = {}
    for strategy in lossless:
        pipe = make_pipeline(loaded, strategy, "trace=off", "temperature=0", f"max_new_tokens={NEW_TOKENS}",
                             "model.quantize=int8", *_sweep(loaded, strategy, heads_dir))
        try:
            assert pipe.engine.backend.describe().startswith("native_cpu cpu int8 w8a8")
            results = [pipe(prompt_ids=p) for p in PROMPTS]
            assert [r.token_ids for r in results] == wants, strategy
            drafted[strategy] = sum(r.stats["accepted_tokens"] for r in results)
        finally:
            pipe.engine.close()
    assert drafted["pld"] > 0 and drafted["mtp"] > 0 and drafted["int8_draft"] > 0
    # one engine batch: every lossless strategy on its own prompt, side by side
    pipe = make_pipeline(loaded, "baseline", "trace=off", "temperature=0", f"max_new_tokens={NEW_TOKENS}",
                         "model.quantize=int8", "max_batch_size=32")
    try:
        requests = []
        for i, strategy in enumerate(lossless):
            overrides = {}
            for item in _sweep(loaded, strategy, heads_dir):  # "strategy.propose.costs=null" -> {"propose.costs": None}
                key, _, value = item.partition("=")
                overrides[key.removeprefix("strategy.")] = yaml.safe_load(value)
            requests.append(Request(prompt_ids=PROMPTS[i % len(PROMPTS)], strategy=strategy, overrides=overrides))
        results = pipe.engine.generate(requests)
    finally:
        pipe.engine.close()
    for i, (strategy, result) in enumerate(zip(lossless, results)):
        assert result.token_ids == wants[i % len(PROMPTS)], strategy


@needs_native
def test_a_bfloat16_model_becomes_the_int8_model_of_its_weights():
    """A model too large for float32 loads in bfloat16 (model.dtype=bfloat16) and is quantized from those weights:
    what is left of it is float32, and its decode equals its reference."""
    loaded = tiny_loaded(seed=5)
    model = loaded.model.to(torch.bfloat16)
    weights = backends.quantize_int8(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    pipe = make_pipeline(dataclasses.replace(loaded, int8=weights), "pld", "trace=off", "max_new_tokens=20",
                         "model.quantize=int8", "strategy.propose.costs=null")
    prompt = [5, 9, 33, 100, 7, 8, 9, 10, 11, 12] * 2
    assert pipe(prompt_ids=prompt).token_ids == R.Int8Reference(weights).greedy(torch.tensor(prompt), 20, (0,))


@needs_native
def test_quantizing_frees_the_float_weights():
    loaded = tiny_loaded(seed=2)
    model = loaded.model
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as SmolLM2's
    vocab, hidden = model.lm_head.weight.shape
    weights = backends.quantize_int8(model)
    floats = sum(p.numel() for p in model.parameters())
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert floats == norms  # only the norms' weights stay float32
    assert model.get_output_embeddings() is model.get_input_embeddings()  # the int8 head, tied
    assert model.get_output_embeddings().weight.shape == (vocab, hidden)
    ids = torch.tensor([[3, 5], [7, 9]])
    assert torch.equal(model.get_input_embeddings()(ids)[1, 0], weights.embedding(torch.tensor([7]))[0])
    assert weights.nbytes < 0.3 * 4 * sum(p.numel() for p in make_tiny_model(vocab, seed=2).parameters())


@needs_native
def test_what_int8_does_not_apply_to_is_one_line():
    wide = make_tiny_model(64, seed=1).to(torch.float64)
    with pytest.raises(UserError, match="model.quantize=int8 does not apply to this model: it runs float32 or "
                                        "bfloat16 or float16 weights and the model is float64"):
        backends.quantize_int8(wide)
    gelu = make_tiny_model(64, seed=1)
    gelu.model.layers[0].mlp.act_fn = torch.nn.GELU()
    with pytest.raises(UserError, match="model.quantize=int8 does not apply to this model: LlamaForCausalLM: its MLP "
                                        "activation is GELU, not SiLU or GELU-tanh"):
        backends.quantize_int8(gelu)
    model = make_tiny_model(64, seed=1)
    weights = backends.quantize_int8(model)
    for name in ("hf", "cuda_graph"):
        with pytest.raises(UserError, match=f"runs on the native_cpu backend, not model.backend={name}"):
            backends.create(model, name, int8=weights)


@pytest.mark.parametrize("argv, message", [
    (["model.quantize=int4"], "model.quantize must be null or one of int8, got 'int4'"),
    (["model.quantize=int8", "model.backend=hf"], "model.quantize=int8 runs on the native_cpu backend"),
    (["model.quantize=int8", "model.backend=cuda_graph"], "model.quantize=int8 runs on the native_cpu backend"),
    (["model=hf", "model.name=GPT2", "model.quantize=int8", "chat=false"],
     "model.quantize=int8 does not apply to this model: GPT2LMHeadModel: its family is not one the layer "
     "description knows"),
])
def test_bad_int8_settings_are_one_line_exit_2(argv, message, tmp_path):
    if any("GPT2" in a for a in argv):
        if not kernel.available():
            pytest.skip("no C compiler: the message would name the kernel, not the model")
        argv = [a.replace("GPT2", str(save_tiny_gpt2(tmp_path / "gpt2"))) for a in argv]
    out = subprocess.run([sys.executable, "-m", "mtpflow", "prompt=hi", "trace=off", "max_new_tokens=4", *argv],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = [line for line in out.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr
