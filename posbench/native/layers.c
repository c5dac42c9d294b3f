/* GELU, LayerNorm, cross-entropy and RoPE's rotation in C, fp32: elementwise and row-wise layers outside the
 * matrix products, each forward and backward one pass over the data. The Python side,
 * and the PyTorch ops that are the reference and the fallback, are in layers.py beside this;
 * tests/test_native_layers.py checks the two against each other, values and gradients.
 *
 *   gelu       y = x Phi(x); backward dx = dy (Phi(x) + x phi(x)), exp(-x^2/2) serving both
 *   gelu_bias  the same of h + b, b per column (the MLP's first bias), keeping the slope for the
 *              backward, which also sums db
 *   layernorm  y = (x - mean) rstd w + b per row; backward dx, and dw, db summed over rows.
 *              For the MLP's residual: the forward may also write x + a vector, and the
 *              backward add the residual's gradient into dx
 *   xent       per row lse - z[target], and the gradient (softmax - onehot) / rows counted
 *   rope       y = x cos + rotate_half(x) sin per row; backward the transposed map
 *
 * Work is split over OpenMP threads (torch's own runtime once loaded after torch: see the top
 * of cope.c). Every output is computed the same way whatever the thread count, so the results
 * are the same bits on 1 thread or more: the sums over rows (LayerNorm's dw and db, the mean
 * loss) are added in a fixed order, in double, never as per-thread partial sums. */
#include <math.h>
#include <stdlib.h>

#include "vmath.h"

/* With its data in cache the GELU is bound by arithmetic (a division and an exp per value), so
 * it runs on the widest vectors the CPU has: 16 floats with AVX-512, where vmath.h's v8f has 8. */
#ifdef __AVX512F__
#define GW 16
typedef v16f gvf;
typedef v16i gvi;
#define gexp vexp16
#else
#define GW 8
typedef v8f gvf;
typedef v8i gvi;
#define gexp vexp
#endif

/* Phi(-|x|), the normal CDF's small tail, from erfc by Abramowitz-Stegun 7.1.26 (error below
 * 1.5e-7 in erf, the formula of torch's vectorised erf; the 1/2 of Phi = erfc/2 and the 1/sqrt 2
 * of its argument are folded into the constants). *e gets exp(-x^2/2), which makes the pdf too:
 * 0 past |x| = 10, where the tail is below 1e-23, so that no subnormal reaches the matrix
 * products (~100x slower on x86). Phi(x < 0) is the tail itself, never 1 - (1 - tail): within
 * 1% down to x = -6, where 0.5 (1 + erf) has cancelled to nothing. */
INLINE gvf gtail(gvf x, gvf *e) {
    gvf ax = (gvf)((gvi)x & 0x7fffffff);
    gvf t = 1.0f / (1.0f + 0.2316418883f * ax); /* 0.3275911 / sqrt 2 */
    gvf p = t * (0.127414796f + t * (-0.142248368f + t * (0.7107068705f + t * (-0.7265760135f + t * 0.5307027145f))));
    gvf h = -0.5f * x * x;
    *e = (gvf)((h > -50.0f) & (gvi)gexp(h));
    return p * *e;
}

/* GW floats: y = x Phi(x) = max(x, 0) - |x| Phi(-|x|), or in the backward dx = dy (Phi(x) +
 * x phi(x)) with Phi(x) = 1 - tail for x >= 0, tail for x < 0 */
INLINE gvf gelu_lanes(int backward, gvf x, gvf dy) {
    gvf e, tail = gtail(x, &e);
    gvi pos = ~((gvi)x >> 31); /* all ones where x >= +0 */
    if (!backward) return (gvf)((gvi)x & pos) - (gvf)((gvi)x & 0x7fffffff) * tail;
    gvf cdf = (gvf)(pos & (gvi)((gvf){0} + 1.0f)) + (gvf)((gvi)tail ^ (pos & (int32_t)0x80000000));
    return dy * (cdf + x * e * 0.39894228040143268f); /* phi = e / sqrt(2 pi) */
}

/* n floats; threads take contiguous halves, the tail goes through padded copies */
static void gelu(int backward, const float *x, const float *dy, float *out, long n, int threads) {
    const long nv = n / GW, at = GW * nv;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < nv; i++) {
        gvf a, b = {0};
        memcpy(&a, x + GW * i, sizeof a);
        if (backward) memcpy(&b, dy + GW * i, sizeof b);
        gvf y = gelu_lanes(backward, a, b);
        memcpy(out + GW * i, &y, sizeof y);
    }
    if (at < n) {
        float xs[GW] = {0}, dys[GW] = {0}, ys[GW];
        gvf a, b;
        memcpy(xs, x + at, sizeof(float) * (n - at));
        if (backward) memcpy(dys, dy + at, sizeof(float) * (n - at));
        memcpy(&a, xs, sizeof a);
        memcpy(&b, dys, sizeof b);
        gvf y = gelu_lanes(backward, a, b);
        memcpy(ys, &y, sizeof y);
        memcpy(out + at, ys, sizeof(float) * (n - at));
    }
}

void gelu_forward(const float *x, float *y, long n, int threads) { gelu(0, x, NULL, y, n, threads); }

void gelu_backward(const float *x, const float *dy, float *dx, long n, int threads) {
    gelu(1, x, dy, dx, n, threads);
}

/* The loops below that are plain C (the GELU's backward, LayerNorm) run under omp simd, which GCC vectorises 8 wide even where AVX-512
 * has 16; asking for 16 makes them ~20% faster here */
#if defined(__AVX512F__) && defined(__GNUC__) && !defined(__clang__)
#define WIDE __attribute__((target("prefer-vector-width=512")))
#else
#define WIDE
#endif

/* The MLP's first layer with its bias folded in, h being the bias-free product x W^T:
 *   forward   y = gelu(h + b), b per column, and the slope g = gelu'(h + b) written over h,
 *   backward  dh = dy g (dh may be dy: in place), and db = the sum of dh over rows.
 * Keeping the slope makes the backward one multiply where it would recompute the erf and exp,
 * and it spares the product's bias copy and a separate pass that would sum db. db is summed per
 * chunk of GB_CHUNK rows and the chunks in order, in double: the same bits whatever the thread
 * count. Returns 1 if out of memory. */
#define GB_CHUNK 64

INLINE void gelu_bias_row(float *h, const float *b, float *y, int cols) {
    int j = 0;
    for (; j + GW <= cols; j += GW) {
        gvf a, c;
        memcpy(&a, h + j, sizeof a);
        memcpy(&c, b + j, sizeof c);
        a += c;
        gvf v = gelu_lanes(0, a, a), g = gelu_lanes(1, a, (gvf){0} + 1.0f);
        memcpy(y + j, &v, sizeof v);
        memcpy(h + j, &g, sizeof g);
    }
    if (j < cols) { /* the row's tail through padded copies */
        float as[GW] = {0}, cs[GW] = {0}, vs[GW], gs[GW];
        const size_t n = sizeof(float) * (cols - j);
        gvf a, c;
        memcpy(as, h + j, n);
        memcpy(cs, b + j, n);
        memcpy(&a, as, sizeof a);
        memcpy(&c, cs, sizeof c);
        a += c;
        gvf v = gelu_lanes(0, a, a), g = gelu_lanes(1, a, (gvf){0} + 1.0f);
        memcpy(vs, &v, sizeof v);
        memcpy(gs, &g, sizeof g);
        memcpy(y + j, vs, n);
        memcpy(h + j, gs, n);
    }
}

void gelu_bias_forward(float *h, const float *b, float *y, long rows, int cols, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < rows; i++) gelu_bias_row(h + i * cols, b, y + i * cols, cols);
}

WIDE int gelu_bias_backward(const float *g, const float *dy, float *dh, float *db, long rows, int cols,
                            int threads) {
    const long chunks = (rows + GB_CHUNK - 1) / GB_CHUNK;
    float *partial = calloc((size_t)cols * (chunks ? chunks : 1), sizeof(float)); /* db per chunk */
    if (!partial) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < chunks; c++) {
        float *pc = partial + c * cols;
        const long end = (c + 1) * GB_CHUNK < rows ? (c + 1) * GB_CHUNK : rows;
        for (long i = c * GB_CHUNK; i < end; i++) {
            const float *gr = g + i * cols, *dr = dy + i * cols;
            float *out = dh + i * cols;
#pragma omp simd
            for (int j = 0; j < cols; j++) {
                out[j] = dr[j] * gr[j];
                pc[j] += out[j];
            }
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int j = 0; j < cols; j++) {
        double s = 0.0;
        for (long c = 0; c < chunks; c++) s += partial[c * cols + j];
        db[j] = (float)s;
    }
    free(partial);
    return 0;
}


/* rows x C floats. mean and rstd: one per row, kept for the backward. The row's sum and sum of
 * squares come from one pass, taken about the mean of its first 8 values: that keeps them of the
 * order of the spread, so that var = E[d^2] - E[d]^2 cancels little (as accurate as torch's
 * Welford here: within 2e-6 at unit scale). */
WIDE void layernorm_forward(const float *x, const float *w, const float *b, float *y, float *mean,
                            float *rstd, const float *addb, float *res, long rows, int C, float eps,
                            int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < rows; i++) {
        const float *xr = x + i * C;
        float *yr = y + i * C;
        const int nk = C < 8 ? C : 8;
        float k = 0.0f, s1 = 0.0f, s2 = 0.0f;
#pragma omp simd reduction(+ : k)
        for (int j = 0; j < nk; j++) k += xr[j];
        k /= nk;
#pragma omp simd reduction(+ : s1, s2)
        for (int j = 0; j < C; j++) {
            const float d = xr[j] - k;
            s1 += d;
            s2 += d * d;
        }
        const float d1 = s1 / C, var = s2 / C - d1 * d1, m = k + d1;
        const float rs = 1.0f / sqrtf((var > 0.0f ? var : 0.0f) + eps);
#pragma omp simd
        for (int j = 0; j < C; j++) yr[j] = (xr[j] - m) * rs * w[j] + b[j];
        if (res) { /* the residual, x + addb, for the MLP to add its product into */
            float *rr = res + i * C;
#pragma omp simd
            for (int j = 0; j < C; j++) rr[j] = xr[j] + addb[j];
        }
        mean[i] = m;
        rstd[i] = rs;
    }
}

#define LN_CHUNK 32 /* rows per partial sum of dw and db */

/* dx = rstd (g - mean(g) - xhat mean(g xhat)) with g = dy w, xhat = (x - mean) rstd, plus dres
 * (a gradient that also reaches x: the residual's) where given; dw = sum over rows of dy xhat,
 * db = sum of dy, and with dres_sum also the sum of dres over rows (the gradient of the bias
 * added into the residual). These are summed per chunk of LN_CHUNK rows, and the chunks' sums
 * added in order, in double: the chunks depend on the row count only, so they are the same
 * bits whatever the thread count. Returns 1 if out of memory. */
WIDE int layernorm_backward(const float *dy, const float *x, const float *w, const float *mean,
                            const float *rstd, const float *dres, float *dx, float *dw, float *db,
                            float *dres_sum, long rows, int C, int threads) {
    const long chunks = (rows + LN_CHUNK - 1) / LN_CHUNK;
    const int parts = dres && dres_sum ? 3 : 2; /* dw, db and the column sums of dres per chunk */
    float *partial = malloc(sizeof(float) * parts * C * (chunks ? chunks : 1));
    if (!partial) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long c = 0; c < chunks; c++) {
        float *pw = partial + parts * c * C, *pb = pw + C, *pr = parts == 3 ? pb + C : NULL;
        memset(pw, 0, sizeof(float) * parts * C);
        const long end = (c + 1) * LN_CHUNK < rows ? (c + 1) * LN_CHUNK : rows;
        for (long i = c * LN_CHUNK; i < end; i++) {
            const float *g = dy + i * C, *xr = x + i * C, m = mean[i], rs = rstd[i];
            float *d = dx + i * C, a = 0.0f, bs = 0.0f;
#pragma omp simd reduction(+ : a, bs)
            for (int j = 0; j < C; j++) {
                const float gw = g[j] * w[j], xh = (xr[j] - m) * rs;
                a += gw;
                bs += gw * xh;
                pw[j] += g[j] * xh;
                pb[j] += g[j];
            }
            a /= C;
            bs /= C;
            const float *dr = dres ? dres + i * C : NULL;
            if (dr && pr) {
#pragma omp simd
                for (int j = 0; j < C; j++) {
                    d[j] = rs * (g[j] * w[j] - a - (xr[j] - m) * rs * bs) + dr[j];
                    pr[j] += dr[j];
                }
            } else if (dr) {
#pragma omp simd
                for (int j = 0; j < C; j++) d[j] = rs * (g[j] * w[j] - a - (xr[j] - m) * rs * bs) + dr[j];
            } else {
#pragma omp simd
                for (int j = 0; j < C; j++) d[j] = rs * (g[j] * w[j] - a - (xr[j] - m) * rs * bs);
            }
        }
    }
    for (int j = 0; j < C; j++) {
        double sw = 0.0, sb = 0.0, sr = 0.0;
        for (long c = 0; c < chunks; c++) {
            sw += partial[parts * c * C + j];
            sb += partial[(parts * c + 1) * C + j];
            if (parts == 3) sr += partial[(parts * c + 2) * C + j];
        }
        dw[j] = (float)sw;
        db[j] = (float)sb;
        if (parts == 3) dres_sum[j] = (float)sr;
    }
    free(partial);
    return 0;
}

/* Mean cross-entropy of rows x V logits z against targets (rows with target == ignore are left
 * out of the mean, as torch's ignore_index), fused with its gradient: grad = (softmax(z) -
 * onehot(target)) / counted rows, 0 on ignored rows. rowloss: scratch, one float per row.
 * Returns 0, or 1 (nothing computed) if a target is neither in [0, V) nor ignore. */
int xent_forward(const float *z, const int64_t *target, float *grad, float *rowloss, float *loss,
                 long rows, int V, int64_t ignore, int threads) {
    long counted = 0;
    for (long i = 0; i < rows; i++) {
        if (target[i] == ignore) continue;
        if (target[i] < 0 || target[i] >= V) return 1;
        counted++;
    }
    const float inv_n = 1.0f / (float)counted; /* inf when every row is ignored: unused then */
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long i = 0; i < rows; i++) {
        const float *zr = z + i * V;
        float *g = grad + i * V;
        if (target[i] == ignore) {
            memset(g, 0, sizeof(float) * V);
            rowloss[i] = 0.0f;
            continue;
        }
        float m = -INFINITY, s = 0.0f;
#pragma omp simd reduction(max : m)
        for (int j = 0; j < V; j++) m = zr[j] > m ? zr[j] : m;
        /* exact 0 far below the max (as torch's exp gives), never a subnormal */
        MAP8(V, zr, g, (v8f)((x - m > -80.0f) & (v8i)vexp(x - m)));
#pragma omp simd reduction(+ : s)
        for (int j = 0; j < V; j++) s += g[j];
        rowloss[i] = m + logf(s) - zr[target[i]];
        const float scale = inv_n / s;
#pragma omp simd
        for (int j = 0; j < V; j++) g[j] *= scale;
        g[target[i]] -= inv_n;
    }
    double total = 0.0; /* in row order: the same bits whatever the thread count */
    for (long i = 0; i < rows; i++) total += rowloss[i];
    *loss = (float)(total / counted); /* 0/0 = nan when every row is ignored, as torch */
    return 0;
}

/* RoPE's rotation of rows of D floats (D even, h = D / 2 the half), with tables c, s of D floats
 * per position t:
 *   forward    y = x c + rotate_half(x) s, rotate_half(x) = (-x2, x1) for the halves x1, x2
 *   transpose  dx = g c + (g2 s2, -g1 s1), the same map transposed: the backward
 * x and y are (B, H, T, D) with (batch, head, row) strides xs, ys and a unit last stride (the
 * head-major views the model makes), c and s contiguous (T, D). Rows are independent. */
void rope_rotate(const float *x, const long *xs, float *y, const long *ys, const float *c, const float *s,
                 int B, int H, int T, int D, int transpose, int threads) {
    const int h = D / 2;
    const float sign = transpose ? -1.0f : 1.0f;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (long row = 0; row < (long)B * H * T; row++) {
        const int t = (int)(row % T), hd = (int)(row / T % H), b = (int)(row / T / H);
        const float *xr = x + b * xs[0] + hd * xs[1] + t * xs[2], *cr = c + (long)t * D, *sr = s + (long)t * D;
        float *yr = y + b * ys[0] + hd * ys[1] + t * ys[2];
        /* forward: s of the output's own dimension; transpose: s of the input's (the other half) */
        const float *s1 = transpose ? sr + h : sr, *s2 = transpose ? sr : sr + h;
#pragma omp simd
        for (int d = 0; d < h; d++) {
            const float x1 = xr[d], x2 = xr[d + h];
            yr[d] = x1 * cr[d] - sign * x2 * s1[d];
            yr[d + h] = x2 * cr[d + h] + sign * x1 * s2[d];
        }
    }
}
