"""Token recycling and the suffix cache through the real loop on tiny random models: token for token equal to HF
greedy generate (as proposers, as grafts onto other strategies and into ``mtp_heads``'s head tree; ``mtp`` is the
suffix-cache drafter), sampling in
distribution, a repeated request drafted from the earlier output, and memory under each drafter's bound after
200 requests."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from helpers import hf_greedy, make_pipeline, make_tiny_model, make_tiny_tokenizer, tiny_loaded
from mtpflow.strategies.suffix import SuffixAcceptance
from mtpflow.strategies.token_recycling import AdjacencyTable
from mtpflow.suffix_cache import SuffixCache

GRAFT = "strategy.plugins=[{_target_:mtpflow.strategies.suffix.SuffixGraft}]"
ALPHA = 1e-3


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-model stages are many small ops: a second thread's wake-ups make them far slower on a shared CPU."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def prompts(vocab: int, n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = int(torch.randint(3, 40, (1,), generator=g))
        base = torch.randint(1, vocab, (length,), generator=g)
        if i % 2:
            base = base[: max(3, length // 3)].repeat(3)
        out.append(base.tolist())
    return out


def shared_objects(pipe, kind):
    return [pipe.shared.get(name, lambda: None) for name in pipe.shared.names()
            if isinstance(pipe.shared.get(name, lambda: None), kind)]


@pytest.mark.parametrize("overrides", [
    ["strategy.prune=[]"],  # every template node the table can fill is verified
    ["strategy.prune=[]", "strategy.propose.shared=false", "strategy.propose.seed_from_prompt=false"],
    ["strategy.prune.0.costs=null", "strategy.prune.0.max_nodes=6", "k=3"],
    [],  # the shipped configuration (cost-aware pruning)
])
def test_recycling_matches_hf_greedy(tiny, overrides):
    pipe = make_pipeline(tiny, "recycling", "max_new_tokens=40", "trace=off", *overrides)
    accepted = 0
    for rep in range(2):
        for i, ids in enumerate(prompts(len(tiny.tokenizer), 8)):
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(tiny.model, ids, 40), f"prompt {i}, round {rep}"
            accepted += result.stats["accepted_tokens"]
    if overrides and overrides[0] == "strategy.prune=[]":
        assert accepted > 20  # the recycled trees really were accepted


def test_recycling_on_other_models():
    for seed in (3, 4):
        loaded = tiny_loaded(seed=seed, layers=3)
        pipe = make_pipeline(loaded, "recycling", "max_new_tokens=48", "trace=off", "strategy.prune=[]",
                             "strategy.propose.top_k=4", "strategy.propose.template_nodes=20")
        for ids in prompts(len(loaded.tokenizer), 3, seed=seed):
            assert pipe(prompt_ids=ids).token_ids == hf_greedy(loaded.model, ids, 48)


# The cost-pruned runs take a fixed verify-cost curve (flat, as a tiny model's is): the curve this machine measures
# under a loaded test run can make the pruner keep shorter trees (one repeat at MAL 7.8 in a CI run).
FLAT_COSTS = "strategy.prune.0.costs={0:1.0,8:1.2,32:1.6}"


@pytest.mark.parametrize("overrides", [["strategy.prune=[]"], [FLAT_COSTS],
                                       [FLAT_COSTS, "strategy.propose.use_request=false"]])
def test_suffix_cache_matches_hf_greedy_and_drafts_a_repeat_from_the_earlier_output(tiny, overrides):
    pipe = make_pipeline(tiny, "suffix_cache", "max_new_tokens=40", "trace=off", *overrides)
    first, again = [], []
    for rnd, mals in ((0, first), (1, again)):
        for i, ids in enumerate(prompts(len(tiny.tokenizer), 8)):
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(tiny.model, ids, 40), f"prompt {i}, round {rnd}"
            if len(result.token_ids) >= 20:
                mals.append(result.stats["mal"])
    assert first and min(again) >= 8  # the whole earlier output is drafted (K = 24 here)
    assert sum(again) > 2 * sum(first)


def test_mtp_is_the_suffix_cache_drafter_and_lossless(tiny):
    """``mtp`` (chosen by measurement, docs/strategies.md) builds on ``suffix_cache``: the same stages, its own
    name; greedy output equals HF and a repeated request is drafted from the earlier output."""
    from mtpflow.config import compose

    mtp, suffix = compose(["strategy=mtp"]).strategy, compose(["strategy=suffix_cache"]).strategy
    assert mtp.name == "mtp" and mtp.lossless and not mtp.get("needs_hidden_states")
    for stage in ("select_k", "propose", "prune", "gate", "dedup", "rescore", "window"):
        assert mtp.get(stage) == suffix.get(stage), stage
    pipe = make_pipeline(tiny, "mtp", "max_new_tokens=40", "trace=off", FLAT_COSTS)
    ids = prompts(len(tiny.tokenizer), 2)[1]
    first, again = pipe(prompt_ids=ids), pipe(prompt_ids=ids)
    assert first.token_ids == again.token_ids == hf_greedy(tiny.model, ids, 40)
    assert again.stats["mal"] >= 8 > first.stats["mal"]


@pytest.mark.parametrize("strategy", ["pld", "jacobi", "draft_model", "recycling"])
def test_the_suffix_graft_keeps_any_strategy_lossless(tiny, strategy):
    extra = ["strategy.propose.layers=1"] if strategy == "draft_model" else []
    pipe = make_pipeline(tiny, strategy, "max_new_tokens=32", "trace=off", GRAFT, *extra)
    again = []
    for rnd in range(2):
        for i, ids in enumerate(prompts(len(tiny.tokenizer), 6, seed=2)):
            result = pipe(prompt_ids=ids)
            assert result.token_ids == hf_greedy(tiny.model, ids, 32), f"prompt {i}, round {rnd}"
            if rnd and len(result.token_ids) >= 20:
                again.append(result.stats["mal"])
                assert result.stats["suffix_accepted"] > 0
    assert again and min(again) > 2


def test_grafts_into_the_mtp_head_tree_are_lossless(tiny, tmp_path):
    """``mtp`` grafts both by default; each alone, and both with other options."""
    from test_heads_lossless import random_heads

    folder = random_heads(tiny, "medusa", tmp_path / "medusa")
    for graft in (["strategy.propose.suffix=null"], ["strategy.propose.recycling=null"],
                  ["+strategy.propose.recycling.top_k=4", "+strategy.propose.suffix.max_nodes=8"]):
        pipe = make_pipeline(tiny, "mtp_heads", "max_new_tokens=32", "trace=off", f"strategy.propose.heads={folder}",
                             "strategy.prune.0.costs=null", "strategy.prune.0.max_nodes=16", *graft)
        stats = Counter()
        for rnd in range(2):
            for i, ids in enumerate(prompts(len(tiny.tokenizer), 6, seed=3)):
                result = pipe(prompt_ids=ids)
                assert result.token_ids == hf_greedy(tiny.model, ids, 32), f"{graft} prompt {i}, round {rnd}"
                stats.update({k: v for k, v in result.stats.items()
                              if k in ("recycling_accepted", "suffix_accepted", "lookup_accepted")})
        if "recycling=null" not in graft[0]:
            assert stats["recycling_accepted"] > 0
        if "suffix=null" not in graft[0]:
            assert stats["suffix_accepted"] > 0


def tiny8():
    from mtpflow.model import LoadedModel

    model = make_tiny_model(8, seed=2, init=0.5)
    model.generation_config.eos_token_id = None
    return LoadedModel(model, make_tiny_tokenizer(), "tiny-8", torch.device("cpu"), torch.float32, 1024, (-1,))


SAMPLING_PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
SAMPLING_RUNS = 400


def sampled_pairs(loaded, strategy: str, *overrides: str) -> tuple[Counter, int]:
    """(counts of the 2nd and 3rd tokens over SAMPLING_RUNS seeds, draft tokens accepted in all)."""
    pipe = make_pipeline(loaded, strategy, "max_new_tokens=4", "temperature=1.0", "trace=off", *overrides)
    counts: Counter = Counter()
    accepted = 0
    for seed in range(SAMPLING_RUNS):
        pipe.cfg.seed = seed
        result = pipe(prompt_ids=SAMPLING_PROMPT)
        accepted += result.stats["accepted_tokens"]
        counts[tuple(result.token_ids[1:3])] += 1
    return counts, accepted


@pytest.fixture(scope="module")
def plain_sampling():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        loaded = tiny8()
        return loaded, sampled_pairs(loaded, "baseline")[0]
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("strategy", ["recycling", "suffix_cache"])
def test_sampling_keeps_the_target_distribution(plain_sampling, strategy):
    """Temperature 1: the second and third tokens (decided by the gate whenever a draft was verified) follow
    the same joint distribution as plain sampling. Both drafters' state carries over between the runs."""
    loaded, plain = plain_sampling
    spec, accepted = sampled_pairs(loaded, strategy, "strategy.prune=[]")
    assert accepted > SAMPLING_RUNS // 2  # drafts were verified and accepted often
    keys = sorted(set(plain) | set(spec))
    rows = [[plain.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]]
    big = [i for i in range(len(keys)) if rows[0][i] + rows[1][i] >= 10]
    table = [[r[i] for i in big] + [sum(r) - sum(r[i] for i in big)] for r in rows]
    if table[0][-1] + table[1][-1] == 0:
        table = [r[:-1] for r in table]
    assert chi2_contingency(table).pvalue > ALPHA


def test_memory_stays_under_each_bound_after_200_requests(tiny):
    """Token recycling's table is fixed (vocab x top_k int32 + the template's counts); the suffix cache evicts
    least recently used outputs to stay under ``max_bytes``. 200 requests through one pipeline, both in it."""
    max_bytes = 64 << 10
    graft = f"strategy.plugins=[{{_target_:mtpflow.strategies.suffix.SuffixGraft,max_bytes:{max_bytes}}}]"
    pipe = make_pipeline(tiny, "recycling", "max_new_tokens=12", "trace=off", "strategy.prune=[]", graft)
    g = torch.Generator().manual_seed(7)
    vocab = len(tiny.tokenizer)
    top_k, nodes = 8, 48
    table_bound = vocab * top_k * 4 + 3 * nodes * 8 + 4 * 256  # int32 table, 3 float64 vectors, tensor headers
    ids: list[int] = []
    for i in range(200):
        n = int(torch.randint(3, 30, (1,), generator=g))
        fresh = torch.randint(1, vocab, (n,), generator=g).tolist()
        ids = ids if i % 4 == 3 else fresh  # every fourth request retries the one before
        pipe(prompt_ids=ids)
        (table,) = shared_objects(pipe, AdjacencyTable)
        (cache,) = shared_objects(pipe, SuffixCache)
        assert table.nbytes() <= table_bound
        assert cache.nbytes() <= max_bytes
    assert cache.evicted > 0 and len(cache) > 0
    assert len(shared_objects(pipe, SuffixAcceptance)) == 1
    assert table.updates > 200
