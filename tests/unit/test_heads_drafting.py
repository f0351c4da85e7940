"""Draft heads at decoding time (``mtpflow.strategies.head_drafting``): the products of the engine's backend compute
what the trained torch modules compute (EAGLE's tree levels what training's ``unroll`` computes, Medusa's stacked
heads what its blocks compute), through the torch default and through the native products in float32 and int8;
and random heads over the int8 model decode exactly as the int8 reference."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from helpers import make_pipeline, tiny_loaded
from mtpflow import backends
from mtpflow.backends.base import Backend
from mtpflow.strategies.head_drafting import DraftVocabulary, EagleDraft, MedusaDraft
from mtpflow.strategies.head_modules import Eagle3Drafter, EagleDrafter, MedusaHeads, unroll
from test_heads_lossless import one_thread, prompts, random_heads  # noqa: F401 (fixture)

HIDDEN, VOCAB = 64, 40


def torch_products():
    return Backend(torch.nn.Linear(1, 1)).head_product


def native_products(int8: bool):
    """``head_product`` of the native float32 backend over a tiny model, the draft's precision bound."""
    loaded = tiny_loaded(seed=0)
    try:
        backend = backends.create(loaded.model, "native_cpu")
    except Exception as exc:  # no C compiler here
        pytest.skip(f"native backend: {exc}")
    return lambda weight, bias=None: backend.head_product(weight, bias, int8)


def vocabulary(product, seed=1):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(VOCAB, HIDDEN, generator=g) * 0.3
    return DraftVocabulary(rows, torch.arange(VOCAB) * 3, product, torch.randn(VOCAB, HIDDEN, generator=g)), rows


def random_module(kind: str, seed=0):
    torch.manual_seed(seed)
    if kind == "medusa":
        module = MedusaHeads(HIDDEN, 3)
    elif kind == "eagle":
        module = EagleDrafter(HIDDEN, 4, 96, window=6)
    else:
        module = Eagle3Drafter(HIDDEN, 4, 96, window=6, taps=3)
    for p in module.parameters():
        p.data.normal_(0, 0.15)
    return module.eval()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
@pytest.mark.parametrize("products", ["torch", "native"])
def test_eagle_levels_compute_what_training_unrolls(kind, products):
    """A chain drafted level by level from every anchor (the committed keys up to the anchor in the window, then its
    own path) equals step s of ``unroll`` at that position: the decoding runner and the training-time test are the
    same computation."""
    module = random_module(kind)
    product = torch_products() if products == "torch" else native_products(int8=False)
    vocab, rows = vocabulary(product)
    draft = EagleDraft(module, vocab, product, torch.device("cpu"))
    t, steps = 12, 4
    width = HIDDEN * (3 if kind == "eagle3" else 1)
    hidden = torch.randn(t, width)
    tokens = torch.randint(0, 100, (t + 1,))
    emb_table = torch.randn(100, HIDDEN)
    embed = lambda ids: emb_table[ids]  # noqa: E731
    with torch.no_grad():
        outs = unroll(module, module.input_features(hidden[None]), emb_table[tokens[1:]][None], torch.arange(t)[None],
                      steps)
    tol = 1e-5 if products == "torch" else 1e-4
    for anchor in range(2, t - steps):
        draft.reset()
        draft.sync(hidden[:anchor + 1], tokens[:anchor + 2], embed)  # committed: inputs 0..anchor, root token anchor+1
        out, logits = draft.first()
        torch.testing.assert_close(out[0], outs[0][0, anchor], atol=tol, rtol=tol)
        torch.testing.assert_close(logits[0], module.head_features(outs[0][0, anchor]) @ rows.T, atol=tol, rtol=tol)
        for s in range(2, steps + 1):
            p = anchor + s - 1
            out, _ = draft.level(out, emb_table[tokens[p + 1]][None], p, s - 1, [list(range(s - 2))])
            torch.testing.assert_close(out[0], outs[s - 1][0, p], atol=tol, rtol=tol)


def test_a_tree_level_attends_to_each_nodes_own_path():
    """Two sibling branches expanded in one level: each node's output is the one it has drafted alone (its
    ancestors' keys, never its sibling's)."""
    module = random_module("eagle", seed=2)
    product = torch_products()
    vocab, _ = vocabulary(product)
    hidden, tokens = torch.randn(5, HIDDEN), torch.randint(0, VOCAB, (6,))
    embed = lambda ids: vocab.embeddings[ids]  # noqa: E731
    a, b = vocab.embeddings[3][None], vocab.embeddings[7][None]
    together = EagleDraft(module, vocab, product, torch.device("cpu"))
    together.sync(hidden, tokens, embed)
    root, _ = together.first()
    level1, _ = together.level(torch.cat([root, root]), torch.cat([a, b]), 5, 1, [[], []])
    level2, _ = together.level(level1, torch.cat([b, a]), 6, 2, [[0], [1]])
    for j, (first, second) in enumerate(((a, b), (b, a))):
        alone = EagleDraft(module, vocab, product, torch.device("cpu"))
        alone.sync(hidden, tokens, embed)
        alone.first()
        out1, _ = alone.level(root, first, 5, 1, [[]])
        out2, _ = alone.level(out1, second, 6, 2, [[0]])
        torch.testing.assert_close(level2[j], out2[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("products", ["torch", "native", "native-int8"])
def test_medusa_heads_are_one_stacked_product(products):
    module = random_module("medusa")
    product = torch_products() if products == "torch" else native_products(int8=products == "native-int8")
    vocab, rows = vocabulary(product)
    draft = MedusaDraft(module, vocab, product)
    h = torch.randn(HIDDEN)
    with torch.no_grad():
        want = module(h)[:2] @ rows.T  # [2, vocab]
    got = draft.logits(h, 2)
    if products == "native-int8":  # int8 weights and activations: close, and the same most likely tokens
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_int8_products_track_float32():
    """The W8A8 draft products: per-output int8 weights and per-row int8 activations, a bias added in float32."""
    product = native_products(int8=True)
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(200, 96, generator=g), torch.randn(200, generator=g), torch.randn(3, 96, generator=g)
    got, want = product(w, b)(x), x @ w.T + b
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@pytest.mark.parametrize("kind", ["medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("precision", ["float32", "int8"])
def test_heads_over_the_int8_model_decode_as_its_reference(kind, precision, tmp_path):
    """Random heads over the int8 model (``model.quantize=int8``), their products in either precision: every token
    is the int8 reference's greedy, and the run says which precision drafted."""
    loaded = tiny_loaded(seed=4, layers=8)
    folder = random_heads(loaded, kind, tmp_path / kind, scale=0.2, draft_vocab=120)
    try:
        int8 = dataclasses.replace(loaded, int8=backends.quantize_int8(loaded.model))
    except Exception as exc:
        pytest.skip(f"int8 model: {exc}")
    reference = backends.int8_reference(int8.int8)
    drafted = 0
    for ids in prompts(len(loaded.tokenizer), 3, seed=2):
        pipe = make_pipeline(int8, kind, "max_new_tokens=24", "trace=off", "model.quantize=int8",
                             f"strategy.propose.heads={folder}", f"strategy.propose.precision={precision}",
                             "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null")
        result = pipe(prompt_ids=ids)
        assert result.token_ids == reference.greedy(torch.tensor(ids), 24, loaded.eos_token_ids)
        assert result.stats["heads_precision"] == precision
        drafted += result.stats["draft_tokens"]
    assert drafted > 0


def test_a_smaller_draft_vocabulary_from_the_most_frequent_tokens(tmp_path):
    """``pick_draft_vocab`` keeps the most frequent target choices first; ``strategy.propose.vocab_size`` drafts from
    the first N of them only (still lossless); heads whose vocabulary is not stored in that order are refused."""
    from helpers import hf_greedy
    from mtpflow.errors import UserError
    from mtpflow.hookspecs import hookimpl
    from mtpflow.strategies.head_modules import CONFIG_NAME, load_heads
    from mtpflow.tools.train_heads import pick_draft_vocab

    records = [{"greedy": torch.tensor([-1, 7, 7, 3, 7, 3, 9]), "prompt_len": 2}]
    assert pick_draft_vocab(records, 3, 12).tolist() == [7, 3, 9]
    assert pick_draft_vocab(records, 0, 12)[:3].tolist() == [7, 3, 9]

    loaded = tiny_loaded(seed=0)
    folder = random_heads(loaded, "eagle", tmp_path / "e", scale=0.2, draft_vocab=120)
    config = json.loads((folder / CONFIG_NAME).read_text())
    first = load_heads(folder)[1][:30].tolist()
    drafted = set()

    class Spy:
        @hookimpl
        def on_step_end(self, record):
            drafted.update(record.draft.tokens.tolist())

    args = ("max_new_tokens=24", "trace=off", f"strategy.propose.heads={folder}", "strategy.propose.vocab_size=30",
            "strategy.prune.0.threshold=0.0", "strategy.prune.0.costs=null")
    with pytest.raises(UserError, match="not stored most frequent first"):
        make_pipeline(loaded, "eagle", *args)(prompt_ids=[5, 6, 7])
    (folder / CONFIG_NAME).write_text(json.dumps({**config, "draft_vocab_order": "frequency"}))
    for ids in prompts(len(loaded.tokenizer), 3, seed=1):
        result = make_pipeline(loaded, "eagle", *args)(prompt_ids=ids, extra_plugins=(Spy(),))
        assert result.token_ids == hf_greedy(loaded.model, ids, 24)
    assert drafted and drafted <= set(first)
