"""Property tests of the decode loop (hypothesis): random tiny models (seed, depth), random prompts (random or
repetitive, so the lookup proposers really draft), random strategies with random K, proposer windows and KV
window sizes, decoded together in random batch mixes on one engine. Every lossless strategy at temperature 0
equals HF greedy token for token, whatever it shares a batch with; lossy, sampling and KV-window runs never
raise and stop where they should. Bounded for CI: a fixed number of examples, drawn the same way every run
(``MTPFLOW_PROPERTY_EXAMPLES`` and ``MTPFLOW_PROPERTY_RANDOM=1`` explore more locally)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest

hypothesis = pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402 - after the skip
from hypothesis import strategies as st  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from helpers import hf_greedy, tiny_loaded  # noqa: E402
from mtpflow.config import compose  # noqa: E402
from mtpflow.engine import Engine  # noqa: E402
from mtpflow.request import Request  # noqa: E402

EXAMPLES = int(os.environ.get("MTPFLOW_PROPERTY_EXAMPLES", "100"))  # about 25 s here
RANDOM = os.environ.get("MTPFLOW_PROPERTY_RANDOM") == "1"
MODELS = [(0, 2), (1, 1), (2, 3)]  # (seed, layers) of the tiny random Llamas
MAX_BATCH = 4


@dataclass
class Job:
    """One request of an example: what it runs and what must hold for it."""

    strategy: str
    overrides: dict = field(default_factory=dict)
    prompt: list[int] = field(default_factory=list)
    max_new_tokens: int = 8
    temperature: float | None = None
    lossless: bool = True  # True: must equal HF greedy
    kv_window: dict | None = None  # the attention-sink KV window's settings (a stage the YAMLs do not spell out)

    def request(self) -> Request:
        return Request(prompt_ids=self.prompt, strategy=self.strategy, overrides=self.overrides,
                       max_new_tokens=self.max_new_tokens, temperature=self.temperature, seed=7)


K = st.integers(1, 8)
CONTEXT_WINDOW = st.integers(4, 512)


@st.composite
def prompts(draw, vocab: int = 300) -> list[int]:
    length = draw(st.integers(1, 30))
    tokens = draw(st.lists(st.integers(1, vocab - 1), min_size=length, max_size=length))
    repeats = draw(st.integers(1, 3))  # repetitive prompts give prompt lookup and the suffix cache matches
    return (tokens * repeats)[:60]


@st.composite
def jobs(draw) -> Job:
    kind = draw(st.sampled_from(["baseline", "pld", "adaptive", "jacobi", "length_dynamic", "hardware_aware",
                                 "suffix_cache", "mtp", "recycling", "draft_model", "domain_aware",
                                 "typical", "composite_gate", "sampling", "kv_window"]))
    job = Job(kind, prompt=draw(prompts()), max_new_tokens=draw(st.integers(1, 24)))
    if kind in ("pld", "adaptive", "typical", "sampling"):
        job.overrides = {"propose.costs": None, "propose.min_ngram": draw(st.integers(1, 2))}
    if kind == "adaptive":
        job.overrides["select_k.k"] = draw(K)
    elif kind == "draft_model":
        job.overrides = {"propose.layers": 1, "propose.cost_aware": False, "k": draw(K)}
    elif kind == "domain_aware":
        job.overrides = {"context_window": draw(CONTEXT_WINDOW)}
    elif kind != "baseline":
        job.overrides["k"] = draw(K)
    if kind in ("typical", "composite_gate"):
        job.lossless = False
        if kind == "composite_gate":  # no bigram table: the shipped one is the default model's tokenizer's
            job.overrides.update({"context_window": draw(CONTEXT_WINDOW), "gate.ngram_table": None,
                                  "gate.global_weight": 0.0})
    elif kind == "sampling":
        job.lossless, job.temperature = False, draw(st.sampled_from([0.5, 1.0, 1.5]))
    elif kind == "kv_window":  # the attention-sink KV window, small enough to evict during the run
        job.strategy, job.lossless, job.overrides = "domain_aware", False, {}
        job.kv_window = {"cache_size": draw(st.integers(70, 110)), "headroom": draw(st.integers(2, 64)), "room": 2,
                         "sink_tokens": draw(st.integers(0, 4))}
        job.max_new_tokens = draw(st.integers(30, 70))
    return job


_engines: dict = {}
_references: dict = {}


def engine_for(model: tuple[int, int]) -> Engine:
    """One engine per tiny model for the whole test (Hydra composed once; strategies composed once each)."""
    if model not in _engines:
        seed, layers = model
        loaded = tiny_loaded(seed=seed, layers=layers)
        _engines[model] = Engine(compose(["strategy=baseline", "trace=off", f"max_batch_size={MAX_BATCH}",
                                          "batch_k=off", "prefix_cache_mb=0"]), loaded=loaded)
    return _engines[model]


def reference(model: tuple[int, int], prompt: list[int], n: int) -> list[int]:
    key = (model, tuple(prompt), n)
    if key not in _references:
        _references[key] = hf_greedy(engine_for(model).loaded.model, prompt, n)
    return _references[key]


def strategy_config(engine: Engine, job: Job):
    if job.kv_window is None:
        return None
    node = engine.strategy_config(job.strategy).copy()
    OmegaConf.update(node, "window", {"_target_": "mtpflow.strategies.window.AttentionSinkWindow", **job.kv_window},
                     merge=False)
    return node


@pytest.fixture(scope="module", autouse=True)
def close_engines():
    yield
    for engine in _engines.values():
        engine.close()
    _engines.clear()


@pytest.mark.timeout(300)  # a hung decode fails the test instead of the CI job
@settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(model=st.sampled_from(MODELS), batch=st.lists(jobs(), min_size=1, max_size=MAX_BATCH + 1))
def test_lossless_strategies_equal_greedy_in_any_batch_mix(model, batch):
    engine = engine_for(model)
    # submitted one by one, so later ones join a batch already running; more jobs than the batch holds wait in
    # the queue and join as others leave
    handles = [engine.submit(job.request(), wait=True, strategy_config=strategy_config(engine, job)) for job in batch]
    for job, handle in zip(batch, handles):
        result = handle.result(120)  # raises whatever the decode raised
        tokens = result.token_ids
        assert 1 <= len(tokens) <= job.max_new_tokens, job
        if job.lossless:
            expected = reference(model, job.prompt, job.max_new_tokens)
            assert tokens == expected, (job, result.stats.get("stop_reason"))
        else:
            assert result.stats["stop_reason"] in ("max_new_tokens", "eos"), (job, result.stats)
            if job.kv_window is not None and len(job.prompt) + len(tokens) > job.kv_window["cache_size"]:
                assert result.stats["window_evictions"] >= 1, (job, result.stats)
