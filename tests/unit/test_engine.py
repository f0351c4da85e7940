"""The engine: many requests decoded together, each exactly as it would be alone.

Greedy requests in a batch (mixed strategies, prompt lengths, tree and chain drafts, requests that join
mid-run) equal HF ``generate`` token for token; sampling requests keep the target distribution; a bad or
failing request fails alone; cancelled requests leave the batch; streaming, threads and asyncio work.
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from helpers import OracleTreeProposer, count_runs, hf_greedy, make_tiny_model, make_tiny_tokenizer
from mtpflow.config import compose
from mtpflow.cost_model import BatchCostModel
from mtpflow.engine import Engine, QueueFull
from mtpflow.errors import UserError
from mtpflow.plugins import hookimpl
from mtpflow.loop import RETRY_DRAFTS_EVERY
from mtpflow.model import LoadedModel
from mtpflow.request import Request

NEW = 32


def make_engine(loaded, *overrides):
    """batch_k=off: each strategy drafts as it would alone (the batch-aware cap has its own test)."""
    return Engine(compose(["strategy=pld", "trace=off", f"max_new_tokens={NEW}", "batch_k=off", *overrides]),
                  loaded=loaded)


def random_prompts(n: int, seed: int, vocab: int = 300) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 40, (n,), generator=g).tolist()
    prompts = [torch.randint(1, vocab, (k,), generator=g).tolist() for k in lengths]
    for i in range(0, n, 3):  # repeated spans, so prompt lookup really drafts and gets accepted
        prompts[i] = prompts[i] * 3
    return prompts


# (strategy, overrides): the lookup proposers draft every match (costs=null: on a tiny model the measured
# verify cost would rightly stop drafting), jacobi drafts a fixed K
STRATEGIES = [("baseline", {}), ("pld", {"propose.costs": None}), ("adaptive", {"propose.costs": None}),
              ("jacobi", {"k": 3}), ("length_dynamic", {}), ("pld", {"propose.costs": None})]


def test_admission_idle_takes_all_running_takes_the_step_token_budget(tiny, monkeypatch):
    """An idle engine admits a whole ``submit_many`` list in one go; while a request decodes, waiting prompts
    join in steps holding at most ``prefill_tokens_per_step`` prompt tokens (a longer prompt still joins,
    alone); every request decodes as HF greedy."""
    starts = []  # (engine step at admission, prompt length)
    real_start = Engine._start

    def recording(self, handles):
        starts.extend((self.steps, int(h.prepared.prompt_ids.numel())) for h in handles)
        return real_start(self, handles)

    monkeypatch.setattr(Engine, "_start", recording)
    engine = make_engine(tiny, "strategy=baseline", "max_batch_size=8", "prefill_tokens_per_step=25")
    g = torch.Generator().manual_seed(11)
    idle = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (12, 30, 5, 9)]
    assert [r.token_ids for r in engine.generate([Request(prompt_ids=p) for p in idle])] == \
        [hf_greedy(tiny.model, p, NEW) for p in idle]
    assert len({step for step, _ in starts}) == 1  # all four admitted before the first step, 56 tokens > 25
    starts.clear()

    first_step, queued, calls = threading.Event(), threading.Event(), []

    def hold_first_step(record, tokens):  # the engine thread waits in the first decode step (the first call
        calls.append(record)  # comes from the prefill) until the others are queued
        if len(calls) == 2:
            first_step.set()
            queued.wait(30)

    long_prompt, *short = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (8, 10, 10, 10, 10, 30)]
    try:
        running = engine.submit(Request(prompt_ids=long_prompt, max_new_tokens=60), on_step=hold_first_step)
        assert first_step.wait(30)
        handles = engine.submit_many([Request(prompt_ids=p, max_new_tokens=8) for p in short])
        queued.set()
        results = [h.result() for h in handles]
        assert running.result().token_ids == hf_greedy(tiny.model, long_prompt, 60)
    finally:
        queued.set()
        engine.close()
    steps = [step for step, _ in starts[1:]]
    assert [n for _, n in starts] == [8, 10, 10, 10, 10, 30]
    assert steps[0] == steps[1] < steps[2] == steps[3] < steps[4]  # 10 + 10 fit in 25 tokens, a third does not
    for prompt, result in zip(short, results):
        assert result.token_ids == hf_greedy(tiny.model, prompt, 8)


def test_requests_admitted_together_are_prefilled_in_one_packed_forward(tiny, monkeypatch):
    """An idle engine prefills a ``submit_many`` list in packed forwards of at most ``PACKED_PREFILL_ROWS`` prompt
    rows (one here; two with an 80-row bound, and a prompt alone), and every request still decodes as HF greedy."""
    from mtpflow import forward as lean
    from mtpflow.backends import hf

    packs = count_runs(monkeypatch, lean, "forward_packed")
    prompts = random_prompts(6, seed=21)
    engine = make_engine(tiny, "max_batch_size=8", "prefix_cache_mb=0")  # the second pass prefills whole prompts
    try:
        requests = [Request(prompt_ids=p, strategy=STRATEGIES[i][0], overrides=STRATEGIES[i][1])
                    for i, p in enumerate(prompts)]
        results = engine.generate(requests)
        assert len(packs) == 1
        monkeypatch.setattr(hf, "PACKED_PREFILL_ROWS", 80)
        packs.clear()
        again = engine.generate(requests)
    finally:
        engine.close()
    lengths = [len(p) for p in prompts]
    assert lengths == [51, 37, 38, 36, 36, 2] and len(packs) == 2  # 51 alone | 37 + 38 | 36 + 36 + 2
    for prompt, result, other in zip(prompts, results, again):
        assert result.token_ids == other.token_ids == hf_greedy(tiny.model, prompt, NEW)


def test_a_failing_packed_prefill_falls_back_to_each_prompt_alone(tiny, monkeypatch):
    from mtpflow import forward as lean

    def broken(*args, **kwargs):
        raise RuntimeError("packed prefill broke")

    monkeypatch.setattr(lean, "forward_packed", broken)
    prompts = random_prompts(4, seed=22)
    engine = make_engine(tiny, "strategy=baseline")
    try:
        results = engine.generate([Request(prompt_ids=p) for p in prompts])
    finally:
        engine.close()
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(tiny.model, prompt, NEW)


@pytest.mark.parametrize("max_batch_size", [1, 4, 16])
def test_batch_equals_hf_greedy_with_mixed_strategies_and_joins(tiny, max_batch_size):
    engine = make_engine(tiny, f"max_batch_size={max_batch_size}")
    prompts = random_prompts(18, seed=max_batch_size)
    requests = [Request(prompt_ids=p, strategy=STRATEGIES[i % 6][0], overrides=STRATEGIES[i % 6][1],
                        max_new_tokens=NEW - i % 7) for i, p in enumerate(prompts)]
    results = engine.generate(requests)  # 18 requests through a batch of at most max_batch_size: they join mid-run
    drafted = 0
    for request, result in zip(requests, results):
        assert result.token_ids == hf_greedy(tiny.model, request.prompt_ids, request.max_new_tokens), request.strategy
        drafted += result.stats["draft_tokens"]
    assert drafted > 0  # drafts really went through the batched verify (acceptance: the oracle test below)
    assert engine.steps < sum(r.stats["new_tokens"] for r in results)  # one forward served several sequences


def test_tree_drafts_share_a_forward_with_chains_and_plain_steps(tiny):
    engine = make_engine(tiny, "max_batch_size=8")
    vocab = len(tiny.tokenizer)
    prompts = random_prompts(8, seed=3)
    handles = []
    for i, p in enumerate(prompts):
        reference = hf_greedy(tiny.model, p, NEW)
        plugins = (OracleTreeProposer(reference, vocab, seed=i, wrong_rate=0.2),) if i % 2 == 0 else ()
        strategy = "baseline" if i % 4 != 1 else "pld"
        request = Request(prompt_ids=p, strategy=strategy, overrides={"k": 2 + i % 4} if i % 2 == 0 else {})
        handles.append((engine.submit(request, extra_plugins=plugins, keep_steps=True), reference))
    for i, (handle, reference) in enumerate(handles):
        result = handle.result()
        assert result.token_ids == reference
        if i % 2 == 0:
            assert any(not r.draft.is_chain for r in result.steps) and result.stats["mal"] > 1.5


def test_batch_result_equals_its_own_batch_one_run(tiny):
    prompts = random_prompts(6, seed=11)
    requests = [Request(prompt_ids=p, strategy="jacobi", overrides={"k": 4}) for p in prompts]
    alone = make_engine(tiny, "max_batch_size=1").generate(requests)
    together = make_engine(tiny, "max_batch_size=6").generate(requests)
    assert [r.token_ids for r in alone] == [r.token_ids for r in together]


@pytest.mark.parametrize("cheap", [True, False])
def test_batch_aware_cap_follows_the_cost_model_and_stays_lossless(tiny, cheap):
    """With drafting nearly free the cap keeps every draft; with every extra row as dear as a whole forward it
    cuts drafts to nothing (plain steps) and, once it has seen each sequence's draft size, stops asking the
    proposers at all (no proposal the batch would cut). Either way the output is HF greedy."""
    engine = make_engine(tiny, "max_batch_size=4")
    engine.batch_k = "auto"
    grid = {(b, q): (1.0 + (0.001 if cheap else 1.0) * b * (q - 1)) for b in (1, 4, 16) for q in (1, 3, 9, 17)}
    engine._batch_costs = BatchCostModel(grid)
    prompt = random_prompts(1, seed=6)[0]  # the same request four times: they run every step together
    reference = hf_greedy(tiny.model, prompt, NEW)
    oracles = [OracleTreeProposer(reference, len(tiny.tokenizer), seed=i, wrong_rate=0.1, branch=1) for i in range(4)]
    calls = []
    for oracle in oracles:
        oracle.propose = (lambda f: hookimpl(lambda state, k: calls.append(k) or f(state, k)))(oracle.propose)
    with engine._lock:  # the engine thread waits until all four are queued: they start in the same step
        handles = [(engine.submit(Request(prompt_ids=prompt, strategy="baseline", overrides={"k": 4}),
                                  extra_plugins=(oracle,)), reference) for oracle in oracles]
    drafted = steps = 0
    for handle, reference in handles:
        result = handle.result()
        assert result.token_ids == reference
        drafted += result.stats["draft_tokens"]
        steps += result.stats["verify_forwards"]
    assert (drafted > 0) == cheap
    # dear: each proposer drafts in the first step (its size is unknown), then once every RETRY_DRAFTS_EVERY + 1
    # steps (the sizes refresh); cheap: every step but a sequence's last (one token left: K = 0)
    every = RETRY_DRAFTS_EVERY + 1
    assert len(calls) >= 4 and (len(calls) >= steps - 4 if cheap else len(calls) <= 4 + steps / every + 4), \
        (len(calls), steps)


def test_a_batch_that_stopped_drafting_drafts_again_when_it_pays(tiny):
    """Proposers that find nothing in the first steps (a lookup before its first match) leave a forecast of empty
    drafts, so the batch stops asking them; it asks again every ``RETRY_DRAFTS_EVERY`` steps, and with drafting
    cheap their later drafts run (before, the batch never drafted again). Output: HF greedy."""
    engine = make_engine(tiny, "max_batch_size=4")
    engine.batch_k = "auto"
    engine._batch_costs = BatchCostModel({(b, q): 1.0 + 0.001 * b * (q - 1) for b in (1, 4, 16) for q in (1, 3, 9, 17)})
    prompt = random_prompts(1, seed=7)[0]
    reference = hf_greedy(tiny.model, prompt, NEW)
    oracles = []
    for i in range(4):
        oracle = OracleTreeProposer(reference, len(tiny.tokenizer), seed=i, wrong_rate=0.1, branch=1)
        oracle.propose = (lambda f: hookimpl(lambda state, k: f(state, k) if state.step >= 3 else None))(oracle.propose)
        oracles.append(oracle)
    with engine._lock:
        handles = [engine.submit(Request(prompt_ids=prompt, strategy="baseline", overrides={"k": 4}),
                                 extra_plugins=(oracle,)) for oracle in oracles]
    results = [h.result() for h in handles]
    engine.close()
    assert all(r.token_ids == reference for r in results)
    assert all(r.stats["accepted_tokens"] > 0 for r in results)


class FailsAtStep:
    """Raises from propose at a given step: a strategy that breaks mid-decode."""

    def __init__(self, step: int):
        self.step = step

    @hookimpl
    def propose(self, state, k):
        if state.step == self.step:
            raise RuntimeError("proposer exploded")


def test_a_temperature_too_small_to_divide_by_is_greedy(tiny):
    """Found by fuzzing the server: temperature=5e-324 overflowed the logits to inf and failed the decode with a
    NaN distribution; under 1e-5 (vLLM's rule) a request is greedy."""
    engine = make_engine(tiny)
    prompt = random_prompts(1, seed=3)[0]
    for temperature in (5e-324, 1e-6):
        result = engine.submit(Request(prompt_ids=prompt, temperature=temperature, top_p=5e-324, seed=0)).result()
        assert result.token_ids == hf_greedy(tiny.model, prompt, NEW)


def test_bad_and_failing_requests_fail_alone(tiny):
    engine = make_engine(tiny, "max_batch_size=8")
    for bad, message in [
        (Request(prompt_ids=[1, 2], strategy="nope"), "unknown strategy"),
        (Request(prompt="   "), "empty prompt"),
        (Request(), "empty prompt"),
        (Request(prompt_ids=[1, 2], temperature=-1), "temperature"),
        (Request(prompt_ids=[1, 2], top_p=0), "top_p"),
        (Request(prompt_ids=[1, 2], top_p=float("nan")), "top_p"),
        (Request(prompt_ids=[1, 2], max_new_tokens=0), "max_new_tokens"),
        (Request(prompt_ids=[1, 2], stop=[""]), "stop"),
        (Request(prompt_ids=[1] * 2000), "context"),
        (Request(prompt_ids=[1, 99999]), "prompt_ids"),
        (Request(prompt_ids=[1, 2], overrides={"propose.nonsense": 3}), "unknown parameter"),
        (Request(prompt_ids=[1, 2], overrides={"propose._target_": "os.system"}), "not allowed"),
        (Request(prompt_ids=[1, 2], strategy="baseline", overrides={"propose.max_ngram": 3}), "unknown parameter"),
        (Request(prompt_ids=[1, 2], overrides={"k": -1}), "k"),
    ]:
        with pytest.raises(UserError, match=message):
            engine.submit(bad)
    prompts = random_prompts(5, seed=5)
    good = [engine.submit(Request(prompt_ids=p, overrides={"propose.costs": None})) for p in prompts]
    failing = engine.submit(Request(prompt_ids=prompts[0], overrides={"propose.costs": None}),
                            extra_plugins=(FailsAtStep(3),))
    with pytest.raises(UserError, match="proposer exploded"):
        failing.result()
    assert failing.status == "failed"
    for p, handle in zip(prompts, good):
        assert handle.result().token_ids == hf_greedy(tiny.model, p, NEW)


def test_cancel_leaves_the_batch_and_others_finish(tiny):
    engine = make_engine(tiny, "max_batch_size=4", "max_new_tokens=200")
    prompts = random_prompts(3, seed=8)
    started = threading.Event()
    victim = engine.submit(Request(prompt_ids=prompts[0], max_new_tokens=200),
                           on_step=lambda record, tokens: started.set())
    others = [engine.submit(Request(prompt_ids=p, max_new_tokens=60)) for p in prompts[1:]]
    assert started.wait(60)
    victim.cancel(wait=True)
    assert victim.status == "interrupted" and len(victim.result().token_ids) < 200
    for p, handle in zip(prompts[1:], others):
        assert handle.result().token_ids == hf_greedy(tiny.model, p, 60)
    assert engine.pool.used == 0  # every KV slot went back


def test_stream_threads_and_asyncio(tiny):
    engine = make_engine(tiny, "max_batch_size=8")
    prompts = random_prompts(6, seed=21)
    outputs: dict[int, str] = {}

    def client(i):
        outputs[i] = "".join(engine.stream(Request(prompt_ids=prompts[i], strategy="pld")))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i in range(4):
        expected = tiny.tokenizer.decode(hf_greedy(tiny.model, prompts[i], NEW), skip_special_tokens=True)
        assert outputs[i] == expected

    async def both():
        a = engine.submit(Request(prompt_ids=prompts[4]))
        pieces = [p async for p in a.astream()]
        b = await engine.submit(Request(prompt_ids=prompts[5])).aresult()
        return "".join(pieces), b

    # in a thread of its own: a test run earlier in the session (Playwright's sync API) may have left an event
    # loop running in the main thread, where asyncio.run refuses to start
    box = {}
    runner = threading.Thread(target=lambda: box.update(out=asyncio.run(both())))
    runner.start()
    runner.join(120)
    text, result = box["out"]
    assert result.token_ids == hf_greedy(tiny.model, prompts[5], NEW)
    assert text == tiny.tokenizer.decode(hf_greedy(tiny.model, prompts[4], NEW), skip_special_tokens=True)


def test_stream_holds_back_a_stop_string(tiny):
    engine = make_engine(tiny)
    prompt = random_prompts(1, seed=4)[0]
    full = tiny.tokenizer.decode(hf_greedy(tiny.model, prompt, NEW), skip_special_tokens=True)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    pieces = list(engine.stream(Request(prompt_ids=prompt, stop=[stop])))
    assert "".join(pieces) == full[: full.index(stop)]


def test_queue_bound(tiny):
    engine = make_engine(tiny, "max_batch_size=1", "max_waiting=2")
    prompt = random_prompts(1, seed=2)[0]
    release, running = threading.Event(), threading.Event()

    def hold(record, tokens):  # keeps the engine busy with the first request
        running.set()
        release.wait(60)

    first = engine.submit(Request(prompt_ids=prompt), on_step=hold)
    assert running.wait(60)
    waiting = [engine.submit(Request(prompt_ids=prompt)) for _ in range(2)]
    with pytest.raises(QueueFull):
        engine.submit(Request(prompt_ids=prompt))
    release.set()
    for h in [first, *waiting]:
        assert h.result(60).token_ids == hf_greedy(tiny.model, prompt, NEW)


def test_sampling_in_a_batch_keeps_the_target_distribution():
    """Speculative sampling requests decoded 16 at a time: the second token's distribution equals plain
    sampling's (chi-square), as in the batch-1 test of test_sampling_distribution."""
    vocab = 8
    model = make_tiny_model(vocab, seed=2, init=0.5)
    model.generation_config.eos_token_id = None
    loaded = LoadedModel(model, make_tiny_tokenizer(), "tiny-8", torch.device("cpu"), torch.float32, 1024, (-1,))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n = 300
    # batch_k=off: the batch-wide draft cap (measured costs of this machine) would cut drafts at batch 16
    engine = Engine(compose(["strategy=baseline", "trace=off", "max_batch_size=16", "batch_k=off"]), loaded=loaded)
    tables = []
    for strategy, overrides in (("baseline", {}), ("sampling", {"propose.min_ngram": 1, "propose.costs": None})):
        requests = [Request(prompt_ids=prompt, strategy=strategy, overrides=overrides, temperature=1.0, seed=seed,
                            max_new_tokens=4) for seed in range(n)]
        results = engine.generate(requests)
        drafted = sum(r.stats["draft_tokens"] for r in results)
        tables.append((Counter(tuple(r.token_ids[1:2]) for r in results), drafted))
    (plain, _), (spec, drafted) = tables
    assert drafted > n // 2  # speculation really happened (about one draft token a request on this toy)
    keys = sorted(set(plain) | set(spec))
    table = [[plain.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]]
    table = [[a for a, b in zip(*table) if a + b >= 10], [b for a, b in zip(*table) if a + b >= 10]]
    assert chi2_contingency(table).pvalue > 1e-3
