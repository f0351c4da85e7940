"""Builds the labeled prompt set of the domain classifier from the hand-written requests and slot templates in
``mtpflow/data/domain_sources/*.yaml``: expands the templates, adds light user-style noise (lower case,
typos, greetings), drops near-duplicates and splits train / held-out by source group, so a held-out prompt
never shares a template with a training prompt.

    python -m mtpflow.tools.domain_prompts      # rewrites mtpflow/data/domain_prompts.jsonl
"""
from __future__ import annotations

import json
import random
import re
import sys
import zlib
from importlib import resources
from pathlib import Path

DOMAINS = ("finance", "education", "healthcare", "code", "general")
SOURCE_DIR = Path(__file__).resolve().parents[1] / "data" / "domain_sources"
OUTPUT = Path(__file__).resolve().parents[1] / "data" / "domain_prompts.jsonl"
HELDOUT_SHARE = 0.2
NEAR_DUPLICATE_JACCARD = 0.8  # character 5-gram overlap above which two prompts count as the same request
SEED = 20260

# User-style surface noise, shared by all classes so the classifier cannot learn it as a domain cue.
OPENERS = ["hi,", "Hello!", "hey", "Quick question:", "ok so", "Hi there.", "Can you help?", "Good morning.",
           "I need some help.", "So"]
CLOSERS = ["thanks!", "Thanks in advance.", "thx", "Please keep it short.", "Any help appreciated.",
           "Thank you so much", "Be concise please.", "I'd appreciate a detailed answer."]


def _typo(text: str, rng: random.Random) -> str:
    """Swap two inner letters of one longer word, the commonest real typo."""
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if len(w) >= 6 and w.isalpha()]
    if not candidates:
        return text
    i = rng.choice(candidates)
    w = words[i]
    j = rng.randrange(1, len(w) - 2)
    words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def add_noise(text: str, rng: random.Random) -> str:
    if "\n" not in text:  # leave pasted code and documents alone
        if rng.random() < 0.15:
            text = f"{rng.choice(OPENERS)} {text[0].lower() + text[1:] if rng.random() < 0.5 else text}"
        if rng.random() < 0.08:
            text = f"{text} {rng.choice(CLOSERS)}"
        if rng.random() < 0.12:
            text = _typo(text, rng)
        if rng.random() < 0.12:
            text = text.lower()
        if rng.random() < 0.1:
            text = text.rstrip("?.!")
    return text


def expand_template(template: dict, rng: random.Random) -> list[str]:
    """One prompt per filler of the longest slot list; every slot cycles through its own shuffled fillers."""
    slots = {k: list(v) for k, v in template["slots"].items()}
    for values in slots.values():
        rng.shuffle(values)
    n = max(len(v) for v in slots.values())
    out = []
    for i in range(n):
        text = template["text"].format(**{k: v[i % len(v)] for k, v in slots.items()})
        out.append(re.sub(r"\s+([?.!,])", r"\1", re.sub(r" {2,}", " ", text)).strip())
    return out


def shingles(text: str, n: int = 5) -> set[str]:
    t = re.sub(r"\s+", " ", text.lower())
    return {t[i:i + n] for i in range(max(1, len(t) - n + 1))}


def drop_near_duplicates(rows: list[dict]) -> tuple[list[dict], int]:
    kept, kept_shingles, dropped = [], [], 0
    for row in rows:
        s = shingles(row["text"])
        if any(len(s & o) / len(s | o) >= NEAR_DUPLICATE_JACCARD for o in kept_shingles):
            dropped += 1
            continue
        kept.append(row)
        kept_shingles.append(s)
    return kept, dropped


def split_by_group(rows: list[dict], rng: random.Random) -> None:
    """Mark whole source groups held-out, per domain, until they hold HELDOUT_SHARE of the domain's prompts."""
    for domain in DOMAINS:
        group_sizes: dict[str, int] = {}
        for r in rows:
            if r["domain"] == domain:
                group_sizes[r["group"]] = group_sizes.get(r["group"], 0) + 1
        groups = sorted(group_sizes)
        rng.shuffle(groups)
        target = HELDOUT_SHARE * sum(group_sizes.values())
        held, count = set(), 0
        for g in groups:
            if count >= target:
                break
            held.add(g)
            count += group_sizes[g]
        for r in rows:
            if r["domain"] == domain:
                r["split"] = "heldout" if r["group"] in held else "train"


def build(source_dir: Path = SOURCE_DIR) -> tuple[list[dict], dict]:
    import yaml

    rows: list[dict] = []
    for domain in DOMAINS:
        spec = yaml.safe_load((source_dir / f"{domain}.yaml").read_text(encoding="utf-8"))
        for i, text in enumerate(spec["prompts"]):
            rows.append({"domain": domain, "group": f"{domain}-h{i:03d}", "text": text.strip()})
        for j, template in enumerate(spec.get("templates", [])):
            rng = random.Random(zlib.crc32(f"{domain}-{j}".encode()) ^ SEED)
            for text in expand_template(template, rng):
                rows.append({"domain": domain, "group": f"{domain}-t{j:02d}", "text": text})
    for r in rows:
        r["text"] = add_noise(r["text"], random.Random(zlib.crc32(r["text"].encode()) ^ SEED))
    rows, dropped = drop_near_duplicates(rows)
    split_by_group(rows, random.Random(SEED))
    for domain in DOMAINS:
        for i, r in enumerate(x for x in rows if x["domain"] == domain):
            r["id"] = f"{domain}-{i:03d}"
    rows = [{"id": r["id"], "domain": r["domain"], "split": r["split"], "group": r["group"], "text": r["text"]}
            for r in rows]
    return rows, {"near_duplicates_dropped": dropped}


def load_prompts(split: str | None = None) -> list[dict]:
    """The shipped labeled prompts (id, domain, split, group, text), optionally one split only."""
    text = resources.files("mtpflow.data").joinpath("domain_prompts.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    return [r for r in rows if split is None or r["split"] == split]


def main() -> int:
    rows, info = build()
    OUTPUT.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    for domain in DOMAINS:
        mine = [r for r in rows if r["domain"] == domain]
        held = sum(r["split"] == "heldout" for r in mine)
        print(f"{domain:11s} {len(mine):4d} prompts ({len(mine) - held} train, {held} held-out)")
    print(f"near-duplicates dropped: {info['near_duplicates_dropped']}; wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
