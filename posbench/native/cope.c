/* CoPE attention's row-wise middle in C: the part that PyTorch can only do in ~25 passes over
 * (B, H, Tq, Tk) tensors. The matrix products stay in PyTorch (posbench/native/__init__.py).
 * The formula and the pure-PyTorch reference are CoPE and CoPEBias in posbench/schemes.py;
 * tests/test_native.py checks this file against them, values and gradients.
 *
 * For one query row i, with n keys visible and L_j = q_i.k_j (unscaled), E_p = q_i.e[p]:
 *   forward   g_j = sigmoid(L_j s)               s = 1 / sqrt(head dim)
 *             pos_j = min(sum_{t=j..n-1} g_t, P-1)
 *             score_j = L_j s + E[lo] + w (E[hi] - E[lo]),  lo = floor(pos_j), w = pos_j - lo
 *             prob_j = softmax(score)_j                      (0 for the n..Tk-1 unseen keys)
 *   backward  from dprob: dscore, then dE (the two interpolation weights), dpos_j =
 *             dscore_j (E[hi] - E[lo]), dg_t = sum_{j<=t} dpos_j, and
 *             dL_j = s (dscore_j + dg_j g_j (1 - g_j)).
 * Rows are split over OpenMP threads; loaded after torch, this uses torch's own OpenMP runtime
 * (same soname), so the two share one pool of threads instead of fighting over the cores.
 * Every row is computed the same way whatever the thread count, so results are reproducible. */
#include "vmath.h"
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_thread_num() 0
#endif


/* position c, clamped to P-1, lies between table rows lo and hi = lo+1 (hi = lo at the clamp);
 * returns the weight of hi */
INLINE float interpolation(double c, int P, int *lo, int *hi) {
    double p = c < P - 1 ? c : P - 1;
    *lo = (int)p;
    *hi = *lo < P - 1 ? *lo + 1 : *lo;
    return (float)(p - *lo);
}

/* The scans carry one running sum per row, each step waiting on the last. The same query
 * row of R (batch, head) pairs sees the same keys, so R rows are scanned side by side: R
 * independent chains that the CPU overlaps. R is 4, or 1 for what is left over. */

INLINE void scan_forward(int R, float **S, float **G, const float **E, int n, int P, float *mx) {
    double c[4] = {0, 0, 0, 0}; /* in double, as torch's cumsum accumulates fp32 */
    float m[4] = {-3e38f, -3e38f, -3e38f, -3e38f};
    for (int j = n - 1; j >= 0; j--) {
        for (int r = 0; r < R; r++) {
            c[r] += G[r][j];
            int lo, hi;
            float w = interpolation(c[r], P, &lo, &hi);
            float s = S[r][j] + E[r][lo] + w * (E[r][hi] - E[r][lo]);
            S[r][j] = s;
            m[r] = s > m[r] ? s : m[r];
        }
    }
    for (int r = 0; r < R; r++) mx[r] = m[r];
}

INLINE void scan_backward(int R, float **dS, float **G, const float **E, float **dE, float **dpos,
                          int n, int P) {
    double c[4] = {0, 0, 0, 0};
    for (int j = n - 1; j >= 0; j--) {
        for (int r = 0; r < R; r++) {
            c[r] += G[r][j];
            int lo, hi;
            float w = interpolation(c[r], P, &lo, &hi), d = dS[r][j];
            dE[r][lo] += d - d * w;
            dE[r][hi] += d * w;
            dpos[r][j] = d * (E[r][hi] - E[r][lo]); /* 0 once clamped, where hi == lo */
        }
    }
}

INLINE void scan_gates(int R, float **dS, float **G, float **dpos, int n, float scale) {
    float acc[4] = {0, 0, 0, 0};
    for (int t = 0; t < n; t++) {
        for (int r = 0; r < R; r++) {
            acc[r] += dpos[r][t]; /* gate t is counted in the positions of keys j <= t */
            float g = G[r][t];
            dS[r][t] = (dS[r][t] + acc[r] * g * (1.0f - g)) * scale;
        }
    }
}

/* S: q.k in, probabilities out; G: gates out */
static void forward_rows(int R, float **S, float **G, const float **E, int n, int Tk, int P,
                         float scale) {
    float mx[4];
    for (int r = 0; r < R; r++) {
        MAP8(n, S[r], S[r], x * scale);
        MAP8(n, S[r], G[r], 1.0f / (1.0f + vexp(-x)));
    }
    if (R == 4)
        scan_forward(4, S, G, E, n, P, mx);
    else
        scan_forward(1, S, G, E, n, P, mx);
    for (int r = 0; r < R; r++) {
        float *s = S[r], m = mx[r], sum = 0.0f;
        MAP8(n, s, s, vexp(x - m));
#pragma omp simd reduction(+ : sum)
        for (int j = 0; j < n; j++) sum += s[j];
        float inv = 1.0f / sum;
#pragma omp simd
        for (int j = 0; j < n; j++) s[j] *= inv;
        for (int j = n; j < Tk; j++) s[j] = G[r][j] = 0.0f;
    }
}

/* dS: d probabilities in, d (q.k) out; dE: d (q.e) out */
static void backward_rows(int R, float **dS, const float **Pr, float **G, const float **E,
                          float **dE, float **dpos, int n, int Tk, int P, float scale) {
    for (int r = 0; r < R; r++) { /* through the softmax */
        float *d = dS[r], delta = 0.0f;
        const float *p = Pr[r];
#pragma omp simd reduction(+ : delta)
        for (int j = 0; j < n; j++) delta += p[j] * d[j];
#pragma omp simd
        for (int j = 0; j < n; j++) d[j] = p[j] * (d[j] - delta);
        memset(dE[r], 0, sizeof(float) * P);
    }
    if (R == 4) {
        scan_backward(4, dS, G, E, dE, dpos, n, P);
        scan_gates(4, dS, G, dpos, n, scale);
    } else {
        scan_backward(1, dS, G, E, dE, dpos, n, P);
        scan_gates(1, dS, G, dpos, n, scale);
    }
    for (int r = 0; r < R; r++)
        for (int j = n; j < Tk; j++) dS[r][j] = 0.0f;
}

/* pairs (batch, head) of Tq rows each; row i sees the first nvis[i] keys. scratch: 4 Tk floats
 * per thread, backward only (allocated by the caller, so nothing here can fail) */
static void run(int backward, float *S, const float *Pr, float *G, const float *E, float *dE,
                const int *nvis, float *scratch, long pairs, int Tq, int Tk, int P, float scale,
                int threads) {
    const long groups = (pairs + 3) / 4;
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        float *buf = backward ? scratch + (size_t)omp_get_thread_num() * 4 * Tk : NULL;
#pragma omp for schedule(static)
        for (long task = 0; task < groups * Tq; task++) {
            long bh = task / Tq * 4;
            int i = (int)(task % Tq), left = pairs - bh < 4 ? (int)(pairs - bh) : 4;
            int R = left == 4 ? 4 : 1;
            for (int first = 0; first < left; first += R) {
                float *s[4], *g[4], *de[4], *dpos[4];
                const float *e[4], *pr[4];
                for (int r = 0; r < R; r++) {
                    long row = (bh + first + r) * Tq + i;
                    s[r] = S + row * Tk;
                    g[r] = G + row * Tk;
                    e[r] = E + row * P;
                    if (backward) {
                        pr[r] = Pr + row * Tk;
                        de[r] = dE + row * P;
                        dpos[r] = buf + r * Tk;
                    }
                }
                if (backward)
                    backward_rows(R, s, pr, g, e, de, dpos, nvis[i], Tk, P, scale);
                else
                    forward_rows(R, s, g, e, nvis[i], Tk, P, scale);
            }
        }
    }
}

void cope_forward(float *S, float *G, const float *E, const int *nvis, long pairs, int Tq, int Tk,
                  int P, float scale, int threads) {
    run(0, S, NULL, G, E, NULL, nvis, NULL, pairs, Tq, Tk, P, scale, threads);
}

/* scratch: threads * 4 * Tk floats */
void cope_backward(float *dS, const float *Pr, float *G, const float *E, float *dE,
                   const int *nvis, float *scratch, long pairs, int Tq, int Tk, int P, float scale,
                   int threads) {
    run(1, dS, Pr, G, E, dE, nvis, scratch, pairs, Tq, Tk, P, scale, threads);
}
