"""Draft heads through the real loop: Medusa and EAGLE trees (random heads on tiny random models, the
shipped heads on the default model) must emit exactly HF greedy generate's tokens, and heads load only for
the model shape they were trained for."""
from __future__ import annotations

import pytest
import torch

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.errors import UserError
from mtpflow.types import hidden_taps
from mtpflow.strategies.head_modules import Eagle3Drafter, EagleDrafter, MedusaHeads, load_heads, save_heads


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny-model stages are many small ops; on the shared 2-core CPU a second thread's wake-ups made
    them ~30x slower (measured: 10.8 s vs 0.33 s CPU for one 40-token EAGLE decode)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_heads(loaded, kind: str, folder, seed: int = 0, scale: float = 0.05, draft_vocab: int = 0, taps=None):
    """Save randomly initialised heads of ``kind`` for ``loaded``'s model into ``folder``; returns folder."""
    torch.manual_seed(seed)
    hidden = loaded.model.config.hidden_size
    vocab = loaded.model.get_output_embeddings().weight.shape[0]
    if kind == "medusa":
        module = MedusaHeads(hidden, 3)
        for block in module.blocks:  # the default zero init would make every head repeat the root
            torch.nn.init.normal_(block.linear.weight, std=scale)
        extra = {"num_heads": 3}
    elif kind == "eagle":
        module = EagleDrafter(hidden, 4, 2 * hidden, window=8)
        extra = {"num_heads": 1, "attention_heads": 4, "intermediate_size": 2 * hidden, "window": 8}
    else:  # eagle3: on the layers needs_hidden_states: eagle3 taps (unless ``taps`` says otherwise)
        taps = list(hidden_taps(loaded.model, "eagle3")) if taps is None else list(taps)
        module = Eagle3Drafter(hidden, 4, 2 * hidden, window=8, taps=len(taps))
        extra = {"num_heads": 1, "attention_heads": 4, "intermediate_size": 2 * hidden, "window": 8, "taps": taps}
    ids = torch.arange(vocab) if not draft_vocab else torch.randperm(vocab)[:draft_vocab].sort().values
    config = {"model_id": loaded.model_id, "hidden_size": hidden, "vocab_size": vocab, "kind": kind, **extra}
    save_heads(folder, module, ids, config, dtype=torch.float32)
    return folder


def prompts(vocab: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        base = torch.randint(1, vocab, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g)
        out.append((base[: max(3, base.numel() // 3)].repeat(3) if i % 2 else base).tolist())
    return out


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_random_heads_match_hf_greedy(tiny, kind, tmp_path):
    folder = random_heads(tiny, kind, tmp_path / kind)
    trees = 0
    for i, ids in enumerate(prompts(len(tiny.tokenizer), 6, seed=11)):
        pipe = make_pipeline(tiny, kind, "max_new_tokens=40", f"strategy.propose.heads={folder}",
                             "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(tiny.model, ids, 40), f"{kind} prompt {i}"
        trees += sum(not r.draft.is_chain for r in result.steps if r.draft.num_nodes)
    assert trees > 0  # the drafts really were trees


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
def test_other_models_draft_vocab_and_pruning(kind, tmp_path):
    """Another seed and depth, a draft vocabulary smaller than the model's, and the adaptive PFS threshold."""
    loaded = tiny_loaded(seed=5, layers=3)
    folder = random_heads(loaded, kind, tmp_path / kind, seed=3, scale=0.2, draft_vocab=200)
    for ids in prompts(len(loaded.tokenizer), 4, seed=5):
        pipe = make_pipeline(loaded, kind, "max_new_tokens=32", f"strategy.propose.heads={folder}", "k=3",
                             "strategy.propose.top_k=3", "strategy.prune.0.threshold=0.01", "strategy.prune.0.costs=null")
        assert pipe(prompt_ids=ids).token_ids == hf_greedy(loaded.model, ids, 32)


def test_tree_shape_and_scores(tiny, tmp_path):
    """Nodes come parent-first, pfs is the product of probs along the path, depth never exceeds K."""
    folder = random_heads(tiny, "medusa", tmp_path / "m", scale=0.3)
    seen = []

    class Spy:
        from mtpflow.plugins import hookimpl

        @hookimpl
        def on_step_end(self, record):
            seen.append(record)

    pipe = make_pipeline(tiny, "medusa", "max_new_tokens=12", f"strategy.propose.heads={folder}", "k=3",
                         "strategy.propose.max_nodes=10", "strategy.prune=[]")
    pipe(prompt_ids=[5, 6, 7, 8, 9], extra_plugins=(Spy(),))
    for record in seen:
        d = record.draft
        if not d.num_nodes:
            continue
        assert d.num_nodes <= 10 and int(d.depths().max()) <= 3
        assert all(p < i for i, p in enumerate(d.parents.tolist()))
        for i, p in enumerate(d.parents.tolist()):
            expected = float(d.probs[i]) * (1.0 if p < 0 else float(d.scores["pfs"][p]))
            assert abs(float(d.scores["pfs"][i]) - expected) < 1e-5
        if record.k == 3:  # nothing pruned, and the proposer filled its budget
            assert record.num_proposed == d.num_nodes == 10


def test_heads_refuse_another_model(tiny, tmp_path):
    folder = random_heads(tiny, "medusa", tmp_path / "m")
    other = tiny_loaded(seed=1, hidden=32)
    pipe = make_pipeline(other, "medusa", "max_new_tokens=4", f"strategy.propose.heads={folder}")
    with pytest.raises(UserError, match="trained for"):
        pipe(prompt_ids=[5, 6, 7])


def test_missing_heads_is_a_user_error(tiny, tmp_path):
    pipe = make_pipeline(tiny, "eagle", "max_new_tokens=4", f"strategy.propose.heads={tmp_path}")
    with pytest.raises(UserError, match="no trained eagle heads"):
        pipe(prompt_ids=[5, 6, 7])


def test_save_load_round_trip(tiny, tmp_path):
    folder = random_heads(tiny, "eagle", tmp_path / "e", draft_vocab=100)
    module, ids, config = load_heads(folder)
    assert isinstance(module, EagleDrafter) and ids.numel() == 100 and config["draft_vocab_size"] == 100
    assert config["kind"] == "eagle" and config["hidden_size"] == tiny.model.config.hidden_size


@pytest.mark.default_model
@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3", "mtp_heads", "mtp_tree"])
def test_shipped_heads_match_hf_greedy(default_loaded, kind):
    from mtpflow.request import encode_prompt

    pipe = make_pipeline(default_loaded, kind, "max_new_tokens=48", "strategy.prune.0.costs=null")  # every tree verified
    mal = []
    for prompt in ("Write a Python function that returns the square of a number.",
                   "Summarize: The meeting moved to Thursday at 3 pm because the client asked for more time."):
        ids = encode_prompt(default_loaded.tokenizer, prompt)
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(default_loaded.model, ids, 48)
        mal.append(result.stats["mal"])
    assert max(mal) > 1.1  # trained heads really are accepted (untrained ones stay near 1.0)


def graft_chain(tree, chain, acceptance):
    from mtpflow.strategies.graft import GraftedTree

    merged = GraftedTree.of_draft(tree)
    merged.add_chain(chain, acceptance, "lookup")
    return merged.draft()


def test_a_lookup_chain_shares_prefixes_and_keeps_parents_first():
    from mtpflow.types import Draft

    # tree: 10 -> (20, 21), 20 -> 30; pfs 0.5, 0.2, 0.1, 0.25
    tree = Draft(torch.tensor([10, 20, 21, 30]), torch.tensor([-1, 0, 0, 1]),
                 probs=torch.tensor([0.5, 0.4, 0.2, 0.5]),
                 scores={"pfs": torch.tensor([0.5, 0.2, 0.1, 0.1]), "entropy": torch.tensor([0.3, 0.4, 0.4, 0.5])})
    out = graft_chain(tree, [10, 21, 40, 50], acceptance=0.8)
    assert out.tokens.tolist() == [10, 20, 21, 30, 40, 50]
    assert out.parents.tolist() == [-1, 0, 0, 1, 2, 4]
    pfs = out.scores["pfs"].tolist()
    assert pfs[0] == pytest.approx(0.8) and pfs[2] == pytest.approx(0.64)  # shared nodes take the larger score
    assert pfs[1] == pytest.approx(0.2) and pfs[3] == pytest.approx(0.1)  # heads-only nodes are untouched
    assert pfs[4] == pytest.approx(0.8 ** 3) and pfs[5] == pytest.approx(0.8 ** 4)
    assert out.scores["lookup"].tolist() == [1, 0, 1, 0, 1, 1]
    assert all(pfs[i] <= pfs[p] for i, p in enumerate(out.parents.tolist()) if p >= 0)
    assert out.scores["entropy"][4] == pytest.approx(0.4)  # from the parent: no sibling at that depth
    # a chain that diverges at the root becomes a new root child
    other = graft_chain(tree, [11], acceptance=0.5)
    assert other.tokens.tolist()[-1] == 11 and other.parents.tolist()[-1] == -1
    assert other.scores["entropy"][-1] == pytest.approx(0.3)  # from a sibling
    assert graft_chain(tree, [], acceptance=0.9).tokens.tolist() == tree.tokens.tolist()


def test_heads_with_lookup_match_hf_greedy(tiny, tmp_path):
    """Medusa tree + grafted prompt-lookup chain (the ``mtp_heads`` strategy's drafter) on repetitive prompts: same
    tokens as HF greedy, and lookup tokens really are drafted and accepted."""
    folder = random_heads(tiny, "medusa", tmp_path / "m")
    steps = accepted = 0
    for i, ids in enumerate(prompts(len(tiny.tokenizer), 6, seed=4)):
        pipe = make_pipeline(tiny, "mtp_heads", "max_new_tokens=40", f"strategy.propose.heads={folder}",
                             "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null",
                             "strategy.propose.lookup.min_ngram=1")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(tiny.model, ids, 40), f"prompt {i}"
        steps += result.stats["lookup_steps"]
        accepted += result.stats["lookup_accepted"]
    assert steps > 0 and accepted > 0
    # K below the chain length: still lossless, and lookup still drafts
    pipe = make_pipeline(tiny, "mtp_heads", "max_new_tokens=24", f"strategy.propose.heads={folder}", "k=2",
                         "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null",
                         "strategy.propose.lookup.min_ngram=1")
    ids = prompts(len(tiny.tokenizer), 2, seed=4)[1]
    result = pipe(prompt_ids=ids)
    assert result.token_ids == hf_greedy(tiny.model, ids, 24)
    assert result.stats["lookup_steps"] > 0


def test_mtp_tree_is_the_head_tree_at_a_fixed_budget_and_lossless(tiny, tmp_path):
    """``mtp_tree`` builds on ``mtp_heads``: the same gate and grafts, a wider candidate tree, and a pruner that
    keeps up to 32 nodes of highest PFS with no verify-cost budget; greedy output equals HF, and trees of more
    than 17 nodes are really verified."""
    from mtpflow.config import compose

    tree, heads = compose(["strategy=mtp_tree"]).strategy, compose(["strategy=mtp_heads"]).strategy
    assert tree.name == "mtp_tree" and tree.lossless and tree.needs_hidden_states
    assert tree.propose._target_ == heads.propose._target_ and tree.gate == heads.gate
    assert tree.propose.recycling == heads.propose.recycling and tree.propose.suffix == heads.propose.suffix
    assert tree.propose.max_nodes > tree.prune[0].max_nodes == 32 and tree.prune[0].costs is None
    folder = random_heads(tiny, "medusa", tmp_path / "m")
    pipe = make_pipeline(tiny, "mtp_tree", "max_new_tokens=40", "trace=off", f"strategy.propose.heads={folder}")
    widest = 0
    for i, ids in enumerate(prompts(len(tiny.tokenizer), 4, seed=6)):
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(tiny.model, ids, 40), f"prompt {i}"
        widest = max(widest, result.stats["draft_tokens"] / max(result.stats["verify_forwards"], 1))
    assert widest > 17  # more nodes a step, on average, than mtp_heads' cost-pruned tree may keep (12)


@pytest.mark.parametrize("bad", [{"max_ngram": 0}, {"min_ngram": 3, "max_ngram": 2}, {"window": 3}, 7])
def test_bad_lookup_settings_are_config_errors(bad):
    from mtpflow.errors import ConfigError
    from mtpflow.strategies.mtp_heads import MTPHeadsProposer

    with pytest.raises(ConfigError, match="lookup"):
        MTPHeadsProposer(lookup=bad)


def test_bad_lookup_override_is_one_clear_error(tiny):
    with pytest.raises(UserError, match="lookup"):
        make_pipeline(tiny, "mtp_heads", "strategy.propose.lookup.max_ngram=0")
