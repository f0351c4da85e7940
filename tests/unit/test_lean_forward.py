"""The lean Llama forward (``mtpflow.forward``) computes what HF's forward computes, over the KV pool's views:
prefill, one row, a chain after a cache, and a batch with its 4D mask; greedy decoding through it stays
identical to HF ``generate``. The ``native_cpu`` backend (``mtpflow.backends.native.cpu``: fused products, the
native kernels, ``mtpflow_llama_rows``) computes what the ``hf`` backend (the lean forward over the model's own
modules) computes, over the same pool state."""
from __future__ import annotations

import pytest
import torch

from helpers import count_runs, hf_greedy, make_pipeline, make_tiny_model
from mtpflow import forward as lean
from mtpflow.backends.hf import HFBackend
from mtpflow.backends.native import cpu as native_cpu
from mtpflow.backends.native import kernel, products
from mtpflow.kv_cache import BatchCache, KVPool, SequenceKV
from mtpflow.types import hidden_taps


@pytest.fixture()
def model():
    return make_tiny_model(96, layers=3)


def run_both(model, fn):
    """fn(use_lean) on two fresh pools; returns both results."""
    return fn(True), fn(False)


def hf_or_lean(model, use_lean, ids, positions, mask, cache, need_hidden=True, keep=0):
    if use_lean:
        return lean.forward(model, ids, positions, mask, cache, need_hidden, logits_to_keep=keep)
    extra = {"logits_to_keep": keep} if keep else {}
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                output_hidden_states=need_hidden, **extra)
    return out.logits, out.hidden_states[-1]


def test_supported_models():
    model = make_tiny_model(32, layers=1)
    assert model.config._attn_implementation == "sdpa" and lean.supports(model)
    eager = make_tiny_model(32, layers=1)
    eager.config._attn_implementation = "eager"
    assert not lean.supports(eager)  # another attention: HF's own forward...
    pool = KVPool(eager, max_slots=1)
    ids = torch.tensor([[3, 7, 9, 11]])
    with torch.inference_mode():
        logits, hidden = lean.run(eager, ids, torch.arange(4)[None], None, SequenceKV(pool).view(), True, 1)
        full = eager(input_ids=ids, output_hidden_states=True)
    assert logits.shape[1] == 1 and torch.allclose(logits[0, -1], full.logits[0, -1], atol=1e-6)  # ...through run
    assert torch.allclose(hidden, full.hidden_states[-1], atol=1e-6)


def test_the_config_key_turns_it_off():
    """``model.lean_forward=false``: the backend runs the model's own forward (no environment variable does)."""
    from mtpflow.backends import ExecutionSpec, create

    spec = ExecutionSpec.from_config({"model": {"lean_forward": False, "backend": "hf"}})
    backend = create(make_tiny_model(32, layers=1), spec)
    assert backend.lean is False and backend.spec is spec
    assert "lean_forward=false" in spec.describe()


@torch.inference_mode()
def test_prefill_then_rows_match_hf(model):
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, 96, (1, 11), generator=g)
    chain = torch.randint(1, 96, (1, 4), generator=g)

    def run(use_lean):
        pool = KVPool(model, max_slots=1)
        seq = SequenceKV(pool)
        cache = seq.view()
        outs = [hf_or_lean(model, use_lean, prompt, torch.arange(11)[None], None, cache)]
        seq.length = cache.layers[0].length
        cache = seq.view()
        outs.append(hf_or_lean(model, use_lean, chain[:, :1], torch.tensor([[11]]), None, cache))  # one row
        seq.length = cache.layers[0].length
        cache = seq.view()
        outs.append(hf_or_lean(model, use_lean, chain, torch.arange(12, 16)[None], None, cache))  # a chain
        cache = seq.view()
        outs.append(hf_or_lean(model, use_lean, chain, torch.arange(12, 16)[None], None, cache, keep=1))
        return outs

    mine, theirs = run_both(model, run)
    for (la, ha), (lb, hb) in zip(mine, theirs):
        assert torch.equal(la, lb) and torch.equal(ha, hb)  # the same operations in the same order
    assert mine[-1][0].shape[1] == 1  # logits_to_keep


@torch.inference_mode()
def test_batch_with_a_4d_mask_matches_hf(model):
    g = torch.Generator().manual_seed(1)
    lengths = [7, 3, 12]

    def run(use_lean):
        pool = KVPool(model, max_slots=3)
        seqs = [SequenceKV(pool) for _ in lengths]
        for seq, n in zip(seqs, lengths):
            g.manual_seed(n)
            cache = seq.view()
            model(input_ids=torch.randint(1, 96, (1, n), generator=g), cache=cache, use_cache=True)
            seq.length = cache.layers[0].length
        q = 3
        cache = BatchCache(pool, lengths, q)
        allowed = torch.zeros(3, q, cache.kv_length, dtype=torch.bool)
        for b, n in enumerate(lengths):
            allowed[b, :, :n] = True
            allowed[b, :, n:n + q] = torch.tril(torch.ones(q, q, dtype=torch.bool))
        mask = torch.zeros(3, 1, q, cache.kv_length).masked_fill_(~allowed[:, None], torch.finfo(torch.float32).min)
        ids = torch.tensor([[5, 6, 7], [8, 9, 10], [11, 12, 13]])
        positions = torch.tensor(lengths)[:, None] + torch.arange(q)[None]
        return hf_or_lean(model, use_lean, ids, positions, mask, cache)

    (la, ha), (lb, hb) = run_both(model, run)
    assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_greedy_through_the_lean_forward_equals_hf(tiny):
    prompt = [5, 17, 23, 8, 42, 11, 9]
    for strategy in ("baseline", "pld"):
        pipe = make_pipeline(tiny, strategy, "max_new_tokens=24", "trace=off", "model.backend=hf")
        assert lean.supports(pipe.loaded.model) and type(pipe.engine.backend) is HFBackend
        result = pipe(prompt_ids=prompt)
        assert result.token_ids == hf_greedy(tiny.model, prompt, 24), strategy


def test_hidden_taps_name_layers_and_reject_bad_values():
    model = make_tiny_model(32, layers=8)
    assert hidden_taps(model, False) == () and hidden_taps(model, True) == (-1,)
    assert hidden_taps(model, "eagle3") == (2, 4, 5)  # low, middle, high of 8 layers
    assert hidden_taps(make_tiny_model(32, layers=2), "eagle3") == (0,)
    assert hidden_taps(model, [1, -1]) == (1, -1)
    for bad in ("eagle4", [7], [-2], []):
        with pytest.raises(ValueError, match="needs_hidden_states"):
            hidden_taps(model, bad)


@torch.inference_mode()
@pytest.mark.parametrize("use_lean", [True, False])
def test_taps_are_the_layer_outputs_hf_reports(use_lean):
    """Taps through ``run`` (lean, and the model's own forward) equal HF's ``hidden_states[i + 1]``, concatenated."""
    model = make_tiny_model(96, layers=4)
    ids = torch.tensor([[5, 9, 2, 44, 17]])
    pool = KVPool(model, max_slots=1)
    _, taps = lean.run(model, ids, torch.arange(5)[None], None, SequenceKV(pool).view(), (0, 2, -1), lean=use_lean)
    states = model(input_ids=ids, output_hidden_states=True).hidden_states
    want = torch.cat([states[1], states[3], states[-1]], dim=-1)
    assert taps.shape == want.shape and torch.allclose(taps, want, atol=1e-5)


@pytest.mark.parametrize("backend", ["hf", "native_cpu"])
def test_batch_verify_gives_each_sequence_its_own_taps(backend):
    """One batched forward with a sequence that wants the last hidden state and one that wants EAGLE-3's layers:
    each gets its own taps, equal to what its verify alone returns (``native_cpu``: inner-layer taps run the lean
    forward's layers with the backend's products)."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = make_tiny_model(96, layers=8)
    if backend == "native_cpu":
        if not kernel.available():
            pytest.skip("the native kernel cannot be built here")
        backend = native_cpu.NativeCPUBackend(model)
    else:
        backend = HFBackend(model)
    pool = KVPool(model, max_slots=2)
    taps = [(-1,), hidden_taps(model, "eagle3")]
    prompts = [torch.tensor([3, 8, 1, 40]), torch.tensor([7, 7, 21, 5, 9, 60])]
    chain = Draft(tokens=torch.tensor([12, 30]), parents=torch.tensor([-1, 0]))
    batched = [Target(backend, need_hidden=t, pool=pool) for t in taps]
    for target, prompt in zip(batched, prompts):
        target.prefill(prompt)
    results = backend.verify(batched, [4, 6], [chain, chain], [len(p) for p in prompts])
    for t, prompt, got in zip(taps, prompts, results):
        alone = Target(backend, need_hidden=t)
        alone.prefill(prompt)
        want = alone.verify(4 if len(prompt) == 4 else 6, chain, len(prompt))
        assert got.hidden.shape == want.hidden.shape == (3, 64 * len(t))
        assert torch.allclose(got.hidden, want.hidden, atol=1e-4)  # float noise of a padded batch; values reach ~30


def _native_model(**config):
    if not kernel.available():
        pytest.skip("the native kernel cannot be built here")
    model = make_tiny_model(96, layers=3)
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


def _module_state(model):
    """Each module's class and attribute names, the state dict's names and the parameter count."""
    return ([(name, type(m), sorted(vars(m))) for name, m in model.named_modules()], list(model.state_dict()),
            sum(p.numel() for p in model.parameters()))


def test_fused_projections_compute_what_the_parts_compute(monkeypatch):
    """The native backend's fused q/k/v and gate/up products give what the parts give through the same kernels
    and what the model's own modules give; the model keeps its modules, attributes and state dict, its parts'
    weights become views into the fused weight, and a part given a new weight is used alone."""
    model = _native_model()
    before = _module_state(model)
    backend = native_cpu.NativeCPUBackend(model)
    assert _module_state(model) == before
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 96, (2, 9), generator=g)
    positions = torch.arange(9)[None].expand(2, 9)

    def run(products):
        pool = KVPool(model, max_slots=2)
        seqs = [SequenceKV(pool) for _ in range(2)]
        with torch.inference_mode():
            out = lean.forward(model, ids, positions, None, BatchCache(pool, [0, 0], 9), True, products=products)
        assert len(seqs) == pool.used
        return out

    fused = {id(f.weight) for f in backend.qkv + backend.gate_up}
    assert len(fused) == 6 and backend.qkv[0].weight.shape[0] == 64 + 2 * 32  # q, k, v (2 of 4 heads) per layer
    products = []  # for each native product: whether its weight is a fused one
    real_linear = backend.linear
    monkeypatch.setattr(backend, "linear",
                        lambda w, *a, **k: products.append(id(w) in fused) or real_linear(w, *a, **k))
    fused_logits, fused_hidden = run(backend.products)
    assert sum(products) == 6  # the fused products really ran, once per layer each
    products.clear()
    with monkeypatch.context() as m:
        m.setattr(native_cpu._Fused, "ready", lambda self: False)  # every part alone
        logits, hidden = run(backend.products)
    assert products and not any(products)
    torch.testing.assert_close(fused_logits, logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_hidden, hidden, rtol=1e-5, atol=1e-5)
    module_logits, module_hidden = run(lean.MODULE_PRODUCTS)  # the model's own modules (the hf backend)
    torch.testing.assert_close(fused_logits, module_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_hidden, module_hidden, rtol=1e-5, atol=1e-5)
    attn = model.model.layers[0].self_attn
    qkv = backend.qkv[0]
    assert attn.k_proj.weight.data_ptr() == qkv.weight.data_ptr() + attn.q_proj.weight.numel() * 4
    assert qkv.ready() and backend.gate_up[1].ready()
    attn.k_proj.weight = torch.nn.Parameter(attn.k_proj.weight.detach().clone())  # replaced: used alone
    assert not qkv.ready() and backend.gate_up[1].ready()


def test_greedy_with_fused_projections_equals_hf(tiny):
    prompt = [5, 17, 23, 8, 42, 11, 9]
    if not kernel.available():
        pytest.skip("the native kernel cannot be built here")
    pipe = make_pipeline(tiny, "pld", "max_new_tokens=24", "trace=off", "model.backend=native_cpu")
    model = pipe.loaded.model
    reference = hf_greedy(model, prompt, 24)
    result = pipe(prompt_ids=prompt)
    backend = pipe.engine.backend
    assert backend.name == "native_cpu" and backend.qkv and all(f.ready() for f in backend.qkv + backend.gate_up)
    assert type(model.lm_head) is torch.nn.Linear  # no class swapped
    assert result.token_ids == reference
    assert hf_greedy(model, prompt, 24) == reference  # HF's own forward over the parts (now views) unchanged


@pytest.fixture(scope="module")
def avx2_kernels(tmp_path_factory):
    """small_gemm.c built for CPUs without AVX-512 (8-float vectors), or None where it cannot be."""
    cc = kernel.compiler()
    out = tmp_path_factory.mktemp("avx2") / "avx2.so"
    if cc is None or not kernel.build(cc, out, (*kernel.FLAGS, "-mno-avx512f")):
        return None
    return kernel.load(out)


@pytest.mark.parametrize("build", ["this", "avx2"])  # the kernels built for this CPU, and the 8-float build
@pytest.mark.parametrize("context", [11, 300])  # 300: attention over more than 128 entries runs on threads
def test_native_rows_verify_one_sequence_as_the_lean_forward_does(context, build, avx2_kernels, monkeypatch):
    """A sequence's own verify (``Target.verify``) through mtpflow_llama_rows: plain steps and a chain give the
    logits, hidden states, KV entries and length the ``hf`` backend's lean forward gives (the attention over the
    cached prefix and SiLU take vector exponentials, the tree's own entries the scalar loop)."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = _native_model()
    native = native_cpu.NativeCPUBackend(model)
    if build == "avx2":
        if avx2_kernels is None:
            pytest.skip("the compiler cannot target AVX2 without AVX-512 here")
        assert avx2_kernels.mtpflow_vector_width() == 8
        native.lib = avx2_kernels  # every native call of this backend: the rows, the products, the LM head
    prompt = torch.randint(1, 96, (context,), generator=torch.Generator().manual_seed(2))
    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")

    def run(backend):
        with torch.inference_mode():
            target = Target(backend, need_hidden=True)
            target.prefill(prompt)
            outs = [target.verify(token, Draft.chain([]), context + step) for step, token in enumerate((5, 17, 42))]
            outs.append(target.verify(9, Draft.chain([3, 4, 5]), context + 3))
            n = target.cache_len
            return outs, target.pool.keys[1][0, :, :n].clone(), target.pool.values[2][0, :, :n].clone(), n

    mine, keys, values, length = run(native)
    assert len(ran) == 4
    theirs, keys_ref, values_ref, length_ref = run(HFBackend(model))
    assert len(ran) == 4
    assert length == length_ref == context + 7
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)  # another summation order only
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(keys, keys_ref, rtol=1e-5, atol=1e-5)  # the new entries written into the pool
    torch.testing.assert_close(values, values_ref, rtol=1e-5, atol=1e-5)


def test_native_rows_decline_what_they_do_not_compute(monkeypatch):
    """A model the rows cannot compute is not taken (``not_applicable``: ``auto`` picks ``hf``), one they can (a bias on
    a product) is; a weight replaced
    after the backend was built (``_RowSpec.ready``) sends the verify to the lean forward's layers, which compute
    the model as it is now."""
    from mtpflow import backends
    from mtpflow.target import Target
    from mtpflow.types import Draft

    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")

    def verify(backend):
        with torch.inference_mode():
            target = Target(backend, need_hidden=True)
            target.prefill(torch.tensor([5, 9, 14]))
            return target.verify(7, Draft.chain([3, 4]), 3)

    def ran_on(backend) -> bool:
        """Whether a verify went through the rows, after checking it computes the model as the hf backend does."""
        ran.clear()
        got, want = verify(backend), verify(HFBackend(backend.model))
        torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=1e-5, atol=1e-5)
        return bool(ran)

    assert native_cpu.not_applicable(_native_model()) is None
    assert ran_on(native_cpu.NativeCPUBackend(_native_model()))
    gelu = _native_model()  # an activation the layer description does not know (erf GELU)
    gelu.model.layers[1].mlp.act_fn = torch.nn.GELU()
    why = "LlamaForCausalLM: its MLP activation is GELU, not SiLU or GELU-tanh"
    assert native_cpu.not_applicable(gelu) == why
    with pytest.raises(ValueError, match=why):
        native_cpu.NativeCPUBackend(gelu)
    assert backends.create(gelu, "auto").name == "hf"
    biased = _native_model()  # a bias on one product: a part of the description, computed by the rows
    biased.model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.randn(64) * 0.1)
    assert ran_on(native_cpu.NativeCPUBackend(biased))
    replaced = native_cpu.NativeCPUBackend(_native_model())
    assert ran_on(replaced) and replaced._rows.ready()
    down = replaced.model.model.layers[2].mlp.down_proj
    with torch.no_grad():
        down.weight = torch.nn.Parameter(down.weight.detach() * -2.0)  # a weight swapped after the first call
    assert not replaced._rows.ready() and not ran_on(replaced)
    assert replaced.fallbacks == {"a weight was replaced": 1}  # named and counted, never silent
    assert replaced.stats()["backend_fallbacks"] == {"a weight was replaced": 1}
    part = native_cpu.NativeCPUBackend(_native_model())
    assert ran_on(part)
    k_proj = part.model.model.layers[1].self_attn.k_proj
    with torch.no_grad():
        k_proj.weight = torch.nn.Parameter(k_proj.weight.detach() * 0.5)  # one part of a fused product
    assert not part._rows.ready() and not ran_on(part)
    assert part.self_draft(Target(part), 5, 0, 2) is None  # the self-draft declines too


def test_greedy_through_the_native_rows_equals_hf(tiny, monkeypatch):
    if not kernel.available():
        pytest.skip("the native kernel cannot be built here")
    prompt = [5, 17, 23, 8, 42, 11, 9]
    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")  # every verify forward (plain steps, drafts)
    for strategy in ("baseline", "pld"):
        pipe = make_pipeline(tiny, strategy, "max_new_tokens=40", "trace=off", "model.backend=native_cpu")
        ran.clear()
        result = pipe(prompt_ids=prompt)
        assert result.token_ids == hf_greedy(pipe.loaded.model, prompt, 40), strategy
        assert len(ran) == result.stats["verify_forwards"], strategy


@pytest.mark.parametrize("drafted", ["none", "mixed", "wide"])
def test_native_rows_verify_a_batch_as_the_lean_forward_does(drafted, monkeypatch):
    """A batched verify through mtpflow_llama_rows (only real rows, each sequence's tree visibility; a verify of
    more rows than any draft bucket takes the rows too) against the ``hf`` backend's padded batch forward:
    logits, hidden states, the entries written and the lengths; a pool slot that is not in the batch (a sequence
    between prefill and its first step) stays untouched."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = _native_model()
    g = torch.Generator().manual_seed(3)
    tree = Draft(torch.tensor([7, 8, 9, 10, 11]), torch.tensor([-1, -1, 0, 0, 2]))
    drafts = {"none": [Draft.chain([]), Draft.chain([]), Draft.chain([])],
              "mixed": [Draft.chain([]), Draft.chain([4, 5, 6]), tree],  # 9 rows: the panel products
              "wide": [tree, tree, Draft.chain(list(range(3, 33)))]}[drafted]  # 43 rows
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (9, 140, 30, 12)]

    def run(backend):
        pool = KVPool(model, max_slots=4)
        with torch.inference_mode():
            targets = [Target(backend, pool=pool, need_hidden=True) for _ in prompts]
            for t, p in zip(targets, prompts):
                t.prefill(p)
            batch = targets[:3]  # the fourth rides along
            out = backend.verify(batch, [5, 6, 7], drafts, [t.cache_len for t in batch])
            return out, [t.kv.length for t in targets], [k.clone() for k in pool.keys], [v.clone() for v in pool.values]

    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")
    mine, lengths, keys, values = run(native_cpu.NativeCPUBackend(model))
    assert len(ran) == 1
    theirs, lengths_ref, keys_ref, values_ref = run(HFBackend(model))
    assert len(ran) == 1
    assert lengths == lengths_ref
    for a, b in zip(mine, theirs):
        torch.testing.assert_close(a.logits, b.logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(a.hidden, b.hidden, rtol=1e-5, atol=1e-5)
    for slot, n in enumerate(lengths):  # every slot's valid entries (the padded path writes padding past them)
        for a, b in zip(keys + values, keys_ref + values_ref):
            torch.testing.assert_close(a[slot, :, :n], b[slot, :, :n], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("changed", ["down_proj", "q_proj"])
def test_native_rows_follow_a_weight_changed_in_place(changed, monkeypatch):
    """The panel copies (from ``panel_min_rows()`` rows) are rebuilt when a weight changes in place, a part of a
    fused product (``q_proj``: a view into the fused q/k/v weight) included: the rows keep computing the model as
    it is now."""
    from mtpflow.target import Target
    from mtpflow.types import Draft

    model = _native_model()
    native = native_cpu.NativeCPUBackend(model)
    chain = Draft.chain([3, 4, 5, 6, 7, 8, 9, 10])  # 9 rows: the panel products
    ran = count_runs(monkeypatch, native_cpu._RowSpec, "run_groups")

    def logits(backend):
        with torch.inference_mode():
            target = Target(backend)
            target.prefill(torch.arange(1, 12))
            return target.verify(5, chain, 11).logits

    before = logits(native)
    with torch.no_grad():
        if changed == "down_proj":
            model.model.layers[1].mlp.down_proj.weight.mul_(-2.0)
        else:
            model.model.layers[0].self_attn.q_proj.weight.mul_(0.5)
    after = logits(native)
    assert len(ran) == 2 and native._rows.ready()  # changed in place, not replaced: still the rows
    assert not torch.allclose(before, after, atol=1e-3)
    torch.testing.assert_close(after, logits(HFBackend(model)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["hf", "native_cpu"])
def test_packed_prefill_computes_each_prompts_own_prefill(backend, monkeypatch):
    """``target.prefill_many`` runs several prompts' rows in one forward (products over every row, attention per
    sequence): each sequence gets the logits, taps and cache entries its prefill alone gives, a 1-token prompt
    and one that starts after a reused prefix included."""
    from mtpflow.prefix_cache import BLOCK, PrefixKVCache
    from mtpflow.target import Target, prefill_many

    if backend == "native_cpu" and not kernel.available():
        pytest.skip("the native kernel cannot be built here")
    model = make_tiny_model(96, layers=3)
    backend = native_cpu.NativeCPUBackend(model) if backend == "native_cpu" else HFBackend(model)
    g = torch.Generator().manual_seed(5)
    system = torch.randint(1, 96, (BLOCK + 2,), generator=g)
    prompts = [torch.randint(1, 96, (n,), generator=g) for n in (9, 1, 23)]
    prompts.append(torch.cat([system, torch.randint(1, 96, (6,), generator=g)]))  # reuses the stored system prompt
    taps = [(), (-1,), (0, -1), ()]
    pool = KVPool(model, max_slots=2 * len(prompts) + 1)
    packs = count_runs(monkeypatch, lean, "forward_packed")
    with torch.inference_mode():
        prefix = PrefixKVCache(max_bytes=10**8)
        Target(backend, need_hidden=False, pool=pool).prefill_cached(torch.cat([system, torch.tensor([3])]), prefix)
        alone = [Target(backend, need_hidden=t, pool=pool) for t in taps]
        want = [a.prefill(p) for a, p in zip(alone, prompts)]
        together = [Target(backend, need_hidden=t, pool=pool) for t in taps]
        got = prefill_many(together, prompts, prefix)
    assert len(packs) == 1 and [reused for _, _, reused in got] == [0, 0, 0, BLOCK]
    for (logits, hidden, _), (w_logits, w_hidden), t, a, b, p in zip(got, want, taps, alone, together, prompts):
        torch.testing.assert_close(logits, w_logits, rtol=1e-5, atol=1e-5)
        assert (hidden is None) == (not t)
        if t:
            torch.testing.assert_close(hidden, w_hidden, rtol=1e-5, atol=1e-5)
        assert a.cache_len == b.cache_len == p.numel()
        for layer in range(pool.num_layers):
            torch.testing.assert_close(b.kv.keys(layer), a.kv.keys(layer), rtol=1e-5, atol=1e-5)
            n = int(p.numel())
            torch.testing.assert_close(pool.values[layer][b.kv.slot, :, :n], pool.values[layer][a.kv.slot, :, :n],
                                       rtol=1e-5, atol=1e-5)
