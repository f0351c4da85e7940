"""Where a verify forward of the int8 model spends its time, by part: the working tree's rows_int8.c against builds
with the products (and the head) switched off ("nop"), then the attention too ("nop-noatt"), then the rows' elementwise
loops too ("bare": barriers and the call itself). Their outputs are wrong; only their time counts. Timed in one
process by ab_kv.compare (alternating rounds).

    python docs/bench/step_dec06/ablate_parts.py ROUNDS CONTEXT K,K,...
"""
import statistics, sys
sys.path.insert(0, "docs/bench/int8_kv_dec06")
from ab_kv import compare
from mtpflow.backends.native import kernel
full = (kernel.HERE / "rows_int8.c").read_text()
NOP = ("    mtpflow_q8_part(tm->t, tm->nt, xq, sx, M, w, s, z, N, kp, out);\n", "    (void)out;\n")
NOATT = ("                    attend_exact(&Q,", "                    if (0) attend_exact(&Q,")
NOHEAD = ("        mtpflow_q8_part(t, nt, xq + (size_t)from * a->kp_h,", "        if (0) mtpflow_q8_part(t, nt, xq + (size_t)from * a->kp_h,")
def rep(text, *pairs):
    for old, new in pairs:
        assert text.count(old) >= 1, old
        text = text.replace(old, new)
    return text
# the row loops between products: each "for (int r = r0; r < r1; r++)" -> skip
NOELEM = ("for (int r = r0; r < r1; r++)", "for (int r = r0; r < r0; r++)")
sources = {"full": full, "nop": rep(full, NOP, NOHEAD), "nop-noatt": rep(full, NOP, NOHEAD, NOATT),
           "bare": rep(full, NOP, NOHEAD, NOATT, NOELEM)}
ks = [int(x) for x in sys.argv[3].split(",")]
times = compare(sources, int(sys.argv[2]), ks, int(sys.argv[1]))
for k in ks:
    fk = times[("full", k)]
    print(f"K={k}: " + ", ".join(f"{n} / full {statistics.median(b / a for a, b in zip(fk, times[(n, k)])):.3f}" for n in sources if n != "full"))
