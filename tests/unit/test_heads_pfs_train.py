"""The PFS pruner (threshold, node budget, entropy adaptation), the best-first tree builder, and a training
smoke test of ``mtpflow.train_heads`` on a tiny model (a few steps, then the heads decode losslessly)."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.errors import ConfigError
from mtpflow.strategies.mtp_heads import best_first_tree
from mtpflow.strategies.pfs import PFSPruner, path_scores
from mtpflow.types import DecodeState, Draft, SamplingParams
from test_heads_lossless import one_thread  # noqa: F401 (fixture)

STATE = DecodeState(tokens=torch.tensor([1, 2]), prompt_len=2, step=0, next_position=2,
                    sampling=SamplingParams(), max_new_tokens=8)


def tree(probs, parents, entropy=None):
    scores = {} if entropy is None else {"entropy": torch.full((len(probs),), float(entropy))}
    return Draft(torch.arange(len(probs)) + 10, torch.tensor(parents), probs=torch.tensor(probs), scores=scores)


def test_path_score_is_product_along_the_path():
    d = tree([0.9, 0.5, 0.8, 0.5], [-1, 0, 1, -1])
    assert torch.allclose(path_scores(d), torch.tensor([0.9, 0.45, 0.36, 0.5]))


def test_fixed_threshold_drops_infeasible_paths():
    d = tree([0.9, 0.5, 0.8, 0.3], [-1, 0, 1, -1])  # pfs 0.9, 0.45, 0.36, 0.3
    keep = PFSPruner(threshold=0.4, adapt=0).prune(STATE, d)
    assert keep.tolist() == [True, True, False, False]


def test_node_budget_keeps_the_most_feasible():
    d = tree([0.9, 0.9, 0.9, 0.8], [-1, 0, 1, -1])  # pfs 0.9, 0.81, 0.729, 0.8
    keep = PFSPruner(threshold=0.0, adapt=0, max_nodes=2).prune(STATE, d)
    assert keep.tolist() == [True, True, False, False]
    assert not PFSPruner(threshold=0.0, adapt=0, max_nodes=0).prune(STATE, d).any()


def test_threshold_adapts_to_entropy():
    pruner = PFSPruner(threshold=0.35, adapt=2.0, reference_entropy=0.2, min_threshold=0.05, max_threshold=0.8)
    confident, uncertain = pruner.step_threshold(0.0), pruner.step_threshold(0.8)
    assert confident > 0.35 > uncertain >= 0.05
    assert pruner.step_threshold(0.2) == pytest.approx(0.35)
    assert pruner.step_threshold(None) == 0.35  # no entropy from the proposer: the base threshold
    # the same draft keeps more nodes when its distribution is uncertain
    probs, parents = [0.3, 0.6, 0.2], [-1, 0, -1]
    assert pruner.prune(STATE, tree(probs, parents, entropy=0.9)).sum() > pruner.prune(STATE, tree(probs, parents, entropy=0.0)).sum()


def test_bad_parameters_are_config_errors():
    with pytest.raises(ConfigError):
        PFSPruner(threshold=1.5)
    with pytest.raises(ConfigError):
        PFSPruner(min_threshold=0.5, max_threshold=0.1)
    with pytest.raises(ConfigError):
        PFSPruner(max_nodes=-1)


def test_best_first_tree_takes_most_probable_paths():
    probs = [torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.9, 0.05]), torch.tensor([0.5, 0.4])]
    ids = [torch.tensor([1, 2, 3]), torch.tensor([4, 5]), torch.tensor([6, 7])]
    tokens, parents, node_p, path_p, depths = best_first_tree(probs, ids, max_nodes=5)
    assert path_p == sorted(path_p, reverse=True)
    assert all(p < i for i, p in enumerate(parents))
    # every path the tree could hold, ranked: the kept five are the five most probable
    everything = sorted([a * b * c for a in probs[0].tolist() for b in [1] for c in [1]] +
                        [a * b for a in probs[0].tolist() for b in probs[1].tolist()] +
                        [a * b * c for a in probs[0].tolist() for b in probs[1].tolist() for c in probs[2].tolist()],
                        reverse=True)
    assert path_p == pytest.approx(everything[:5])
    assert tokens[:3] == [1, 4, 2] and depths[:3] == [1, 2, 1]  # 0.6, 0.54, 0.3


def test_training_smoke_on_tiny(tmp_path):
    """A few steps of data generation and training on a tiny model; the saved heads load and decode
    token-identically to HF greedy."""
    from mtpflow.tools.train_heads import compose, run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the quick brown fox", "def add(a, b):"]))
    loaded = tiny_loaded(seed=0)
    cfg = compose([f"out={tmp_path / 'heads'}", f"data.folder={tmp_path / 'data'}", f"data.prompts={prompts}",
                   "data.samples=4", "data.batch_size=2", "data.max_new_tokens=12", "chat=false",
                   "draft_vocab=64", "medusa.num_heads=2", "medusa.steps=3", "eagle.steps=3", "eagle.window=8",
                   "eagle.sequence_length=8", "eagle.intermediate_size=32", "eagle.batch_sequences=2"])
    out = run(cfg, loaded=loaded)
    assert len(list((tmp_path / "data").glob("shard_*.pt"))) == 2  # resumable shards on disk
    for kind in ("medusa", "eagle"):
        config = json.loads((out / kind / "heads.json").read_text())
        assert config["kind"] == kind and config["draft_vocab_size"] == 64
        ids = [5, 6, 7, 8]
        pipe = make_pipeline(loaded, kind, "max_new_tokens=16", f"model.heads={out}")
        assert pipe(prompt_ids=ids).token_ids == hf_greedy(loaded.model, ids, 16)


def test_data_only_run_unwritable_folders_and_short_runs(tmp_path, capsys):
    """``kinds=[]`` only writes the training text (and returns its folder, creating no heads folder); a heads
    or data folder that cannot be written is a one-line error before the model writes any text; short runs
    train."""
    from mtpflow.errors import UserError
    from mtpflow.tools.train_heads import compose, main, run

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the quick brown fox"}) + "\n")
    loaded = tiny_loaded(seed=0)
    base = [f"data.prompts={prompts}", "data.samples=2", "data.batch_size=2", "data.max_new_tokens=4", "chat=false"]
    data = tmp_path / "data"
    assert run(compose(base + ["kinds=[]", f"data.folder={data}", f"out={tmp_path / 'none'}"]), loaded=loaded) == data
    assert len(list(data.glob("shard_*.pt"))) == 1 and not (tmp_path / "none").exists()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    for bad in ([f"data.folder={data}", f"out={blocker / 'heads'}"], [f"data.folder={blocker / 'data'}"]):
        with pytest.raises(UserError, match="cannot write to .*a-file"):
            run(compose(base + bad), loaded=loaded)
    assert list(data.glob("shard_*.pt"))  # the text already written is kept
    # any step count trains, including 20 (OneCycleLR's warm-up would be one step: a division by zero)
    for steps in (1, 20, 40):
        run(compose(base + [f"data.folder={data}", f"out={tmp_path / 'heads'}", "draft_vocab=64", "medusa.num_heads=2",
                            f"medusa.steps={steps}", f"eagle.steps={steps}", "eagle.eval_every=10",
                            "medusa.eval_every=10", "eagle.window=8", "eagle.sequence_length=8",
                            "eagle.intermediate_size=32", "eagle.batch_sequences=2"]), loaded=loaded)
    # the command line turns these errors into one line and exit 2 (here a missing model, found first)
    capsys.readouterr()  # drop the progress bars of the runs above
    assert main(["model=hf", f"model.name={tmp_path / 'no-model'}", f"out={blocker / 'heads'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpflow.train_heads: error:") and "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize("override, message", [
    ("medusa.num_heads=0", "medusa.num_heads must be a whole number >= 1, got 0"),
    ("medusa.lr=-1", "medusa.lr must be in \\(0, inf\\), got -1"),
    ("eagle.batch_sequences=0", "eagle.batch_sequences must be a whole number"),
    ("eagle.attention_heads=-2", "eagle.attention_heads must be a whole number"),
    ("eagle.window=1.5", "eagle.window must be a whole number"),
    ("data.samples=abc", "data.samples must be a whole number >= 1, got 'abc'"),
    ("data.max_new_tokens=1", "data.max_new_tokens must be a whole number >= 2"),
    ("data.temperatures=[0.5,-1]", "data.temperatures must be in"),
    ("eagle.noise=-0.1", "eagle.noise must be in"),
    ("medusa.head_decay=0", "medusa.head_decay must be in"),
    ("kinds=eagle", "kinds must be a list"),
])
def test_training_settings_are_checked_before_any_work(tmp_path, override, message):
    """Each bad setting is a ConfigError naming it, raised before the data folder is even created (these were
    tracebacks from the optimiser or torch, some after the model had written its text)."""
    from mtpflow.tools.train_heads import compose, run

    with pytest.raises(ConfigError, match=message):
        run(compose([override, f"data.folder={tmp_path / 'data'}", f"out={tmp_path / 'heads'}"]),
            loaded=tiny_loaded(seed=0))
    assert not (tmp_path / "data").exists() and not (tmp_path / "heads").exists()


def test_held_out_split_is_by_prompt():
    """Every prompt is sampled several times (greedy and at temperature): the held-out sequences must come
    from prompts the heads never trained on, or the held-out accuracy measures memorisation."""
    from mtpflow.tools.train_heads import split_by_prompt

    records = [{"tokens": torch.tensor([p, p + 1, 100 + s]), "prompt_len": 2} for p in range(20) for s in range(3)]
    held, train = split_by_prompt(records, 0.1, seed=0)
    prompts = lambda rs: {tuple(r["tokens"][:2].tolist()) for r in rs}  # noqa: E731
    assert len(prompts(held)) == 2 and len(held) == 6 and len(train) == 54
    assert not prompts(held) & prompts(train)
    single = records[:3]
    assert split_by_prompt(single, 0.1, seed=0) == (single, single)


def test_checkpoint_keeps_the_best_weights():
    from mtpflow.tools.train_heads import Checkpoint

    layer = torch.nn.Linear(2, 1)
    best = Checkpoint(layer)
    with torch.no_grad():
        layer.weight.fill_(1.0)
        best.offer(10, 0.5, [0.5])
        layer.weight.fill_(2.0)
        best.offer(20, 0.4, [0.4])  # worse: not kept
    best.restore()
    assert best.step == 10 and best.metrics == [0.5] and torch.all(layer.weight == 1.0)


def test_bad_training_settings_and_prompt_files(tmp_path):
    from mtpflow.errors import UserError
    from mtpflow.tools.head_data import load_prompts
    from mtpflow.tools.train_heads import compose, run

    with pytest.raises(ConfigError, match="eval_every"):
        run(compose(["medusa.eval_every=0"]), loaded=tiny_loaded(seed=0))
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"text": "a question"}\n{"prompt": "an instruction"}\n')
    assert load_prompts(str(texts)) == ["a question", "an instruction"]
    (tmp_path / "bad.jsonl").write_text('{"title": "no prompt here"}\n')
    with pytest.raises(UserError, match="'prompt' or 'text'"):
        load_prompts(str(tmp_path / "bad.jsonl"))
    shipped = load_prompts(None)  # both shipped sets, one seeded shuffle
    assert len(shipped) == len(set(shipped)) > 1400 and shipped == load_prompts(None)


def test_length_buckets_group_similar_prompts_and_keep_every_one():
    """Training batches are left-padded to their longest prompt: sorting each span of ``bucket`` batches by
    length cuts the padding, while every prompt is still sampled exactly once and the split is reproducible
    (a resumed run must rebuild the same batches)."""
    from mtpflow.errors import UserError
    from mtpflow.tools.head_data import length_buckets

    g = torch.Generator().manual_seed(0)
    prompts = [list(range(int(n))) for n in torch.randint(1, 200, (70,), generator=g)]
    batches = length_buckets(prompts, batch_size=8, bucket=4)
    assert [len(b) for b in batches] == [8] * 8 + [6]  # ceil(70 / 8) batches, only the last one short
    assert sorted(map(len, sum(batches, []))) == sorted(map(len, prompts))
    first_span = sum(batches[:4], [])
    assert [len(p) for p in first_span] == sorted(len(p) for p in prompts[:32])  # sorted within a span only
    padded = lambda bs: sum(len(b) * max(map(len, b)) for b in bs)  # noqa: E731
    unsorted = [prompts[i:i + 8] for i in range(0, 70, 8)]
    assert padded(batches) < 0.8 * padded(unsorted)
    assert length_buckets(prompts, 8, 4) == batches
    assert length_buckets(prompts, 8, 1) == [sorted(b, key=len) for b in unsorted]
    with pytest.raises(UserError, match="bucket"):
        length_buckets(prompts, 8, 0)
