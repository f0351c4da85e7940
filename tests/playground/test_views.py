"""The playground's pieces without a server: per-token views from live steps, HTML, knob and override checks,
history rebuilt from the trace store (tiny model, fast)."""
from __future__ import annotations

import pytest

from mtpflow.errors import ConfigError
from mtpflow.types import ACCEPTED, BONUS, PLAIN, RECOVERED

from mtpflow.playground import history, render
from mtpflow.playground.runner import Knobs, PlaygroundRunner, example_prompts, parse_overrides, tunable_parameters
from mtpflow.playground.views import (
    IncrementalDetokenizer, SideView, StepView, acceptance_by_position, finish_tokens, step_tokens, step_view,
)

PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog. the quick"
# the tiny model's own first layer drafts: on it, some drafts are accepted (with a bonus) and some refused
DRAFTS_SOME = ["strategy.propose.layers=1", "strategy.propose.cost_aware=false", "strategy.select_k.k=1"]  # always drafts


def live_side(loaded, tmp_path, strategy: str = "draft_model", extra=DRAFTS_SOME, max_new_tokens: int = 32):
    runner = PlaygroundRunner((f"trace.db={tmp_path / 'traces.db'}", "chat=false"), loaded=loaded)
    pipe = runner.build(strategy, Knobs(max_new_tokens, 0.0, None), list(extra))
    side = SideView(strategy)
    detok = IncrementalDetokenizer(loaded.tokenizer)

    def on_step(record, emitted):
        side.tokens.extend(step_tokens(record, list(emitted), detok))
        if record is not None:
            side.steps.append(step_view(record, loaded.tokenizer))

    result = pipe(PROMPT, on_step=on_step)
    finish_tokens(side.tokens, detok)
    side.stats, side.text, side.run_id, side.done = result.stats, result.text, result.run_id, True
    return side, result, runner


@pytest.fixture(scope="module")
def live(tiny, tmp_path_factory):
    """One recorded decode shared by the tests below (side view, DecodeResult, runner)."""
    return live_side(tiny, tmp_path_factory.mktemp("live"))


def test_incremental_detokenizer_matches_full_decode(tiny):
    tok = tiny.tokenizer
    text = "caf\u00e9 \u2603 na\u00efve \U0001f600 fox"  # multi-byte characters split over byte-level tokens
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_live_views_follow_the_step_records(live):
    side, result, _ = live
    assert [t.token_id for t in side.tokens] == result.token_ids
    assert "".join(t.text for t in side.tokens) == result.text
    kinds = [t.kind for t in side.tokens]
    assert kinds[0] == PLAIN  # the prefill's token
    expected = [PLAIN] + [k for r in result.steps for k in r.emitted_kinds]
    assert kinds == expected
    assert {ACCEPTED, RECOVERED, BONUS} <= set(kinds)
    for t in side.tokens:
        if t.kind == ACCEPTED:
            assert t.depth >= 1 and t.target_prob is not None
    # refused drafts: every kept draft node is accepted or listed as rejected
    for s, r in zip(side.steps, result.steps):
        assert s.accepted + len(s.rejected) == r.draft.num_nodes
        assert s.k == r.k


def test_pane_html_colors_tokens_and_escapes_text():
    side = SideView("pld", done=True)
    from mtpflow.playground.views import RejectedDraft, TokenView

    side.tokens = [TokenView(1, "<b>", PLAIN, -1), TokenView(2, " ok", ACCEPTED, 0, depth=1, draft_prob=0.5,
                                                                 target_prob=0.9, pfs=0.4, gate_score=0.9,
                                                                 origin="prompt lookup"),
                   TokenView(3, "!", RECOVERED, 0, target_prob=0.7)]
    side.steps = [StepView(0, 4, 3, 3, 1, 2, max_depth=3, rejected=(RejectedDraft(2, "?", "rejected", 0.2, 0.1),))]
    out = render.pane_html(side, show_rejected=True)
    assert "&lt;b&gt;" in out and "<b>" not in out
    assert 'class="tok tok-accepted"' in out and 'class="tok tok-recovered"' in out
    assert "PFS = 0.400" in out and "gate score = 0.900" in out and "draft p = 0.500" in out
    assert "drafted by prompt lookup" in out
    assert out.index('class="rej"') < out.index("tok-recovered")  # refused drafts sit before the recovered token
    assert 'class="rej"' not in render.pane_html(side, show_rejected=False)


def test_acceptance_by_position():
    steps = [StepView(0, 3, 3, 3, 3, 4, max_depth=3), StepView(1, 3, 3, 3, 1, 2, max_depth=3),
             StepView(2, 0, 0, 0, 0, 1, max_depth=0)]
    assert acceptance_by_position(steps) == [(1, 2, 2), (2, 2, 1), (3, 2, 1)]


@pytest.mark.parametrize("args, message", [
    ((0, "", ""), "max new tokens"), ((2000, "", ""), "max new tokens"), ((1.5, "", ""), "max new tokens"),
    ((8, "-1", ""), "temperature"), ((8, "hot", ""), "temperature"), ((8, "", "65"), "K must"),
    ((8, "", "2.5"), "K must"), ((8, "", "abc"), "K must"), ((8, "nan", ""), "temperature"),
])
def test_invalid_knobs_are_one_line_errors(args, message):
    with pytest.raises(ConfigError, match=message):
        Knobs.parse(*args, max_tokens_cap=1024)


def test_blank_knobs_keep_the_strategy_values():
    knobs = Knobs.parse("16", "", "")
    assert knobs == Knobs(16, None, None, 0)
    assert knobs.overrides() == ["max_new_tokens=16", "seed=0"]
    assert Knobs.parse(16, "0.5", "3").overrides() == ["max_new_tokens=16", "seed=0", "temperature=0.5", "k=3"]


@pytest.mark.parametrize("text", [
    "strategy.propose._target_=os.system", "model.name=/etc", "prompt_file=/etc/passwd",
    "strategy.propose.max_ngram=${oc.env:HOME}", "trace.db=/tmp/x.db", "strategy.propose.model=/x", "justaword",
])
def test_overrides_from_the_page_are_allow_listed(text):
    with pytest.raises(ConfigError):
        parse_overrides(text)


def test_allowed_overrides_and_tunable_parameters():
    assert parse_overrides("strategy.gate.epsilon=0.2\n top_p=0.9") == ["strategy.gate.epsilon=0.2", "top_p=0.9"]
    params = tunable_parameters("typical")
    assert "strategy.gate.epsilon=0.09" in params.splitlines()
    assert parse_overrides(params)  # what the page pre-fills is itself accepted


def test_example_prompts_come_from_the_benchmark_suite():
    rows = example_prompts()
    assert rows and all(r["prompt"].strip() for r in rows)
    assert len({r["class"] for r in rows}) >= 2


def test_history_rebuilds_the_live_view(tiny, live):
    side, result, runner = live
    store = runner.trace_store()
    assert store is not None and result.run_id is not None
    rows = history.runs_table(store)
    assert rows[0][0] == result.run_id and rows[0][3] == "draft_model"
    again = history.side_from_trace(store, result.run_id, tiny.tokenizer, tiny.model_id)
    assert [(t.token_id, t.kind, t.text) for t in again.tokens] == [(t.token_id, t.kind, t.text) for t in side.tokens]
    assert [(s.step, s.k, s.accepted, len(s.rejected)) for s in again.steps] == \
        [(s.step, s.k, s.accepted, len(s.rejected)) for s in side.steps]
    assert again.stats["new_tokens"] == side.stats["new_tokens"]
    with pytest.raises(KeyError):
        history.side_from_trace(store, 10_000)


def test_node_origin_tells_heads_from_lookup():
    import torch

    from mtpflow.playground.views import node_origin
    from mtpflow.strategies.graft import GraftedTree
    from mtpflow.types import Draft

    tree = Draft(torch.tensor([10, 20]), torch.tensor([-1, 0]), probs=torch.tensor([0.5, 0.5]),
                 source="mtp_heads:medusa", scores={"pfs": torch.tensor([0.5, 0.25])})
    grafted = GraftedTree.of_draft(tree)
    grafted.add_chain([10, 30], 0.8, "lookup")  # shares 10, adds 30
    merged = grafted.draft()
    assert [node_origin(merged, i) for i in range(3)] == ["heads + lookup", "heads", "prompt lookup"]
    assert node_origin(tree, 0) == "mtp_heads:medusa"
