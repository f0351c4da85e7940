"""Token recycling and the suffix cache on the embedded default model (SmolLM2-135M-Instruct): token for token
equal to HF greedy generate, alone and grafted into ``mtp_heads`` (its default); a request repeated in the same pipeline is drafted
from its earlier output (MAL >= 8)."""
from __future__ import annotations

import functools

import pytest

from helpers import hf_greedy, make_pipeline

pytestmark = pytest.mark.default_model

PROMPTS = [
    ("Summarize: The meeting moved from Tuesday to Thursday at 3 pm because the client asked for more time to "
     "review the proposal. Please bring the revised budget numbers."),
    "Rename the variable x to total:\n\ndef f(values):\n    x = 0\n    for v in values:\n        x += v\n    return x",
    "What is the capital of France?",
]


@functools.lru_cache(maxsize=None)
def reference(model, ids: tuple[int, ...], new: int) -> list[int]:
    """HF greedy once per prompt for the whole file (the model is the session's)."""
    return hf_greedy(model, list(ids), new)


@pytest.mark.parametrize("strategy, overrides, drafters", [
    ("recycling", ["strategy.prune.0.costs=null", "strategy.prune.0.max_nodes=16"], ["recycling"]),  # trees verified
    ("suffix_cache", [], ["suffix"]),
    ("mtp_heads", [], ["recycling", "suffix"]),  # grafts both by default
])
def test_default_model_lossless(default_loaded, strategy, overrides, drafters):
    pipe = make_pipeline(default_loaded, strategy, "max_new_tokens=32", "trace=off", *overrides)
    accepted = dict.fromkeys(drafters, 0)
    for _ in range(2):  # the second round drafts from what the first one left in the shared state
        for prompt in PROMPTS:
            ids = pipe.encode(prompt).tolist()
            result = pipe(prompt_ids=ids)
            assert result.token_ids == reference(default_loaded.model, tuple(ids), 32), prompt[:30]
            for name in drafters:
                accepted[name] += result.stats[f"{name}_accepted"]
    assert all(accepted.values()), accepted  # each drafter's own tokens were drafted and accepted


@pytest.mark.parametrize("strategy, least_mal", [("suffix_cache", 8), ("mtp_heads", 4)])
def test_a_repeated_request_is_drafted_from_the_earlier_output(default_loaded, strategy, least_mal):
    # the pruner sizes trees with the suite's fixed profile (tests/fixtures/profile.json: the default model's curve on
    # the 2-core AVX2 host in a quiet hour), never with a curve timed while the suite loads the machine. mtp_heads
    # grafts the suffix cache; its ledger (GraftLedger) is the request's own, so the repeat keeps the graft on
    pipe = make_pipeline(default_loaded, strategy, "max_new_tokens=80", "trace=off")
    prompt = "Explain in a short paragraph how a hash table works."
    first = pipe(prompt)
    again = pipe(prompt)
    assert again.token_ids == first.token_ids == hf_greedy(default_loaded.model, pipe.encode(prompt).tolist(), 80)
    assert len(again.token_ids) == 80
    assert again.stats["mal"] >= least_mal, (first.stats["mal"], again.stats["mal"])
    assert again.stats.get("suffix_rested_steps", 0) == 0, again.stats
