"""Spec-Bench's own question file, read as is (``python -m mtpflow.bench prompts=PATH/question.jsonl``).

Spec-Bench (hemingkx/Spec-Bench) is the field's common yardstick for speculative decoding: JSON lines with
``question_id``, ``category`` and ``turns`` (a list of user messages). Its report groups the eight MT-bench
categories (writing, roleplay, ...) as ``mt_bench`` beside ``translation``, ``summarization``, ``qa``,
``math_reasoning`` and ``rag``, and gives per category the tokens per second, the speedup over plain decoding
(the ratio of the mean per-question tokens/s) and the mean accepted tokens per step; this module computes the
same, with HF ``generate`` in the same process as the plain decoding. No copy of Spec-Bench ships with mtpflow.
``load_prompt_suite`` reads either kind of prompt file (mtpflow's own suite, or Spec-Bench's) for every bench mode.
"""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from mtpflow.errors import UserError

FIELDS = ("question_id", "category", "turns")
MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
ORDER = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")  # Spec-Bench's report order


def looks_like_specbench(rows: list) -> bool:
    """A prompt file in Spec-Bench's format: its lines carry Spec-Bench's fields rather than ``prompt``."""
    return any(isinstance(r, dict) and ("turns" in r or "question_id" in r) for r in rows)


def group(category: str) -> str:
    """The category Spec-Bench reports a question under (MT-bench's eight as one)."""
    return "mt_bench" if category in MT_BENCH else category


def load_questions(rows: list, path: str) -> list[dict]:
    """Spec-Bench lines as suite items: ``id`` (the question id), ``class`` (the reported category),
    ``category`` (the file's own), ``turns``. A missing field or a malformed one is a UserError naming the line."""
    items = []
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise UserError(f"{path}: line {number} is not a JSON object (Spec-Bench lines have "
                            f"{', '.join(FIELDS)})")
        missing = [f for f in FIELDS if f not in row]
        if missing:
            raise UserError(f"{path}: line {number} has no {missing[0]!r} (Spec-Bench lines have "
                            f"{', '.join(FIELDS)})")
        turns = row["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise UserError(f"{path}: line {number}: 'turns' must be a non-empty list of strings")
        if not isinstance(row["category"], str) or not row["category"]:
            raise UserError(f"{path}: line {number}: 'category' must be a non-empty string")
        items.append({"id": str(row["question_id"]), "class": group(row["category"]),
                      "category": row["category"], "turns": list(turns), "prompt": turns[0]})
    ids = [i["id"] for i in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UserError(f"{path}: question_id {dup} appears more than once")
    return items


def check_turns(value) -> int:
    if isinstance(value, bool) or value not in (1, 2, "1", "2"):
        raise UserError(f"turns must be 1 (the first question) or 2 (both, MT-bench style), got {value!r}")
    return int(value)


def class_order(classes) -> list[str]:
    known = [c for c in ORDER if c in set(classes)]
    return known + sorted(set(classes) - set(ORDER))


def second_turn_messages(item: dict, first_answer: str) -> list[dict]:
    """The conversation for turn 2: the first question, the model's own (HF greedy) answer to it, the second."""
    return [{"role": "user", "content": item["turns"][0]}, {"role": "assistant", "content": first_answer},
            {"role": "user", "content": item["turns"][1]}]


def encode_messages(tokenizer, messages: list[dict], chat: bool, system_prompt=None) -> list[int]:
    """Token ids of a conversation as the pipelines would feed it: through the chat template (with the
    configured system prompt), or, without one (``chat=false``), the messages joined by blank lines."""
    from mtpflow.request import encode_prompt

    if chat and getattr(tokenizer, "chat_template", None):
        if system_prompt:
            messages = [{"role": "system", "content": str(system_prompt)}, *messages]
        try:
            out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # noqa: BLE001 - a template that rejects an assistant turn
            raise UserError(f"the model's chat template rejected a two-turn conversation: "
                            f"{str(exc).splitlines()[0]}") from None
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(i) for i in ids]
    return encode_prompt(tokenizer, "\n\n".join(m["content"] for m in messages), chat=False)


def summarize(df) -> "pandas.DataFrame":
    """Spec-Bench's figures per category and overall, for every strategy (and peer) in the runs: a
    question's tokens/s is its tokens over its seconds, both turns summed; a category's tokens/s is the mean
    over its questions; the speedup is that mean over HF ``generate``'s on the same questions; MAL is tokens
    per verify step (the prefill's token aside) over all the category's turns; identical counts turns. With
    ``repeats`` > 1 each turn counts with its fastest repeat. Same columns as ``bench.summarize``."""
    import pandas as pd


    df = best_of_repeats(df)
    per_question = df.groupby(["strategy", "question_id"], sort=False).agg(
        cls=("class", "first"), tokens=("tokens", "sum"), seconds=("seconds", "sum")).reset_index()
    per_question["rate"] = per_question["tokens"] / per_question["seconds"]
    hf = per_question[per_question["strategy"] == "hf_generate"].set_index("question_id")["rate"]
    out = []
    strategies = list(dict.fromkeys(df["strategy"]))
    for strategy in strategies:
        runs = df[df["strategy"] == strategy]
        questions = per_question[per_question["strategy"] == strategy]
        for cls in [*class_order(runs["class"].unique()), "overall"]:
            g = runs if cls == "overall" else runs[runs["class"] == cls]
            q = questions if cls == "overall" else questions[questions["cls"] == cls]
            if not len(g):
                continue
            rate = q["rate"].mean()
            hf_rate = hf.reindex(q["question_id"]).mean()
            tokens = int(g["tokens"].sum())
            steps = g["steps"]
            known = steps.notna().all()
            out.append({
                "strategy": strategy, "class": cls, "prompts": int(len(q)), "tokens": tokens,
                "tokens_per_s": round(rate, 2),
                "speedup_vs_hf": round(rate / hf_rate, 3) if hf_rate == hf_rate and hf_rate else None,
                "mal": round((tokens - len(g)) / max(steps.sum() - len(g), 1), 3) if known else None,
                "forwards_per_token": round(steps.sum() / tokens, 3) if known and tokens else None,
                "identical": f"{int(g['identical'].sum())}/{len(g)}",
                "lookup_ceiling_mal": None,
            })
    return pd.DataFrame(out)


def print_table(table) -> str:
    """Spec-Bench's layout: a row per strategy, the speedup per category, then MAL and tokens/s overall."""
    rows = table[table["strategy"] != "hf_generate"]
    classes = [c for c in class_order(table["class"].unique()) if c != "overall"]
    head = ["strategy", *classes, "overall", "MAL", "tokens/s"]
    lines = [head]
    for strategy in dict.fromkeys(rows["strategy"]):
        part = rows[rows["strategy"] == strategy].set_index("class")

        def cell(cls):
            v = part["speedup_vs_hf"].get(cls) if cls in part.index else None
            return "-" if v is None or v != v else f"{v:.2f}x"

        overall = part.loc["overall"] if "overall" in part.index else None
        mal = None if overall is None else overall["mal"]
        lines.append([strategy, *[cell(c) for c in classes], cell("overall"),
                      "-" if mal is None or mal != mal else f"{mal:.2f}",
                      "-" if overall is None else f"{overall['tokens_per_s']:.1f}"])
    widths = [max(len(str(r[i])) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in lines)


def load_prompt_suite(path: str | None = None, classes=None, limit: int = 0) -> list[dict]:
    """The benchmark prompts as dicts with id, class and prompt; a Spec-Bench question file (``question_id``,
    ``category``, ``turns``) gives one item per question, its reported category as class, its turns kept."""
    if path:
        try:
            text = Path(path).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the prompt file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    else:
        text = resources.files("mtpflow.data").joinpath("bench_prompts.jsonl").read_text(encoding="utf-8")
    try:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError:
        rows = None
    if rows is not None and looks_like_specbench(rows):
        rows = load_questions(rows, str(path))
    else:
        try:
            if rows is None or not all(isinstance(r, dict) and isinstance(r.get("prompt"), str) for r in rows):
                raise ValueError
            rows = [{"id": str(r.get("id", i)), "class": str(r.get("class", "all")), **{k: v for k, v in r.items()
                     if k not in ("id", "class")}} for i, r in enumerate(rows)]
        except ValueError:
            raise UserError(f"{path}: every line must be a JSON object with a 'prompt' (and optionally 'id', "
                            "'class')") from None
    if classes:
        rows = [r for r in rows if r["class"] in set(classes)]
    if limit:
        seen: dict[str, int] = {}
        kept = []
        for r in rows:
            seen[r["class"]] = seen.get(r["class"], 0) + 1
            if seen[r["class"]] <= limit:
                kept.append(r)
        rows = kept
    return rows


def best_of_repeats(df) -> "pandas.DataFrame":
    """One row per (prompt, strategy): the fastest of its repeats (timing noise on a shared machine only ever
    adds time), token identity only if every repeat was identical."""
    if "repeat" not in df or df["repeat"].nunique() <= 1:
        return df
    fastest = df.loc[df.groupby(["id", "strategy"])["seconds"].idxmin()].copy()
    identical = df.groupby(["id", "strategy"])["identical"].all()
    fastest["identical"] = [identical[(r.id, r.strategy)] for r in fastest.itertuples()]
    return fastest.reset_index(drop=True)
