"""Speculative sampling over draft-head trees keeps the target distribution: the tokens a tiny 8-token model
emits with Medusa / EAGLE / EAGLE-3 trees (random heads; for mtp with a prompt-lookup chain grafted in) follow the same law as plain sampling (chi-square)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chi2_contingency

from helpers import make_pipeline, make_tiny_model, make_tiny_tokenizer
from mtpflow.model import LoadedModel
from test_heads_lossless import one_thread, random_heads  # noqa: F401 (fixture)

VOCAB = 8
ALPHA = 1e-3  # false-alarm rate per test


def sample_counts(pipe, prompt, n):
    counts, drafted, trees, lookups = Counter(), 0, 0, 0
    for seed in range(n):
        pipe.cfg.seed = seed
        r = pipe(prompt_ids=prompt)
        lookups += r.stats.get("lookup_steps", 0)
        drafted += r.stats["draft_tokens"]
        trees += sum(not s.draft.is_chain for s in r.steps if s.draft.num_nodes)
        counts[tuple(r.token_ids[1:3])] += 1  # tokens 2 and 3: decided by the gate over a tree
    return counts, drafted, trees, lookups


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp_heads"])  # Medusa tree + grafted lookup chain
def test_tree_sampling_matches_plain_sampling(kind, tmp_path):
    model = make_tiny_model(VOCAB, seed=2, init=0.5)
    model.generation_config.eos_token_id = None
    loaded = LoadedModel(model, make_tiny_tokenizer(), "tiny-8", torch.device("cpu"), torch.float32, 1024, (-1,))
    folder = random_heads(loaded, kind if kind in ("eagle", "eagle3") else "medusa", tmp_path / kind, seed=4, scale=0.5)
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n = 400
    plain, _, _, _ = sample_counts(make_pipeline(loaded, "baseline", "max_new_tokens=4", "temperature=1.0"), prompt, n)
    pipe = make_pipeline(loaded, kind, "max_new_tokens=4", "temperature=1.0", f"strategy.propose.heads={folder}",
                         "k=2", "strategy.propose.top_k=3", "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null")
    spec, drafted, trees, lookups = sample_counts(pipe, prompt, n)
    assert drafted > n and trees > n // 2  # speculation over trees really happened
    if kind == "mtp_heads":
        assert lookups > n // 4  # and lookup chains were grafted into them
    keys = sorted(set(plain) | set(spec))
    table = [[plain.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]]
    big = [i for i, k in enumerate(keys) if table[0][i] + table[1][i] >= 10]
    small = [i for i in range(len(keys)) if i not in big]
    rows = [[row[i] for i in big] + [sum(row[i] for i in small)] for row in table]
    if rows[0][-1] + rows[1][-1] == 0:
        rows = [r[:-1] for r in rows]
    assert chi2_contingency(rows).pvalue > ALPHA
