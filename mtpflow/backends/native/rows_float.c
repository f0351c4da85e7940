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


/* ---- attention over a sequence's cached prefix, vectorized: the prefix's scores four keys at a time (no mask
 * there: every row sees its whole prefix), their exponentials VW at a time, the weighted values with the output
 * row in registers. The new entries of the row's own tree (a handful, masked) take the scalar loop. */
#define ATT_MAX_VECS (256 / VW)  /* head sizes up to 256 take the vector path (d a multiple of VW) */

/* one query head's attention output o[d] over keys / values [n][d], of which the first n0 are all visible and
 * the rest only where own[t - n0]; s: scratch for n scores */
static void attend(const float *qh, const float *keys, const float *values, const unsigned char *own, int n0, int n,
                   int d, float scale, float softcap, float *s, float *o) {
    float m = -INFINITY, total = 0.0f;
    const int dv = d / VW;
    const int fast = d % VW == 0 && dv <= ATT_MAX_VECS;
    int t = 0;
    if (fast) {
        vec qv[ATT_MAX_VECS];
        for (int i = 0; i < dv; i++) qv[i] = loadv(qh + i * VW);
        for (; t + 4 <= n0; t += 4) {
            const float *k0 = keys + (size_t)t * d;
            vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < dv; i++) {
                a0 += qv[i] * loadv(k0 + i * VW);
                a1 += qv[i] * loadv(k0 + d + i * VW);
                a2 += qv[i] * loadv(k0 + 2 * d + i * VW);
                a3 += qv[i] * loadv(k0 + 3 * d + i * VW);
            }
            s[t] = sumv(a0) * scale;
            s[t + 1] = sumv(a1) * scale;
            s[t + 2] = sumv(a2) * scale;
            s[t + 3] = sumv(a3) * scale;
        }
    }
    for (; t < n; t++) {
        if (t >= n0 && !own[t - n0]) { s[t] = -INFINITY; continue; }
        s[t] = dot(qh, keys + (size_t)t * d, d) * scale;
    }
    if (softcap != 0.0f) softcap_scores(s, n, softcap);
    for (t = 0; t < n; t++)
        if (s[t] > m) m = s[t];
    t = 0;
    if (fast) {
        vec sum = {0};
        for (; t + VW <= n0; t += VW) {
            const vec e = vexp(loadv(s + t) - m);
            storev(s + t, e);
            sum += e;
        }
        total = sumv(sum);
    }
    for (; t < n; t++) {
        s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - m);
        total += s[t];
    }
    const float inv = 1.0f / total;
    if (fast) {
        vec ov[ATT_MAX_VECS];
        for (int i = 0; i < dv; i++) ov[i] = (vec){0};
        for (t = 0; t < n; t++) {
            const float w = s[t];
            if (w == 0.0f) continue;
            const float *vt = values + (size_t)t * d;
            for (int i = 0; i < dv; i++) ov[i] += w * loadv(vt + i * VW);
        }
        for (int i = 0; i < dv; i++) storev(o + i * VW, ov[i] * inv);
        return;
    }
    for (int i = 0; i < d; i++) o[i] = 0.0f;
    for (t = 0; t < n; t++) {
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
        for (int p = 0; p < M * nh; p++) {
            const int r = p / nh, j = p % nh;
            const float *qh = qkv + (size_t)r * nqkv + (size_t)j * d;
            const int lo = window_start(w, w ? a->pos[r] : 0, prefix[r]);
            const size_t base = slot[r] * slot_stride + (size_t)(j / group) * cap * d + (size_t)lo * d;
            const unsigned char *mask = w ? own + (size_t)r * qmax : a->allowed + (size_t)r * qmax;
            attend(qh, a->kc[l] + base, a->vc[l] + base, mask, prefix[r] - lo, prefix[r] + count[r] - lo, d, scale,
                   a->softcap, scores + (size_t)p * longest, att + (size_t)r * nq + (size_t)j * d);
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
