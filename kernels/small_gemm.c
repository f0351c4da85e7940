/* Small-batch float32 linear for CPU verify forwards: y[m][n] = sum_k x[m][k] * w[n][k] (+ b[n]).
 *
 * A verify forward multiplies 1 + K rows (K draft nodes, a handful) by every weight matrix of the model.
 * Reading the weights from memory is the whole cost, so the kernel reads each weight row once for all
 * input rows: blocks of 4 weight rows x up to 6 input rows keep 24 vector accumulators in registers while
 * the 4 weight rows stream past, and the next block's weight rows are prefetched while this one computes,
 * so memory and arithmetic overlap (mtpflow_small_gemm). From about 6 rows the arithmetic starts to show,
 * and mtpflow_panel_gemm takes over: the weight is re-laid once into panels of 64 output features x K
 * (panel[k][0..63]), so each step of k loads 4 vectors of weights and broadcasts one input value per row
 * into 4 x 6 accumulators with no horizontal sums, while one sequential stream per panel is prefetched
 * 4 KB ahead. Weight blocks and panels are split across OpenMP threads (torch's own OpenMP
 * runtime: torch has loaded libgomp.so.1 before this library is opened).
 *
 * Portable C with GCC vector extensions: 16-float vectors where the compiler targets AVX-512, else 8-float
 * ones (AVX2) with fewer input rows per block, since AVX2 has 16 vector registers, not 32 (64-byte vectors
 * without AVX-512 compile to scalar code, 10-20x slower). The pure-torch reference is F.linear; mtpflow/kernels/native_linear.py compiles, loads and
 * tests this file. Summation order differs from MKL's (differences around 1e-6 relative).
 *
 * mtpflow_small_gemm_q8 is the row kernel over int8 weights with one float scale per output feature
 * (y[m][n] = scale[n] * sum_k x[m][k] * q[n][k] (+ b[n])): a quarter of the bytes to read, each 16 (or 8)
 * int8 weights widened to floats in registers; every row count takes it (no panel copy: the widening, not
 * the weight stream, is the work it repeats per block of input rows).
 */
#include <stddef.h>

#if defined(__AVX512F__)
#define VW 16     /* floats per vector */
#define MB_MAX 6  /* input rows per block: 4 x 6 accumulators + 4 weight vectors + 1 input vector <= 32 registers */
#else
#define VW 8
#define MB_MAX 2  /* 4 x 2 accumulators + 4 + 1 <= 16 registers */
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

/* ---- row kernel: nb weight rows from n0 times mb input rows from m0 (compile-time nb, mb after inlining) */
static inline __attribute__((always_inline)) void block(const float *x, const float *w, const float *b, float *y,
                                                        int N, int K, int n0, int m0, const int nb, const int mb) {
    const int kv = K - K % VW;
    vec acc[NB][MB_MAX];
    const float *wr[NB], *xr[MB_MAX];
    for (int i = 0; i < nb; i++) wr[i] = w + (size_t)(n0 + i) * K;
    for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = (vec){0};
    for (int k = 0; k < kv; k += VW) {
        vec wv[NB];
        for (int i = 0; i < nb; i++) {
            __builtin_prefetch(wr[i] + (size_t)NB * K + k); /* the next block's row, same column */
            wv[i] = loadv(wr[i] + k);
        }
        for (int j = 0; j < mb; j++) {
            vec xv = loadv(xr[j] + k);
            for (int i = 0; i < nb; i++) acc[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float s = sumv(acc[i][j]);
            for (int k = kv; k < K; k++) s += wr[i][k] * xr[j][k];
            y[(size_t)(m0 + j) * N + n0 + i] = b ? s + b[n0 + i] : s;
        }
}

#if MB_MAX == 6
#define ROW_CASES(nb)                                                   \
    case 6: block(x, w, b, y, N, K, n0, m0, nb, 6); break;              \
    case 5: block(x, w, b, y, N, K, n0, m0, nb, 5); break;              \
    case 4: block(x, w, b, y, N, K, n0, m0, nb, 4); break;              \
    case 3: block(x, w, b, y, N, K, n0, m0, nb, 3); break;
#else
#define ROW_CASES(nb)
#endif
#define ROWS(nb)                                                        \
    for (int m0 = 0; m0 < M; m0 += MB_MAX) {                            \
        switch (M - m0 < MB_MAX ? M - m0 : MB_MAX) {                    \
            ROW_CASES(nb)                                               \
            case 2: block(x, w, b, y, N, K, n0, m0, nb, 2); break;      \
            default: block(x, w, b, y, N, K, n0, m0, nb, 1); break;     \
        }                                                               \
    }

/* x: M x K, w: N x K, b: N or NULL, y: M x N; all row-major and contiguous */
void mtpflow_small_gemm(const float *x, const float *w, const float *b, float *y, int M, int N, int K,
                        int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        switch (N - n0 < NB ? N - n0 : NB) {
            case 4: ROWS(4) break;
            case 3: ROWS(3) break;
            case 2: ROWS(2) break;
            default: ROWS(1) break;
        }
    }
}

/* ---- panel layout: panels[p][k][j] = w[p * PANEL + j][k] (zero past N), built by native_linear.pack_panels */
#define PANEL 64
#define GROUP (NB * VW)            /* columns of a panel one pass accumulates: 64 (AVX-512) or 32 */
#define PANEL_PREFETCH 1024        /* floats ahead in the panel's stream */

static inline __attribute__((always_inline)) void panel_block(const float *x, const float *panel, const float *b,
                                                              float *y, int N, int K, int n0, int m0, const int mb) {
    const float *xr[MB_MAX];
    for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    for (int g = 0; g < PANEL; g += GROUP) {
        vec acc[MB_MAX][NB];
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

#if MB_MAX == 6
#define PANEL_CASES                                                             \
    case 6: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 6); break;         \
    case 5: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 5); break;         \
    case 4: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 4); break;         \
    case 3: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 3); break;
#else
#define PANEL_CASES
#endif

/* x: M x K, panels: ceil(N / 64) x K x 64, b: N or NULL, y: M x N */
void mtpflow_panel_gemm(const float *x, const float *panels, const float *b, float *y, int M, int N, int K,
                        int threads) {
    const int np = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int p = 0; p < np; p++) {
        const float *panel = panels + (size_t)p * K * PANEL;
        for (int m0 = 0; m0 < M; m0 += MB_MAX) {
            switch (M - m0 < MB_MAX ? M - m0 : MB_MAX) {
                PANEL_CASES
                case 2: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 2); break;
                default: panel_block(x, panel, b, y, N, K, p * PANEL, m0, 1); break;
            }
        }
    }
}

/* ---- int8 weights, one float scale per output feature (weight-only quantization) --------------------- */
typedef signed char qvec_u __attribute__((vector_size(VW), aligned(1), may_alias));

/* widen VW int8 weights to floats: GCC 12 scalarizes __builtin_convertvector from char vectors (one
 * vcvtsi2ss per weight, 4x slower than the float kernel), so x86 takes the sign-extend + convert instructions */
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

static inline __attribute__((always_inline)) void qblock(const float *x, const signed char *w, const float *scale,
                                                         const float *b, float *y, int N, int K, int n0, int m0,
                                                         const int nb, const int mb) {
    const int kv = K - K % VW;
    vec acc[NB][MB_MAX];
    const signed char *wr[NB];
    const float *xr[MB_MAX];
    for (int i = 0; i < nb; i++) wr[i] = w + (size_t)(n0 + i) * K;
    for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) acc[i][j] = (vec){0};
    for (int k = 0; k < kv; k += VW) {
        vec wv[NB];
        for (int i = 0; i < nb; i++) {
            if (k % 64 == 0) __builtin_prefetch(wr[i] + (size_t)NB * K + k); /* one line per 64 weights */
            wv[i] = loadq(wr[i] + k);
        }
        for (int j = 0; j < mb; j++) {
            vec xv = loadv(xr[j] + k);
            for (int i = 0; i < nb; i++) acc[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < nb; i++)
        for (int j = 0; j < mb; j++) {
            float s = sumv(acc[i][j]);
            for (int k = kv; k < K; k++) s += (float)wr[i][k] * xr[j][k];
            s *= scale[n0 + i];
            y[(size_t)(m0 + j) * N + n0 + i] = b ? s + b[n0 + i] : s;
        }
}

#if MB_MAX == 6
#define QROW_CASES(nb)                                                          \
    case 6: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 6); break;              \
    case 5: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 5); break;              \
    case 4: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 4); break;              \
    case 3: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 3); break;
#else
#define QROW_CASES(nb)
#endif
#define QROWS(nb)                                                               \
    for (int m0 = 0; m0 < M; m0 += MB_MAX) {                                    \
        switch (M - m0 < MB_MAX ? M - m0 : MB_MAX) {                            \
            QROW_CASES(nb)                                                      \
            case 2: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 2); break;      \
            default: qblock(x, w, scale, b, y, N, K, n0, m0, nb, 1); break;     \
        }                                                                       \
    }

/* x: M x K float, w: N x K int8, scale: N, b: N or NULL, y: M x N */
void mtpflow_small_gemm_q8(const float *x, const signed char *w, const float *scale, const float *b, float *y,
                           int M, int N, int K, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int n0 = 0; n0 < N; n0 += NB) {
        switch (N - n0 < NB ? N - n0 : NB) {
            case 4: QROWS(4) break;
            case 3: QROWS(3) break;
            case 2: QROWS(2) break;
            default: QROWS(1) break;
        }
    }
}
