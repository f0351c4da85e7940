"""Speculative sampling keeps the target distribution: chi-square tests of the gate on fixed logits (chain,
tree, stochastic drafts) and of the whole loop against plain sampling on a tiny model."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy.stats import chisquare, chi2_contingency

from helpers import make_pipeline, make_tiny_model
from mtpflow.sampling import target_probs
from mtpflow.strategies.gates import SpeculativeSamplingGate, speculative_tree_walk
from mtpflow.types import BONUS, RECOVERED, DecodeState, Draft, SamplingParams, Verification

VOCAB = 8
ALPHA = 1e-3  # false-alarm rate per test


def exact_pair_distribution(probs: torch.Tensor, draft: Draft) -> dict[tuple, float]:
    """Exact P(first emitted token, second emitted token or None) for a depth-<=2 draft."""
    out: dict[tuple, float] = {}
    root_children = {int(draft.tokens[i]): i for i in range(draft.num_nodes) if int(draft.parents[i]) < 0}
    for a in range(VOCAB):
        pa = float(probs[0, a])
        if a in root_children:
            row = root_children[a] + 1
            for b in range(VOCAB):
                out[(a, b)] = out.get((a, b), 0.0) + pa * float(probs[row, b])
        else:
            out[(a, None)] = pa
    return out


def run_gate(draft: Draft, logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> Counter:
    gen = torch.Generator().manual_seed(seed)
    state = DecodeState(tokens=torch.tensor([1, 2]), prompt_len=2, step=0, next_position=2, sampling=params,
                        max_new_tokens=8, extras={"rng": gen})
    verification = Verification(logits=logits, hidden=None, forward_seconds=0.0)
    counts: Counter = Counter()
    gate = SpeculativeSamplingGate()
    for _ in range(n):
        d = gate.gate(state, draft, verification)
        emitted = draft.tokens[d.accepted].tolist() + [d.next_token]
        counts[(emitted[0], emitted[1] if len(emitted) > 1 else None)] += 1
    return counts


def assert_fits(counts: Counter, exact: dict[tuple, float], n: int):
    keys = [k for k, p in exact.items() if p * n >= 5]  # pool tiny cells into one bin
    rest = [k for k in exact if k not in keys]
    observed = [counts.get(k, 0) for k in keys] + [sum(counts.get(k, 0) for k in rest)]
    expected = [exact[k] * n for k in keys] + [sum(exact[k] for k in rest) * n]
    assert sum(counts.values()) == n and set(counts) <= set(exact), "emitted an impossible pair"
    if expected[-1] < 5:
        last_observed, last_expected = observed.pop(), expected.pop()
        observed[-1] += last_observed
        expected[-1] += last_expected
    total = sum(expected)
    expected = [e * n / total for e in expected]  # float32 probabilities sum to 1 only approximately
    assert chisquare(observed, expected).pvalue > ALPHA


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 1.5


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=5), SamplingParams(1.3, top_p=0.8)])
def test_chain_and_tree_gate_keep_distribution(params):
    n = 4000
    drafts = [
        Draft.chain([3, 5]),  # chain: depth 2
        Draft(torch.tensor([3, 6, 1, 2]), torch.tensor([-1, -1, 0, 1])),  # tree: two root children
    ]
    for i, draft in enumerate(drafts):
        logits = random_logits(1 + draft.num_nodes, seed=i)
        probs = target_probs(logits, params)
        counts = run_gate(draft, logits, params, n, seed=10 + i)
        assert_fits(counts, exact_pair_distribution(probs, draft), n)


def test_stochastic_chain_draft_uses_min_p_over_q():
    """A chain drafted from q (draft.dists set): accept with min(1, p/q), residual max(0, p - q)."""
    params = SamplingParams(1.0)
    n = 4000
    gen = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(2, VOCAB, generator=gen), -1)
    logits = random_logits(3, seed=5)
    probs = target_probs(logits, params)
    state_gen = torch.Generator().manual_seed(9)
    counts: Counter = Counter()
    gate = SpeculativeSamplingGate()
    state = DecodeState(tokens=torch.tensor([1]), prompt_len=1, step=0, next_position=1, sampling=params,
                        max_new_tokens=8, extras={"rng": state_gen})
    v = Verification(logits=logits, hidden=None, forward_seconds=0.0)
    for _ in range(n):  # the drafted tokens themselves are sampled from q, as a draft model would
        d0 = int(torch.multinomial(q[0], 1, generator=gen))
        d1 = int(torch.multinomial(q[1], 1, generator=gen))
        draft = Draft(torch.tensor([d0, d1]), torch.tensor([-1, 0]), dists=q)
        dec = gate.gate(state, draft, v)
        emitted = draft.tokens[dec.accepted].tolist() + [dec.next_token]
        counts[emitted[0]] += 1
    # The first emitted token must follow p_root exactly, whatever q is.
    observed = [counts.get(a, 0) for a in range(VOCAB)]
    expected = [float(probs[0, a]) * n for a in range(VOCAB)]
    keep = [i for i, e in enumerate(expected) if e >= 5]
    obs = [observed[i] for i in keep] + [sum(observed[i] for i in range(VOCAB) if i not in keep)]
    exp = [expected[i] for i in keep] + [sum(expected[i] for i in range(VOCAB) if i not in keep)]
    if exp[-1] < 5:
        last_obs, last_exp = obs.pop(), exp.pop()
        obs[-1] += last_obs
        exp[-1] += last_exp
    exp = [e * n / sum(exp) for e in exp]
    assert chisquare(obs, exp).pvalue > ALPHA


def test_chain_kernel_gives_what_the_tree_walk_gives_for_the_same_random_stream():
    """The gate runs a chain through ``speculative_accept`` and a tree through ``speculative_tree_walk``: on
    chains (deterministic and drafted from q) both accept the same nodes and emit the same recovered or bonus
    token when the walk reads the uniforms the gate drew from the same seed."""
    g = torch.Generator().manual_seed(4)
    params = SamplingParams(1.0)
    outcomes = set()
    for case in range(120):
        n, vocab = case % 6, (8, 50, 3000)[case % 3]
        logits = torch.randn(n + 1, vocab, generator=g) * (0.5, 2.0, 5.0)[case // 3 % 3]
        probs = target_probs(logits, params)
        dists = torch.randn(n, vocab, generator=g).mul(3).softmax(-1) if case % 2 and n else None
        # drafted from the target's own rows most of the time, so that whole chains get accepted too
        source = probs[:n] if case % 4 < 2 or dists is None else dists
        tokens = torch.multinomial(source, 1, generator=g).flatten() if n else torch.zeros(0, dtype=torch.long)
        draft = Draft(tokens, torch.arange(-1, n - 1), dists=dists)
        state = DecodeState(tokens=torch.tensor([1]), prompt_len=1, step=0, next_position=1, sampling=params,
                            max_new_tokens=8, extras={"rng": torch.Generator().manual_seed(case)})
        decision = SpeculativeSamplingGate().gate(state, draft, Verification(logits, None, 0.0))
        uniforms = torch.rand(n + 1, generator=torch.Generator().manual_seed(case))
        path, token, bonus = speculative_tree_walk(lambda i: probs[i], draft, uniforms)
        assert decision.accepted.tolist() == path and decision.next_token == token, case
        assert decision.next_kind == (BONUS if bonus and path else RECOVERED), case
        outcomes.add((dists is None, len(path) == n, len(path) == 0))
    assert len(outcomes) >= 6  # full, partial and empty accepts, with and without draft distributions


@pytest.mark.parametrize("speculative", ["sampling", "int8_draft"])
def test_loop_sampling_matches_plain_sampling(speculative):
    """End to end on a tiny 8-token model: speculative sampling (prompt-lookup drafts, or the int8 self-draft's
    deterministic chains through the native forward) vs plain sampling (baseline)."""
    from helpers import make_tiny_tokenizer
    from mtpflow.backends.native import kernel, products
    from mtpflow.model import LoadedModel

    if speculative == "int8_draft" and not kernel.available():
        pytest.skip("the native CPU kernels could not be built")

    tok = make_tiny_tokenizer()
    model = make_tiny_model(VOCAB, seed=2, init=0.5)
    model.generation_config.eos_token_id = None
    loaded = LoadedModel(model, tok, "tiny-8", torch.device("cpu"), torch.float32, 1024, (-1,))
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    n = 300
    tables = []
    for strategy in ("baseline", speculative):
        # costs=null / cost_aware=false: drafts every step (the cost model would rightly skip drafting on this toy)
        extra = {"baseline": [], "sampling": ["strategy.propose.min_ngram=1", "strategy.propose.costs=null"],
                 "int8_draft": ["strategy.propose.cost_aware=false", "model.backend=native_cpu"]}[strategy]
        pipe = make_pipeline(loaded, strategy, "max_new_tokens=4", "temperature=1.0", *extra)
        counts = Counter()
        drafted = 0
        for seed in range(n):
            pipe.cfg.seed = seed
            r = pipe(prompt_ids=prompt)
            drafted += r.stats["draft_tokens"]
            counts[tuple(r.token_ids[1:3])[:1]] += 1  # second token: decided by the gate when drafted
        tables.append((counts, drafted))
    (plain, _), (spec, drafted) = tables
    assert drafted > n // 2  # speculation really happened (about one draft token a run on this toy)
    keys = sorted(set(plain) | set(spec))
    table = [[plain.get(k, 0) for k in keys], [spec.get(k, 0) for k in keys]]
    table = [[a for a, b in zip(*table) if a + b >= 10], [b for a, b in zip(*table) if a + b >= 10]]
    assert chi2_contingency(table).pvalue > ALPHA
