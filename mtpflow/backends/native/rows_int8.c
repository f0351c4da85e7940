/* No multiply and add in this file is fused into one rounding (GCC's optimize pragma, clang's fp contract): every
 * float operation between the products rounds as the same operation in torch does, so the int8 model's forward
 * computes exactly what its torch reference (mtpflow/backends/native/int8_reference.py) computes, operation for
 * operation. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

/* The int8 model's decoder stack (model.quantize=int8): mtpflow_w8a8_rows; gemm.c describes its numerics and
 * computes its products. */
#include <omp.h>
#include "rows_common.h"

typedef float fvec8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef double dvec8 __attribute__((vector_size(64)));

/* sum_i a[i] b[i] in double (8 lanes, then the lanes; each product exact in double) */
static inline double dot_exact(const float *a, const float *b, int d) {
    dvec8 acc = {0};
    int i = 0;
    for (; i + 8 <= d; i += 8)
        acc += __builtin_convertvector(*(const fvec8 *)(a + i), dvec8) * __builtin_convertvector(*(const fvec8 *)(b + i), dvec8);
    double s = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < d; i++) s += (double)a[i] * b[i];
    return s;
}

/* o[8 lanes] = float(sum_t s[t] v[t]) * inv for 8 * lanes values of rows of ``stride`` floats (lanes a constant
 * after inlining: every output lane in registers, one pass over the values) */
static inline __attribute__((always_inline)) void weigh_values(const float *s, const float *values, int n, int stride,
                                                               const int lanes, float inv, float *o) {
    dvec8 acc[16];
    for (int g = 0; g < lanes; g++) acc[g] = (dvec8){0};
    for (int t = 0; t < n; t++) {
        const double w = s[t];
        if (w == 0.0) continue;
        const float *vt = values + (size_t)t * stride;
        for (int g = 0; g < lanes; g++) acc[g] += w * __builtin_convertvector(*(const fvec8 *)(vt + 8 * g), dvec8);
    }
    for (int g = 0; g < lanes; g++)
        for (int e = 0; e < 8; e++) o[8 * g + e] = (float)acc[g][e] * inv;
}

static void attend_exact(const float *qh, const float *keys, const float *values, const unsigned char *own, int n0,
                         int n, int d, float scale, float softcap, float *s, float *o) {
    float m = -INFINITY;
    int t = 0;
    if (d % 8 == 0) {  /* four keys at a time: four independent sums */
        for (; t + 4 <= n0; t += 4) {
            const float *k0 = keys + (size_t)t * d;
            dvec8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int i = 0; i < d; i += 8) {
                const dvec8 qv = __builtin_convertvector(*(const fvec8 *)(qh + i), dvec8);
                a0 += qv * __builtin_convertvector(*(const fvec8 *)(k0 + i), dvec8);
                a1 += qv * __builtin_convertvector(*(const fvec8 *)(k0 + d + i), dvec8);
                a2 += qv * __builtin_convertvector(*(const fvec8 *)(k0 + 2 * d + i), dvec8);
                a3 += qv * __builtin_convertvector(*(const fvec8 *)(k0 + 3 * d + i), dvec8);
            }
            const dvec8 *acc[4] = {&a0, &a1, &a2, &a3};
            for (int e = 0; e < 4; e++) {
                const dvec8 v = *acc[e];
                s[t + e] = (float)(((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]))) * scale;
            }
        }
    }
    for (; t < n; t++) {
        if (t >= n0 && !own[t - n0]) { s[t] = -INFINITY; continue; }
        s[t] = (float)dot_exact(qh, keys + (size_t)t * d, d) * scale;
    }
    if (softcap != 0.0f) softcap_scores(s, n, softcap);
    for (t = 0; t < n; t++)
        if (s[t] > m) m = s[t];
    /* exponentials VW at a time (a padded copy for the last few): the same vexp for every entry */
    double total = 0.0;
    for (int t = 0; t < n; t += VW) {
        vec v;
        const int c = n - t < VW ? n - t : VW;
        for (int i = 0; i < VW; i++) v[i] = i < c ? s[t + i] - m : -INFINITY;
        const vec e = vexp(v);
        for (int i = 0; i < c; i++) {
            s[t + i] = s[t + i] == -INFINITY ? 0.0f : e[i];
            total += s[t + i];
        }
    }
    const float inv = 1.0f / (float)total;
    if (d % 128 == 0) {  /* 128 values at a time (each value's sum in the same order whatever the chunks) */
        for (int c = 0; c < d; c += 128) weigh_values(s, values + c, n, d, 16, inv, o + c);
        return;
    }
    if (d == 64) { weigh_values(s, values, n, d, 8, inv, o); return; }
    for (int i = 0; i < d; i++) {
        double acc = 0.0;
        for (t = 0; t < n; t++) acc += (double)s[t] * values[(size_t)t * d + i];
        o[i] = (float)acc * inv;
    }
}

/* The arguments of mtpflow_w8a8_rows, versioned as mtpflow_rows_args is (MTPFLOW_W8A8_ABI; mirrored once in
 * kernel.W8A8Args). The rows and the optional parts of a layer are described as for mtpflow_llama_rows; the weights
 * are the int8 model's: per layer, fused q/k/v [(nh + 2 nkv) d][kp_h], o [H][kp_q], fused gate/up [2 I][kp_h], down
 * [H][kp_i], each with its scales and row sums. taps: NULL, or L pointers, non-NULL where layer l's output [M][H]
 * is wanted. */
#define MTPFLOW_W8A8_ABI 2

struct mtpflow_w8a8_args {
    MTPFLOW_ROWS_HEAD
    int kp_h, kp_q, kp_i;
    const float *const *ln1, *const *ln2;
    const signed char *const *wqkv, *const *wo, *const *wgu, *const *wd;
    const float *const *sqkv, *const *so, *const *sgu, *const *sd;
    const int32_t *const *zqkv, *const *zo, *const *zgu, *const *zd;
    MTPFLOW_DESCRIPTION_MEMBERS
    /* the int8 LM head [vocab][kp_h] (packed, scales, row sums) over rows head_from .. M - 1 into logits
     * [M - head_from][vocab]; logits NULL: no head */
    const signed char *head_q;
    const float *head_s;
    const int32_t *head_z;
    int vocab, head_from;
    float *logits;
};

int mtpflow_w8a8_abi(void) { return MTPFLOW_W8A8_ABI; }

int mtpflow_w8a8_args_size(void) { return (int)sizeof(struct mtpflow_w8a8_args); }

/* The threads of one mtpflow_w8a8_rows call wait for each other between its steps on this barrier: they spin (a
 * pause per turn) rather than sleep. At batch 1 a step of the default model is some 120 products of 0.3 to 2 MB
 * with a few microseconds of other work between them; an OpenMP region per product, whose idle threads go to
 * sleep and are woken again, took about 1.5 times as long for the whole forward (measured:
 * docs/bench/int8_dec05.md#kernel-figures). The call holds
 * its threads for its whole length only: between calls they are OpenMP's again. */
struct spin_barrier {
    int count, generation;
};

static void spin_wait(struct spin_barrier *b, int nt) {
    if (nt == 1) return;
    const int gen = __atomic_load_n(&b->generation, __ATOMIC_ACQUIRE);
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == nt) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->generation, gen + 1, __ATOMIC_RELEASE);
        return;
    }
    while (__atomic_load_n(&b->generation, __ATOMIC_ACQUIRE) == gen) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
}

/* y[r][n] += b[n] for rows [r0, r1) (a product's bias; b NULL: none) */
static inline void add_bias(float *y, const float *b, int r0, int r1, int N) {
    if (!b) return;
    for (int r = r0; r < r1; r++)
        for (int n = 0; n < N; n++) y[(size_t)r * N + n] = y[(size_t)r * N + n] + b[n];
}

/* the threads of one forward: their barrier, this one's number of nt, and its rows [r0, r1) */
struct team {
    struct spin_barrier *barrier;
    int t, nt, r0, r1;
};

/* one product of a layer, all threads together: out = xq W once every row's quantized input is there (a barrier
 * before), then, once every thread's part of out is there (a barrier after), the bias on this thread's rows */
static inline void q8_product(const struct team *tm, const unsigned char *xq, const float *sx, int M,
                              const signed char *w, const float *s, const int32_t *z, int N, int kp, float *out,
                              const float *bias) {
    spin_wait(tm->barrier, tm->nt);
    mtpflow_q8_part(tm->t, tm->nt, xq, sx, M, w, s, z, N, kp, out);
    spin_wait(tm->barrier, tm->nt);
    add_bias(out, bias, tm->r0, tm->r1, N);
}

/* The int8 model's decoder stack over M rows: as mtpflow_llama_rows (the same rows, pool, layer parts and taps), with
 * the int8 products and the exact attention above, in one OpenMP region: each step split between the threads (rows,
 * heads or weight blocks), a spin_wait between steps. 0, -1 out of memory, MTPFLOW_ROWS_BAD_ABI for another
 * struct. */
int mtpflow_w8a8_rows(const struct mtpflow_w8a8_args *a) {
    if (a->version != MTPFLOW_W8A8_ABI || a->size != (int)sizeof(struct mtpflow_w8a8_args)) return MTPFLOW_ROWS_BAD_ABI;
    float *const h = a->h;
    const int M = a->M, L = a->L, H = a->H, nh = a->nh, nkv = a->nkv, d = a->d, I = a->I;
    const int nq = nh * d, nk = nkv * d, group = nh / nkv, nqkv = nq + 2 * nk;
    const int kp_max = a->kp_h > a->kp_q ? (a->kp_h > a->kp_i ? a->kp_h : a->kp_i) : (a->kp_q > a->kp_i ? a->kp_q : a->kp_i);
    const size_t slot_stride = (size_t)nkv * a->cap * d;
    int longest = 1;
    for (int r = 0; r < M; r++)
        if (a->prefix[r] + a->count[r] > longest) longest = a->prefix[r] + a->count[r];
    const size_t floats = (size_t)M * (2 * H + nqkv + nq + 3 * (size_t)I) + (size_t)M * nh * longest + M;
    char *buf = malloc(floats * sizeof(float) + (size_t)M * kp_max + (size_t)M * a->qmax);
    if (!buf) return -1;
    float *x = (float *)buf, *tmp = x + (size_t)M * H, *qkv = tmp + (size_t)M * H,
          *att = qkv + (size_t)M * nqkv, *gu = att + (size_t)M * nq, *act = gu + (size_t)M * 2 * I,
          *scores = act + (size_t)M * I, *sx = scores + (size_t)M * nh * longest;
    unsigned char *xq = (unsigned char *)(sx + M), *own = xq + (size_t)M * kp_max;  /* own: a window's own mask */
    struct spin_barrier barrier = {0, 0};
#pragma omp parallel num_threads(a->threads)
    {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    /* this thread's rows [r0, r1) and (row, head) pairs [p0, p1) */
    const int r0 = (int)((long)M * t / nt), r1 = (int)((long)M * (t + 1) / nt);
    const int p0 = (int)((long)M * nh * t / nt), p1 = (int)((long)M * nh * (t + 1) / nt);
    const struct team team = {&barrier, t, nt, r0, r1};
    for (int r = r0; r < r1; r++) {  /* the first layer's norm; each later one follows its residual below */
        rmsnorm(h + (size_t)r * H, a->ln1[0], a->eps, x + (size_t)r * H, H);
        sx[r] = mtpflow_quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
    }
    for (int l = 0; l < L; l++) {
        const float *c = PART(a->cos, l), *sn = PART(a->sin, l), *post_attn = PART(a->post_attn, l),
                    *post_mlp = PART(a->post_mlp, l);
        const int w = a->window ? a->window[l] : 0;
        q8_product(&team, xq, sx, M, a->wqkv[l], a->sqkv[l], a->zqkv[l], nqkv, a->kp_h, qkv, PART(a->bqkv, l));
        for (int r = r0; r < r1; r++) {
            float *q = qkv + (size_t)r * nqkv, *k = q + nq, *v = k + nk;
            heads_in(q, k, nh, nkv, d, PART(a->qn, l), PART(a->kn, l), a->eps, c ? c + (size_t)r * a->rot : NULL,
                     sn ? sn + (size_t)r * a->rot : NULL, a->rot);
            for (int j = 0; j < nkv; j++) {
                const size_t at = a->slot[r] * slot_stride + ((size_t)j * a->cap + a->wpos[r]) * d;
                for (int i = 0; i < d; i++) { a->kc[l][at + i] = k[j * d + i]; a->vc[l][at + i] = v[j * d + i]; }
            }
            window_own(w, a->allowed + (size_t)r * a->qmax, a->pos, r, a->first[r], a->count[r],
                       own + (size_t)r * a->qmax);
        }
        spin_wait(&barrier, nt);
        for (int p = p0; p < p1; p++) {
            const int r = p / nh, j = p % nh;
            const int lo = window_start(w, w ? a->pos[r] : 0, a->prefix[r]);
            const size_t base = a->slot[r] * slot_stride + (size_t)(j / group) * a->cap * d + (size_t)lo * d;
            const unsigned char *mask = (w ? own : a->allowed) + (size_t)r * a->qmax;
            attend_exact(qkv + (size_t)r * nqkv + (size_t)j * d, a->kc[l] + base, a->vc[l] + base, mask,
                         a->prefix[r] - lo, a->prefix[r] + a->count[r] - lo, d, a->scale, a->softcap,
                         scores + (size_t)p * longest, att + (size_t)r * nq + (size_t)j * d);
        }
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++)
            sx[r] = mtpflow_quantize_row(att + (size_t)r * nq, nq, a->kp_q, xq + (size_t)r * a->kp_q);
        q8_product(&team, xq, sx, M, a->wo[l], a->so[l], a->zo[l], H, a->kp_q, tmp, PART(a->bo, l));
        for (int r = r0; r < r1; r++) {
            add_residual(h + (size_t)r * H, tmp + (size_t)r * H, post_attn, a->eps, H);
            rmsnorm(h + (size_t)r * H, a->ln2[l], a->eps, x + (size_t)r * H, H);
            sx[r] = mtpflow_quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
        }
        q8_product(&team, xq, sx, M, a->wgu[l], a->sgu[l], a->zgu[l], 2 * I, a->kp_h, gu, PART(a->bgu, l));
        for (int r = r0; r < r1; r++) {  /* act(gate) * up, VW at a time (rows_common.h) */
            const float *g = gu + (size_t)r * 2 * I;
            gated(g, g + I, act + (size_t)r * I, I, a->act);
            sx[r] = mtpflow_quantize_row(act + (size_t)r * I, I, a->kp_i, xq + (size_t)r * a->kp_i);
        }
        q8_product(&team, xq, sx, M, a->wd[l], a->sd[l], a->zd[l], H, a->kp_i, tmp, PART(a->bd, l));
        for (int r = r0; r < r1; r++) {
            float *hr = h + (size_t)r * H;
            add_residual(hr, tmp + (size_t)r * H, post_mlp, a->eps, H);
            if (a->taps && a->taps[l])
                for (int i = 0; i < H; i++) a->taps[l][(size_t)r * H + i] = hr[i];
            if (l + 1 < L) {
                rmsnorm(hr, a->ln1[l + 1], a->eps, x + (size_t)r * H, H);
                sx[r] = mtpflow_quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
            } else {
                rmsnorm(hr, a->norm_w, a->eps, a->normed + (size_t)r * H, H);
                if (a->logits && r >= a->head_from)
                    sx[r] = mtpflow_quantize_row(a->normed + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
            }
        }
    }
    if (a->logits) {
        spin_wait(&barrier, nt);
        const int from = a->head_from;
        mtpflow_q8_part(t, nt, xq + (size_t)from * a->kp_h, sx + from, M - from, a->head_q, a->head_s, a->head_z, a->vocab,
                a->kp_h, a->logits);
    }
    }
    free(buf);
    return 0;
}
