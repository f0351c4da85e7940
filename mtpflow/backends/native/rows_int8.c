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
#include <stdint.h>
#include "rows_common.h"
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float fvec8 __attribute__((vector_size(32), aligned(4), may_alias));
typedef int32_t i32x8 __attribute__((vector_size(32)));

/* The attention below, over the pool's int8 entries (each key / value head of a token: int8 values, then their float
 * scale): the queries that read the same keys and values (rows of one sequence's verify, times the query heads that
 * share a key / value head) go together, so each key and value is read once for all of them from memory and widened
 * once per key or value block. The scores are integer dot products summed in float (exact below 2^24, in any order);
 * the weighted values are integer sums of 16-bit fixed-point weights times int8 values (exact in any order), scaled
 * once in float. So a fused multiply-add rounds as the multiply and add do: these functions may fuse them (the file's
 * rule above is for the float operations that must round as torch's do). */
#define KEYS 8  /* keys per block of scores: one vector of 8 sums */
#define WEIGH 6  /* queries whose weighted values are summed together: 4 x 16 values each in 24 registers */
#define WQ_MAX 32767.0f  /* a query's largest weight in fixed point (int8_reference.WQ_MAX) */
/* tokens whose products sum in 32 bits: WQ_SPAN * WQ_MAX * 127 < 2^31; longer sums go on in double (exact) */
#define WQ_SPAN 512

/* the softmax of one query's scores s[0, n) and its weights: w_t = e_t * sv_t (float32) into w[0, n), e_t the float
 * exponential (VW at a time, a padded copy for the last few: the same vexp for every entry; 0 for a masked score) and
 * sv_t its value's scale; *wmax the largest weight. Returns 1 / sum e (in double, rounded once). */
static float softmax_weights(float *s, int n, float softcap, const float *sv, float *w, float *wmax) {
    typedef double dvecw __attribute__((vector_size(VW * 8)));
    if (softcap != 0.0f) softcap_scores(s, n, softcap);
    const vec none = splat(-INFINITY);
    vec mv = none;
    int t = 0;
    for (; t + VW <= n; t += VW) mv = select_lt(mv, loadv(s + t), loadv(s + t), mv);
    float m = -INFINITY;
    for (int i = 0; i < VW; i++)
        if (mv[i] > m) m = mv[i];
    for (; t < n; t++)
        if (s[t] > m) m = s[t];
    dvecw total = {0};
    vec wm = splat(0.0f);
    for (t = 0; t < n; t += VW) {
        vec v, scales;
        const int c = n - t < VW ? n - t : VW;
        if (c == VW) v = loadv(s + t), scales = loadv(sv + t);
        else for (int i = 0; i < VW; i++) v[i] = i < c ? s[t + i] : -INFINITY, scales[i] = i < c ? sv[t + i] : 0.0f;
        const ivec masked = (ivec)(v == none);
        const vec x = (vec)((ivec)vexp(v - m) & ~masked);  /* masked: weight 0 */
        total += __builtin_convertvector(x, dvecw);
        const vec y = x * scales;
        wm = select_lt(wm, y, y, wm);
        if (c == VW) __builtin_memcpy(w + t, &y, sizeof y);
        else for (int i = 0; i < c; i++) w[t + i] = y[i];
    }
    float top = 0.0f;
    for (int i = 0; i < VW; i++) top = wm[i] > top ? wm[i] : top;
    *wmax = top;
    double sum = 0.0;  /* the sum in double, rounded once: its order does not matter (int8_reference.py) */
    for (int i = 0; i < VW; i++) sum += total[i];
    return 1.0f / (float)sum;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#endif

/* a key or value entry of the pool (one token, one key / value head): its d values as int8, then their scale (a
 * float, unaligned), ENTRY_BYTES(d) bytes in all */
#define ENTRY_BYTES(d) ((size_t)(d) + sizeof(float))

static inline float entry_scale(const signed char *entry, int d) {
    float s;
    __builtin_memcpy(&s, entry + d, sizeof s);
    return s;
}

/* a value of mtpflow_quantize_row's bytes: the byte minus Q8_OFFSET where there is one, else the byte read as int8 */
static inline int q8_value(unsigned char b) {
    return Q8_OFFSET ? (int)b - Q8_OFFSET : (int)(signed char)b;
}

/* x [d] into an entry: quantized as an activation row is (mtpflow_quantize_row, int8_reference.quantize_rows), its
 * bytes (value + Q8_OFFSET) turned into the int8 values */
static inline void store_entry(const float *x, int d, signed char *entry) {
    const float s = mtpflow_quantize_row(x, d, d, (unsigned char *)entry);
#if Q8_OFFSET
    for (int i = 0; i < d; i++) entry[i] = (signed char)q8_value(((unsigned char *)entry)[i]);
#endif
    __builtin_memcpy(entry + d, &s, sizeof s);
}

/* 8 int8 values as 8 int32 lanes (then widened to float exactly: they are small integers) */
static inline i32x8 load_q8(const signed char *p) {
#if defined(__AVX2__)
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p));
    i32x8 out;
    __builtin_memcpy(&out, &v, sizeof out);
    return out;
#else
    i32x8 out;
    for (int i = 0; i < 8; i++) out[i] = p[i];
    return out;
#endif
}

/* sum_i q[i] k[i] of a quantized query (mtpflow_quantize_row's bytes, read by q8_value) and an int8 key: an integer
 * below 2^24 in magnitude for d <= 1024, exact in float */
static inline float dot_q8(const unsigned char *q, const signed char *k, int d) {
    int acc = 0;
    for (int i = 0; i < d; i++) acc += q8_value(q[i]) * (int)k[i];
    return (float)acc;
}

/* a set of queries over the same keys / values: query qi = (row qi / g, head qi % g) */
struct queries {
    const float *q;       /* query (row 0, head 0); rows qrow floats apart, heads d */
    float *s, *o;         /* scores (row 0, head 0): rows srow apart, heads sh; outputs: rows orow apart, heads d */
    const unsigned char *own;  /* row 0's mask over the new entries; rows mrow apart */
    const int *lim;       /* row 0's visible end (it sees no key from there on; a prefill row's causal end); rows 1 apart */
    int rows, g;
    size_t qrow, srow, sh, orow, mrow;
};

static inline const float *query_at(const struct queries *Q, int qi, int d) {
    return Q->q + (size_t)(qi / Q->g) * Q->qrow + (size_t)(qi % Q->g) * d;
}

static inline float *scores_at(const struct queries *Q, int qi) {
    return Q->s + (size_t)(qi / Q->g) * Q->srow + (size_t)(qi % Q->g) * Q->sh;
}

/* the keys [0, lim) hold every key query qi sees */
static inline int limit_at(const struct queries *Q, int qi) { return Q->lim[qi / Q->g]; }

static inline float *out_at(const struct queries *Q, int qi, int d) {
    return Q->o + (size_t)(qi / Q->g) * Q->orow + (size_t)(qi % Q->g) * d;
}

/* ((dots * sq) * sk) * scale into s[0, KEYS): the int8 model's score of a query (scale sq) and KEYS keys (sk) */
static inline void store_scores(float *s, fvec8 dots, float sq, fvec8 sk, float scale) {
    const fvec8 f = ((dots * sq) * sk) * scale;
    __builtin_memcpy(s, &f, sizeof f);
}

#if !(defined(__AVX512VNNI__) && defined(__AVX512BW__))  /* elsewhere block_scores_vnni below */
/* every query's scores against keys [0, n0 - n0 % KEYS) (d % 8 == 0, d <= 256), the queries quantized already (qf:
 * query qi's values at qi * d, its scale sq[qi]): each block of KEYS keys widened to float once (kf: scratch of KEYS
 * * d floats) for all the queries, two queries at a time sharing each load of a key. The dot products are integers
 * below 2^24: their float sums are exact, so they may run in any order and fuse their multiplies and adds. */
static void block_scores(const struct queries *Q, const float *qf, const float *sq, const signed char *keys, int n0,
                         int d, float scale, float *kf) {
    const int dv = d / 8, nq = Q->rows * Q->g;
    const size_t kr = ENTRY_BYTES(d);
    for (int t = 0; t + KEYS <= n0; t += KEYS) {
        fvec8 sk;
        for (int e = 0; e < KEYS; e++) {
            const signed char *key = keys + (size_t)(t + e) * kr;
            sk[e] = entry_scale(key, d);
            for (int i = 0; i < dv; i++)
                *(fvec8 *)(kf + ((size_t)i * KEYS + e) * 8) = __builtin_convertvector(load_q8(key + 8 * i), fvec8);
        }
        int qi = 0;
        for (; qi + 2 <= nq; qi += 2) {
            const float *q0 = qf + (size_t)qi * d, *q1 = q0 + d;
            fvec8 a0[KEYS], a1[KEYS];
            for (int e = 0; e < KEYS; e++) a0[e] = a1[e] = (fvec8){0};
            for (int i = 0; i < dv; i++) {
                const fvec8 u0 = *(const fvec8 *)(q0 + 8 * i), u1 = *(const fvec8 *)(q1 + 8 * i);
                const fvec8 *k = (const fvec8 *)(kf + (size_t)i * KEYS * 8);
                for (int e = 0; e < KEYS; e++) { a0[e] += u0 * k[e]; a1[e] += u1 * k[e]; }
            }
            store_scores(scores_at(Q, qi) + t, lane_sums8(a0), sq[qi], sk, scale);
            store_scores(scores_at(Q, qi + 1) + t, lane_sums8(a1), sq[qi + 1], sk, scale);
        }
        if (qi < nq) {
            const float *q0 = qf + (size_t)qi * d;
            fvec8 a0[KEYS];
            for (int e = 0; e < KEYS; e++) a0[e] = (fvec8){0};
            for (int i = 0; i < dv; i++) {
                const fvec8 u0 = *(const fvec8 *)(q0 + 8 * i);
                const fvec8 *k = (const fvec8 *)(kf + (size_t)i * KEYS * 8);
                for (int e = 0; e < KEYS; e++) a0[e] += u0 * k[e];
            }
            store_scores(scores_at(Q, qi) + t, lane_sums8(a0), sq[qi], sk, scale);
        }
    }
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define VNNI_KEYS 16  /* keys per block of scores on AVX-512 VNNI: one vector of 16 integer sums */
#define VNNI_QUERIES 4  /* queries that share each load of a block's keys (independent sums in flight) */

/* the integer dot products of queries q0 .. q0 + nqs - 1 (nqs <= VNNI_QUERIES; mtpflow_quantize_row's bytes, the
 * values offset by Q8_OFFSET = 128, d apart in qu) with a block of VNNI_KEYS keys transposed in kt (d / 4 groups of 4 bytes x the keys):
 * sum (q + 128) k - 128 sum k (corr: 128 sum k per key), exact; then the scores as store_scores computes them */
static inline void vnni_block(const struct queries *Q, const unsigned char *qu, const float *sq, int q0, int nqs, int t,
                              int d, float scale, const int32_t *kt, __m512i corr, __m512 sk, __mmask16 keep) {
    __m512i acc[VNNI_QUERIES];
    for (int i = 0; i < nqs; i++) acc[i] = _mm512_setzero_si512();
    for (int j = 0; j < d / 4; j++) {
        const __m512i k = _mm512_load_si512((const void *)(kt + (size_t)j * VNNI_KEYS));
        for (int i = 0; i < nqs; i++) {
            int32_t word;
            __builtin_memcpy(&word, qu + (size_t)(q0 + i) * d + 4 * j, sizeof word);
            acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_set1_epi32(word), k);
        }
    }
    for (int i = 0; i < nqs; i++) {
        const __m512 dots = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i], corr));
        const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(dots, _mm512_set1_ps(sq[q0 + i])), sk),
                                       _mm512_set1_ps(scale));
        _mm512_mask_storeu_ps(scores_at(Q, q0 + i) + t, keep, f);  /* keep: the block's keys */
    }
}

/* a 16 x 16 matrix of 32-bit words transposed in registers: r[e][j] into r[j][e] */
static inline void transpose16(__m512i r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_castsi512_ps(_mm512_unpacklo_epi32(r[i], r[i + 1]));
        t[i + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi32(r[i], r[i + 1]));
    }
    for (int i = 0; i < 16; i += 4) {
        u[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_f32x4(u[i], u[i + 4], 0xDD);
        t[i + 8] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_f32x4(u[i + 8], u[i + 12], 0xDD);
    }
    for (int i = 0; i < 8; i++) {
        r[i] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0x88));
        r[i + 8] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD));
    }
}

/* block_scores on AVX-512 VNNI (d % 4 == 0, d <= 256), over all n keys (a last block of fewer keys: the rest zeros,
 * their scores not stored): each block of VNNI_KEYS keys transposed once (transpose16; kt: 16 d bytes, 64-byte
 * aligned) for all the queries, which read it VNNI_QUERIES at a time (qu: as vnni_block reads them). The same integers
 * as block_scores, so the same scores. */
static void block_scores_vnni(const struct queries *Q, const unsigned char *qu, const float *sq, const signed char *keys,
                              int n, int d, float scale, int32_t *kt, const int *glim) {
    const int groups = d / 4, nq = Q->rows * Q->g;
    const size_t kr = ENTRY_BYTES(d);
    const __m512i ones = _mm512_set1_epi8(1);
    for (int t = 0; t < n; t += VNNI_KEYS) {
        const int count = n - t < VNNI_KEYS ? n - t : VNNI_KEYS;
        const __mmask16 keep = (__mmask16)((1u << count) - 1);
        float skv[VNNI_KEYS];
        for (int e = 0; e < VNNI_KEYS; e++) skv[e] = e < count ? entry_scale(keys + (size_t)(t + e) * kr, d) : 0.0f;
        for (int j0 = 0; j0 < groups; j0 += 16) {  /* 16 groups of 4 bytes of each key a time */
            const int m = groups - j0 < 16 ? groups - j0 : 16;
            const __mmask16 words = (__mmask16)((1u << m) - 1);
            __m512i r[16];
            for (int e = 0; e < VNNI_KEYS; e++)
                r[e] = e < count ? _mm512_maskz_loadu_epi32(words, keys + (size_t)(t + e) * kr + 4 * j0)
                                 : _mm512_setzero_si512();
            transpose16(r);
            for (int j = 0; j < m; j++) _mm512_store_si512((void *)(kt + (size_t)(j0 + j) * VNNI_KEYS), r[j]);
        }
        __m512i sums = _mm512_setzero_si512();
        for (int j = 0; j < groups; j++)
            sums = _mm512_dpbusd_epi32(sums, ones, _mm512_load_si512((const void *)(kt + (size_t)j * VNNI_KEYS)));
        const __m512i corr = _mm512_slli_epi32(sums, 7);
        const __m512 sk = _mm512_loadu_ps(skv);
        int qi = 0;  /* a group none of whose queries sees the block: skipped */
        for (; qi + VNNI_QUERIES <= nq; qi += VNNI_QUERIES)  /* a constant count: the sums stay in registers */
            if (glim[qi / VNNI_QUERIES] > t) vnni_block(Q, qu, sq, qi, VNNI_QUERIES, t, d, scale, kt, corr, sk, keep);
        if (qi < nq && glim[qi / VNNI_QUERIES] > t) vnni_block(Q, qu, sq, qi, nq - qi, t, d, scale, kt, corr, sk, keep);
    }
}
#endif

/* A query's weights w[0, n) (softmax_weights') in 16-bit fixed point: wq_t = round(w_t * (WQ_MAX / wmax)) (half to
 * even) into wq[0, n), a 0 after an odd n (wq holds n + n % 2); returns the fixed point's unit, wmax / WQ_MAX. */
static float quantize_weights(const float *e, float wmax, int n, int16_t *wq) {
    const float r = WQ_MAX / wmax;  /* wmax > 0: the largest score's exponential is 1, a scale is positive */
    int t = 0;
#if defined(__AVX512F__)
    for (; t + 16 <= n; t += 16)  /* round to nearest even: the default rounding mode */
        _mm256_storeu_si256((__m256i *)(wq + t),
                            _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(e + t),
                                                                                     _mm512_set1_ps(r)))));
#endif
    for (; t < n; t++) wq[t] = (int16_t)__builtin_rintf(e[t] * r);
    if (n & 1) wq[n] = 0;
    return wmax / WQ_MAX;
}

/* The weighted sums: sums [g][d] (doubles) += sum_t wq[j][t] v[t][c] over tokens [t0, t1) (t1 - t0 <= WQ_SPAN, t0
 * even) for g <= WEIGH queries, exact integers in 32 bits added into the double sums exactly. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/* 16 values of tokens t and t + 1 (va, vb) as 16 lanes of their two int16 values: (va[i], vb[i]) */
static inline __m512i value_pairs(const signed char *va, const signed char *vb) {
    const __m128i a = _mm_loadu_si128((const __m128i *)va), b = _mm_loadu_si128((const __m128i *)vb);
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(a, b), _mm_unpacklo_epi8(a, b)));
}

/* on AVX-512 VNNI, 64 columns [c, c + 64) a call, each pair of tokens read once for the g queries (vpdpwssd: a
 * lane's two weights times its two values, added); the g x 4 sums in registers */
static inline __attribute__((always_inline)) void weigh_span(const int16_t *const *wq, const signed char *values, int t0,
                                                             int t1, int n, int d, int c, const int g, double *sums) {
    __m512i acc[WEIGH][4];
    for (int j = 0; j < g; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_si512();
    for (int t = t0; t < t1; t += 2) {
        const signed char *va = values + (size_t)t * ENTRY_BYTES(d) + c;
        const signed char *vb = t + 1 < n ? va + ENTRY_BYTES(d) : va;  /* past an odd n: its weight is 0 */
        __m512i v[4];
        for (int i = 0; i < 4; i++) v[i] = value_pairs(va + 16 * i, vb + 16 * i);
        for (int j = 0; j < g; j++) {
            int32_t both;
            __builtin_memcpy(&both, wq[j] + t, sizeof both);
            const __m512i w = _mm512_set1_epi32(both);
            for (int i = 0; i < 4; i++) acc[j][i] = _mm512_dpwssd_epi32(acc[j][i], w, v[i]);
        }
    }
    for (int j = 0; j < g; j++)
        for (int i = 0; i < 4; i++) {
            double *out = sums + (size_t)j * d + c + 16 * i;
            _mm512_storeu_pd(out, _mm512_add_pd(_mm512_loadu_pd(out),
                                                _mm512_cvtepi32_pd(_mm512_castsi512_si256(acc[j][i]))));
            _mm512_storeu_pd(out + 8, _mm512_add_pd(_mm512_loadu_pd(out + 8),
                                                    _mm512_cvtepi32_pd(_mm512_extracti64x4_epi64(acc[j][i], 1))));
        }
}

#elif defined(__AVX2__)
/* on AVX2, 16 columns [c, c + 16) a call, each pair of tokens read and widened once for the g queries (vpmaddwd: a
 * lane's two weights times its two values, added); the g x 2 sums in registers. The loop one query at a time
 * (weigh_columns) widened every value to 32 bits and multiplied in 32 bits for each query: a verify's rows and the
 * query heads that share a key / value head read each value once here. */
static inline __attribute__((always_inline)) void weigh_span(const int16_t *const *wq, const signed char *values, int t0,
                                                             int t1, int n, int d, int c, const int g, double *sums) {
    __m256i acc[WEIGH][2];
    for (int j = 0; j < g; j++) acc[j][0] = acc[j][1] = _mm256_setzero_si256();
    for (int t = t0; t < t1; t += 2) {
        const signed char *va = values + (size_t)t * ENTRY_BYTES(d) + c;
        const signed char *vb = t + 1 < n ? va + ENTRY_BYTES(d) : va;  /* past an odd n: its weight is 0 */
        const __m128i a = _mm_loadu_si128((const __m128i *)va), b = _mm_loadu_si128((const __m128i *)vb);
        const __m256i lo = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));  /* columns c .. c + 7: (a, b) pairs */
        const __m256i hi = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));  /* columns c + 8 .. c + 15 */
        for (int j = 0; j < g; j++) {
            int32_t both;
            __builtin_memcpy(&both, wq[j] + t, sizeof both);
            const __m256i w = _mm256_set1_epi32(both);
            acc[j][0] = _mm256_add_epi32(acc[j][0], _mm256_madd_epi16(w, lo));
            acc[j][1] = _mm256_add_epi32(acc[j][1], _mm256_madd_epi16(w, hi));
        }
    }
    for (int j = 0; j < g; j++)
        for (int i = 0; i < 2; i++) {
            double *out = sums + (size_t)j * d + c + 8 * i;
            _mm256_storeu_pd(out, _mm256_add_pd(_mm256_loadu_pd(out),
                                                _mm256_cvtepi32_pd(_mm256_castsi256_si128(acc[j][i]))));
            _mm256_storeu_pd(out + 4, _mm256_add_pd(_mm256_loadu_pd(out + 4),
                                                    _mm256_cvtepi32_pd(_mm256_extracti128_si256(acc[j][i], 1))));
        }
}
#endif

/* weigh's sums for the columns [c0, d), one query at a time, 64 columns at a time: the compiler's vectors */
static void weigh_columns(const int16_t *const *wq, const signed char *values, int t0, int t1, int c0, int d, int g,
                          double *sums) {
    for (int j = 0; j < g; j++)
        for (int c = c0; c < d; c += 64) {
            const int nc = d - c < 64 ? d - c : 64;
            int32_t acc[64] = {0};
            for (int t = t0; t < t1; t++) {
                const signed char *vt = values + (size_t)t * ENTRY_BYTES(d) + c;
                const int32_t w = wq[j][t];
                for (int i = 0; i < nc; i++) acc[i] += w * (int32_t)vt[i];
            }
            for (int i = 0; i < nc; i++) sums[(size_t)j * d + c + i] += (double)acc[i];
        }
}

/* o[j] = ((float)(sum_t wq[j][t] v[t]) * unit[j]) * inv[j] for g <= WEIGH queries over values [0, n) (entries
 * ENTRY_BYTES(d) apart): the sums exact, in WQ_SPAN tokens at a time (sums: g * d doubles of scratch) */
static void weigh(const int16_t *const *wq, const signed char *values, int n, int d, int g, const float *unit,
                  const float *inv, float *const *o, double *sums) {
    for (int i = 0; i < g * d; i++) sums[i] = 0.0;
    for (int t0 = 0; t0 < n; t0 += WQ_SPAN) {
        const int t1 = n - t0 < WQ_SPAN ? n : t0 + WQ_SPAN;
        int c = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        for (; c + 64 <= d; c += 64) {
#define WEIGH_G(G) case G: weigh_span(wq, values, t0, t1, n, d, c, G, sums); break;
            switch (g) { WEIGH_G(1) WEIGH_G(2) WEIGH_G(3) WEIGH_G(4) WEIGH_G(5) WEIGH_G(6) }
#undef WEIGH_G
        }
#elif defined(__AVX2__)
        for (; c + 16 <= d; c += 16) {
#define WEIGH_G(G) case G: weigh_span(wq, values, t0, t1, n, d, c, G, sums); break;
            switch (g) { WEIGH_G(1) WEIGH_G(2) WEIGH_G(3) WEIGH_G(4) WEIGH_G(5) WEIGH_G(6) }
#undef WEIGH_G
        }
#endif
        if (c < d) weigh_columns(wq, values, t0, t1, c, d, g, sums);
    }
    for (int j = 0; j < g; j++)
        for (int i = 0; i < d; i++) o[j][i] = ((float)sums[(size_t)j * d + i] * unit[j]) * inv[j];
}

/* per-thread scratch of the attention: kf (KEYS * 256 floats; on VNNI a block's keys transposed), qf (a unit's
 * queries quantized: queries * d floats for block_scores, then their scales, then their bytes), e (their weights:
 * queries * n floats), wq (the weights in fixed point: queries * (n + 1) int16), inv and unit (queries floats each),
 * sv (the values' scales: n floats), sums (WEIGH * d doubles), glim (queries / VNNI_QUERIES + 1 ints) */
struct att_scratch {
    float *kf, *qf, *e;
    int16_t *wq;
    float *inv, *unit, *sv;
    double *sums;
    int *glim;  /* block_scores_vnni's groups' visible ends: queries / VNNI_QUERIES + 1 ints */
};

/* the attention of queries Q over keys and values [n] (int8 entries of ENTRY_BYTES(d) bytes), of which the first n0
 * are visible to every query and the rest only where the query row's own[t - n0]. Each query is quantized as the
 * keys are; a score is the integer dot product times both scales, times the model's scale; a weight, the softmax's
 * exponential times its value's scale (float32), in 16-bit fixed point (quantize_weights) weighs the int8 values in
 * an exact integer sum (weigh). The vector scores take d % 8 == 0 and d <= 256; other sizes the scalar loop. */
static void attend_exact(const struct queries *Q, const signed char *keys, const signed char *values, int n0, int n, int d,
                         float scale, float softcap, const struct att_scratch *w) {
    const int nq = Q->rows * Q->g;
    const size_t kr = ENTRY_BYTES(d);
    float *const sq = w->qf + (size_t)nq * d;
    unsigned char *const qu = (unsigned char *)(sq + nq);  /* the queries quantized: value + Q8_OFFSET */
    for (int qi = 0; qi < nq; qi++) sq[qi] = mtpflow_quantize_row(query_at(Q, qi, d), d, d, qu + (size_t)qi * d);
    int seen = n0;  /* the keys any query sees: [0, seen) */
    for (int qi = 0; qi < nq; qi++) seen = limit_at(Q, qi) > seen ? limit_at(Q, qi) : seen;
    n = seen;  /* the keys past every query's limit: none computed (their weights would all be 0) */
    for (int t = 0; t < n; t++) w->sv[t] = entry_scale(values + (size_t)t * kr, d);
    const size_t np = (size_t)n + 1;  /* wq's room per query: n and a 0 after an odd n */
    int from = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (d % 4 == 0 && d <= 256) {
        for (int qi = 0; qi < nq; qi++)  /* each group's visible end: the largest of its queries' */
            if (qi % VNNI_QUERIES == 0 || limit_at(Q, qi) > w->glim[qi / VNNI_QUERIES])
                w->glim[qi / VNNI_QUERIES] = limit_at(Q, qi);
        block_scores_vnni(Q, qu, sq, keys, n, d, scale, (int32_t *)w->kf, w->glim);
        from = n;
    }
#else
    if (d % 8 == 0 && d <= 256) {
        for (size_t i = 0; i < (size_t)nq * d; i++) w->qf[i] = (float)q8_value(qu[i]);
        block_scores(Q, w->qf, sq, keys, n0, d, scale, w->kf);
        from = n0 - n0 % KEYS;
    }
#endif
    /* each query over the keys up to its limit: those past it weigh 0 (a masked score's weight), and a 0 adds
     * nothing to the softmax's sum, its largest weight or the exact integer sums */
    for (int qi = 0; qi < nq; qi++) {
        float *s = scores_at(Q, qi);
        const int lq = limit_at(Q, qi);
        for (int t = from; t < lq; t++) {  /* the keys the block scores leave */
            const signed char *key = keys + (size_t)t * kr;
            s[t] = ((dot_q8(qu + (size_t)qi * d, key, d) * sq[qi]) * entry_scale(key, d)) * scale;
        }
        const unsigned char *own = Q->own + (size_t)(qi / Q->g) * Q->mrow;
        for (int t = n0; t < lq; t++)  /* the new entries this row does not see */
            if (!own[t - n0]) s[t] = -INFINITY;
        float wmax;
        w->inv[qi] = softmax_weights(s, lq, softcap, w->sv, w->e + (size_t)qi * n, &wmax);
        w->unit[qi] = quantize_weights(w->e + (size_t)qi * n, wmax, lq, w->wq + (size_t)qi * np);
    }
    for (int j = 0; j < nq; j += WEIGH) {
        const int g = nq - j < WEIGH ? nq - j : WEIGH;
        const int16_t *wq[WEIGH];
        float *o[WEIGH];
        int ng = 0;  /* the group's keys: to its longest limit, the others' weights 0 from their limits on */
        for (int i = 0; i < g; i++) ng = limit_at(Q, j + i) > ng ? limit_at(Q, j + i) : ng;
        for (int i = 0; i < g; i++) {
            int16_t *q = w->wq + (size_t)(j + i) * np;
            for (int t = limit_at(Q, j + i); t < ng + (ng & 1); t++) q[t] = 0;
            wq[i] = q;
            o[i] = out_at(Q, j + i, d);
        }
        weigh(wq, values, ng, d, g, w->unit + j, w->inv + j, o, w->sums);
    }
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC pop_options
#endif

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

/* whether row r (r > 0) belongs to row r - 1's sequence: the same slot, prefix and new entries */
static inline int same_sequence(const struct mtpflow_w8a8_args *a, int r) {
    return a->slot[r] == a->slot[r - 1] && a->prefix[r] == a->prefix[r - 1] && a->count[r] == a->count[r - 1];
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
    const size_t slot_stride = (size_t)nkv * a->cap * ENTRY_BYTES(d);  /* bytes: the pool's entries (ENTRY_BYTES) */
    int longest = 1, widest = 1;  /* the longest row's keys; the most rows that see the same keys */
    for (int r = 0, run = 0; r < M; r++) {
        if (a->prefix[r] + a->count[r] > longest) longest = a->prefix[r] + a->count[r];
        run = r && same_sequence(a, r) ? run + 1 : 1;
        if (run > widest) widest = run;
    }
    const int teams = a->threads > 1 ? a->threads : 1;  /* per-thread scratch: the attention's runs and sums */
    const size_t floats = (size_t)M * (2 * H + nqkv + nq + 3 * (size_t)I) + (size_t)M * nh * longest + M +
                          (size_t)teams * ((size_t)M * nh + 3 * M + 1);
    /* each thread's attention scratch (struct att_scratch), 64-byte aligned: a unit has at most widest x group
     * queries */
    const size_t unit_q = (size_t)widest * group;
    /* in doubles: kf, qf (d + 1 per query), e and wq (n floats and n + 1 int16 per query: under n + 1 doubles), unit
     * and sv (floats), sums, glim (ints); each part rounded up to whole doubles */
    const size_t doubles = KEYS * 256 + unit_q * (d + 1) + unit_q * ((size_t)longest + 1) + unit_q + longest + 1 +
                           (size_t)WEIGH * d + unit_q / 2 + 1 + 8;
    char *buf = malloc(floats * sizeof(float) + (size_t)M * kp_max + (size_t)M * a->qmax);
    double *att_buf = malloc((size_t)teams * doubles * sizeof(double) + 64);
    if (!buf || !att_buf) { free(buf); free(att_buf); return -1; }
    float *x = (float *)buf, *tmp = x + (size_t)M * H, *qkv = tmp + (size_t)M * H,
          *att = qkv + (size_t)M * nqkv, *gu = att + (size_t)M * nq, *act = gu + (size_t)M * 2 * I,
          *scores = act + (size_t)M * I, *sx = scores + (size_t)M * nh * longest, *invs = sx + M;
    int *ints = (int *)(invs + (size_t)teams * M * nh);
    unsigned char *xq = (unsigned char *)(ints + (size_t)teams * (3 * M + 1)), *own = xq + (size_t)M * kp_max;  /* own: a window's own mask */
    struct spin_barrier barrier = {0, 0};
#pragma omp parallel num_threads(a->threads)
    {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    /* this thread's rows [r0, r1) */
    const int r0 = (int)((long)M * t / nt), r1 = (int)((long)M * (t + 1) / nt);
    double *const mine = (double *)(((uintptr_t)(att_buf + (size_t)t * doubles) + 63) & ~(uintptr_t)63);
    /* doubles' parts in order (see doubles above) */
    double *const qf_at = mine + KEYS * 256, *const e_at = qf_at + unit_q * (d + 1),
                 *const unit_at = e_at + unit_q * ((size_t)longest + 1), *const sv_at = unit_at + unit_q,
                 *const sums_at = sv_at + longest + 1;
    const struct att_scratch scratch = {(float *)mine, (float *)qf_at, (float *)e_at,
                                        (int16_t *)((float *)e_at + unit_q * (size_t)longest),
                                        invs + (size_t)t * M * nh, (float *)unit_at, (float *)sv_at, sums_at,
                                        (int *)(sums_at + (size_t)WEIGH * d)};
    /* this thread's: each row's window start, its visible end (struct queries' lim), the runs */
    int *const lo = ints + (size_t)t * (3 * M + 1), *const seen = lo + M, *const runs = seen + M;
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
            for (int j = 0; j < nkv; j++) {  /* the keys and values as int8 entries with their scales */
                const size_t at = a->slot[r] * slot_stride + ((size_t)j * a->cap + a->wpos[r]) * ENTRY_BYTES(d);
                store_entry(k + (size_t)j * d, d, (signed char *)a->kc[l] + at);
                store_entry(v + (size_t)j * d, d, (signed char *)a->vc[l] + at);
            }
            window_own(w, a->allowed + (size_t)r * a->qmax, a->pos, r, a->first[r], a->count[r],
                       own + (size_t)r * a->qmax);
        }
        spin_wait(&barrier, nt);
        /* the attention. Its queries, in the order (run, key / value head jk, row, head of jk's group), split evenly
         * among the threads; a run is rows that see the same keys (one sequence's slot, prefix, new entries and
         * window start). A thread's share goes in units of whole rows x the group's heads, with a part of a row where
         * the share starts or ends inside one: each unit reads its keys and values once */
        int nr = 0;
        for (int r = 0; r < M; r++) {
            lo[r] = window_start(w, w ? a->pos[r] : 0, a->prefix[r]);
            const unsigned char *mask = (w ? own : a->allowed) + (size_t)r * a->qmax;
            int last = a->count[r];
            while (last > 0 && !mask[last - 1]) last--;
            seen[r] = a->prefix[r] - lo[r] + last;
            if (r == 0 || !same_sequence(a, r) || lo[r] != lo[r - 1])
                runs[nr++] = r;
        }
        runs[nr] = M;
        const long q0 = (long)M * nh * t / nt, q1 = (long)M * nh * (t + 1) / nt;
        for (int i = 0; i < nr; i++) {
            const int len = runs[i + 1] - runs[i];
            const long first = (long)runs[i] * nh;  /* the run's first query */
            for (int jk = 0; jk < nkv; jk++) {
                const long a0 = first + (long)jk * len * group, a1 = a0 + (long)len * group;
                long u = a0 > q0 ? a0 : q0;
                const long end = a1 < q1 ? a1 : q1;
                while (u < end) {
                    const int row = (int)((u - a0) / group), hh = (int)((u - a0) % group);
                    int rows = 1, g = group - hh;
                    if (hh == 0 && end - u >= group) rows = (int)((end - u) / group);
                    else if (end - u < g) g = (int)(end - u);
                    const int ra = runs[i] + row, h0 = jk * group + hh;
                    const size_t base = a->slot[ra] * slot_stride + ((size_t)jk * a->cap + lo[ra]) * ENTRY_BYTES(d);
                    const struct queries Q = {
                        .q = qkv + (size_t)ra * nqkv + (size_t)h0 * d, .s = scores + ((size_t)ra * nh + h0) * longest,
                        .o = att + (size_t)ra * nq + (size_t)h0 * d, .own = (w ? own : a->allowed) + (size_t)ra * a->qmax, .lim = seen + ra,
                        .rows = rows, .g = g, .qrow = (size_t)nqkv, .srow = (size_t)nh * longest, .sh = (size_t)longest,
                        .orow = (size_t)nq, .mrow = (size_t)a->qmax};
                    attend_exact(&Q, (const signed char *)a->kc[l] + base, (const signed char *)a->vc[l] + base, a->prefix[ra] - lo[ra],
                                 a->prefix[ra] + a->count[ra] - lo[ra], d, a->scale, a->softcap, &scratch);
                    u += (long)rows * g;
                }
            }
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
    free(att_buf);
    return 0;
}


/* The int8 model's own greedy continuation, one row per token, in one call (a self-draft's loop: the Python around
 * each one-row call cost about a tenth of the row; measured: docs/bench/step_dec07b.md). rows: the call's rows as
 * mtpflow_w8a8_rows takes them, one per step (M = steps; row i: the ints, tree mask and rotary tables of step i,
 * first[i] = 0 and count[i] = 1: each step is a call of its own row), h [1][H] and normed [1][H] scratch, logits [1]
 * [vocab]; the head on that row (head_from 0). Step i feeds its token (token, then the argmax of step i - 1: the
 * first index of the largest logit, as torch.argmax takes it where no logit is NaN), embedded as Int8Weights.embedding
 * does: the float table's row (embed) or the int8 head's row times its scale (embed NULL), times embed_scale where it
 * is not 0, each a float multiply in that order. out[i]: step i's argmax. Returns 0, -1 out of memory,
 * MTPFLOW_ROWS_BAD_ABI for another struct. The model's logits must not be soft-capped (the caller's rule: tanh's
 * rounding can tie what the raw logits order). */
#define MTPFLOW_W8A8_GREEDY_ABI 1

struct mtpflow_w8a8_greedy_args {
    int version, size;
    const struct mtpflow_w8a8_args *rows;
    int steps, token;
    int *out;
    const float *embed;
    float embed_scale;
};

int mtpflow_w8a8_greedy_abi(void) { return MTPFLOW_W8A8_GREEDY_ABI; }

int mtpflow_w8a8_greedy_args_size(void) { return (int)sizeof(struct mtpflow_w8a8_greedy_args); }

/* row `token` of the int8 head packed as pack_q8 lays it out ([panels][kp / 4][Q8_PANEL][4]) times its scale */
static void head_row(const struct mtpflow_w8a8_args *a, int token, float *out) {
    const signed char *panel = a->head_q + (size_t)(token / Q8_PANEL) * a->kp_h * Q8_PANEL;
    const int j = token % Q8_PANEL;
    const float s = a->head_s[token];
    for (int k = 0; k < a->H; k++) out[k] = (float)panel[((size_t)(k / 4) * Q8_PANEL + j) * 4 + k % 4] * s;
}

int mtpflow_w8a8_greedy(const struct mtpflow_w8a8_greedy_args *g) {
    if (g->version != MTPFLOW_W8A8_GREEDY_ABI || g->size != (int)sizeof(struct mtpflow_w8a8_greedy_args))
        return MTPFLOW_ROWS_BAD_ABI;
    const struct mtpflow_w8a8_args *a = g->rows;
    struct mtpflow_w8a8_args r = *a;
    r.M = 1;
    r.head_from = 0;
    const float **tables = malloc(2 * (size_t)a->L * sizeof *tables);
    if (!tables) return -1;
    r.cos = a->cos ? tables : NULL;
    r.sin = a->sin ? tables + a->L : NULL;
    int token = g->token;
    for (int i = 0; i < g->steps; i++) {
        if (g->embed) for (int k = 0; k < a->H; k++) r.h[k] = g->embed[(size_t)token * a->H + k];
        else head_row(a, token, r.h);
        if (g->embed_scale != 0.0f) for (int k = 0; k < a->H; k++) r.h[k] = r.h[k] * g->embed_scale;
        r.slot = a->slot + i, r.wpos = a->wpos + i, r.prefix = a->prefix + i, r.first = a->first + i;
        r.count = a->count + i, r.pos = a->pos + i, r.allowed = a->allowed + (size_t)i * a->qmax;
        for (int l = 0; l < a->L; l++) {
            if (a->cos) tables[l] = a->cos[l] ? a->cos[l] + (size_t)i * a->rot : NULL;
            if (a->sin) tables[a->L + l] = a->sin[l] ? a->sin[l] + (size_t)i * a->rot : NULL;
        }
        const int code = mtpflow_w8a8_rows(&r);
        if (code != 0) { free(tables); return code; }
        int best = 0;
        for (int v = 1; v < a->vocab; v++)
            if (r.logits[v] > r.logits[best]) best = v;
        g->out[i] = token = best;
    }
    free(tables);
    return 0;
}
