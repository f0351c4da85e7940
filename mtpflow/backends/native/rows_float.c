/* No multiply and add in this file is fused into one rounding (GCC's optimize pragma, clang's fp contract): the
 * arithmetic between the products rounds as the same operations in torch do (the products, gemm.c, keep their
 * fused multiply-adds). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* ---- verify forward rows through a whole Llama-family decoder stack (mtpflow_llama_rows) ----------------
 *
 * Between the linears a verify forward ran some fifty small torch ops per layer (RMSNorm, rotary, KV writes,
 * attention, SwiGLU, residuals), each paying torch's per-op dispatch for a few hundred floats of work: a large
 * share of the forward (measured: docs/bench/code-figures.md#small_gemm-llama_rows). This runs the same
 * arithmetic, in HF's LlamaDecoderLayer order, in one call for all layers: RMSNorm (x * rsqrt(mean(x^2) + eps),
 * then * weight), the fused q/k/v product, rotary (q * cos + rotate_half(q) * sin), each row's new key and value
 * written into the KV pool, grouped-query attention (softmax of scaled dot products), the output projection plus
 * residual, RMSNorm, the fused gate/up product, silu(gate) * up, the down projection plus residual; then the final
 * norm. The products are this file's kernels, as the native linear calls them, so they give its numbers; the
 * rest differs from torch's kernels in summation order and exp/rsqrt rounding (around 1e-7 relative).
 * mtpflow/backends/native/cpu.py calls it (through kernel.llama_rows, which fills struct
 * mtpflow_rows_args below) and checks when it may; native_reference.llama_rows_reference is its pure-torch
 * reference. The names below are the struct's members.
 *
 * M rows of several sequences: row r belongs to the sequence in pool slot slot[r], writes its key and value at
 * wpos[r] of that slot's row, and attends to the slot's first prefix[r] entries plus those of its own
 * sequence's new entries (rows first[r] .. first[r] + count[r] - 1, written at prefix[r] + 0, 1, ...) that
 * allowed[r * qmax + j] marks (a tree: the root, its ancestors, itself). h: [M][H] the tokens' embeddings in,
 * the last layer's output out; normed: [M][H] its final norm. Per layer l (arrays of L pointers): ln1/ln2 [H]
 * norm weights, wqkv [(nh + 2 nkv) d x H], wo [H x nh d], wgu [2 I x H] (gate rows, then up rows), wd [H x I];
 * pqkv, po, pgu, pd their panel copies (products.pack_panels), or NULL for the row kernel (the caller
 * passes them from kernel.panel_min_rows() rows, as the native linear does); kc, vc the whole key / value buffer,
 * [slots][nkv][cap][d]. cos, sin: [M][d] at each row's position. */

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
#define ATT_MAX_VECS (128 / VW)  /* head sizes up to 128 take the vector path (d a multiple of VW) */

/* one query head's attention output o[d] over keys / values [n][d], of which the first n0 are all visible and
 * the rest only where own[t - n0]; s: scratch for n scores */
static void attend(const float *qh, const float *keys, const float *values, const unsigned char *own, int n0, int n,
                   int d, float scale, float *s, float *o) {
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
                    float *y, int M, int N, int K, int threads) {
    if (q) mtpflow_small_gemm_q8(x, q, qs, NULL, y, M, N, K, threads);  /* the int8 copy (a draft forward) */
    else if (panel) mtpflow_panel_gemm(x, panel, NULL, y, M, N, K, threads);
    else mtpflow_small_gemm(x, w, NULL, y, M, N, K, threads);
}

/* The arguments of mtpflow_llama_rows, one struct so that a caller built against another layout is refused rather
 * than read wrongly: the caller sets version to MTPFLOW_ROWS_ABI and size to sizeof the struct as it built it, and
 * the function checks both before it reads anything else. Any change to the members (their order, types or
 * meaning) raises MTPFLOW_ROWS_ABI; mtpflow/backends/native/kernel.py mirrors the struct once (RowsArgs) and
 * refuses to load a build whose mtpflow_rows_abi() or mtpflow_rows_args_size() differ from the mirror's. */
#define MTPFLOW_ROWS_ABI 1

struct mtpflow_rows_args {
    int version;  /* MTPFLOW_ROWS_ABI */
    int size;     /* sizeof(struct mtpflow_rows_args) as the caller built it */
    float *h, *normed;
    int M, L, H, nh, nkv, d, I;
    const float *const *ln1, *const *wqkv, *const *wo, *const *ln2, *const *wgu, *const *wd;
    const float *const *pqkv, *const *po, *const *pgu, *const *pd;  /* NULL: the row kernel */
    const float *norm_w;
    float eps;
    float *const *kc, *const *vc;
    long cap;
    /* per row; first (the row's sequence's first row in this call) is not read: the sequence's new entries are
     * found by position in the pool, at prefix[r] + 0, 1, ... */
    const int *slot, *wpos, *prefix, *first, *count;
    const unsigned char *allowed;  /* [M][qmax] */
    int qmax;
    const float *cos, *sin;
    float scale;
    int threads;
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
    const float *const *ln1 = a->ln1, *const *wqkv = a->wqkv, *const *wo = a->wo, *const *ln2 = a->ln2,
                *const *wgu = a->wgu, *const *wd = a->wd;
    const float *const *pqkv = a->pqkv, *const *po = a->po, *const *pgu = a->pgu, *const *pd = a->pd;
    const float *norm_w = a->norm_w;
    const float eps = a->eps, scale = a->scale;
    float *const *kc = a->kc, *const *vc = a->vc;
    const long cap = a->cap;
    const int *slot = a->slot, *wpos = a->wpos, *prefix = a->prefix, *count = a->count;
    const unsigned char *allowed = a->allowed;
    const int qmax = a->qmax, threads = a->threads;
    const float *cos = a->cos, *sin = a->sin;
    const signed char *const *qqkv = a->qqkv, *const *qo = a->qo, *const *qgu = a->qgu, *const *qd = a->qd;
    const float *const *sqkv = a->sqkv, *const *so = a->so, *const *sgu = a->sgu, *const *sd = a->sd;
    const int nq = nh * d, nk = nkv * d, group = nh / nkv, nqkv = nq + 2 * nk;
    const size_t slot_stride = (size_t)nkv * cap * d;
    int longest = 1;
    for (int r = 0; r < M; r++)
        if (prefix[r] + count[r] > longest) longest = prefix[r] + count[r];
    const size_t need = (size_t)M * (2 * H + nqkv + nq + 3 * (size_t)I) + (size_t)M * nh * longest;
    float *buf = malloc(need * sizeof(float));
    if (!buf) return -1;
    float *x = buf, *tmp = x + (size_t)M * H, *qkv = tmp + (size_t)M * H, *att = qkv + (size_t)M * nqkv,
          *gu = att + (size_t)M * nq, *act = gu + (size_t)M * 2 * I, *scores = act + (size_t)M * I;
    /* the per-row loops between the products run on the threads from 4 rows on (each row's arithmetic is the
     * same: bit-identical output; below 4 rows a parallel region costs more than it saves) */
    for (int l = 0; l < L; l++) {
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, ln1[l], eps, x + (size_t)r * H, H);
        product(x, wqkv[l], pqkv ? pqkv[l] : NULL, qqkv ? qqkv[l] : NULL, qqkv ? sqkv[l] : NULL, qkv, M, nqkv, H,
                threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) {
            float *q = qkv + (size_t)r * nqkv, *k = q + nq, *v = k + nk;
            const float *c = cos + (size_t)r * d, *sn = sin + (size_t)r * d;
            for (int j = 0; j < nh; j++) rotary(q + (size_t)j * d, c, sn, d);
            for (int j = 0; j < nkv; j++) {
                rotary(k + (size_t)j * d, c, sn, d);
                const size_t at = slot[r] * slot_stride + ((size_t)j * cap + wpos[r]) * d;
                for (int i = 0; i < d; i++) { kc[l][at + i] = k[j * d + i]; vc[l][at + i] = v[j * d + i]; }
            }
        }
        const long work = (long)M * nh * longest;
#pragma omp parallel for schedule(static) num_threads(threads) if (work > 1024)
        for (int p = 0; p < M * nh; p++) {
            const int r = p / nh, j = p % nh;
            const float *qh = qkv + (size_t)r * nqkv + (size_t)j * d;
            const size_t base = slot[r] * slot_stride + (size_t)(j / group) * cap * d;
            const float *keys = kc[l] + base, *values = vc[l] + base;
            attend(qh, keys, values, allowed + (size_t)r * qmax, prefix[r], prefix[r] + count[r], d, scale,
                   scores + (size_t)p * longest, att + (size_t)r * nq + (size_t)j * d);
        }
        product(att, wo[l], po ? po[l] : NULL, qo ? qo[l] : NULL, qo ? so[l] : NULL, tmp, M, H, nq, threads);
        for (size_t i = 0; i < (size_t)M * H; i++) h[i] = h[i] + tmp[i];
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, ln2[l], eps, x + (size_t)r * H, H);
        product(x, wgu[l], pgu ? pgu[l] : NULL, qgu ? qgu[l] : NULL, qgu ? sgu[l] : NULL, gu, M, 2 * I, H, threads);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
        for (int r = 0; r < M; r++) {
            const float *g = gu + (size_t)r * 2 * I, *u = g + I;
            float *a = act + (size_t)r * I;
            int i = 0;
            for (; i + VW <= I; i += VW) {  /* silu(gate) * up */
                const vec gv = loadv(g + i);
                storev(a + i, gv / (1.0f + vexp(-gv)) * loadv(u + i));
            }
            for (; i < I; i++) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
        }
        product(act, wd[l], pd ? pd[l] : NULL, qd ? qd[l] : NULL, qd ? sd[l] : NULL, tmp, M, H, I, threads);
        for (size_t i = 0; i < (size_t)M * H; i++) h[i] = h[i] + tmp[i];
    }
    for (int r = 0; r < M; r++) rmsnorm(h + (size_t)r * H, norm_w, eps, normed + (size_t)r * H, H);
    free(buf);
    return 0;
}

