"""What each part of the int8 model's attention costs a verify forward: the working tree's rows_int8.c against
builds of it with one part switched off (their outputs are wrong; only their time counts), timed in one process
by ab_kv.compare (alternating rounds, 20 forwards per draft length). Prints each build's fastest and median ms and,
per K, the median over the rounds of build / full.

    python docs/bench/int8_attention_dec06/ablate.py [rounds] [context] [k,k,...]
"""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "int8_kv_dec06"))
from ab_kv import compare  # noqa: E402

from mtpflow.backends.native import kernel  # noqa: E402

# (name, text in rows_int8.c, its replacement): each switches one part of attend_exact off
PARTS = (
    ("no-weigh", "        weigh(wq, values, n, d, g, w->unit + j, w->inv + j, o, w->sums);",
     "        (void)wq; (void)o;"),
    ("no-scores", "        block_scores_vnni(Q, qu, sq, keys, n, d, scale, (int32_t *)w->kf);",
     "        for (int qi = 0; qi < nq; qi++) for (int t = 0; t < n; t++) scores_at(Q, qi)[t] = 0.0f;"),
    ("no-softmax", "        w->inv[qi] = softmax_weights(s, n, softcap, w->sv, w->e + (size_t)qi * n, &wmax);",
     "        w->inv[qi] = 1.0f; wmax = 1.0f; for (int t = 0; t < n; t++) w->e[(size_t)qi * n + t] = s[t];"),
    ("no-attention", "                    attend_exact(&Q,", "                    if (0) attend_exact(&Q,"),
)


def main(rounds: int, context: int, ks: list[int]) -> None:
    full = (kernel.HERE / "rows_int8.c").read_text()
    sources = {"full": full}
    for name, old, new in PARTS:
        if full.count(old) != 1:
            sys.exit(f"{name}: rows_int8.c no longer holds the text it replaces")
        sources[name] = full.replace(old, new)
    times = compare(sources, context, ks, rounds)
    for k in ks:
        full_k = times[("full", k)]
        ratios = {name: statistics.median(b / a for a, b in zip(full_k, times[(name, k)]))
                  for name in sources if name != "full"}
        print(f"K={k}: " + ", ".join(f"{name} / full {ratio:.3f}" for name, ratio in ratios.items()))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(int(args[0]) if args else 12, int(args[1]) if len(args) > 1 else 256,
         [int(x) for x in (args[2] if len(args) > 2 else "0,8").split(",")])
