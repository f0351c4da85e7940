/* The native CPU kernel's shared definitions: vector types and widths, the int8 products' layout, and the
 * entry points one file of the kernel calls in another. The kernel is five files compiled into one library
 * (mtpflow/backends/native/kernel.py builds and loads it):
 * - gemm.c: the float products: float32 weights (row blocks, panels), int8 weights with float activations (the
 *   self-draft, the certified head), and the one entry point of every product (mtpflow_linear);
 * - w8a8.c: the int8 model's products (int8 weights and activations, exact integer dots);
 * - rows_float.c: a float32 model's decoder stack over a verify forward's rows (mtpflow_llama_rows);
 * - rows_int8.c: the int8 model's decoder stack (mtpflow_w8a8_rows);
 * - rows_common.h: the arithmetic between the products both stacks share (RMSNorm, rotary, vexp).
 */
#ifndef MTPFLOW_NATIVE_H
#define MTPFLOW_NATIVE_H
#include <stddef.h>

#if defined(__AVX512F__)
#define VW 16     /* floats per vector */
#define MB_MAX 6  /* input rows per block: 4 x 6 accumulators + 4 weight vectors + 1 input vector <= 32 registers */
#define PANEL_MB 12  /* panel kernel: 12 rows x 2 vectors (24 accumulators) + 2 weight vectors <= 32 registers */
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
#define NB 4      /* weight rows per block (row kernel) */

typedef float vec __attribute__((vector_size(VW * 4)));
typedef float vec_u __attribute__((vector_size(VW * 4), aligned(4), may_alias)); /* unaligned access */

static inline vec loadv(const float *p) { return *(const vec_u *)p; }

static inline void storev(float *p, vec v) { *(vec_u *)p = v; }

static inline float sumv(vec v) {
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
}

#include <stdint.h>

#define Q8_STEP 64   /* columns of the int8 model's weights are padded with zeros to a multiple of it */
#define Q8_PANEL 32  /* output features per packed panel (products.Q8_PANEL; w8a8.c has the layout) */
#include <omp.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q8_VNNI 1
#define Q8_OFFSET 128
#define Q8_MB 12     /* rows per tile: 12 x 2 accumulators + 2 weight vectors + 1 broadcast <= 32 registers */
#define Q8_TILE 2    /* 16-feature units per tile: a whole panel */
#elif defined(__AVX2__)
#define Q8_AVX2 1
#define Q8_OFFSET 0
#define Q8_MB 2      /* 2 x 4 accumulators + 4 weight vectors + 3 temporaries <= 16 registers */
#define Q8_TILE 2    /* a whole panel (4 8-lane vectors) */
#else
#define Q8_OFFSET 0
#define Q8_MB 2
#define Q8_TILE 2
#endif


/* what an entry point taking a versioned struct returns for a struct of another version or size */
#define MTPFLOW_ROWS_BAD_ABI (-2)

#define HIDDEN __attribute__((visibility("hidden")))

/* gemm.c: the float products; w8a8.c: the int8 model's */
HIDDEN void mtpflow_small_gemm(const float *x, const float *w, const float *b, float *y, int M, int N, int K, int threads);
HIDDEN void mtpflow_small_gemm_q8(const float *x, const signed char *wq, const float *scale, const float *b, float *y,
                           int M, int N, int K, int threads);
HIDDEN void mtpflow_panel_gemm(const float *x, const float *panels, const float *b, float *y, int M, int N, int K,
                        int threads);
HIDDEN void mtpflow_q8_panel_gemm(const float *x, const signed char *qpanels, const float *scale, const float *b,
                                  float *y, int M, int N, int K, int threads);
HIDDEN int mtpflow_gemm_w8a8(const float *x, const signed char *q, const float *scale, const int32_t *wsum, float *y,
                             int M, int N, int K, int kp, int threads);
/* a row x[K] as int8 (offset by Q8_OFFSET, zero past K up to kp); returns its scale */
HIDDEN float mtpflow_quantize_row(const float *x, int K, int kp, unsigned char *xq);
/* thread t of nt's share of a W8A8 product over quantized rows (see gemm.c) */
HIDDEN void mtpflow_q8_part(int t, int nt, const unsigned char *xq, const float *sx, int M, const signed char *q,
                            const float *scale, const int32_t *wsum, int N, int kp, float *y);

#endif
