/* What every verify step reads from its logits besides the logits themselves, in one pass over each row while the
 * row is still in cache: the target's greedy choice (the argmax), the log of the softmax's normalizer and the ids of
 * the row's top entries. The gate, the loop's per-token probabilities, the traces and token recycling read these;
 * torch computes them in three more passes over [rows][vocab] (argmax, logsumexp, topk), which on a CPU cost as much
 * as a tenth of a verify of a dozen rows. */
#include <omp.h>
#include <stdint.h>
#include "rows_common.h"

#define MTPFLOW_LOGIT_STATS_ABI 1
#define TOP_MAX 16  /* the most top ids a row gives */

struct mtpflow_logit_stats_args {
    int version, size;
    int rows, vocab, threads;
    int top;                    /* ids of each row's top entries wanted, 0 .. min(TOP_MAX, vocab) */
    long stride;                /* floats between rows */
    const float *logits;        /* [rows][stride], the first vocab of each row read */
    int64_t *argmax;            /* [rows] out */
    float *log_norm;            /* [rows] out: log sum_j exp(logits[r][j]) */
    int64_t *top_ids;           /* [rows][top] out: the ids of the top largest entries, largest first (among equal
                                 * entries the lower id first); NULL where top is 0 */
};

int mtpflow_logit_stats_abi(void) { return MTPFLOW_LOGIT_STATS_ABI; }

int mtpflow_logit_stats_args_size(void) { return (int)sizeof(struct mtpflow_logit_stats_args); }

/* entry (v, id) into the top kept so far (values kept[0, *count) descending, their ids beside), ids coming in
 * ascending: an entry equal to a kept one goes after it */
static inline void keep_top(float v, int64_t id, int top, float *kept, int64_t *ids, int *count) {
    if (*count == top && !(v > kept[top - 1])) return;
    int p = *count < top ? (*count)++ : top - 1;
    for (; p > 0 && v > kept[p - 1]; p--) { kept[p] = kept[p - 1]; ids[p] = ids[p - 1]; }
    kept[p] = v;
    ids[p] = id;
}

/* the first index of the row's largest entry, as torch.argmax picks it (a NaN counts as the largest: the first
 * NaN); *nan set where the row has one. With top > 0, ids[0, top) get the ids of the row's top largest entries
 * (largest first, the lower id first among equals; meaningless where the row has a NaN): each vector is looked at
 * lane by lane only where a lane beats the smallest of those kept so far. */
static int64_t row_argmax(const float *x, int n, int *nan, int top, int64_t *ids) {
    vec best = (vec){0} - INFINITY;
    ivec at = (ivec){0} - 1, idx, bad = (ivec){0};
    float kept[TOP_MAX];
    int count = 0;
    vec floor = (vec){0} - INFINITY;  /* the smallest kept value, once top are kept */
    for (int i = 0; i < VW; i++) idx[i] = i;
    int t = 0;
    for (; t + VW <= n; t += VW, idx += VW) {
        const vec v = loadv(x + t);
        const ivec up = (ivec)(v > best);  /* strictly larger: each lane keeps its first maximum */
        best = (vec)(((ivec)v & up) | ((ivec)best & ~up));
        at = (idx & up) | (at & ~up);
        bad |= (ivec)(v != v);
        if (top) {
            const ivec in = (ivec)(v > floor);
            int any = count < top;
            for (int i = 0; i < VW && !any; i++) any = in[i] != 0;
            if (any) {
                for (int i = 0; i < VW; i++) keep_top(x[t + i], t + i, top, kept, ids, &count);
                if (count == top) floor = (vec){0} + kept[top - 1];
            }
        }
    }
    float m = -INFINITY;
    int64_t arg = -1;
    for (int i = 0; i < VW; i++)  /* the lanes' maxima: the largest, the lowest index among equals */
        if (at[i] >= 0 && (best[i] > m || (best[i] == m && at[i] < arg))) { m = best[i]; arg = at[i]; }
    for (; t < n; t++) {
        if (x[t] > m) { m = x[t]; arg = t; }
        if (x[t] != x[t]) bad[0] = 1;
        if (top) keep_top(x[t], t, top, kept, ids, &count);
    }
    *nan = 0;
    for (int i = 0; i < VW; i++) *nan |= bad[i] != 0;
    if (*nan)
        for (int j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    return arg < 0 ? 0 : arg;  /* every entry -inf: index 0, as torch */
}

/* log sum exp(x) around the row's largest entry m: the exponentials summed in float vectors BLOCK at a time (each
 * at most 1: a block's sum is within BLOCK float roundings, far below what a probability shows), the blocks in
 * double */
#define BLOCK 64
static float row_log_norm(const float *x, int n, float m) {
    if (!isfinite(m)) return m;  /* +inf, -inf (every entry -inf) or NaN: what torch.logsumexp gives */
    const vec mv = (vec){0} + m;
    double total = 0.0;
    int t = 0;
    while (t + VW <= n) {
        vec acc = (vec){0};
        for (int b = 0; b < BLOCK && t + VW <= n; b++, t += VW) acc += vexp(loadv(x + t) - mv);
        total += sumv(acc);
    }
    for (; t < n; t++) total += exp((double)x[t] - m);
    return m + (float)log(total);
}

/* the number of rows with a NaN (their top ids are not set), or MTPFLOW_ROWS_BAD_ABI for another struct */
int mtpflow_logit_stats(const struct mtpflow_logit_stats_args *a) {
    if (a->version != MTPFLOW_LOGIT_STATS_ABI || a->size != (int)sizeof(*a)) return MTPFLOW_ROWS_BAD_ABI;
    const int threads = a->threads > 0 ? a->threads : 1;
    int top = a->top_ids == NULL || a->top < 0 ? 0 : a->top;
    if (top > TOP_MAX) top = TOP_MAX;
    if (top > a->vocab) top = a->vocab;
    int nans = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (a->rows > 1 && threads > 1) reduction(+ : nans)
    for (int r = 0; r < a->rows; r++) {
        const float *x = a->logits + (size_t)r * a->stride;
        int nan;
        const int64_t arg = row_argmax(x, a->vocab, &nan, top, top ? a->top_ids + (size_t)r * a->top : NULL);
        a->argmax[r] = arg;
        a->log_norm[r] = nan ? NAN : row_log_norm(x, a->vocab, x[arg]);
        nans += nan;
    }
    return nans;
}
