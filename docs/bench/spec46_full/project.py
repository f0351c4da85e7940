"""A projection, not a measurement: the int8 speedups of the lookup drafters at real model sizes, from the
acceptance and speedups measured on the default model and the verify-cost curves measured at each shape.

    python docs/bench/spec46_full/project.py SUMMARY.csv DEFAULT_PROFILE.json SHAPE_PROFILE.json...

For each strategy over the int8 target (``strategy|model.quantize=int8`` rows of a bench summary, the ``overall``
class): its speedup over the int8 ``baseline`` is MAL x t(0) / t(step), so a step cost it t(step) / t(0) = MAL /
speedup times a one-token forward. That cost is read as an effective draft length K on the default model's int8
verify curve (linear between the measured Ks); the projection is MAL / c(K) on the shape's curve, c its cost over
K = 0. The drafter's own time rides in K (a lookup's does not grow with the model, so the projection is
conservative for pld and suffix_cache);
strategies whose drafter runs a model or heads (int8_draft, mtp_heads) are projected the same way and marked: their
drafter's cost at the shape was not measured. A profile argument may end in ``#TEXT``: the newest int8 curve whose
key contains TEXT (a kernel hash) instead of the newest one.
"""
import csv
import json
import sys

LOOKUP = {"pld", "suffix_cache", "mtp", "recycling"}  # drafters that run no model: their cost does not grow with it


def int8_curve(arg):
    """(key, {K: seconds}) of the newest int8 verify curve in a tuning profile (``PATH#TEXT``: whose key has TEXT)."""
    path, _, text = arg.partition("#")
    entries = json.load(open(path))["entries"]
    curves = [(key, v["verify"]) for key, v in entries.items() if "int8" in key and "verify" in v and text in key]
    key, verify = curves[-1]
    context = sorted(verify, key=int)[-1]
    return key, {int(k): t for k, t in verify[context].items()}


def cost(curve, k):
    """c(k) = t(k) / t(0), linear between the measured Ks"""
    ks = sorted(curve)
    k = min(max(k, ks[0]), ks[-1])
    for a, b in zip(ks, ks[1:]):
        if a <= k <= b:
            t = curve[a] + (curve[b] - curve[a]) * (k - a) / (b - a)
            return t / curve[0]
    return curve[ks[-1]] / curve[0]


def effective_k(curve, c):
    """the K whose cost is c on curve (the largest K if c is above it all)"""
    ks = sorted(curve)
    for a, b in zip(ks, ks[1:]):
        ca, cb = cost(curve, a), cost(curve, b)
        if ca <= c <= cb and cb > ca:
            return a + (b - a) * (c - ca) / (cb - ca)
    return 0.0 if c < 1.0 else float(ks[-1])


def main(argv):
    summary, default, shapes = argv[0], argv[1], argv[2:]
    rows = {r["strategy"]: r for r in csv.DictReader(open(summary)) if r["class"] == "overall"}
    base = float(rows["baseline|model.quantize=int8"]["tokens_per_s"])
    _, dcurve = int8_curve(default)
    scurves = [(path, *int8_curve(path)) for path in shapes]
    print("| strategy (int8) | MAL | measured x int8 `baseline` | effective K | "
          + " | ".join(f"projected, {key.split(' |')[0]}" for _, key, _ in scurves) + " |")
    print("|---|---|---|---|" + "---|" * len(scurves))
    for name, r in sorted(rows.items()):
        if not name.endswith("|model.quantize=int8") or name.startswith("baseline"):
            continue
        strategy = name.split("|")[0]
        mal, speedup = float(r["mal"]), float(r["tokens_per_s"]) / base
        k = effective_k(dcurve, mal / speedup)
        mark = "" if strategy in LOOKUP else " (drafter cost at the shape not measured)"
        cells = [f"{mal / cost(c, k):.2f}x" for _, _, c in scurves]
        print(f"| `{strategy}`{mark} | {mal:.2f} | {speedup:.2f}x | {k:.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
