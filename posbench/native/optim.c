/* One training step's update in C, fp32: the gradients' global-norm clipping
 * (torch.nn.utils.clip_grad_norm_) and AdamW (torch.optim.AdamW: decoupled weight decay, no
 * amsgrad, not maximizing) over every parameter tensor in one call. torch takes ~30 calls of
 * its own for the clipping (a norm per tensor, then a scaling per tensor) and an optimizer step
 * whose Python costs as much as its kernel at posbench's sizes. The Python side, and the torch
 * path that is its reference and fallback, are in optim.py beside this; tests/test_native_optim.py
 * checks the two against each other.
 *
 *   norm   sqrt(sum of g^2 over every tensor), in double; coef = min(max_norm / (norm + 1e-6), 1)
 *          (a NaN norm gives a NaN coef, as torch's clamp does); with max_norm <= 0, no clipping
 *   adamw  per tensor, step += 1; bc1 = 1 - beta1^step, bc2 = 1 - beta2^step (in double, as
 *          torch's fused kernel), and per value, with g = coef * grad:
 *            p -= p lr wd;  m += (1 - beta1) (g - m);  v = beta2 v + (1 - beta2) g^2;
 *            p -= (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps)
 *          The gradients themselves are left as they were (torch's clipping scales them in place).
 *
 * Work is split in fixed chunks of CHUNK values, whatever the thread count, and the sum of
 * squares is added chunk by chunk in order: the same bits on 1 thread or more. Built with
 * -fno-math-errno (EXTRA_FLAGS in __init__.py): without it sqrtf is a call per value, not a
 * vector instruction, and the step takes 4x as long. */
#include <math.h>
#include <stdlib.h>

#define CHUNK 8192

typedef struct {
    int t;        /* the tensor */
    long lo, hi;  /* its values lo..hi-1 */
} chunk_t;

/* The chunks of every tensor, in order; NULL if out of memory. */
static chunk_t *make_chunks(const long *n, int count, long *total) {
    long k = 0;
    for (int t = 0; t < count; t++) k += (n[t] + CHUNK - 1) / CHUNK;
    chunk_t *c = malloc(sizeof(chunk_t) * (k ? k : 1));
    if (!c) return NULL;
    k = 0;
    for (int t = 0; t < count; t++)
        for (long lo = 0; lo < n[t]; lo += CHUNK) c[k++] = (chunk_t){t, lo, lo + CHUNK < n[t] ? lo + CHUNK : n[t]};
    *total = k;
    return c;
}

/* hyper: per tensor lr, beta1, beta2, eps, weight_decay. Returns 1 if out of memory (nothing
 * changed), else 0. */
int clip_adamw(float *const *p, const float *const *g, float *const *m, float *const *v, float *const *step,
               const long *n, const double *hyper, int count, float max_norm, int threads) {
    long nc = 0;
    chunk_t *c = make_chunks(n, count, &nc);
    double *sq = malloc(sizeof(double) * (nc ? nc : 1));
    float *coef_t = malloc(sizeof(float) * 4 * (count ? count : 1)); /* per tensor: decay, step size, bc2 sqrt, eps */
    if (!c || !sq || !coef_t) {
        free(c);
        free(sq);
        free(coef_t);
        return 1;
    }
    float coef = 1.0f;
    if (max_norm > 0.0f) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (long k = 0; k < nc; k++) {
            const float *gr = g[c[k].t];
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (long i = c[k].lo; i < c[k].hi; i++) s += gr[i] * gr[i];
            sq[k] = s;
        }
        double total = 0.0;
        for (long k = 0; k < nc; k++) total += sq[k];
        const float norm = (float)sqrt(total);
        coef = max_norm / (norm + 1e-6f);
        coef = coef > 1.0f ? 1.0f : coef; /* a NaN stays NaN, as torch.clamp(max=1) */
    }
    for (int t = 0; t < count; t++) {
        const double *h = hyper + 5 * t, lr = h[0], beta1 = h[1], beta2 = h[2];
        const double s = (double)(*step[t] += 1.0f);
        const double bc1 = 1.0 - pow(beta1, s), bc2 = 1.0 - pow(beta2, s);
        coef_t[4 * t] = (float)(1.0 - lr * h[4]);
        coef_t[4 * t + 1] = (float)(lr / bc1);
        coef_t[4 * t + 2] = (float)sqrt(bc2);
        coef_t[4 * t + 3] = (float)h[3];
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long k = 0; k < nc; k++) {
        const int t = c[k].t;
        const float b1 = (float)(1.0 - hyper[5 * t + 1]), beta2 = (float)hyper[5 * t + 2], b2 = 1.0f - beta2;
        const float decay = coef_t[4 * t], step_size = coef_t[4 * t + 1], bc2s = coef_t[4 * t + 2],
                    eps = coef_t[4 * t + 3];
        float *pr = p[t], *mr = m[t], *vr = v[t];
        const float *gr = g[t];
#pragma omp simd
        for (long i = c[k].lo; i < c[k].hi; i++) {
            const float gi = gr[i] * coef;
            const float mi = mr[i] + b1 * (gi - mr[i]);
            const float vi = vr[i] * beta2 + b2 * gi * gi;
            mr[i] = mi;
            vr[i] = vi;
            pr[i] = pr[i] * decay - step_size * mi / (sqrtf(vi) / bc2s + eps);
        }
    }
    free(c);
    free(sq);
    free(coef_t);
    return 0;
}
