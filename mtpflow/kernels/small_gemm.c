/* Small-batch float32 linear for CPU verify forwards: y[m][n] = sum_k x[m][k] * w[n][k] (+ b[n]).
 *
 * A verify forward multiplies 1 + K rows (K draft nodes, a handful) by every weight matrix of the model.
 * Reading the weights from memory is the whole cost, so the kernel reads each weight row once for all
 * input rows: blocks of 4 weight rows x up to 6 input rows keep 24 vector accumulators in registers while
 * the 4 weight rows stream past, and the next block's weight rows are prefetched while this one computes,
 * so memory and arithmetic overlap (mtpflow_small_gemm). As rows grow the arithmetic starts to show, and
 * from PANEL_MIN_ROWS rows mtpflow_panel_gemm takes over: the weight is re-laid once into panels of 64 output
 * features x K (panel[k][0..63]), so each step of k loads 4 vectors of weights and broadcasts one input value
 * per row into 4 x 6 accumulators with no horizontal sums, while one sequential stream per panel is prefetched
 * 4 KB ahead. Weight blocks and panels are split across OpenMP threads (torch's own OpenMP
 * runtime: torch has loaded libgomp.so.1 before this library is opened).
 *
 * The caller starts the panels at PANEL_MIN_ROWS rows (read by native_linear.panel_min_rows): 1 on AVX-512
 * builds, where the panels' sequential streams beat the row blocks at every row count; 3 on AVX2 builds, where
 * 1-2 rows instead read one weight row at a time (one sequential stream per thread); the reasons are at the
 * constants below (measured: docs/bench/code-figures.md#small_gemm-panel_min_rows).
 *
 * Portable C with GCC vector extensions: 16-float vectors where the compiler targets AVX-512, else 8-float
 * ones (AVX2) with fewer input rows per block, since AVX2 has 16 vector registers, not 32 (64-byte vectors
 * without AVX-512 compile to scalar code, many times slower; measured: docs/bench/code-figures.md#small_gemm-header).
 * The pure-torch reference is F.linear; mtpflow/kernels/native_linear.py compiles, loads and tests this file.
 * Summation order differs from MKL's (differences around 1e-6 relative).
 *
 * mtpflow_small_gemm_q8 is the row kernel over int8 weights with one float scale per output feature
 * (y[m][n] = scale[n] * sum_k x[m][k] * q[n][k] (+ b[n])): a quarter of the bytes to read, each 16 (or 8)
 * int8 weights widened to floats in registers; every row count takes it (there is no int8 panel kernel).
 */
#include <stddef.h>

#if defined(__AVX512F__)
#define VW 16     /* floats per vector */
#define MB_MAX 6  /* input rows per block: 4 x 6 accumulators + 4 weight vectors + 1 input vector <= 32 registers */
#define PANEL_MB 6
/* the panels from one row on AVX-512 builds: their sequential weight streams beat the 4 x 6 row blocks at every
 * row count measured, in the products alone (each layer's weights streamed from memory) and in whole verify
 * forwards (measured: docs/bench/code-figures.md#small_gemm-panel_min_rows) */
#define PANEL_MIN_ROWS 1
#else
#define VW 8
#define MB_MAX 2  /* 4 x 2 accumulators + 4 + 1 <= 16 registers */
/* panel kernel: 3 rows x 4 vectors (12 accumulators; the panel's vectors partly as memory operands): faster than
 * 2 rows per block from 3 to 9 rows and level at 16 (measured: docs/bench/code-figures.md#small_gemm-panel_mb) */
#define PANEL_MB 3
/* from 3 rows the panels beat the 4 x 2 blocks in whole verify steps (below 3 rows the one-row kernel is faster;
 * measured: docs/bench/code-figures.md#small_gemm-panel_min_rows) */
#define PANEL_MIN_ROWS 3
#endif
#define NB 4      /* weight rows per block (row kernel), vectors per column group (panel kernel) */

typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vec_u __attribute__((vector_size(VW * 4), aligned(4), may_alias)); /* unaligned access */

static inline vec loadv(const float *p) { return *(const vec_u *)p; }

static inline void storev(float *p, vec v) { *(vec_u *)p = v; }

static inline float sumv(vec v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

int mtpflow_vector_width(void) { return VW; }

/* from how many rows callers that hold panels should call mtpflow_panel_gemm (native_linear.panel_min_rows) */
int mtpflow_panel_min_rows(void) { return PANEL_MIN_ROWS; }

/* ---- int8 weights (mtpflow_small_gemm_q8): VW of them widened to floats per load ---------------------- */
typedef signed char qvec_u __attribute__((vector_size(VW), aligned(1), may_alias));

/* widen VW int8 weights to floats: GCC 12 scalarizes __builtin_convertvector from char vectors (one
 * vcvtsi2ss per weight, slower than the float kernel; measured: docs/bench/code-figures.md#small_gemm-loadq),
 * so x86 takes the sign-extend + convert instructions */
#if defined(__AVX512F__)
#include <immintrin.h>
static inline vec loadq(const signed char *p) {
    return (vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#elif defined(__AVX2__)
#include <immintrin.h>
static inline vec loadq(const signed char *p) {
    return (vec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#else
static inline vec loadq(const signed char *p) { return __builtin_convertvector(*(const qvec_u *)p, vec); }
#endif

/* ---- row kernel: nb weight rows from n0 times mb input rows from m0 (compile-time nb, mb and q8 after
 * inlining): float weights w, or (q8) int8 weights wq with one float scale per output feature */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const signed char *wq,
                                                        const float *scale, const float *b, float *y, int N, int K,
                                                        int n0, int m0, const int nb, const int mb, const int q8) {
    const int kv = K - K % VW;
    vec acc[NB][MB_MAX];
    const float *wr[NB], *xr[MB_MAX];
    const signed char *qr[NB];
    for (int i = 0; i < nb; i++) {
        if (q8) qr[i] = wq + (size_t)(n0 + i) * K;
        else wr[i] = w + (size_t)(n0 + i) * K;
    }
    for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = (vec){0};
    for (int k = 0; k < kv; k += VW) {
        vec wv[NB];
        for (int i = 0; i < nb; i++) {
            if (q8) {  /* the next block's row, same column: one cache line per 64 int8 weights */
                if (k % 64 == 0) __builtin_prefetch(qr[i] + (size_t)NB * K + k);
                wv[i] = loadq(qr[i] + k);
            } else {
                __builtin_prefetch(wr[i] + (size_t)NB * K + k);
                wv[i] = loadv(wr[i] + k);
            }
        }
        for (int j = 0; j < mb; j++) {
            vec xv = loadv(xr[j] + k);
            for (int i = 0; i < nb; i++) acc[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float s = sumv(acc[i][j]);
            for (int k = kv; k < K; k++) s += (q8 ? (float)qr[i][k] : wr[i][k]) * xr[j][k];
            if (q8) s *= scale[n0 + i];
            y[(size_t)(m0 + j) * N + n0 + i] = b ? s + b[n0 + i] : s;
        }
}

#define BLOCK(nb, mb, q8) block(x, w, wq, scale, b, y, N, K, n0, m0, nb, mb, q8)
#if MB_MAX == 6
#define ROW_CASES(nb, q8)                                               \
    case 6: BLOCK(nb, 6, q8); break;                                    \
    case 5: BLOCK(nb, 5, q8); break;                                    \
    case 4: BLOCK(nb, 4, q8); break;                                    \
    case 3: BLOCK(nb, 3, q8); break;
#else
#define ROW_CASES(nb, q8)
#endif
#define ROWS(nb, q8)                                                    \
    for (int m0 = 0; m0 < M; m0 += MB_MAX) {                            \
        switch (M - m0 < MB_MAX ? M - m0 : MB_MAX) {                    \
            ROW_CASES(nb, q8)                                           \
            case 2: BLOCK(nb, 2, q8); break;                            \
            default: BLOCK(nb, 1, q8); break;                           \
        }                                                               \
    }
#define WEIGHT_BLOCKS(q8)                                               \
    for (int n0 = 0; n0 < N; n0 += NB) {                                \
        switch (N - n0 < NB ? N - n0 : NB) {                            \
            case 4: ROWS(4, q8) break;                                  \
            case 3: ROWS(3, q8) break;                                  \
            case 2: ROWS(2, q8) break;                                  \
            default: ROWS(1, q8) break;                                 \
        }                                                               \
    }

#if VW == 8
/* ---- one weight row at a time for 1 or 2 (ONE_ROW_MAX) input rows (AVX2 builds): the weight is read as one
 * sequential stream per thread, which the hardware prefetchers follow better than the 4 strided rows of a
 * block: faster than the 4 x 2 blocks for one and two rows, the LM head included; slower for three rows (more
 * streams of input rows than the loop hides), and from 3 rows the panel kernel is faster still (PANEL_MIN_ROWS;
 * measured: docs/bench/code-figures.md#small_gemm-one_row_max). AVX-512 builds take the panels from one row
 * (PANEL_MIN_ROWS above). */
#define ONE_ROW_MAX 2
#if defined(__FMA__) && defined(__AVX2__)  /* immintrin.h is included above for AVX2 */
static inline vec fmadd(vec a, vec b, vec c) { return (vec)_mm256_fmadd_ps((__m256)b, (__m256)c, (__m256)a); }
#else
static inline vec fmadd(vec a, vec b, vec c) { return a + b * c; }
#endif
/* two accumulators per input row (even and odd vectors of k): with one chain of fused multiply-adds per row each
 * waits on the previous one's latency every 8 floats, and a plain verify step was slower that way (measured:
 * docs/bench/code-figures.md#small_gemm-one_row-two-chains) */
static inline __attribute__((always_inline)) void one_row(const float *x, const float *w, const float *b, float *y,
                                                          int N, int K, int n, const int mb) {
    const int k2 = K - K % (2 * VW), kv = K - K % VW;
    const float *wr = w + (size_t)n * K;
    vec even[ONE_ROW_MAX], odd[ONE_ROW_MAX];
    for (int j = 0; j < mb; j++) even[j] = odd[j] = (vec){0};
    for (int k = 0; k < k2; k += 2 * VW) {
        const vec w0 = loadv(wr + k), w1 = loadv(wr + k + VW);
        for (int j = 0; j < mb; j++) {
            even[j] = fmadd(even[j], w0, loadv(x + (size_t)j * K + k));
            odd[j] = fmadd(odd[j], w1, loadv(x + (size_t)j * K + k + VW));
        }
    }
    if (kv > k2)
        for (int j = 0; j < mb; j++) even[j] = fmadd(even[j], loadv(wr + k2), loadv(x + (size_t)j * K + k2));
    for (int j = 0; j < mb; j++) {
        float s = sumv(even[j] + odd[j]);
        for (int k = kv; k < K; k++) s += wr[k] * x[(size_t)j * K + k];
        y[(size_t)j * N + n] = b ? s + b[n] : s;
    }
}
#else
#define ONE_ROW_MAX 0
#endif

/* x: M x K, w: N x K, b: N or NULL, y: M x N; all row-major and contiguous */
void mtpflow_small_gemm(const float *x, const float *w, const float *b, float *y, int M, int N, int K,
                        int threads) {
    const signed char *wq = NULL;
    const float *scale = NULL;
#if ONE_ROW_MAX
    if (M <= ONE_ROW_MAX) {
#pragma omp parallel for schedule(static) num_threads(threads)
        for (int n = 0; n < N; n++) {
            switch (M) {
                case 2: one_row(x, w, b, y, N, K, n, 2); break;
                default: one_row(x, w, b, y, N, K, n, 1); break;
            }
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    WEIGHT_BLOCKS(0)
}

/* x: M x K float, wq: N x K int8, scale: N, b: N or NULL, y: M x N */
void mtpflow_small_gemm_q8(const float *x, const signed char *wq, const float *scale, const float *b, float *y,
                           int M, int N, int K, int threads) {
    const float *w = NULL;
#pragma omp parallel for schedule(static) num_threads(threads)
    WEIGHT_BLOCKS(1)
}

/* ---- panel layout: panels[p][k][j] = w[p * PANEL + j][k] (zero past N), built by native_linear.pack_panels */
#define PANEL 64
#define GROUP (NB * VW)            /* columns of a panel one pass accumulates: 64 (AVX-512) or 32 */
#define PANEL_PREFETCH 1024        /* floats ahead in the panel's stream */

static inline __attribute__((always_inline)) void panel_block(const float *x, const float *panel, const float *b,
                                                              float *y, int N, int K, int n0, int m0, const int mb) {
    const float *xr[PANEL_MB];
    for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    for (int g = 0; g < PANEL; g += GROUP) {
        vec acc[PANEL_MB][NB];
        for (int j = 0; j < mb; j++)
            for (int v = 0; v < NB; v++) acc[j][v] = (vec){0};
        for (int k = 0; k < K; k++) {
            const float *pk = panel + (size_t)k * PANEL;
            if (g == 0)
                for (int c = 0; c < PANEL; c += 16) __builtin_prefetch(pk + PANEL_PREFETCH + c);
            vec pv[NB];
            for (int v = 0; v < NB; v++) pv[v] = loadv(pk + g + VW * v);
            for (int j = 0; j < mb; j++) {
                const float xs = xr[j][k];
                for (int v = 0; v < NB; v++) acc[j][v] += pv[v] * xs;
            }
        }
        const int nv = N - n0 - g < GROUP ? N - n0 - g : GROUP;
        for (int j = 0; j < mb && nv > 0; j++) {
            float out[GROUP];
            for (int v = 0; v < NB; v++) storev(out + VW * v, acc[j][v]);
            float *yr = y + (size_t)(m0 + j) * N + n0 + g;
            for (int i = 0; i < nv; i++) yr[i] = b ? out[i] + b[n0 + g + i] : out[i];
        }
    }
}

#if PANEL_MB == 6
#define PANEL_CASES                                                             \
    case 6: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 6); break;         \
    case 5: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 5); break;         \
    case 4: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 4); break;         \
    case 3: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 3); break;
#else
#define PANEL_CASES                                                             \
    case 3: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 3); break;
#endif

/* x: M x K, panels: ceil(N / 64) x K x 64, b: N or NULL, y: M x N */
/* The threads split the (panel, row block) pairs in panel order, each thread a contiguous run: where the panels
 * split evenly between the threads this is a split of the panels; where they do not (576 outputs: 9 panels for 2
 * threads) the panel at the seam is shared, so no thread idles for a panel's worth of rows (the second read of
 * that panel mostly from the shared L3). Each output comes from the same block either way: the same numbers. */
void mtpflow_panel_gemm(const float *x, const float *panels, const float *b, float *y, int M, int N, int K,
                        int threads) {
    const int np = (N + PANEL - 1) / PANEL, nb = (M + PANEL_MB - 1) / PANEL_MB;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int u = 0; u < np * nb; u++) {
        const int p = u / nb, m0 = (u % nb) * PANEL_MB;
        const float *panel = panels + (size_t)p * K * PANEL;
        switch (M - m0 < PANEL_MB ? M - m0 : PANEL_MB) {
            PANEL_CASES
            case 2: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 2); break;
            default: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 1); break;
        }
    }
}

/* From here to the end of the file no multiply and add is fused into one rounding (GCC's optimize pragma, clang's
 * fp contract): every float operation between the products rounds as the same operation in torch does, so the int8
 * model's forward (mtpflow_w8a8_rows, below) computes exactly what its torch reference
 * (mtpflow/kernels/int8_reference.py) computes, operation for operation. The products above keep their fused
 * multiply-adds. */
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
 * mtpflow/forward.py (native_rows) calls it (through native_linear.llama_rows, which fills struct
 * mtpflow_rows_args below) and checks when it may; native_reference.llama_rows_reference is its pure-torch
 * reference. The names below are the struct's members.
 *
 * M rows of several sequences: row r belongs to the sequence in pool slot slot[r], writes its key and value at
 * wpos[r] of that slot's row, and attends to the slot's first prefix[r] entries plus those of its own
 * sequence's new entries (rows first[r] .. first[r] + count[r] - 1, written at prefix[r] + 0, 1, ...) that
 * allowed[r * qmax + j] marks (a tree: the root, its ancestors, itself). h: [M][H] the tokens' embeddings in,
 * the last layer's output out; normed: [M][H] its final norm. Per layer l (arrays of L pointers): ln1/ln2 [H]
 * norm weights, wqkv [(nh + 2 nkv) d x H], wo [H x nh d], wgu [2 I x H] (gate rows, then up rows), wd [H x I];
 * pqkv, po, pgu, pd their panel copies (native_linear.pack_panels), or NULL for the row kernel (the caller
 * passes them from native_linear.panel_min_rows() rows, as the native linear does); kc, vc the whole key / value buffer,
 * [slots][nkv][cap][d]. cos, sin: [M][d] at each row's position. */
#include <math.h>
#include <stdlib.h>

static void rmsnorm(const float *x, const float *w, float eps, float *out, int H) {
    double ss = 0.0;
    for (int i = 0; i < H; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / H) + eps);
    for (int i = 0; i < H; i++) out[i] = w[i] * (x[i] * r);
}

static void rotary(float *v, const float *cos, const float *sin, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

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
 * meaning) raises MTPFLOW_ROWS_ABI; mtpflow/kernels/native_linear.py mirrors the struct once (RowsArgs) and
 * refuses to load a build whose mtpflow_rows_abi() or mtpflow_rows_args_size() differ from the mirror's. */
#define MTPFLOW_ROWS_ABI 1
#define MTPFLOW_ROWS_BAD_ABI (-2)  /* what mtpflow_llama_rows returns for a struct of another version or size */

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

/* ==== The int8 model (model.quantize=int8): int8 weights, int8 activations, integer dot products ===========
 *
 * Its numerics are defined once, by the torch reference mtpflow/kernels/int8_reference.py; this is the fast
 * implementation of the same arithmetic.
 * - Weights: int8 q[n][k] with one float scale per output feature (symmetric, |q| <= 127), each row padded with
 *   zeros to kp = a multiple of 64 columns (Q8_STEP), and wsum[n] = sum_k q[n][k]; laid out in blocks of Q8_NB rows
 *   (zero rows past N), each block [kp / 64][Q8_NB][64], so that the threads read the weights as sequential
 *   streams: at batch 1 that read is the whole cost (four rows at a time in row-major order read at about a
 *   third of the packed layout's rate; measured: docs/bench/int8_dec05.md#kernel-figures).
 * - Activations: each row of a product's input quantized on its own: s = max|x| / 127 (1 for a row of zeros),
 *   xq = round-half-even(x / s) clamped to +-127. A row's result never depends on the other rows in the call,
 *   so a batched verify gives exactly what its rows give one at a time.
 * - The dot product is exact in int32 (|x q| <= 127 * 127 per term); y = ((float)dot * s_row) * scale[n].
 * - Between the products: RMSNorm with the sum of squares in double, rotary, attention whose scores, softmax
 *   sum and weighted values are summed in double and rounded once to float, exponentials by vexp (both in the
 *   attention and in SiLU), each other operation one float rounding in the reference's order.
 * The dot products: AVX-512 VNNI (vpdpbusd: unsigned times signed bytes, so the activations go in offset by 128
 * and 128 * wsum[n] comes off the sum), else AVX2 (the sign trick: |x| times sign(x) * q, pairs summed in int16
 * without overflow since 2 * 127 * 127 < 32768), else plain C. */
#include <stdint.h>

#define Q8_STEP 64  /* columns per step of the int8 dot products; kp is a multiple of it */
#define Q8_NB 4     /* weight rows per block (native_linear.Q8_NB) */
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI 1
#define Q8_OFFSET 128
#define Q8_MB 6     /* 4 x 6 accumulators + 4 weight vectors + 1 input vector <= 32 registers */
#elif defined(__AVX2__)
#define Q8_AVX2 1
#define Q8_OFFSET 0
#define Q8_MB 2
#else
#define Q8_OFFSET 0
#define Q8_MB 2
#endif

/* a row x[K] as int8 (offset by Q8_OFFSET, zero past K up to kp); returns its scale */
static float quantize_row(const float *x, int K, int kp, unsigned char *xq) {
    float amax = 0.0f;
    for (int i = 0; i < K; i++) {
        const float a = fabsf(x[i]);
        if (a > amax) amax = a;
    }
    const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int i = 0; i < K; i++) {
        float v = nearbyintf(x[i] / s);  /* the default rounding mode: half to even, as torch.round */
        v = v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v);
        xq[i] = (unsigned char)((int)v + Q8_OFFSET);
    }
    for (int i = K; i < kp; i++) xq[i] = (unsigned char)Q8_OFFSET;
    return s;
}

/* exact int32 dot products of the Q8_NB weight rows of one packed block (w: [kp / 64][Q8_NB][64]: the rows' 64
 * columns of each step side by side, so a block is read as one sequential stream) with mb quantized rows */
static inline __attribute__((always_inline)) void q8_block(const unsigned char *xq, const signed char *w, int kp,
                                                           const int mb, int32_t out[Q8_NB][Q8_MB]) {
#if defined(Q8_VNNI)
    __m512i acc[Q8_NB][Q8_MB];
    for (int i = 0; i < Q8_NB; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm512_setzero_si512();
    for (int k = 0; k < kp; k += Q8_STEP) {
        const signed char *step = w + (size_t)k * Q8_NB;
        __m512i wv[Q8_NB];
        for (int i = 0; i < Q8_NB; i++) wv[i] = _mm512_loadu_si512((const void *)(step + i * Q8_STEP));
        for (int j = 0; j < mb; j++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + (size_t)j * kp + k));
            for (int i = 0; i < Q8_NB; i++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[i]);
        }
    }
    for (int i = 0; i < Q8_NB; i++)
        for (int j = 0; j < mb; j++) out[i][j] = _mm512_reduce_add_epi32(acc[i][j]);
#elif defined(Q8_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[Q8_NB][Q8_MB];
    for (int i = 0; i < Q8_NB; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = _mm256_setzero_si256();
    for (int k = 0; k < kp; k += 32) {  /* half a step: columns k % 64 .. + 31 of each row */
        const signed char *step = w + (size_t)(k - k % Q8_STEP) * Q8_NB + k % Q8_STEP;
        __m256i wv[Q8_NB];
        for (int i = 0; i < Q8_NB; i++) wv[i] = _mm256_loadu_si256((const __m256i *)(step + i * Q8_STEP));
        for (int j = 0; j < mb; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)j * kp + k));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            for (int i = 0; i < Q8_NB; i++) {
                const __m256i pairs = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv[i], xv));
                acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(pairs, ones));
            }
        }
    }
    for (int i = 0; i < Q8_NB; i++)
        for (int j = 0; j < mb; j++) {
            const __m256i v = acc[i][j];
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
            out[i][j] = _mm_cvtsi128_si32(s);
        }
#else
    for (int i = 0; i < Q8_NB; i++)
        for (int j = 0; j < mb; j++) {
            const signed char *xr = (const signed char *)xq + (size_t)j * kp;
            int32_t s = 0;
            for (int k = 0; k < kp; k++) s += (int32_t)xr[k] * w[(size_t)(k - k % Q8_STEP) * Q8_NB + i * Q8_STEP + k % Q8_STEP];
            out[i][j] = s;
        }
#endif
}

/* y[m][n] = ((float)dot(xq[m], q[n]) * sx[m]) * scale[n] for rows m of xq (quantized, kp columns each) and the
 * N outputs of q, packed in blocks of Q8_NB rows (zero rows past N; native_linear.pack_q8) */
/* thread t of nt's share of the product: y[m][n] = ((float)dot(xq[m], q[n]) * sx[m]) * scale[n] for rows m of xq
 * (quantized, kp columns each) and the N outputs of q, packed in blocks of Q8_NB rows (zero rows past N;
 * native_linear.pack_q8). Each thread takes one contiguous run of blocks: one sequential stream. */
static void q8_part(int t, int nt, const unsigned char *xq, const float *sx, int M, const signed char *q,
                    const float *scale, const int32_t *wsum, int N, int kp, float *y) {
    const int blocks = (N + Q8_NB - 1) / Q8_NB;
    const int b0 = (int)((long)blocks * t / nt), b1 = (int)((long)blocks * (t + 1) / nt);
    for (int b = b0; b < b1; b++) {
        const int n0 = b * Q8_NB, nb = N - n0 < Q8_NB ? N - n0 : Q8_NB;
        const signed char *w = q + (size_t)n0 * kp;
        for (int m0 = 0; m0 < M; m0 += Q8_MB) {
            const int mb = M - m0 < Q8_MB ? M - m0 : Q8_MB;
            int32_t out[Q8_NB][Q8_MB];
            const unsigned char *xr = xq + (size_t)m0 * kp;
            switch (mb) {
#if Q8_MB == 6
                case 6: q8_block(xr, w, kp, 6, out); break;
                case 5: q8_block(xr, w, kp, 5, out); break;
                case 4: q8_block(xr, w, kp, 4, out); break;
                case 3: q8_block(xr, w, kp, 3, out); break;
#endif
                case 2: q8_block(xr, w, kp, 2, out); break;
                default: q8_block(xr, w, kp, 1, out); break;
            }
            for (int i = 0; i < nb; i++)
                for (int j = 0; j < mb; j++) {
                    const int32_t dot = out[i][j] - Q8_OFFSET * wsum[n0 + i];
                    y[(size_t)(m0 + j) * N + n0 + i] = ((float)dot * sx[m0 + j]) * scale[n0 + i];
                }
        }
    }
}

/* x: M x K float, q: the packed int8 weight (N rows, kp columns), scale: N, wsum: N, y: M x N. 0, or -1 when out of
 * memory. */
int mtpflow_gemm_w8a8(const float *x, const signed char *q, const float *scale, const int32_t *wsum, float *y, int M,
                      int N, int K, int kp, int threads) {
    unsigned char *xq = malloc((size_t)M * kp + (size_t)M * sizeof(float));
    if (!xq) return -1;
    float *sx = (float *)(xq + (size_t)M * kp);
#pragma omp parallel for schedule(static) num_threads(threads) if (M >= 4)
    for (int m = 0; m < M; m++) sx[m] = quantize_row(x + (size_t)m * K, K, kp, xq + (size_t)m * kp);
#pragma omp parallel num_threads(threads)
    q8_part(omp_get_thread_num(), omp_get_num_threads(), xq, sx, M, q, scale, wsum, N, kp, y);
    free(xq);
    return 0;
}

/* 1 where the dot products run on AVX-512 VNNI, 2 on AVX2, 0 in plain C (the run's describe line names it) */
int mtpflow_q8_isa(void) {
#if defined(Q8_VNNI)
    return 1;
#elif defined(Q8_AVX2)
    return 2;
#else
    return 0;
#endif
}

/* one query head's attention, the int8 model's way: scores, softmax sum and weighted values summed in double,
 * each rounded once to float (so the order of the sums is immaterial); keys and values [n][d], the first n0 all
 * visible, the rest where own[t - n0]; s: scratch for n scores */
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

/* o[8 lanes] = float(sum_t s[t] v[t]) * inv for head size 8 * lanes (a constant after inlining: every output lane
 * in registers, one pass over the values) */
static inline __attribute__((always_inline)) void weigh_values(const float *s, const float *values, int n,
                                                               const int lanes, float inv, float *o) {
    dvec8 acc[16];
    for (int g = 0; g < lanes; g++) acc[g] = (dvec8){0};
    for (int t = 0; t < n; t++) {
        const double w = s[t];
        if (w == 0.0) continue;
        const float *vt = values + (size_t)t * lanes * 8;
        for (int g = 0; g < lanes; g++) acc[g] += w * __builtin_convertvector(*(const fvec8 *)(vt + 8 * g), dvec8);
    }
    for (int g = 0; g < lanes; g++)
        for (int e = 0; e < 8; e++) o[8 * g + e] = (float)acc[g][e] * inv;
}

static void attend_exact(const float *qh, const float *keys, const float *values, const unsigned char *own, int n0,
                         int n, int d, float scale, float *s, float *o) {
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
    if (d == 64) { weigh_values(s, values, n, 8, inv, o); return; }
    if (d == 128) { weigh_values(s, values, n, 16, inv, o); return; }
    for (int i = 0; i < d; i++) {
        double acc = 0.0;
        for (t = 0; t < n; t++) acc += (double)s[t] * values[(size_t)t * d + i];
        o[i] = (float)acc * inv;
    }
}

/* The arguments of mtpflow_w8a8_rows, versioned as mtpflow_rows_args is (MTPFLOW_W8A8_ABI; mirrored once in
 * native_linear.W8A8Args). The rows are described as for mtpflow_llama_rows; the weights are the int8 model's:
 * per layer, fused q/k/v [(nh + 2 nkv) d][kp_h], o [H][kp_q], fused gate/up [2 I][kp_h], down [H][kp_i], each with
 * its scales and row sums. taps: NULL, or L pointers, non-NULL where layer l's output [M][H] is wanted. */
#define MTPFLOW_W8A8_ABI 1

struct mtpflow_w8a8_args {
    int version;  /* MTPFLOW_W8A8_ABI */
    int size;     /* sizeof(struct mtpflow_w8a8_args) as the caller built it */
    float *h, *normed;
    float *const *taps;
    int M, L, H, nh, nkv, d, I;
    int kp_h, kp_q, kp_i;
    const float *const *ln1, *const *ln2;
    const signed char *const *wqkv, *const *wo, *const *wgu, *const *wd;
    const float *const *sqkv, *const *so, *const *sgu, *const *sd;
    const int32_t *const *zqkv, *const *zo, *const *zgu, *const *zd;
    const float *norm_w;
    float eps;
    float *const *kc, *const *vc;
    long cap;
    const int *slot, *wpos, *prefix, *count;
    const unsigned char *allowed;  /* [M][qmax] */
    int qmax;
    const float *cos, *sin;
    float scale;
    int threads;
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

/* The int8 model's decoder stack over M rows: as mtpflow_llama_rows (the same rows, pool and taps), with the int8
 * products and the exact attention above, in one OpenMP region: each step split between the threads (rows, heads
 * or weight blocks), a spin_wait between steps. 0, -1 out of memory, MTPFLOW_ROWS_BAD_ABI for another struct. */
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
    char *buf = malloc(floats * sizeof(float) + (size_t)M * kp_max);
    if (!buf) return -1;
    float *x = (float *)buf, *tmp = x + (size_t)M * H, *qkv = tmp + (size_t)M * H,
          *att = qkv + (size_t)M * nqkv, *gu = att + (size_t)M * nq, *act = gu + (size_t)M * 2 * I,
          *scores = act + (size_t)M * I, *sx = scores + (size_t)M * nh * longest;
    unsigned char *xq = (unsigned char *)(sx + M);
    struct spin_barrier barrier = {0, 0};
#pragma omp parallel num_threads(a->threads)
    {
    const int nt = omp_get_num_threads(), t = omp_get_thread_num();
    /* this thread's rows [r0, r1) and (row, head) pairs [p0, p1) */
    const int r0 = (int)((long)M * t / nt), r1 = (int)((long)M * (t + 1) / nt);
    const int p0 = (int)((long)M * nh * t / nt), p1 = (int)((long)M * nh * (t + 1) / nt);
    for (int r = r0; r < r1; r++) {  /* the first layer's norm; each later one follows its residual below */
        rmsnorm(h + (size_t)r * H, a->ln1[0], a->eps, x + (size_t)r * H, H);
        sx[r] = quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
    }
    for (int l = 0; l < L; l++) {
        spin_wait(&barrier, nt);
        q8_part(t, nt, xq, sx, M, a->wqkv[l], a->sqkv[l], a->zqkv[l], nqkv, a->kp_h, qkv);
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++) {
            float *q = qkv + (size_t)r * nqkv, *k = q + nq, *v = k + nk;
            const float *c = a->cos + (size_t)r * d, *sn = a->sin + (size_t)r * d;
            for (int j = 0; j < nh; j++) rotary(q + (size_t)j * d, c, sn, d);
            for (int j = 0; j < nkv; j++) {
                rotary(k + (size_t)j * d, c, sn, d);
                const size_t at = a->slot[r] * slot_stride + ((size_t)j * a->cap + a->wpos[r]) * d;
                for (int i = 0; i < d; i++) { a->kc[l][at + i] = k[j * d + i]; a->vc[l][at + i] = v[j * d + i]; }
            }
        }
        spin_wait(&barrier, nt);
        for (int p = p0; p < p1; p++) {
            const int r = p / nh, j = p % nh;
            const size_t base = a->slot[r] * slot_stride + (size_t)(j / group) * a->cap * d;
            attend_exact(qkv + (size_t)r * nqkv + (size_t)j * d, a->kc[l] + base, a->vc[l] + base,
                         a->allowed + (size_t)r * a->qmax, a->prefix[r], a->prefix[r] + a->count[r], d, a->scale,
                         scores + (size_t)p * longest, att + (size_t)r * nq + (size_t)j * d);
        }
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++)
            sx[r] = quantize_row(att + (size_t)r * nq, nq, a->kp_q, xq + (size_t)r * a->kp_q);
        spin_wait(&barrier, nt);
        q8_part(t, nt, xq, sx, M, a->wo[l], a->so[l], a->zo[l], H, a->kp_q, tmp);
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++) {
            float *hr = h + (size_t)r * H;
            for (int i = 0; i < H; i++) hr[i] = hr[i] + tmp[(size_t)r * H + i];
            rmsnorm(hr, a->ln2[l], a->eps, x + (size_t)r * H, H);
            sx[r] = quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
        }
        spin_wait(&barrier, nt);
        q8_part(t, nt, xq, sx, M, a->wgu[l], a->sgu[l], a->zgu[l], 2 * I, a->kp_h, gu);
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++) {  /* silu(gate) * up = (gate / (1 + e^-gate)) * up, VW at a time */
            const float *g = gu + (size_t)r * 2 * I, *u = g + I;
            float *o = act + (size_t)r * I;
            for (int i = 0; i < I; i += VW) {
                vec gv;
                const int c = I - i < VW ? I - i : VW;
                for (int e = 0; e < VW; e++) gv[e] = e < c ? g[i + e] : 0.0f;
                const vec sv = gv / (1.0f + vexp(-gv));
                for (int e = 0; e < c; e++) o[i + e] = sv[e] * u[i + e];
            }
            sx[r] = quantize_row(o, I, a->kp_i, xq + (size_t)r * a->kp_i);
        }
        spin_wait(&barrier, nt);
        q8_part(t, nt, xq, sx, M, a->wd[l], a->sd[l], a->zd[l], H, a->kp_i, tmp);
        spin_wait(&barrier, nt);
        for (int r = r0; r < r1; r++) {
            float *hr = h + (size_t)r * H;
            for (int i = 0; i < H; i++) hr[i] = hr[i] + tmp[(size_t)r * H + i];
            if (a->taps && a->taps[l])
                for (int i = 0; i < H; i++) a->taps[l][(size_t)r * H + i] = hr[i];
            if (l + 1 < L) {
                rmsnorm(hr, a->ln1[l + 1], a->eps, x + (size_t)r * H, H);
                sx[r] = quantize_row(x + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
            } else {
                rmsnorm(hr, a->norm_w, a->eps, a->normed + (size_t)r * H, H);
                if (a->logits && r >= a->head_from)
                    sx[r] = quantize_row(a->normed + (size_t)r * H, H, a->kp_h, xq + (size_t)r * a->kp_h);
            }
        }
    }
    if (a->logits) {
        spin_wait(&barrier, nt);
        const int from = a->head_from;
        q8_part(t, nt, xq + (size_t)from * a->kp_h, sx + from, M - from, a->head_q, a->head_s, a->head_z, a->vocab,
                a->kp_h, a->logits);
    }
    }
    free(buf);
    return 0;
}
