/* Small-batch float32 linear for CPU verify forwards: y[m][n] = sum_k x[m][k] * w[n][k] (+ b[n]).
 *
 * A verify forward multiplies 1 + K rows (K draft nodes, a handful) by every weight matrix of the model.
 * Reading the weights from memory is the whole cost, so the kernel reads each weight row once for all
 * input rows: blocks of 4 weight rows x up to 6 input rows keep 24 vector accumulators in registers while
 * the 4 weight rows stream past, and the next block's weight rows are prefetched while this one computes,
 * so memory and arithmetic overlap (mtpflow_small_gemm). As rows grow the arithmetic starts to show, and
 * from PANEL_MIN_ROWS rows mtpflow_panel_gemm takes over: the weight is re-laid once into panels of 32 output
 * features x K (panel[k][0..31]), so each step of k loads 2 vectors of weights (AVX-512) and broadcasts one input
 * value per row into 2 x 12 accumulators with no horizontal sums, while one sequential stream per panel is
 * prefetched 4 KB ahead. Weight blocks and panels are split across OpenMP threads (torch's own OpenMP
 * runtime: torch has loaded libgomp.so.1 before this library is opened).
 *
 * The caller starts the panels at PANEL_MIN_ROWS rows (read by kernel.panel_min_rows): 1 on AVX-512
 * builds, where the panels' sequential streams beat the row blocks at every row count; 3 on AVX2 builds, where
 * 1-2 rows instead read one weight row at a time (one sequential stream per thread); the reasons are at the
 * constants below (measured: docs/bench/code-figures.md#small_gemm-panel_min_rows).
 *
 * Portable C with GCC vector extensions: 16-float vectors where the compiler targets AVX-512, else 8-float
 * ones (AVX2) with fewer input rows per block, since AVX2 has 16 vector registers, not 32 (64-byte vectors
 * without AVX-512 compile to scalar code, many times slower; measured: docs/bench/code-figures.md#small_gemm-header).
 * The pure-torch reference is F.linear; mtpflow/backends/native/products.py calls these kernels; kernel.py compiles and loads them.
 * Summation order differs from MKL's (differences around 1e-6 relative).
 *
 * mtpflow_small_gemm_q8 is the row kernel over int8 weights with one float scale per output feature
 * (y[m][n] = scale[n] * sum_k x[m][k] * q[n][k] (+ b[n])): a quarter of the bytes to read, each 16 (or 8)
 * int8 weights widened to floats in registers; every row count takes it (there is no int8 panel kernel).
 */
#include "native.h"

int mtpflow_vector_width(void) { return VW; }

/* from how many rows callers that hold panels should call mtpflow_panel_gemm (kernel.panel_min_rows) */
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
HIDDEN void mtpflow_small_gemm(const float *x, const float *w, const float *b, float *y, int M, int N, int K,
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
HIDDEN void mtpflow_small_gemm_q8(const float *x, const signed char *wq, const float *scale, const float *b, float *y,
                           int M, int N, int K, int threads) {
    const float *w = NULL;
#pragma omp parallel for schedule(static) num_threads(threads)
    WEIGHT_BLOCKS(1)
}

/* ---- panel layout: panels[p][k][j] = w[p * PANEL + j][k] (zero past N), built by products.pack_panels; int8
 * panels the same with int8 weights (products.pack_q8_panels: the certified head) */
#define PANEL 32                   /* output features per panel: one panel is PANEL_NV vectors wide */
#define PANEL_NV (PANEL / VW)      /* 2 (AVX-512) or 4 vectors */
#define PANEL_PREFETCH 4096        /* bytes ahead in the panel's stream */

/* one panel (PANEL features, from n0) times mb rows from m0, the accumulators in registers over the whole of K. A
 * panel 32 features wide by 12 rows (AVX-512: 24 accumulators) reads each weight once for up to 12 rows; the
 * previous 64 by 6 read a panel twice for 7 to 12 rows, the second time from L2 (or, for a 1B model's 8192-column
 * down projection, from L3): the default model's decoder products at 9 rows took 1.37 times 1 row that way, 1.05
 * times here (measured: docs/bench/verify_cost_dec05.md). q8: int8 panels (32 bytes a step), widened to floats once per
 * step for all the rows, then times scale[n]. */
static inline __attribute__((always_inline)) void panel_block(const float *x, const float *panel,
                                                              const signed char *qpanel, const float *scale,
                                                              const float *b, float *y, int N, int K, int n0,
                                                              int m0, const int mb, const int q8) {
    const float *xr[PANEL_MB];
    _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++) xr[j] = x + (size_t)(m0 + j) * K;
    vec acc[PANEL_MB][PANEL_NV];
    _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++)
        _Pragma("GCC unroll 4") for (int v = 0; v < PANEL_NV; v++) acc[j][v] = (vec){0};
    for (int k = 0; k < K; k++) {
        vec pv[PANEL_NV];
        if (q8) {
            const signed char *pk = qpanel + (size_t)k * PANEL;
            if (k % 2 == 0) __builtin_prefetch(pk + PANEL_PREFETCH);
            _Pragma("GCC unroll 4") for (int v = 0; v < PANEL_NV; v++) pv[v] = loadq(pk + VW * v);
        } else {
            const float *pk = panel + (size_t)k * PANEL;
            _Pragma("GCC unroll 4") for (int c = 0; c < PANEL; c += 16) __builtin_prefetch(pk + PANEL_PREFETCH / 4 + c);
            _Pragma("GCC unroll 4") for (int v = 0; v < PANEL_NV; v++) pv[v] = loadv(pk + VW * v);
        }
        _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++) {
            const float xs = xr[j][k];
            _Pragma("GCC unroll 4") for (int v = 0; v < PANEL_NV; v++) acc[j][v] += pv[v] * xs;
        }
    }
    const int nv = N - n0 < PANEL ? N - n0 : PANEL;
    _Pragma("GCC unroll 16") for (int j = 0; j < mb; j++) {
        float out[PANEL];
        _Pragma("GCC unroll 4") for (int v = 0; v < PANEL_NV; v++) storev(out + VW * v, acc[j][v]);
        float *yr = y + (size_t)(m0 + j) * N + n0;
        for (int i = 0; i < nv; i++) {
            const float s = q8 ? out[i] * scale[n0 + i] : out[i];
            yr[i] = b ? s + b[n0 + i] : s;
        }
    }
}

#define PANEL_CALL(MB, Q8) panel_block(x, panel, qpanel, scale, b, y, N, K, p * PANEL, m0, MB, Q8)
#define PANEL_CASE(MB, Q8) case MB: PANEL_CALL(MB, Q8); break;
#if PANEL_MB == 12
#define PANEL_CASES(Q8) PANEL_CASE(12, Q8) PANEL_CASE(11, Q8) PANEL_CASE(10, Q8) PANEL_CASE(9, Q8) \
    PANEL_CASE(8, Q8) PANEL_CASE(7, Q8) PANEL_CASE(6, Q8) PANEL_CASE(5, Q8) PANEL_CASE(4, Q8) PANEL_CASE(3, Q8)
#else
#define PANEL_CASES(Q8) PANEL_CASE(3, Q8)
#endif

/* The threads split the (panel, row block) pairs in panel order, each thread a contiguous run: where the panels
 * split evenly between the threads this is a split of the panels; where they do not (a panel count odd for 2
 * threads) the panel at the seam is shared, so no thread idles for a panel's worth of rows (the second read of
 * that panel mostly from the shared L3). Each output comes from the same block either way: the same numbers. */
#define PANEL_LOOP(Q8)                                                                  \
    const int np = (N + PANEL - 1) / PANEL, nb = (M + PANEL_MB - 1) / PANEL_MB;         \
    _Pragma("omp parallel for schedule(static) num_threads(threads)")                   \
    for (int u = 0; u < np * nb; u++) {                                                 \
        const int p = u / nb, m0 = (u % nb) * PANEL_MB;                                 \
        const float *panel = panels ? panels + (size_t)p * K * PANEL : NULL;            \
        const signed char *qpanel = qpanels ? qpanels + (size_t)p * K * PANEL : NULL;   \
        switch (M - m0 < PANEL_MB ? M - m0 : PANEL_MB) {                                \
            PANEL_CASES(Q8)                                                             \
            PANEL_CASE(2, Q8)                                                           \
            default: PANEL_CALL(1, Q8); break;                                          \
        }                                                                               \
    }

/* x: M x K, panels: ceil(N / PANEL) x K x PANEL, b: N or NULL, y: M x N */
HIDDEN void mtpflow_panel_gemm(const float *x, const float *panels, const float *b, float *y, int M, int N, int K,
                               int threads) {
    const signed char *qpanels = NULL;
    const float *scale = NULL;
    PANEL_LOOP(0)
}

/* x: M x K float, qpanels: int8 panels ceil(N / PANEL) x K x PANEL, scale: N, b: N or NULL, y: M x N */
HIDDEN void mtpflow_q8_panel_gemm(const float *x, const signed char *qpanels, const float *scale, const float *b,
                                  float *y, int M, int N, int K, int threads) {
    const float *panels = NULL;
    PANEL_LOOP(1)
}

/* ---- the one entry point of the products: mtpflow_linear(struct mtpflow_linear_args) -----------------------
 * y[M][N] = x[M][K] times the weight, by kind:
 * - MTPFLOW_LINEAR_F32: float32 weight w [N][K] (+ bias b [N] or NULL), the row kernel;
 * - MTPFLOW_LINEAR_PANELS: the same product over its panel copy (panels, products.pack_panels);
 * - MTPFLOW_LINEAR_Q8: int8 weight q [N][K] with float scale [N] (+ b), float activations (the self-draft's copy);
 * - MTPFLOW_LINEAR_Q8_PANELS: the same over int8 panels q (products.pack_q8_panels: the certified head);
 * - MTPFLOW_LINEAR_W8A8: the int8 model's product: packed int8 q (products.pack_q8, kp columns), scale [N], row
 *   sums wsum [N], each row of x quantized on its own.
 * Versioned as the decoder stacks' structs are: a caller sets version to MTPFLOW_LINEAR_ABI and size to the struct's
 * size as it built it; products.py mirrors it once (LinearArgs). Returns 0, -1 out of memory (W8A8's scratch),
 * MTPFLOW_ROWS_BAD_ABI for another struct, -3 for an unknown kind. */
#define MTPFLOW_LINEAR_ABI 1
enum { MTPFLOW_LINEAR_F32 = 0, MTPFLOW_LINEAR_PANELS = 1, MTPFLOW_LINEAR_Q8 = 2, MTPFLOW_LINEAR_W8A8 = 3,
       MTPFLOW_LINEAR_Q8_PANELS = 4 };

struct mtpflow_linear_args {
    int version;  /* MTPFLOW_LINEAR_ABI */
    int size;     /* sizeof(struct mtpflow_linear_args) as the caller built it */
    int kind;
    int M, N, K, kp, threads;
    const float *x;
    const float *w, *panels, *b;
    const signed char *q;
    const float *scale;
    const int32_t *wsum;
    float *y;
};

int mtpflow_linear_abi(void) { return MTPFLOW_LINEAR_ABI; }

int mtpflow_linear_args_size(void) { return (int)sizeof(struct mtpflow_linear_args); }

int mtpflow_linear(const struct mtpflow_linear_args *a) {
    if (a->version != MTPFLOW_LINEAR_ABI || a->size != (int)sizeof(struct mtpflow_linear_args)) return MTPFLOW_ROWS_BAD_ABI;
    switch (a->kind) {
        case MTPFLOW_LINEAR_F32: mtpflow_small_gemm(a->x, a->w, a->b, a->y, a->M, a->N, a->K, a->threads); return 0;
        case MTPFLOW_LINEAR_PANELS: mtpflow_panel_gemm(a->x, a->panels, a->b, a->y, a->M, a->N, a->K, a->threads); return 0;
        case MTPFLOW_LINEAR_Q8:
            mtpflow_small_gemm_q8(a->x, a->q, a->scale, a->b, a->y, a->M, a->N, a->K, a->threads);
            return 0;
        case MTPFLOW_LINEAR_Q8_PANELS:
            mtpflow_q8_panel_gemm(a->x, a->q, a->scale, a->b, a->y, a->M, a->N, a->K, a->threads);
            return 0;
        case MTPFLOW_LINEAR_W8A8:
            return mtpflow_gemm_w8a8(a->x, a->q, a->scale, a->wsum, a->y, a->M, a->N, a->K, a->kp, a->threads);
        default: return -3;
    }
}
