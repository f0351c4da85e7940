"""EAGLE-3 heads: the training-time-test unroll computes what tree drafting computes, random eagle3 heads on an
8-layer tiny model (three tapped layers) decode exactly as HF greedy alone and inside an engine batch with
other strategies, heads trained on other layers are refused with one line, and a short training run works."""
from __future__ import annotations

import json

import pytest
import torch

from helpers import hf_greedy, make_pipeline, tiny_loaded
from mtpflow.errors import UserError
from mtpflow.types import hidden_taps
from mtpflow.strategies.head_modules import Eagle3Drafter, load_heads, unroll
from test_heads_lossless import one_thread, prompts, random_heads  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def deep():
    return tiny_loaded(seed=3, layers=8)  # eagle3 taps layers (2, 4, 5)


def test_unroll_equals_step_by_step_drafting():
    """Step s of the unroll at position p equals a chain drafted from anchor p - s + 1 as the proposer does it:
    cached step-1 keys up to the anchor, then each step fed its own previous output."""
    torch.manual_seed(0)
    hidden, window, t, steps = 32, 6, 12, 4
    drafter = Eagle3Drafter(hidden, 4, 48, window, taps=3).eval()
    for p in drafter.parameters():
        p.data.normal_(0, 0.2)
    taps = torch.randn(1, t, 3 * hidden)
    emb = torch.randn(1, t, hidden)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        outs = unroll(drafter, drafter.input_features(taps), emb, pos, steps)
        feats = drafter.input_features(taps)[0]
        for anchor in range(t - steps):
            lo = max(0, anchor - window + 1)
            x, q, k, v = drafter.project(feats[lo:anchor + 1], emb[0, lo:anchor + 1], pos[0, lo:anchor + 1])
            out = drafter.finish(x[-1:][None], q[-1:][None], k[None], v[None],
                                 torch.ones(1, 1, k.shape[0], dtype=torch.bool))[0]
            assert torch.allclose(out, outs[0][0, anchor:anchor + 1], atol=1e-5)
            path_k, path_v = [], []
            for s in range(2, steps + 1):
                p = anchor + s - 1  # the step-s query's position; its token is token p + 1
                x, q, key, value = drafter.project(out, emb[0, p:p + 1], pos[0, p:p + 1])
                path_k.append(key)
                path_v.append(value)
                context = max(0, min(k.shape[0], window - (s - 1)))
                keys = torch.cat([k[k.shape[0] - context:]] + path_k)
                values = torch.cat([v[v.shape[0] - context:]] + path_v)
                out = drafter.finish(x[None], q[None], keys[None], values[None],
                                     torch.ones(1, 1, keys.shape[0], dtype=torch.bool))[0]
                assert torch.allclose(out, outs[s - 1][0, p:p + 1], atol=1e-5), (anchor, s)


def test_random_eagle3_heads_match_hf_greedy(deep, tmp_path):
    folder = random_heads(deep, "eagle3", tmp_path / "e3", draft_vocab=200)
    assert load_heads(folder)[2]["taps"] == [2, 4, 5]
    trees = 0
    for i, ids in enumerate(prompts(len(deep.tokenizer), 5, seed=7)):
        pipe = make_pipeline(deep, "eagle3", "max_new_tokens=32", f"strategy.propose.heads={folder}",
                             "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == hf_greedy(deep.model, ids, 32), f"prompt {i}"
        trees += sum(not r.draft.is_chain for r in result.steps if r.draft.num_nodes)
    assert trees > 0


def test_eagle3_in_an_engine_batch_with_other_strategies(deep, tmp_path):
    from mtpflow.config import compose
    from mtpflow.engine import Engine
    from mtpflow.request import Request

    folder = random_heads(deep, "eagle3", tmp_path / "e3", scale=0.2)
    eagle = random_heads(deep, "eagle", tmp_path / "e")
    engine = Engine(compose(["strategy=pld", "trace=off", "max_new_tokens=24", "batch_k=off", "max_batch_size=6"]),
                    loaded=deep)
    mix = [("eagle3", {"propose.heads": str(folder), "prune.0.costs": None, "prune.0.threshold": 0.0}),
           ("pld", {"propose.costs": None}),
           ("eagle", {"propose.heads": str(eagle), "prune.0.costs": None}),
           ("eagle3", {"propose.heads": str(folder), "prune.0.costs": None}), ("baseline", {})]
    ids = prompts(len(deep.tokenizer), 10, seed=9)
    requests = [Request(prompt_ids=p, strategy=mix[i % 5][0], overrides=mix[i % 5][1]) for i, p in enumerate(ids)]
    results = engine.generate(requests)
    drafted = 0
    for request, result in zip(requests, results):
        assert result.token_ids == hf_greedy(deep.model, request.prompt_ids, 24), request.strategy
        if request.strategy == "eagle3":
            drafted += result.stats["draft_tokens"]
    assert drafted > 0


def test_heads_trained_on_other_layers_are_refused_with_one_line(deep, tmp_path):
    folder = random_heads(deep, "eagle3", tmp_path / "e3", taps=[1, 3, 6])
    pipe = make_pipeline(deep, "eagle3", "max_new_tokens=4", f"strategy.propose.heads={folder}")
    with pytest.raises(UserError, match=r"trained on layers \[1, 3, 6\].*return layers \[2, 4, 5\]") as info:
        pipe(prompt_ids=[5, 6, 7])
    assert "\n" not in str(info.value)
    # the right heads under a strategy whose forwards return only the last hidden state: refused too
    good = random_heads(deep, "eagle3", tmp_path / "good")
    pipe = make_pipeline(deep, "eagle3", "max_new_tokens=4", f"strategy.propose.heads={good}",
                         "strategy.needs_hidden_states=true")
    with pytest.raises(UserError, match=r"return layers \[-1\]"):
        pipe(prompt_ids=[5, 6, 7])


def test_eagle3_training_smoke_on_tiny(deep, tmp_path):
    """Data with tapped layers, a few unrolled training steps, per-step held-out accuracy recorded; the heads
    load and decode token-identically to HF greedy (and eagle gets the same per-step measure)."""
    from mtpflow.tools.train_heads import compose, run

    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text("\n".join(json.dumps({"prompt": p}) for p in ["the quick brown fox", "def add(a, b):",
                                                                         "once upon a time"]))
    cfg = compose([f"out={tmp_path / 'heads'}", f"data.folder={tmp_path / 'data'}", f"data.prompts={prompt_file}",
                   "data.samples=6", "data.batch_size=2", "data.max_new_tokens=12", "chat=false", "draft_vocab=64",
                   "kinds=[eagle,eagle3]", "eagle.steps=3", "eagle.window=8", "eagle.sequence_length=8",
                   "eagle.intermediate_size=32", "eagle3.steps=4", "eagle3.window=8", "eagle3.sequence_length=8",
                   "eagle3.intermediate_size=32", "eagle3.eval_every=2", "eagle3.train_steps=3"])
    out = run(cfg, loaded=deep)
    shard = torch.load(next((tmp_path / "data").glob("shard_*.pt")), weights_only=True)[0]
    assert shard["taps"].shape == (shard["hidden"].shape[0], 3 * deep.model.config.hidden_size)
    config = json.loads((out / "eagle3" / "heads.json").read_text())
    assert config["kind"] == "eagle3" and config["taps"] == list(hidden_taps(deep.model, "eagle3"))
    assert len(config["training"]["held_out_top1"]) == 3  # steps 1, 2, 3
    assert len(json.loads((out / "eagle" / "heads.json").read_text())["training"]["held_out_top1_per_step"]) == 3
    ids = [5, 6, 7, 8]
    pipe = make_pipeline(deep, "eagle3", "max_new_tokens=16", f"model.heads={out}")
    assert pipe(prompt_ids=ids).token_ids == hf_greedy(deep.model, ids, 16)


def test_eagle3_training_needs_tapped_data(tmp_path):
    from mtpflow.errors import ConfigError
    from mtpflow.tools.train_heads import compose, run

    with pytest.raises(ConfigError, match="data.taps"):
        run(compose(["kinds=[eagle3]", "data.taps=null", f"data.folder={tmp_path / 'd'}", f"out={tmp_path / 'h'}"]),
            loaded=tiny_loaded(seed=0))


@pytest.mark.parametrize("bad", ["data.taps=[40]", "data.taps=foo"])
def test_bad_taps_for_the_training_text_are_one_line(bad, tmp_path):
    from mtpflow.tools.train_heads import compose, run

    with pytest.raises(UserError, match="data.taps") as info:
        run(compose(["kinds=[]", bad, f"data.folder={tmp_path / 'd'}", "data.samples=2", "data.batch_size=2",
                     "data.max_new_tokens=3"]), loaded=tiny_loaded(seed=0))
    assert "\n" not in str(info.value)
