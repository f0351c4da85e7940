/* The arithmetic between the products that both decoder stacks (rows_float.c, rows_int8.c) share. Included
 * after the file's fp-contract pragma: no multiply and add here is fused into one rounding, so every operation
 * rounds as the same operation in torch does. */
#ifndef MTPFLOW_ROWS_COMMON_H
#define MTPFLOW_ROWS_COMMON_H
#include <math.h>
#include <stdlib.h>
#include "native.h"

/* out = w * (x * (1 / sqrt(mean(x^2) + eps))), the mean square summed in double (each square is exact there) and
 * rounded once: the order of the sum does not matter but where it lies within double rounding of a float boundary
 * (int8_reference.py), so it runs in two vectors of VW doubles (a sequential sum waits on each add: 576 adds were
 * some 0.5 us a norm, 61 norms a row per forward) */
static inline void rmsnorm(const float *x, const float *w, float eps, float *out, int H) {
    typedef double dvecw __attribute__((vector_size(VW * 8)));
    dvecw s0 = {0}, s1 = {0};
    int i = 0;
    for (; i + 2 * VW <= H; i += 2 * VW) {
        const dvecw a = __builtin_convertvector(loadv(x + i), dvecw), b = __builtin_convertvector(loadv(x + i + VW), dvecw);
        s0 += a * a;
        s1 += b * b;
    }
    s0 += s1;
    double ss = 0.0;
    for (int e = 0; e < VW; e++) ss += s0[e];
    for (; i < H; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / H) + eps);
    for (int i = 0; i < H; i++) out[i] = w[i] * (x[i] * r);
}

/* the first d values of v rotated (the rest of a head, where the rotary part is partial, pass through) */
static inline void rotary(float *v, const float *cos, const float *sin, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}


typedef float f32x8 __attribute__((vector_size(32)));

/* out[e] = the sum of v[e]'s 8 lanes: neighbouring lanes added pairwise, then pairs of pairs, then halves (the
 * float stack's scores on 8-float vectors; the int8 stack's exact integer sums, where any order gives the same) */
static inline f32x8 lane_sums8(const f32x8 v[8]) {
    f32x8 c[4], e[2];
    for (int i = 0; i < 4; i++)
        c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; i++)
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return __builtin_shufflevector(e[0], e[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(e[0], e[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

typedef int ivec __attribute__((vector_size(VW * 4)));

static inline vec splat(float x) { return (vec){0} + x; }

static inline vec select_lt(vec a, vec b, vec if_less, vec otherwise) {  /* a < b ? if_less : otherwise */
    const ivec m = (ivec)(a < b);
    return (vec)(((ivec)if_less & m) | ((ivec)otherwise & ~m));
}

/* e^x after Cephes' expf: x = n ln2 + r (|r| <= ln2 / 2), a degree-6 polynomial in r, times 2^n (about 1 ulp
 * from expf); x is clamped to [-87, 88]: below -87 it is about 1e-38, not 0, which no softmax weight or SiLU
 * can tell apart */
static inline vec vexp(vec x) {
    x = select_lt(x, splat(-87.0f), splat(-87.0f), x);
    x = select_lt(splat(88.0f), x, splat(88.0f), x);
    vec fx = x * 1.44269504088896341f + 0.5f;
    vec t = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec);  /* truncation, then floor: */
    t = t - (vec)((ivec)splat(1.0f) & (ivec)(t > fx));
    x = x - t * 0.693359375f - t * -2.12194440e-4f;
    vec y = splat(1.9875691500e-4f);
    y = y * x + 1.3981999507e-3f;
    y = y * x + 8.3334519073e-3f;
    y = y * x + 4.1665795894e-2f;
    y = y * x + 1.6666665459e-1f;
    y = y * x + 5.0000001201e-1f;
    y = y * (x * x) + x + 1.0f;
    const ivec n = __builtin_convertvector(t, ivec);
    return y * (vec)((n + 127) << 23);
}

/* The activations and the soft-cap, each as exact float operations in this order (int8_reference.py computes the
 * same in torch: the int8 model's numerics): SiLU g / (1 + e^-g); GELU-tanh x / (1 + e^(-2u)) with
 * u = 0.7978845608 (x + 0.044715 x^3), which is HF's 0.5 x (1 + tanh(u)) without its cancellation;
 * tanh y = 1 - 2 / (1 + e^(2y)). */
#define ACT_SILU 0
#define ACT_GELU_TANH 1

static inline vec vsilu(vec g) { return g / (1.0f + vexp(-g)); }

static inline vec vgelu_tanh(vec x) {
    vec u = x * x;
    u = u * x;
    u = u * 0.044715f;
    u = x + u;
    u = u * 0.7978845608f;
    return x / (1.0f + vexp(u * -2.0f));
}

static inline vec vtanh(vec y) { return 1.0f - 2.0f / (1.0f + vexp(y + y)); }

/* c tanh(s / c) of one score (the lanes of a vector compute the same) */
static inline float softcap1(float s, float c) { return vtanh(splat(s / c))[0] * c; }

/* o[i] = act(g[i]) * u[i] for i < n (the last vector's lanes past n padded with zeros: every value goes through
 * the same vector arithmetic) */
static inline void gated(const float *g, const float *u, float *o, int n, int act) {
    for (int i = 0; i < n; i += VW) {
        const int c = n - i < VW ? n - i : VW;
        vec gv;
        if (c == VW) gv = loadv(g + i);
        else for (int e = 0; e < VW; e++) gv[e] = e < c ? g[i + e] : 0.0f;
        const vec a = act == ACT_GELU_TANH ? vgelu_tanh(gv) : vsilu(gv);
        if (c == VW) storev(o + i, a * loadv(u + i));
        else for (int e = 0; e < c; e++) o[i + e] = a[e] * u[i + e];
    }
}

/* s[t] = c tanh(s[t] / c) for t < n where s[t] is finite (a masked score stays -inf) */
static inline void softcap_scores(float *s, int n, float c) {
    int t = 0;
    for (; t + VW <= n; t += VW) {
        const vec v = loadv(s + t);
        const vec capped = vtanh(v / c) * c;
        for (int e = 0; e < VW; e++) s[t + e] = v[e] == -INFINITY ? v[e] : capped[e];
    }
    for (; t < n; t++)
        if (s[t] != -INFINITY) s[t] = softcap1(s[t], c);
}

/* The keys a row attends to in a layer with a sliding window w (HF's sliding mask: a query at position p sees the
 * keys at positions p - w + 1 .. p): the first visible entry of its prefix (entries sit at their positions, as the
 * KV pool keeps them), and its own new entries that its tree allows and the window reaches (own[j]: entry j at
 * position pos[first + j]). w = 0: the whole prefix and allowed as it is. */
static inline int window_start(int w, int pos, int prefix) {
    if (w <= 0) return 0;
    const int lo = pos - w + 1;
    return lo < 0 ? 0 : (lo > prefix ? prefix : lo);
}

static inline const unsigned char *window_own(int w, const unsigned char *allowed, const int *pos, int r, int first,
                                              int count, unsigned char *out) {
    if (w <= 0) return allowed;
    for (int j = 0; j < count; j++) out[j] = allowed[j] && pos[r] - pos[first + j] < w;
    return out;
}

/* the rows' per-(row, layer) extras between the products, shared by both stacks: q and k heads' norms, then their
 * rotary part (NULL table: none), in that order (HF's) */
static inline void heads_in(float *q, float *k, int nh, int nkv, int d, const float *qn, const float *kn, float eps,
                            const float *c, const float *sn, int rot) {
    if (qn) for (int j = 0; j < nh; j++) rmsnorm(q + (size_t)j * d, qn, eps, q + (size_t)j * d, d);
    if (kn) for (int j = 0; j < nkv; j++) rmsnorm(k + (size_t)j * d, kn, eps, k + (size_t)j * d, d);
    if (c) {
        for (int j = 0; j < nh; j++) rotary(q + (size_t)j * d, c, sn, rot);
        for (int j = 0; j < nkv; j++) rotary(k + (size_t)j * d, c, sn, rot);
    }
}

/* The members every rows entry struct starts with: its ABI version and size as the caller built it (checked before
 * anything else is read), the residual stream h [M][H] (in: the embeddings; out: the last layer's output), normed
 * [M][H] (out: the final norm of it), the taps, and the model's shape. */
#define MTPFLOW_ROWS_HEAD          \
    int version, size;             \
    float *h, *normed;             \
    float *const *taps;            \
    int M, L, H, nh, nkv, d, I;

/* The members both rows entry structs (mtpflow_rows_args, mtpflow_w8a8_args) hold, in this order, after their own
 * weights: a layer description's optional parts (per layer; a NULL array or entry: the layer lacks it), the head's
 * rotary values (rot: its first rot; d: all), the gate's activation (ACT_SILU or ACT_GELU_TANH), the scores'
 * soft-cap (softcap * tanh(score / softcap); 0: none), then the final norm, the KV cache and the rows. kernel.py
 * mirrors them once (_DESCRIPTION); a change here raises both ABI versions. */
#define MTPFLOW_DESCRIPTION_MEMBERS                                                                 \
    const float *const *post_attn, *const *post_mlp, *const *qn, *const *kn; /* norms */           \
    const float *const *bqkv, *const *bo, *const *bgu, *const *bd;            /* biases */          \
    const int *window;                                                                              \
    const float *const *cos, *const *sin;                                                           \
    int rot, act;                                                                                   \
    float softcap;                                                                                  \
    const float *norm_w;                                                                            \
    float eps;                                                                                      \
    float *const *kc, *const *vc;                                                                   \
    long cap;                                                                                       \
    const int *slot, *wpos, *prefix, *first, *count, *pos;                                          \
    const unsigned char *allowed; /* [M][qmax] */                                                   \
    int qmax;                                                                                       \
    float scale;                                                                                    \
    int threads;

/* layer l's entry of an optional per-layer part (NULL where no layer has it) */
#define PART(arr, l) ((arr) ? (arr)[l] : NULL)

/* a product's output added to the residual stream h (one row), through the layer's norm of it where it has one
 * (Gemma 2/3's post-attention and post-MLP norms) */
static inline void add_residual(float *hr, float *out, const float *post, float eps, int H) {
    if (post) rmsnorm(out, post, eps, out, H);
    for (int i = 0; i < H; i++) hr[i] = hr[i] + out[i];
}

#endif
