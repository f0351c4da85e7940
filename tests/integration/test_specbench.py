"""Spec-Bench's own question file, read as is: the 6-question sample (one per reported category, written for
these tests in Spec-Bench's format) runs end to end on a tiny model with ``limit=1`` and 16 new tokens, first
turn and both turns; Spec-Bench's figures per category; bad files and a bad ``turns`` are one line, exit 2,
nothing written."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from helpers import make_tiny_model, make_tiny_tokenizer
from mtpflow.errors import UserError
from mtpflow.tools import bench, specbench

SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "specbench_sample.jsonl"
CATEGORIES = ["mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"]
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """The tiny model with a chat template, so the second turn goes through it as messages."""
    folder = tmp_path_factory.mktemp("tiny-chat")
    tok = make_tiny_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    make_tiny_model(len(tok), seed=2).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_the_sample_is_in_spec_bench_format():
    rows = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(rows) == 6 and all(set(r) == {"question_id", "category", "turns"} for r in rows)
    items = bench.load_prompt_suite(str(SAMPLE))
    assert [i["class"] for i in items] == CATEGORIES  # MT-bench's "writing" is reported as mt_bench
    assert items[0]["category"] == "writing" and len(items[0]["turns"]) == 2
    assert [i["id"] for i in bench.load_prompt_suite(str(SAMPLE), classes=["qa"])] == ["321"]


@pytest.mark.parametrize("turns", [1, 2])
def test_spec_bench_runs_both_turn_modes(chat_model, tmp_path, turns):
    out = tmp_path / "out"
    args = [f"model={chat_model}", f"prompts={SAMPLE}", "limit=1", f"turns={turns}", "max_new_tokens=16",
            "strategies=[pld]", "overrides=[trace=off]", f"out={out}"]
    assert bench.main(args) == 0
    runs = pd.read_csv(out / "bench_runs.csv")
    summary = pd.read_csv(out / "bench_summary.csv")
    # one unit per question, plus the MT-bench question's second turn with turns=2
    assert len(runs) == 2 * (6 + (turns == 2))
    assert set(runs["turn"]) == set(range(1, turns + 1))
    if turns == 2:
        second = runs[runs["turn"] == 2]
        assert set(second["question_id"]) == {81} and set(second["id"]) == {"81/turn2"}
    assert runs["identical"].all()
    pld = summary[summary["strategy"] == "pld"]
    assert list(pld["class"]) == [*CATEGORIES, "overall"]
    assert (pld["speedup_vs_hf"] > 0).all() and (pld["mal"] >= 1).all() and (pld["tokens_per_s"] > 0).all()
    assert pld.set_index("class").loc["mt_bench", "identical"] == f"{turns}/{turns}"
    record = json.loads((out / "manifest.json").read_text())
    assert record["settings"]["spec_bench"] is True and record["settings"]["turns"] == turns
    assert record["settings"]["prompt_count"] == 6 + (turns == 2)


def test_second_turn_is_the_conversation_with_the_first_answer(chat_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    item = bench.load_prompt_suite(str(SAMPLE), limit=1)[0]
    messages = specbench.second_turn_messages(item, "Dear neighbour, come on Saturday.")
    ids = specbench.encode_messages(tok, messages, chat=True)
    text = tok.decode(ids)
    assert text.index(item["turns"][0]) < text.index("Dear neighbour") < text.index(item["turns"][1])
    assert text.endswith("assistant:")
    plain = tok.decode(specbench.encode_messages(tok, messages, chat=False))  # chat=false: joined by blank lines
    assert plain == "\n\n".join(m["content"] for m in messages)


def test_spec_bench_figures_follow_its_definitions():
    """A question's tokens/s sums its turns; a category's is the mean over its questions; the speedup is
    the ratio of those means."""
    rows = []
    for qid, cls, hf_s, s_s in (("1", "qa", 1.0, 0.5), ("2", "qa", 4.0, 1.0)):
        for strategy, seconds in (("hf_generate", hf_s), ("pld", s_s)):
            rows.append({"id": qid, "question_id": qid, "turn": 1, "class": cls, "strategy": strategy,
                         "repeat": 0, "tokens": 10, "seconds": seconds, "steps": 10 if strategy == "hf_generate"
                         else 4, "identical": True})
    table = specbench.summarize(pd.DataFrame(rows)).set_index(["strategy", "class"])
    # pld: mean(20, 10) = 15 tokens/s; HF: mean(10, 2.5) = 6.25; speedup 2.4 (not 20 / 5 = 4, the summed ratio)
    assert table.loc[("pld", "qa"), "tokens_per_s"] == pytest.approx(15.0)
    assert table.loc[("pld", "qa"), "speedup_vs_hf"] == pytest.approx(2.4)
    assert table.loc[("pld", "overall"), "mal"] == pytest.approx((20 - 2) / (8 - 2))


BAD_FILES = {
    "missing category": ('{"question_id": 1, "turns": ["hi"]}\n', "line 1 has no 'category'"),
    "missing turns": ('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n{"question_id": 2, "category": "qa"}\n',
                      "line 2 has no 'turns'"),
    "missing question_id": ('{"category": "qa", "turns": ["hi"]}\n', "line 1 has no 'question_id'"),
    "turns not a list": ('{"question_id": 1, "category": "qa", "turns": "hi"}\n',
                         "'turns' must be a non-empty list of strings"),
    "duplicate id": ('{"question_id": 1, "category": "qa", "turns": ["a"]}\n'
                     '{"question_id": 1, "category": "rag", "turns": ["b"]}\n', "question_id 1 appears more than once"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_a_bad_spec_bench_file_is_one_line_and_nothing_written(tmp_path, capsys, case):
    text, message = BAD_FILES[case]
    path = tmp_path / "question.jsonl"
    path.write_text(text)
    out = tmp_path / "out"
    assert bench.main(["model=/does/not/exist", f"prompts={path}", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mtpflow.bench: error:") and message in err and "\n" not in err, err
    assert not out.exists()


@pytest.mark.parametrize("value,message", [
    ("3", "turns must be 1 (the first question) or 2 (both, MT-bench style), got 3"),
    ("two", "turns must be 1 (the first question) or 2 (both, MT-bench style), got 'two'"),
])
def test_an_unknown_turns_value_is_one_line_and_nothing_written(tmp_path, capsys, value, message):
    out = tmp_path / "out"
    assert bench.main(["model=/does/not/exist", f"prompts={SAMPLE}", f"turns={value}", f"out={out}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mtpflow.bench: error: {message}"
    assert not out.exists()


def test_two_turns_need_a_spec_bench_file(tmp_path, capsys):
    out = tmp_path / "out"
    assert bench.main(["model=/does/not/exist", "turns=2", f"out={out}"]) == 2
    assert "turns=2 needs a Spec-Bench question file" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(UserError, match="line 1 has no 'turns'"):
        specbench.load_questions([{"question_id": 1, "category": "qa"}], "q.jsonl")
