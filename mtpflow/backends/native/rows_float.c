/* No multiply and add in this file is fused into one rounding (GCC's optimize pragma, clang's fp contract): the
 * arithmetic between the products rounds as the same operations in torch do (the products, gemm.c, keep their
 * fused multiply-adds). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* ---- verify forward rows through a whole decoder stack (mtpflow_llama_rows) -------------------------------
 *
 * Between the linears a verify forward ran some fifty small torch ops per layer (RMSNorm, rotary, KV writes,
 * attention, SwiGLU, residuals), each paying torch's per-op dispatch for a few hundred floats of work: a large
 * share of the forward (measured: docs/bench/code-figures.md#small_gemm-llama_rows). This runs the same
 * arithmetic, in HF's decoder-layer order, in one call for all layers, for every model a layer description
 * (mtpflow/backends/native/description.py) describes: the input RMSNorm (x * rsqrt(mean(x^2) + eps), then * its
 * scale), the fused q/k/v product (+ bias), each query and key head's norm, rotary (q * cos + rotate_half(q) * sin
 * over the head's first rot values; per layer its own table, or none), each row's new key and value written into
 * the KV pool, grouped-query attention (scaled dot products, soft-capped where the model caps them, over the keys
 * the layer's sliding window reaches; softmax), the output projection (+ bias), its norm where the model has one,
 * the residual, the MLP's input norm, the fused gate/up product (+ bias), act(gate) * up (SiLU or GELU-tanh), the
 * down projection (+ bias), its norm where the model has one, the residual; then the final norm. The products are
 * gemm.c's kernels, as the native linear calls them, so they give its numbers; the rest differs from torch's
 * kernels in summation order and exp/rsqrt rounding (around 1e-7 relative). mtpflow/backends/native/cpu.py calls
 * it (through kernel.llama_rows, which fills struct mtpflow_rows_args below); reference.llama_rows_reference is its
 * pure-torch reference. The names below are the struct's members.
 *
 * M rows of several sequences: row r belongs to the sequence in pool slot slot[r], writes its key and value at
 * wpos[r] of that slot's row, and attends to the slot's first prefix[r] entries plus those of its own
 * sequence's new entries (rows first[r] .. first[r] + count[r] - 1, written at prefix[r] + 0, 1, ...) that
 * allowed[r * qmax + j] marks (a tree: the root, its ancestors, itself); pos[r] is its position (a sliding window
 * counts back from it). h: [M][H] the tokens' embeddings in, the last layer's output out; normed: [M][H] its final
 * norm; taps: NULL or L pointers, non-NULL where layer l's output [M][H] is wanted. Per layer l (arrays of L
 * pointers): ln1/ln2 [H] norm scales, wqkv [(nh + 2 nkv) d x H], wo [H x nh d], wgu [2 I x H] (gate rows, then up
 * rows), wd [H x I]; pqkv, po, pgu, pd their panel copies (products.pack_panels), or NULL for the row kernel (the
 * caller passes them from kernel.panel_min_rows() rows, as the native linear does); kc, vc the whole key / value
 * buffer, [slots][nkv][cap][d]. The optional parts are arrays of L pointers (NULL where no layer has the part, a
 * NULL entry where layer l lacks it): post_attn / post_mlp [H] the norms of the attention's and the MLP's outputs,
 * qn / kn [d] the heads' norms, bqkv / bo / bgu / bd the products' biases; window NULL or [L] (0: none); cos, sin:
 * L pointers, [M][rot] each (layer l's table at each row's position), NULL where layer l has no rotary. */

#include <string.h>
#include "rows_common.h"

static inline float dot(const float *a, const float *b, int d) {
    const int dv = d - d % VW;
    vec acc = (vec){0};
    for (int i = 0; i < dv; i += VW) acc += loadv(a + i) * loadv(b + i);
    float s = sumv(acc);
    for (int i = dv; i < d; i++) s += a[i] * b[i];
    return s;
}


/* ---- attention over a sequence's cached prefix and its own new entries, vectorized (head sizes d that are a
 * multiple of VW, up to 256). A unit of work is one row's query heads that share a key / value head (or some of
 * them): the scores run a block of VW keys at a time, each block read once for all the unit's queries (the keys
 * stay in the L1 cache between them), each query's VW dot products summed lane-wise over the head and then across
 * lanes in one tree (lane_sums: VW sums in log2(VW) shuffle steps, where one horizontal sum per score, a
 * sequential chain of VW adds, took most of the attention's time at long contexts: measured,
 * docs/bench/step_dec07c.md). A block that runs past the last key reads a copy padded with zeros. Each query's
 * arithmetic is the same whatever unit it falls in, so the outputs do not depend on the thread count. The
 * exponentials run VW at a time over the prefix, the weighted values with the output row in registers (the head's
 * vectors a compile-time count). */
#define ATT_MAX_D 256
#define ATT_MAX_VECS (ATT_MAX_D / VW)
#define ATT_MAX_QUERIES 64  /* query heads per unit */
#define ATT_GROUP 4  /* queries per pass over the values */
#if VW == 16
#define ATT_ACC_VECS 16  /* the passes' sums in registers: 16 + a value and the weights of the 32 */
#else
#define ATT_ACC_VECS 8  /* 8 + a value and the weights of the 16 */
#endif

/* out[e] = the sum of v[e]'s lanes, for e < VW: neighbouring lanes added pairwise, then pairs of pairs, ... */
static inline vec lane_sums(const vec v[VW]) {
#if VW == 16
    vec c[8], e[4], f[2];
    for (int i = 0; i < 8; i++)
        c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
    for (int i = 0; i < 4; i++)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
    for (int i = 0; i < 2; i++)
        f[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(e[2 * i], e[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
    return __builtin_shufflevector(f[0], f[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(f[0], f[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
#else
    return lane_sums8(v);
#endif
}

/* the dot products of query q with the VW keys at k (d = DV * VW floats each, d apart), times scale */
static inline __attribute__((always_inline)) vec block_scores(const float *q, const float *k, float scale,
                                                              const int DV) {
    vec acc[VW];
#pragma GCC unroll 16
    for (int e = 0; e < VW; e++) acc[e] = (vec){0};
    for (int i = 0; i < DV; i++) {
        const vec u = loadv(q + i * VW);
#pragma GCC unroll 16
        for (int e = 0; e < VW; e++) acc[e] += u * loadv(k + (size_t)e * DV * VW + i * VW);
    }
    return lane_sums(acc) * scale;
}

/* scores s[n] into the softmax's exponentials in place (the entries own does not mark, and those past n0, to 0;
 * soft-capped first where softcap is not 0); returns 1 / their sum. The maximum runs VW at a time (any order gives
 * the same maximum), the exponentials VW at a time over the prefix. */
static float softmax_in_place(float *s, const unsigned char *own, int n0, int n, float softcap) {
    for (int t = n0; t < n; t++)
        if (!own[t - n0]) s[t] = -INFINITY;
    if (softcap != 0.0f) softcap_scores(s, n, softcap);
    vec mv = splat(-INFINITY);
    int t = 0;
    for (; t + VW <= n; t += VW) {
        const vec x = loadv(s + t);
        mv = select_lt(mv, x, x, mv);
    }
    float m = -INFINITY, total;
    for (int e = 0; e < VW; e++)
        if (mv[e] > m) m = mv[e];
    for (; t < n; t++)
        if (s[t] > m) m = s[t];
    vec sum = {0};
    for (t = 0; t + VW <= n0; t += VW) {
        const vec e = vexp(loadv(s + t) - m);
        storev(s + t, e);
        sum += e;
    }
    total = sumv(sum);
    for (; t < n; t++) {
        s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - m);
        total += s[t];
    }
    return 1.0f / total;
}

/* the outputs o (G heads, d apart) of G queries' weights w (n each, ws apart; G <= ATT_GROUP) over values [n][d],
 * times each query's inv */
static inline __attribute__((always_inline)) void weigh_values(const float *w, size_t ws, const float *values, int n,
                                                               const float *inv, float *o, const int DV,
                                                               const int G) {
    vec acc[ATT_GROUP][ATT_MAX_VECS];  /* fixed sizes and whole unrolled loops: the compiler keeps them in registers */
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 32
        for (int i = 0; i < DV; i++) acc[g][i] = (vec){0};
    for (int t = 0; t < n; t++) {  /* a masked entry's weight is 0: it adds 0 (every entry before n is written) */
        const float *vt = values + (size_t)t * DV * VW;
#pragma GCC unroll 32
        for (int i = 0; i < DV; i++) {
            const vec v = loadv(vt + i * VW);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++) acc[g][i] += w[g * ws + t] * v;
        }
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 32
        for (int i = 0; i < DV; i++) storev(o + (size_t)g * DV * VW + i * VW, acc[g][i] * inv[g]);
}

/* the attention outputs o (nq heads, d apart) of queries q (nq heads of one row, d apart) over keys / values
 * [n][d], of which the first n0 are visible to all and the rest only where own[t - n0]; s: scratch for each
 * query's n scores, sstride apart */
static inline __attribute__((always_inline)) void attend_heads(const float *q, int nq, const float *keys,
                                                               const float *values, const unsigned char *own, int n0,
                                                               int n, float scale, float softcap, float *s,
                                                               size_t sstride, float *o, const int DV) {
    const int d = DV * VW, full = n - n % VW;
    float pad[VW * ATT_MAX_D];
    if (full < n) {  /* the last block's keys, the rows past n zero */
        memcpy(pad, keys + (size_t)full * d, (size_t)(n - full) * d * sizeof(float));
        memset(pad + (size_t)(n - full) * d, 0, (size_t)(VW - (n - full)) * d * sizeof(float));
    }
    for (int t = 0; t < n; t += VW) {
        const float *kb = t < full ? keys + (size_t)t * d : pad;
        for (int j = 0; j < nq; j++) {
            const vec sc = block_scores(q + (size_t)j * d, kb, scale, DV);
            float *sj = s + j * sstride + t;
            if (t < full) storev(sj, sc);
            else
                for (int e = 0; e < n - t; e++) sj[e] = sc[e];
        }
    }
    float inv[ATT_MAX_QUERIES];
    for (int j = 0; j < nq; j++) inv[j] = softmax_in_place(s + j * sstride, own, n0, n, softcap);
    /* the weighted values, up to ATT_GROUP queries at a time where their sums fit the registers: each value vector
     * loaded once for all of them (the values stream from the L2 cache: one query a pass waited on them), and
     * more independent adds in flight; each query's sums run in the same order whatever its company */
    const int most = ATT_ACC_VECS / DV < 1 ? 1 : ATT_ACC_VECS / DV > ATT_GROUP ? ATT_GROUP : ATT_ACC_VECS / DV;
    for (int j = 0; j < nq;) {
        const int g = nq - j < most ? nq - j : most;
        switch (g) {
        case 1: weigh_values(s + j * sstride, sstride, values, n, inv + j, o + (size_t)j * d, DV, 1); break;
        case 2: weigh_values(s + j * sstride, sstride, values, n, inv + j, o + (size_t)j * d, DV, 2); break;
        case 3: weigh_values(s + j * sstride, sstride, values, n, inv + j, o + (size_t)j * d, DV, 3); break;
        default: weigh_values(s + j * sstride, sstride, values, n, inv + j, o + (size_t)j * d, DV, 4); break;
        }
        j += g;
    }
}

/* one instance per head size d = DV * VW up to ATT_MAX_D: every such size takes the grouped attention */
#define ATT_DV(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) X(16)
#if VW == 8
#define ATT_DV_WIDE(X) X(17) X(18) X(19) X(20) X(21) X(22) X(23) X(24) X(25) X(26) X(27) X(28) X(29) X(30) X(31) X(32)
#else
#define ATT_DV_WIDE(X)
#endif
#define ATT_DEFINE(DV)                                                                                              \
    static void attend_heads_##DV(const float *q, int nq, const float *keys, const float *values,                  \
                                  const unsigned char *own, int n0, int n, float scale, float softcap, float *s,     \
                                  size_t sstride, float *o) {                                                       \
        attend_heads(q, nq, keys, values, own, n0, n, scale, softcap, s, sstride, o, DV);                          \
    }
ATT_DV(ATT_DEFINE)
ATT_DV_WIDE(ATT_DEFINE)

typedef void (*attend_fn)(const float *, int, const float *, const float *, const unsigned char *, int, int, float,
                          float, float *, size_t, float *);

/* the grouped attention for head size d, or NULL (not a multiple of VW, or past ATT_MAX_D: attend_one) */
static attend_fn attend_for(int d) {
    if (d % VW) return NULL;
    switch (d / VW) {
#define ATT_CASE(DV) case DV: return attend_heads_##DV;
        ATT_DV(ATT_CASE)
        ATT_DV_WIDE(ATT_CASE)
#undef ATT_CASE
    }
    return NULL;
}

/* one query head's attention output o[d] over keys / values [n][d], of which the first n0 are all visible and
 * the rest only where own[t - n0]; s: scratch for n scores. The head sizes attend_for has no instance for (not a
 * multiple of VW, or past ATT_MAX_D): the scalar loop. */
static void attend_one(const float *qh, const float *keys, const float *values, const unsigned char *own, int n0, int n,
                       int d, float scale, float softcap, float *s, float *o) {
    for (int t = 0; t < n; t++) s[t] = t >= n0 && !own[t - n0] ? -INFINITY : dot(qh, keys + (size_t)t * d, d) * scale;
    const float inv = softmax_in_place(s, own, n0, n, softcap);
    for (int i = 0; i < d; i++) o[i] = 0.0f;
    for (int t = 0; t < n; t++) {
        const float w = s[t];
        if (w == 0.0f) continue;
        const float *vt = values + (size_t)t * d;
        for (int i = 0; i < d; i++) o[i] += w * vt[i];
    }
    for (int i = 0; i < d; i++) o[i] *= inv;
}

static void product(const float *x, const float *w, const float *panel, const signed char *q, const float *qs,
                    const float *b, float *y, int M, int N, int K, int threads) {
    if (q) mtpflow_small_gemm_q8(x, q, qs, b, y, M, N, K, threads);  /* the int8 copy (a draft forward) */
    else if (panel) mtpflow_panel_gemm(x, panel, b, y, M, N, K, threads);
    else mtpflow_small_gemm(x, w, b, y, M, N, K, threads);
}

/* every row's add_residual (rows_common.h) */
static void residual(float *h, float *out, const float *post, float eps, int M, int H, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
    for (int r = 0; r < M; r++) add_residual(h + (size_t)r * H, out + (size_t)r * H, post, eps, H);
}

/* The arguments of mtpflow_llama_rows, one struct so that a caller built against another layout is refused rather
 * than read wrongly: the caller sets version to MTPFLOW_ROWS_ABI and size to sizeof the struct as it built it, and
 * the function checks both before it reads anything else. Any change to the members (their order, types or
 * meaning) raises MTPFLOW_ROWS_ABI; mtpflow/backends/native/kernel.py mirrors the struct once (RowsArgs) and
 * refuses to load a build whose mtpflow_rows_abi() or mtpflow_rows_args_size() differ from the mirror's. */
#define MTPFLOW_ROWS_ABI 2

struct mtpflow_rows_args {
    MTPFLOW_ROWS_HEAD
    const float *const *ln1, *const *wqkv, *const *wo, *const *ln2, *const *wgu, *const *wd;
    const float *const *pqkv, *const *po, *const *pgu, *const *pd;  /* NULL: the row kernel */
    MTPFLOW_DESCRIPTION_MEMBERS
    /* int8 copies of the four products (weights, per-output scales; NULL: the float weights): the same forward
     * with a quarter of the weight bytes, for drafting */
    const signed char *const *qqkv;
    const float *const *sqkv;
    const signed char *const *qo;
    const float *const *so;
    const signed char *const *qgu;
    const float *const *sgu;
    const signed char *const *qd;
    const float *const *sd;
};

int mtpflow_rows_abi(void) { return MTPFLOW_ROWS_ABI; }

int mtpflow_rows_args_size(void) { return (int)sizeof(struct mtpflow_rows_args); }

/* 0, -1 when out of memory, MTPFLOW_ROWS_BAD_ABI (nothing read past version and size, nothing written) when the
 * struct is of another version or size */
int mtpflow_llama_rows(const struct mtpflow_rows_args *a) {
    if (a->version != MTPFLOW_ROWS_ABI || a->size != (int)sizeof(struct mtpflow_rows_args)) return MTPFLOW_ROWS_BAD_ABI;
    float *const h = a->h, *const normed = a->normed;
    const int M = a->M, L = a->L, H = a->H, nh = a->nh, nkv = a->nkv, d = a->d, I = a->I;
    const float eps = a->eps, scale = a->scale;
    const long cap = a->cap;
    const int *slot = a->slot, *wpos = a->wpos, *prefix = a->prefix, *count = a->count;
    const int qmax = a->qmax, threads = a->threads;
    const int nq = nh * d, nk = nkv * d, group = nh / nkv, nqkv = nq + 2 * nk;
    const size_t slot_stride = (size_t)nkv * cap * d;
    int longest = 1;
    for (int r = 0; r < M; r++)
        if (prefix[r] + count[r] > longest) longest = prefix[r] + count[r];
    const size_t need = (size_t)M * (2 * H + nqkv + nq + 3 * (size_t)I) + (size_t)M * nh * longest;
    float *buf = malloc(need * sizeof(float) + (size_t)M * qmax);
    if (!buf) return -1;
    float *x = buf, *tmp = x + (size_t)M * H, *qkv = tmp + (size_t)M * H, *att = qkv + (size_t)M * nqkv,
          *gu = att + (size_t)M * nq, *act = gu + (size_t)M * 2 * I, *scores = act + (size_t)M * I;
    unsigned char *own = (unsigned char *)(scores + (size_t)M * nh * longest);  /* [M][qmax]: a window's own mask */
    /* the attention's units: qc query heads of one row that share a key / value head, all of a group's where that
     * leaves the threads two units each, else fewer */
    const attend_fn heads = attend_for(d);
    int qc = heads ? group : 1;
    while (qc > 1 && (qc > ATT_MAX_QUERIES || M * (nh / qc) < 2 * threads)) do qc--; while (group % qc);
    const int units = M * (nh / qc);
    /* the per-row loops between the products run on the threads from 4 rows on (each row's arithmetic is the
     * same: bit-identical output; below 4 rows a parallel region costs more than it saves) */
    for (int l = 0; l < L; l++) {
        const float *qn = PART(a->qn, l), *kn = PART(a->kn, l), *post_attn = PART(a->post_attn, l),
                    *post_mlp = PART(a->post_mlp, l), *c = PART(a->cos, l), *sn = PART(a->sin, l);
        const int w = a->window ? a->window[l] : 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, a->ln1[l], eps, x + (size_t)r * H, H);
        product(x, a->wqkv[l], PART(a->pqkv, l), PART(a->qqkv, l), PART(a->sqkv, l), PART(a->bqkv, l), qkv, M, nqkv,
                H, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) {
            float *q = qkv + (size_t)r * nqkv, *k = q + nq, *v = k + nk;
            heads_in(q, k, nh, nkv, d, qn, kn, eps, c ? c + (size_t)r * a->rot : NULL,
                     sn ? sn + (size_t)r * a->rot : NULL, a->rot);
            for (int j = 0; j < nkv; j++) {
                const size_t at = slot[r] * slot_stride + ((size_t)j * cap + wpos[r]) * d;
                for (int i = 0; i < d; i++) { a->kc[l][at + i] = k[j * d + i]; a->vc[l][at + i] = v[j * d + i]; }
            }
            window_own(w, a->allowed + (size_t)r * qmax, a->pos, r, a->first[r], count[r], own + (size_t)r * qmax);
        }
        const long work = (long)M * nh * longest;
#pragma omp parallel for schedule(static) num_threads(threads) if (work > 1024)
        for (int u = 0; u < units; u++) {
            const int r = u / (nh / qc), j = u % (nh / qc) * qc;
            const float *qh = qkv + (size_t)r * nqkv + (size_t)j * d;
            const int lo = window_start(w, w ? a->pos[r] : 0, prefix[r]);
            const size_t base = slot[r] * slot_stride + (size_t)(j / group) * cap * d + (size_t)lo * d;
            const unsigned char *mask = w ? own + (size_t)r * qmax : a->allowed + (size_t)r * qmax;
            float *s = scores + ((size_t)r * nh + j) * longest, *o = att + (size_t)r * nq + (size_t)j * d;
            if (heads)
                heads(qh, qc, a->kc[l] + base, a->vc[l] + base, mask, prefix[r] - lo, prefix[r] + count[r] - lo,
                      scale, a->softcap, s, (size_t)longest, o);
            else
                attend_one(qh, a->kc[l] + base, a->vc[l] + base, mask, prefix[r] - lo, prefix[r] + count[r] - lo, d,
                           scale, a->softcap, s, o);
        }
        product(att, a->wo[l], PART(a->po, l), PART(a->qo, l), PART(a->so, l), PART(a->bo, l), tmp, M, H, nq,
                threads);
        residual(h, tmp, post_attn, eps, M, H, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, a->ln2[l], eps, x + (size_t)r * H, H);
        product(x, a->wgu[l], PART(a->pgu, l), PART(a->qgu, l), PART(a->sgu, l), PART(a->bgu, l), gu, M, 2 * I, H,
                threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) {
            const float *g = gu + (size_t)r * 2 * I;
            gated(g, g + I, act + (size_t)r * I, I, a->act);
        }
        product(act, a->wd[l], PART(a->pd, l), PART(a->qd, l), PART(a->sd, l), PART(a->bd, l), tmp, M, H, I,
                threads);
        residual(h, tmp, post_mlp, eps, M, H, threads);
        if (a->taps && a->taps[l]) memcpy(a->taps[l], h, (size_t)M * H * sizeof(float));
    }
    for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, a->norm_w, eps, normed + (size_t)r * H, H);
    free(buf);
    return 0;
}
