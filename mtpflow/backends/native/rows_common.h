/* The arithmetic between the products that both decoder stacks (rows_float.c, rows_int8.c) share. Included
 * after the file's fp-contract pragma: no multiply and add here is fused into one rounding, so every operation
 * rounds as the same operation in torch does. */
#ifndef MTPFLOW_ROWS_COMMON_H
#define MTPFLOW_ROWS_COMMON_H
#include <math.h>
#include <stdlib.h>
#include "native.h"

static inline void rmsnorm(const float *x, const float *w, float eps, float *out, int H) {
    double ss = 0.0;
    for (int i = 0; i < H; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / H) + eps);
    for (int i = 0; i < H; i++) out[i] = w[i] * (x[i] * r);
}

static inline void rotary(float *v, const float *cos, const float *sin, int d) {
    const int half = d / 2;
    for (int i = 0; i < half; i++) {
        const float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
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

#endif
