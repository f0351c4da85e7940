/* The int8 model's products (model.quantize=int8): int8 weights, int8 activations, exact integer dot products.
 *
 * No multiply and add in this file is fused into one rounding (GCC's optimize pragma, clang's fp contract): the
 * scales round each float operation as the torch reference (mtpflow/backends/native/int8_reference.py) does. Its
 * numerics are defined there, once; this is the fast implementation of the same arithmetic.
 * - Weights: int8 q[n][k] with one float scale per output feature (symmetric, |q| <= 127), each row padded with
 *   zeros to kp = a multiple of 64 columns (Q8_STEP), and wsum[n] = sum_k q[n][k].
 * - Activations: each row of a product's input quantized on its own: s = max|x| / 127 (1 for a row of zeros),
 *   xq = round-half-even(x / s) clamped to +-127. A row's result never depends on the other rows in the call,
 *   so a batched verify gives exactly what its rows give one at a time.
 * - The dot product is exact in int32 (|x q| <= 127 * 127 per term); y = ((float)dot * s_row) * scale[n].
 *
 * The layout (products.pack_q8): panels of Q8_PANEL = 32 output features (zero features past N), each
 * [kp / 4][32][4]: a step of four columns holds each feature's four weights side by side, 128 bytes. So
 * - one 32-bit lane of a vector is one output feature: vpdpbusd multiplies four activation bytes, broadcast to
 *   every lane, by each feature's four weights and adds them into that feature's lane. No horizontal sums are
 *   left at the end (the previous layout, four weight rows of 64 columns side by side, spent about as many
 *   instructions reducing its 4 x 6 accumulators as on the dot products of a 576-column product);
 * - a tile of one panel (2 vectors) by up to Q8_MB = 12 rows keeps 24 accumulators in registers across the whole
 *   of K: each weight vector is loaded once for all 12 rows, and an 8-row verify reads the weights as a 1-row step
 *   does. A 64-feature panel with 6 rows per tile needed a second pass (from L2) past 6 rows: the default model's
 *   products at 9 rows took 1.2-1.25 times 1 row, against 0.9-1.0 here (measured: docs/bench/kernels_dec05.md);
 * - a panel is one sequential stream (the threads take contiguous runs of 16-feature units): at batch 1 that read
 *   is the whole cost;
 * - it is the AMX tiles' B layout: 16 steps of a 16-feature unit are 16 rows of 64 bytes at a stride of 128.
 * The dot products: AMX tiles where the CPU has them and Linux grants the tile state (detected at run time;
 * compiled where the compiler knows the instructions), else AVX-512 VNNI (vpdpbusd: unsigned times signed bytes,
 * so the activations go in offset by 128 and 128 * wsum[n] comes off the sum; AMX's tdpbusd is the same product,
 * so both give the same integers), else AVX2 (the sign trick: |x| times sign(x) * q, pairs summed in int16 without
 * overflow since 2 * 127 * 127 < 32768), else plain C. Every path computes the exact integer dot product: the
 * results are the same bit for bit. */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include "native.h"
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#define Q8_UNIT 16                     /* features per unit: one lane each, a 64-byte line of each step */
#define Q8_UNITS (Q8_PANEL / Q8_UNIT)  /* units per panel */
#define Q8_STEP_BYTES (Q8_PANEL * 4)   /* one step of a panel: 4 columns of its features */
/* software prefetch of the weight stream, Q8_PREFETCH bytes ahead into L2 (prefetcht1): on the Zen 4 host one row
 * read the default model's 134 MB in 3.5-4.0 ms with it at 8 KB and 4.6-4.9 ms without (the hardware prefetchers
 * alone fall behind a loop that consumes a line every few cycles); 1-2 KB ahead was slower than none (measured:
 * docs/bench/kernels_dec05.md) */
#ifndef Q8_PREFETCH
#define Q8_PREFETCH 4096
#endif
#ifndef Q8_PF_LOC
#define Q8_PF_LOC 2
#endif

static inline int32_t load4(const unsigned char *p) {  /* four activation bytes as one 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- the activations ------------------------------------------------------------------------------------- */
/* a row x[K] as int8 (offset by Q8_OFFSET, zero past K up to kp); returns its scale. The AVX-512 path divides,
 * rounds half to even (vrndscaleps, the default rounding as nearbyintf and torch.round), clamps and converts as the
 * scalar loop does, 16 at a time. */
float mtpflow_quantize_row(const float *x, int K, int kp, unsigned char *xq) {
    float amax = 0.0f;
    int i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 top = _mm512_setzero_ps();
    for (; i + 16 <= K; i += 16) top = _mm512_max_ps(top, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    amax = _mm512_reduce_max_ps(top);
#endif
    for (; i < K; i++) {
        const float a = fabsf(x[i]);
        if (a > amax) amax = a;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    i = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const __m512i offset = _mm512_set1_epi32(Q8_OFFSET);
    for (; i + 16 <= K; i += 16) {
        __m512 v = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), sv),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
        _mm_storeu_si128((__m128i *)(xq + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), offset)));
    }
#endif
    for (; i < K; i++) {
        float v = nearbyintf(x[i] / s);  /* the default rounding mode: half to even, as torch.round */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        xq[i] = (unsigned char)((int)v + Q8_OFFSET);
    }
    if (kp > K) memset(xq + K, Q8_OFFSET, (size_t)(kp - K));
    return s;
}

/* ---- the scales: y[j][i] = ((float)(dot - Q8_OFFSET * wsum[i]) * sx[j]) * scale[i] for i < n -------------- */
static inline void q8_store(const int32_t out[][Q8_PANEL], int mb, int n, const float *sx, const int32_t *wsum,
                            const float *scale, float *y, int ldy) {
    for (int j = 0; j < mb; j++) {
        float *yr = y + (size_t)j * ldy;
        for (int i = 0; i < n; i++) yr[i] = ((float)(out[j][i] - Q8_OFFSET * wsum[i]) * sx[j]) * scale[i];
    }
}

/* ---- one tile: nu units (16 features each) of a panel from w (its first unit's bytes of step 0) times mb rows of
 * xq (kp columns each), scaled into y (row stride ldy; the first n features of the tile exist) ---------------- */
#if defined(Q8_VNNI)
static inline __attribute__((always_inline)) void q8_tile(const unsigned char *xq, int kp, const signed char *w,
                                                          const int nu, const int mb, int n, const float *sx,
                                                          const int32_t *wsum, const float *scale, float *y, int ldy) {
    __m512i acc[Q8_MB][Q8_TILE];
    _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++)
        _Pragma("GCC unroll 4") for (int v = 0; v < nu; v++) acc[j][v] = _mm512_setzero_si512();
    const int steps = kp / 4;
    for (int s = 0; s < steps; s++) {
        const signed char *ws = w + (size_t)s * Q8_STEP_BYTES;
        __m512i wv[Q8_TILE];
#if Q8_PREFETCH
        for (int v = 0; v < nu; v++) __builtin_prefetch(ws + Q8_PREFETCH + Q8_UNIT * 4 * v, 0, Q8_PF_LOC);
#endif
        _Pragma("GCC unroll 4") for (int v = 0; v < nu; v++) wv[v] = _mm512_loadu_si512((const void *)(ws + Q8_UNIT * 4 * v));
        _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++) {
            const __m512i xb = _mm512_set1_epi32(load4(xq + (size_t)j * kp + 4 * s));
            _Pragma("GCC unroll 4") for (int v = 0; v < nu; v++) acc[j][v] = _mm512_dpbusd_epi32(acc[j][v], xb, wv[v]);
        }
    }
    _Pragma("GCC unroll 4") for (int v = 0; v < nu; v++) {  /* the scales 16 features at a time, from registers */
        const int left = n - Q8_UNIT * v;
        if (left <= 0) break;
        const __mmask16 mask = left >= Q8_UNIT ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
        const __m512i off = _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, wsum + Q8_UNIT * v), 7);  /* 128 wsum */
        const __m512 sc = _mm512_maskz_loadu_ps(mask, scale + Q8_UNIT * v);
        _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++) {
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[j][v], off));
            _mm512_mask_storeu_ps(y + (size_t)j * ldy + Q8_UNIT * v, mask,
                                  _mm512_mul_ps(_mm512_mul_ps(dot, _mm512_set1_ps(sx[j])), sc));
        }
    }
}
#elif defined(Q8_AVX2)
#define Q8_CHUNK 64  /* steps per chunk of q8_rows: 64 x 128 bytes of a whole panel */
#define Q8_GROUP 32  /* rows whose sums a pass of q8_rows keeps; more rows take another pass over the panel */

/* mb <= Q8_MB rows times nu units over the steps [s0, s1) of a panel from w (its first unit's bytes of step 0), added
 * into sums[mb][2 nu] (two 8-lane vectors per unit); prefetch: also prefetch the weights Q8_PREFETCH bytes ahead */
static inline __attribute__((always_inline)) void q8_chunk(const unsigned char *xq, int kp, const signed char *w,
                                                           int s0, int s1, const int nu, const int mb,
                                                           __m256i sums[][2 * Q8_TILE], int prefetch) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[Q8_MB][2 * Q8_TILE];
    for (int j = 0; j < mb; j++)
        for (int v = 0; v < 2 * nu; v++) acc[j][v] = sums[j][v];
    for (int s = s0; s < s1; s++) {
        const signed char *ws = w + (size_t)s * Q8_STEP_BYTES;
        __m256i wv[2 * Q8_TILE];
        if (prefetch)
            for (int v = 0; v < nu; v++) __builtin_prefetch(ws + Q8_PREFETCH + Q8_UNIT * 4 * v, 0, Q8_PF_LOC);
        for (int v = 0; v < 2 * nu; v++) wv[v] = _mm256_loadu_si256((const __m256i *)(ws + 32 * v));
        for (int j = 0; j < mb; j++) {
            const __m256i xb = _mm256_set1_epi32(load4(xq + (size_t)j * kp + 4 * s));
            const __m256i ax = _mm256_sign_epi8(xb, xb);
            for (int v = 0; v < 2 * nu; v++) {
                const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[v], xb));
                acc[j][v] = _mm256_add_epi32(acc[j][v], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int j = 0; j < mb; j++)
        for (int v = 0; v < 2 * nu; v++) sums[j][v] = acc[j][v];
}

/* the scales of mb rows' sums (sums[mb][2 nu]) into y (row stride ldy; the first n features of the units exist) */
static inline void q8_finish(__m256i sums[][2 * Q8_TILE], int nu, int mb, int n, const float *sx, const int32_t *wsum,
                             const float *scale, float *y, int ldy) {
    int32_t out[Q8_GROUP][Q8_PANEL];
    for (int j = 0; j < mb; j++)
        for (int v = 0; v < 2 * nu; v++) _mm256_storeu_si256((__m256i *)&out[j][8 * v], sums[j][v]);
    q8_store(out, mb, n < Q8_UNIT * nu ? n : Q8_UNIT * nu, sx, wsum, scale, y, ldy);
}

static inline __attribute__((always_inline)) void q8_tile(const unsigned char *xq, int kp, const signed char *w,
                                                          const int nu, const int mb, int n, const float *sx,
                                                          const int32_t *wsum, const float *scale, float *y, int ldy) {
    __m256i sums[Q8_MB][2 * Q8_TILE];
    for (int j = 0; j < mb; j++)
        for (int v = 0; v < 2 * nu; v++) sums[j][v] = _mm256_setzero_si256();
    q8_chunk(xq, kp, w, 0, kp / 4, nu, mb, sums, 0);
    q8_finish(sums, nu, mb, n, sx, wsum, scale, y, ldy);
}

/* nu units of a panel from w times M > Q8_MB rows of xq, scaled into y (row stride ldy; the first n features of the
 * panel's units exist). More rows than a tile holds (Q8_MB = 2 here) go through the panel together, Q8_CHUNK steps
 * at a time, each pair's sums kept in memory between chunks. A chunk (8 KB of a whole panel) stays in L1 while every
 * pair reads it, so the weights stream from memory once, at an even pace, while the pairs compute: a pass per pair
 * over the whole panel left memory idle in every pass but the first, so a third row cost far more than a second
 * (measured: docs/bench/verify_avx2_dec07.md). The first pair prefetches Q8_PREFETCH bytes ahead into L2. The sums are
 * exact integers: the results do not change. */
static void q8_rows(const unsigned char *xq, int kp, const signed char *w, int nu, int M, int n, const float *sx,
                    const int32_t *wsum, const float *scale, float *y, int ldy) {
    const int steps = kp / 4;
    for (int g0 = 0; g0 < M; g0 += Q8_GROUP) {
        const int gm = M - g0 < Q8_GROUP ? M - g0 : Q8_GROUP;
        const unsigned char *xg = xq + (size_t)g0 * kp;
        __m256i sums[Q8_GROUP][2 * Q8_TILE];
        for (int j = 0; j < gm; j++)
            for (int v = 0; v < 2 * Q8_TILE; v++) sums[j][v] = _mm256_setzero_si256();
        for (int s0 = 0; s0 < steps; s0 += Q8_CHUNK) {
            const int s1 = steps - s0 < Q8_CHUNK ? steps : s0 + Q8_CHUNK;
            for (int m0 = 0; m0 < gm; m0 += Q8_MB) {
                const unsigned char *xr = xg + (size_t)m0 * kp;
                const int pair = gm - m0 >= 2, first = m0 == 0;
                if (nu == 2) {
                    if (pair) q8_chunk(xr, kp, w, s0, s1, 2, 2, sums + m0, first);
                    else q8_chunk(xr, kp, w, s0, s1, 2, 1, sums + m0, first);
                } else {
                    if (pair) q8_chunk(xr, kp, w, s0, s1, 1, 2, sums + m0, first);
                    else q8_chunk(xr, kp, w, s0, s1, 1, 1, sums + m0, first);
                }
            }
        }
        q8_finish(sums, nu, gm, n, sx + g0, wsum, scale, y + (size_t)g0 * ldy, ldy);
    }
}
#else
static inline void q8_tile(const unsigned char *xq, int kp, const signed char *w, const int nu, const int mb, int n,
                           const float *sx, const int32_t *wsum, const float *scale, float *y, int ldy) {
    int32_t out[Q8_MB][Q8_PANEL];
    const int features = Q8_UNIT * nu;
    for (int j = 0; j < mb; j++) {
        const signed char *xr = (const signed char *)xq + (size_t)j * kp;
        for (int f = 0; f < features; f++) {
            int32_t acc = 0;
            for (int k = 0; k < kp; k++) acc += (int32_t)xr[k] * w[(size_t)(k / 4) * Q8_STEP_BYTES + 4 * f + k % 4];
            out[j][f] = acc;
        }
    }
    q8_store(out, mb, n < features ? n : features, sx, wsum, scale, y, ldy);
}
#endif

/* ---- AMX: the same products on the tile unit ---------------------------------------------------------------
 * tdpbusd multiplies unsigned bytes of A by signed bytes of B, four at a time, into int32: with A the offset
 * activations (rows x 64 columns, a row stride of kp) and B 16 steps of one unit of a panel (16 rows of 64 bytes,
 * a stride of 128: the packed layout as it is) it adds exactly the integers vpdpbusd adds, so the results are the
 * VNNI path's bit for bit. Compiled where the compiler knows the instructions (GCC 11, clang 12 on); used where
 * the CPU has AMX-TILE and AMX-INT8 and Linux grants this process the tile data state
 * (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), Linux 5.16 on), unless MTPFLOW_AMX=0. Tiles: tmm0-3 the
 * int32 sums of the panel's units, tmm4 the activations, tmm5-7 the weights; up to 16 rows per pass. */
#if defined(Q8_VNNI) && defined(__x86_64__) && !defined(MTPFLOW_NO_AMX) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define Q8_AMX 1
#include <cpuid.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#define AMX_ROWS 16
#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state = 0;  /* 1: AMX in use; 0: not (no such CPU, no permission, or switched off) */
static pthread_once_t amx_once = PTHREAD_ONCE_INIT;

static void amx_detect(void) {
    unsigned a, b, c, d;
    const char *env = getenv("MTPFLOW_AMX");
    if (env && env[0] == '0') return;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 25))) return;  /* TILE, INT8 */
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) != 0 || !(granted & (1ul << XFEATURE_XTILEDATA))) return;
    __atomic_store_n(&amx_state, 1, __ATOMIC_RELEASE);
}

static int amx_on(void) {
    pthread_once(&amx_once, amx_detect);
    return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
}

struct amx_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

__attribute__((target("amx-tile,amx-int8"))) static void amx_configure(int mb) {
    struct amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 5; t++) { cfg.rows[t] = (uint8_t)mb; cfg.colsb[t] = 64; }  /* sums, activations */
    for (int t = 5; t < 8; t++) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }           /* weights */
    _tile_loadconfig(&cfg);
}

/* nu units from w times mb <= 16 rows (the tiles configured for mb rows), scaled into y */
__attribute__((target("amx-tile,amx-int8"))) static void amx_tile(const unsigned char *xq, int kp,
                                                                   const signed char *w, int nu, int mb, int n,
                                                                   const float *sx, const int32_t *wsum,
                                                                   const float *scale, float *y, int ldy) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int k = 0; k < kp; k += 64) {  /* 64 columns: 16 steps */
        const signed char *wk = w + (size_t)(k / 4) * Q8_STEP_BYTES;
        _tile_loadd(4, xq + k, kp);
        _tile_loadd(5, wk, Q8_STEP_BYTES);
        _tile_dpbusd(0, 4, 5);
        if (nu > 1) { _tile_loadd(6, wk + 64, Q8_STEP_BYTES); _tile_dpbusd(1, 4, 6); }
#if Q8_UNITS > 2
        if (nu > 2) { _tile_loadd(7, wk + 128, Q8_STEP_BYTES); _tile_dpbusd(2, 4, 7); }
        if (nu > 3) { _tile_loadd(5, wk + 192, Q8_STEP_BYTES); _tile_dpbusd(3, 4, 5); }
#endif
    }
    int32_t out[AMX_ROWS][Q8_PANEL];
    _tile_stored(0, &out[0][0], Q8_PANEL * 4);
    if (nu > 1) _tile_stored(1, &out[0][16], Q8_PANEL * 4);
#if Q8_UNITS > 2
    if (nu > 2) _tile_stored(2, &out[0][32], Q8_PANEL * 4);
    if (nu > 3) _tile_stored(3, &out[0][48], Q8_PANEL * 4);
#endif
    q8_store(out, mb, n < Q8_UNIT * nu ? n : Q8_UNIT * nu, sx, wsum, scale, y, ldy);
}

/* thread t of nt's share on the tiles (mtpflow_q8_part's split) */
__attribute__((target("amx-tile,amx-int8"))) static void amx_part(int u0, int u1, const unsigned char *xq,
                                                                   const float *sx, int M, const signed char *q,
                                                                   const float *scale, const int32_t *wsum, int N,
                                                                   int kp, float *y) {
    int configured = 0;
    for (int u = u0; u < u1;) {
        const int p = u / Q8_UNITS, o = u % Q8_UNITS;
        const int nu = Q8_UNITS - o < u1 - u ? Q8_UNITS - o : u1 - u;
        const signed char *w = q + (size_t)p * kp * Q8_PANEL + (size_t)o * Q8_UNIT * 4;
        const int n0 = u * Q8_UNIT;
        for (int m0 = 0; m0 < M; m0 += AMX_ROWS) {
            const int mb = M - m0 < AMX_ROWS ? M - m0 : AMX_ROWS;
            if (mb != configured) { amx_configure(mb); configured = mb; }
            amx_tile(xq + (size_t)m0 * kp, kp, w, nu, mb, N - n0, sx + m0, wsum + n0, scale + n0,
                     y + (size_t)m0 * N + n0, N);
        }
        u += nu;
    }
    if (configured) _tile_release();
}
#endif

/* 1 when this process runs the int8 products on AMX tiles (then switches them on or off: on = 0 off, 1 on where
 * the CPU and Linux allow it, -1 only asks); the tests compare both paths on AMX hosts */
int mtpflow_q8_amx(int on) {
#if defined(Q8_AMX)
    const int have = amx_on();  /* runs the detection once */
    if (on == 0) __atomic_store_n(&amx_state, 0, __ATOMIC_RELEASE);
    if (on == 1 && !have) {     /* switched off before: detect again, ignoring MTPFLOW_AMX */
        unsigned a, b, c, d;
        unsigned long granted = 0;
        if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25)) &&
            syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 &&
            syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &granted) == 0 && (granted & (1ul << XFEATURE_XTILEDATA)))
            __atomic_store_n(&amx_state, 1, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
#else
    (void)on;
    return 0;
#endif
}

/* 1 where this build contains the AMX path (whether the CPU runs it is mtpflow_q8_amx's answer) */
int mtpflow_q8_amx_built(void) {
#if defined(Q8_AMX)
    return 1;
#else
    return 0;
#endif
}

/* the tile for nu units and mb rows, each a constant after inlining */
#define Q8_TILE_CALL(NU, MB) q8_tile(xr, kp, w, NU, MB, N - n0, sx + m0, wsum + n0, scale + n0, yr, N)
#define Q8_CASE(NU, MB) case MB: Q8_TILE_CALL(NU, MB); break;
#if Q8_MB == 12
#define Q8_ROW_CASES(NU) Q8_CASE(NU, 12) Q8_CASE(NU, 11) Q8_CASE(NU, 10) Q8_CASE(NU, 9) Q8_CASE(NU, 8) \
    Q8_CASE(NU, 7) Q8_CASE(NU, 6) Q8_CASE(NU, 5) Q8_CASE(NU, 4) Q8_CASE(NU, 3)
#elif Q8_MB == 6
#define Q8_ROW_CASES(NU) Q8_CASE(NU, 6) Q8_CASE(NU, 5) Q8_CASE(NU, 4) Q8_CASE(NU, 3)
#else
#define Q8_ROW_CASES(NU)
#endif
#define Q8_ROWS(NU)                               \
    switch (mb) {                                 \
        Q8_ROW_CASES(NU)                          \
        Q8_CASE(NU, 2)                            \
        default: Q8_TILE_CALL(NU, 1); break;      \
    }

/* thread t of nt's share of the product: y[m][n] = ((float)dot(xq[m], q[n]) * sx[m]) * scale[n] for rows m of xq
 * (quantized, kp columns each) and the N outputs of q (packed: products.pack_q8). The threads split the 16-feature
 * units evenly, each a contiguous run (a panel at a seam is read in part by each of two threads); each of its
 * tiles takes up to Q8_TILE units of one panel, and the rows Q8_MB at a time. */
void mtpflow_q8_part(int t, int nt, const unsigned char *xq, const float *sx, int M, const signed char *q,
                     const float *scale, const int32_t *wsum, int N, int kp, float *y) {
    const int units = (N + Q8_UNIT - 1) / Q8_UNIT;
    const int u0 = (int)((long)units * t / nt), u1 = (int)((long)units * (t + 1) / nt);
#if defined(Q8_AMX)
    if (M > 1 && amx_on()) {  /* one row takes the vector units: a 16-row tile product for 1 row wastes 15 */
        amx_part(u0, u1, xq, sx, M, q, scale, wsum, N, kp, y);
        return;
    }
#endif
    for (int u = u0; u < u1;) {
        const int p = u / Q8_UNITS, o = u % Q8_UNITS;
        const int room = Q8_TILE < Q8_UNITS - o ? Q8_TILE : Q8_UNITS - o;
        const int nu = room < u1 - u ? room : u1 - u;
        const signed char *w = q + (size_t)p * kp * Q8_PANEL + (size_t)o * Q8_UNIT * 4;
        const int n0 = u * Q8_UNIT;
#if defined(Q8_AVX2)
        if (M > Q8_MB) {
            q8_rows(xq, kp, w, nu, M, N - n0, sx, wsum + n0, scale + n0, y + n0, N);
            u += nu;
            continue;
        }
#endif
        for (int m0 = 0; m0 < M; m0 += Q8_MB) {
            const int mb = M - m0 < Q8_MB ? M - m0 : Q8_MB;
            const unsigned char *xr = xq + (size_t)m0 * kp;
            float *yr = y + (size_t)m0 * N + n0;
            switch (nu) {
#if Q8_TILE >= 4
                case 4: Q8_ROWS(4) break;
                case 3: Q8_ROWS(3) break;
#endif
                case 2: Q8_ROWS(2) break;
                default: Q8_ROWS(1) break;
            }
        }
        u += nu;
    }
}

/* x: M x K float, q: the packed int8 weight (N rows, kp columns), scale: N, wsum: N, y: M x N. 0, or -1 when out of
 * memory. */
HIDDEN int mtpflow_gemm_w8a8(const float *x, const signed char *q, const float *scale, const int32_t *wsum, float *y,
                             int M, int N, int K, int kp, int threads) {
    unsigned char *xq = malloc((size_t)M * kp + (size_t)M * sizeof(float));
    if (!xq) return -1;
    float *sx = (float *)(xq + (size_t)M * kp);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
    for (int m = 0; m < M; m++) sx[m] = mtpflow_quantize_row(x + (size_t)m * K, K, kp, xq + (size_t)m * kp);
#pragma omp parallel num_threads(threads)
    mtpflow_q8_part(omp_get_thread_num(), omp_get_num_threads(), xq, sx, M, q, scale, wsum, N, kp, y);
    free(xq);
    return 0;
}

/* what computes the int8 model's dot products: 3 AMX tiles (rows > 1; one row on VNNI), 1 AVX-512 VNNI, 2 AVX2,
 * 0 plain C (the run's describe line names it) */
int mtpflow_q8_isa(void) {
#if defined(Q8_AMX)
    if (amx_on()) return 3;
#endif
#if defined(Q8_VNNI)
    return 1;
#elif defined(Q8_AVX2)
    return 2;
#else
    return 0;
#endif
}
