/* The register tiles that attention.c and cope.c build their kernels from: a (batch, head)
 * pair's keys packed transposed, R query rows scored against them at once, and the products
 * back. Tensors come as (B, H, T, D) with (batch, head, row) strides and a contiguous last dim.
 * The cache key of every kernel covers this header. */
#ifndef POSBENCH_TILES_H
#define POSBENCH_TILES_H
#include <math.h>

#include "vmath.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_thread_num() 0
#endif

enum { Q, K, V, BIAS, OUT, DOUT, DQ, DK, DV, QR, RK, DQR, DRK }; /* rows of the stride table */
/* query rows per register tile: 8 where AVX-512 has 32 vector registers for the 16 partial sums
 * of a tile (8% less backward at the default size), 4 elsewhere (AVX2's 16 would spill) */
#ifdef __AVX512F__
#define R 8
#else
#define R 4
#endif
#define CHUNK 128                              /* query rows per forward work item */
#define MAXV 16                                /* head dim at most 16 * MAXV = 256 */
#define CUTOFF -60.0f                          /* exp below this is taken as 0 */

typedef struct {
    const float *t[13]; /* q, k, v, bias, out, dout, dq, dk, dv, qr, rk, dqr, drk (bias, qr... may be NULL) */
    const long *st;     /* 13 x 3 strides: batch, head, row */
    float *lse, *ds;    /* (B, H, Tq); dS as (B, H, Tq, Tk), or NULL */
    int H, Tq, Tk, D, q0;
    float scale;
    const float *table; /* cope.c: the (D, P) position table, its gradient per pair (B, H, P, D) */
    float *dtable;
    int P;
} Args;

/* row i of tensor `which` for pair (b, h) */
INLINE float *row(const Args *a, int which, int b, int h, int i) {
    const long *s = a->st + 3 * which;
    return (float *)a->t[which] + b * s[0] + h * s[1] + i * s[2];
}

/* the first w of 16 floats (w is 16 or 8 for head dims that are multiples of 8), zeros after */
INLINE v16f load16(const float *p, int w) {
    v16f x = {0};
    memcpy(&x, p, sizeof(float) * w);
    return x;
}

INLINE void store16(float *p, v16f x, int w) { memcpy(p, &x, sizeof(float) * w); }

/* width of head-dim chunk c: 16, or 8 for the last chunk of a head dim that is 8 mod 16 */
INLINE int chunk(int D, int c) { return D - 16 * c < 16 ? D - 16 * c : 16; }

#ifdef __AVX2__
/* T[c * ld + r] = x[r * rs + c] for r, c < 8: an 8 x 8 block transposed in registers */
INLINE void transpose8(const float *x, long rs, float *T, int ld) {
    __m256 r0 = _mm256_loadu_ps(x), r1 = _mm256_loadu_ps(x + rs), r2 = _mm256_loadu_ps(x + 2 * rs),
           r3 = _mm256_loadu_ps(x + 3 * rs), r4 = _mm256_loadu_ps(x + 4 * rs), r5 = _mm256_loadu_ps(x + 5 * rs),
           r6 = _mm256_loadu_ps(x + 6 * rs), r7 = _mm256_loadu_ps(x + 7 * rs);
    __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
           t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
           t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE),
           s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE),
           s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE),
           s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    _mm256_storeu_ps(T, _mm256_permute2f128_ps(s0, s4, 0x20));
    _mm256_storeu_ps(T + ld, _mm256_permute2f128_ps(s1, s5, 0x20));
    _mm256_storeu_ps(T + 2 * ld, _mm256_permute2f128_ps(s2, s6, 0x20));
    _mm256_storeu_ps(T + 3 * ld, _mm256_permute2f128_ps(s3, s7, 0x20));
    _mm256_storeu_ps(T + 4 * ld, _mm256_permute2f128_ps(s0, s4, 0x31));
    _mm256_storeu_ps(T + 5 * ld, _mm256_permute2f128_ps(s1, s5, 0x31));
    _mm256_storeu_ps(T + 6 * ld, _mm256_permute2f128_ps(s2, s6, 0x31));
    _mm256_storeu_ps(T + 7 * ld, _mm256_permute2f128_ps(s3, s7, 0x31));
}
#endif

/* keys j < n of pair (b, h), transposed into T[d * ld + j], zero-padded to ld (a multiple of
 * 16). With AVX2, 8 x 8 blocks at a time in registers: a scalar transpose is a large share of
 * the attention kernels' time */
static void pack_t(const Args *a, int which, int b, int h, int n, int ld, float *T) {
    const float *x = row(a, which, b, h, 0);
    const long rs = a->st[3 * which + 2];
    int j0 = 0;
#ifdef __AVX2__
    if (a->D % 8 == 0)
        for (; j0 + 8 <= n; j0 += 8)
            for (int d = 0; d < a->D; d += 8) transpose8(x + j0 * rs + d, rs, T + d * ld + j0, ld);
#endif
    for (int d = 0; d < a->D; d++) /* the rest: contiguous writes, faster than contiguous reads */
        for (int j = j0; j < n; j++) T[d * ld + j] = x[j * rs + d];
    for (int d = 0; d < a->D; d++) memset(T + d * ld + n, 0, sizeof(float) * (ld - n));
}

/* S[r * ld + j] = scale * x_r . T[:, j] for R rows x_r and columns j < nc (nc rounded to 16) */
INLINE void rows_times_t(const float *x[R], const float *T, int ld, int nc, int D, float scale,
                         float *S) {
    for (int j = 0; j < nc; j += 16) {
        /* even and odd d in separate sums: 8 independent chains keep both FMA units busy */
        v16f even[R] = {0}, odd[R] = {0};
        for (int d = 0; d < D; d += 2) {
            v16f t0 = load16(T + d * ld + j, 16), t1 = load16(T + (d + 1) * ld + j, 16);
            for (int r = 0; r < R; r++) {
                even[r] += x[r][d] * t0;
                odd[r] += x[r][d + 1] * t1;
            }
        }
        for (int r = 0; r < R; r++) store16(S + r * ld + j, (even[r] + odd[r]) * scale, 16);
    }
}

/* y_r = scale_r * sum_{j < n} W[r * ld + j] M_j for R rows, M_j = M + j * rs (D floats) */
INLINE void weights_times_mat(const float *M, long rs, const float *W, int ld, int n, int D,
                              const float scale[R], float *y[R]) {
    const int nv = (D + 15) / 16;
    v16f acc[R][MAXV] = {{0}};
    for (int j = 0; j < n; j++) {
        const float *m = M + j * rs;
        for (int c = 0; c < nv; c++) {
            v16f x = load16(m + 16 * c, chunk(D, c));
            for (int r = 0; r < R; r++) acc[r][c] += W[r * ld + j] * x;
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++) store16(y[r] + 16 * c, acc[r][c] * scale[r], chunk(D, c));
}

/* the same over the rows of tensor `which` for pair (b, h) */
INLINE void weights_times_rows(const Args *a, int which, int b, int h, const float *W, int ld,
                               int n, int D, const float scale[R], float *y[R]) {
    weights_times_mat(row(a, which, b, h, 0), a->st[3 * which + 2], W, ld, n, D, scale, y);
}

/* M_j += scale * sum_r W[r * ld + j] x_r for j < n: the transposed product, into the rows of M
 * (D floats each, contiguous: a pair's dk or dv, which stay in L1 as the tiles go by). Two rows
 * of M at a time, each summing its even and odd r apart: four independent chains of R/2
 * multiply-adds, where one chain of R per row left the FMA units waiting on each other's
 * results (this was a fifth of the attention backward's time) */
INLINE void accumulate_rows(float *M, const float *W, int ld, int n, int D, float scale, const float *x[R]) {
    const int nv = (D + 15) / 16;
    v16f xs[R][MAXV];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nv; c++) xs[r][c] = load16(x[r] + 16 * c, chunk(D, c)) * scale;
    int j = 0;
    for (; j + 2 <= n; j += 2) {
        float *m0 = M + (long)j * D, *m1 = m0 + D;
        for (int c = 0; c < nv; c++) {
            v16f a0 = load16(m0 + 16 * c, chunk(D, c)), a1 = load16(m1 + 16 * c, chunk(D, c)), e0 = {0}, e1 = {0};
            for (int r = 0; r < R; r += 2) {
                a0 += W[r * ld + j] * xs[r][c];
                e0 += W[(r + 1) * ld + j] * xs[r + 1][c];
                a1 += W[r * ld + j + 1] * xs[r][c];
                e1 += W[(r + 1) * ld + j + 1] * xs[r + 1][c];
            }
            store16(m0 + 16 * c, a0 + e0, chunk(D, c));
            store16(m1 + 16 * c, a1 + e1, chunk(D, c));
        }
    }
    for (; j < n; j++) {
        float *m = M + (long)j * D;
        for (int c = 0; c < nv; c++) {
            v16f acc = load16(m + 16 * c, chunk(D, c)), e = {0};
            for (int r = 0; r < R; r += 2) {
                acc += W[r * ld + j] * xs[r][c];
                e += W[(r + 1) * ld + j] * xs[r + 1][c];
            }
            store16(m + 16 * c, acc + e, chunk(D, c));
        }
    }
}


static const v16i LANES = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

/* a vector's 16 lanes summed, and their largest, as trees of halves: four dependent steps where
 * a lane-by-lane loop was fifteen (with exp_row's, a quarter of the forward's time). In
 * registers with AVX (through memory, the halves' loads stall on the whole vector's store) */
#if defined(__AVX512F__)
INLINE float hsum16(v16f x) { return _mm512_reduce_add_ps((__m512)x); }
INLINE float hmax16(v16f x) { return _mm512_reduce_max_ps((__m512)x); }
#elif defined(__AVX2__)
INLINE __m128 halves8(v16f x, int max) { /* the 16 lanes folded to 4 */
    __m256 lo, hi;
    memcpy(&lo, &x, sizeof lo);
    memcpy(&hi, (const char *)&x + sizeof lo, sizeof hi);
    __m256 h = max ? _mm256_max_ps(lo, hi) : _mm256_add_ps(lo, hi);
    __m128 a = _mm256_castps256_ps128(h), b = _mm256_extractf128_ps(h, 1);
    return max ? _mm_max_ps(a, b) : _mm_add_ps(a, b);
}
INLINE float hsum16(v16f x) {
    __m128 v = halves8(x, 0);
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
INLINE float hmax16(v16f x) {
    __m128 v = halves8(x, 1);
    v = _mm_max_ps(v, _mm_movehl_ps(v, v));
    return _mm_cvtss_f32(_mm_max_ss(v, _mm_movehdup_ps(v)));
}
#else
INLINE float hsum16(v16f x) {
    float t[16];
    memcpy(t, &x, sizeof t);
    for (int w = 8; w > 0; w /= 2)
        for (int c = 0; c < w; c++) t[c] += t[c + w];
    return t[0];
}
INLINE float hmax16(v16f x) {
    float t[16];
    memcpy(t, &x, sizeof t);
    for (int w = 8; w > 0; w /= 2)
        for (int c = 0; c < w; c++) t[c] = t[c + w] > t[c] ? t[c + w] : t[c];
    return t[0];
}
#endif

/* the largest of the n visible s[j] (the row runs on to nc, a multiple of 16) */
INLINE float row_max(const float *s, int n, int nc) {
    v16f m = (v16f){0} - INFINITY;
    for (int j = 0; j < nc; j += 16) {
        v16f x = load16(s + j, 16);
        v16i more = (LANES + j < n) & (x > m);
        m = (v16f)((more & (v16i)x) | (~more & (v16i)m));
    }
    return hmax16(m);
}

/* s[j] = exp(s[j] - m) for the n visible keys, 0 for the rest of the row up to nc; the sum.
 * Below e^CUTOFF it is an exact 0: never a subnormal */
INLINE float exp_row(float *s, int n, int nc, float m) {
    v16f acc = {0};
    for (int j = 0; j < nc; j += 16) {
        v16f x = load16(s + j, 16) - m;
        v16f e = (v16f)((LANES + j < n) & ~(x < CUTOFF) & (v16i)vexp16(x)); /* NaN stays NaN */
        store16(s + j, e, 16);
        acc += e;
    }
    return hsum16(acc);
}

INLINE float dot(const float *x, const float *y, int D) {
    v16f acc = {0};
    for (int c = 0; c < (D + 15) / 16; c++) acc += load16(x + 16 * c, chunk(D, c)) * load16(y + 16 * c, chunk(D, c));
    return hsum16(acc);
}

/* The query rows i0..i0+R-1 of pair (b, h) (rows past Tq repeat the last and are not written) */
INLINE int tile_rows(const Args *a, int which, int b, int h, int i0, int n[R], const float *x[R]) {
    int hi = 0;
    for (int r = 0; r < R; r++) {
        int i = i0 + r < a->Tq ? i0 + r : a->Tq - 1;
        n[r] = a->q0 + i + 1 < a->Tk ? a->q0 + i + 1 : a->Tk;
        x[r] = row(a, which, b, h, i);
        hi = n[r] > hi ? n[r] : hi;
    }
    return hi; /* keys the tile sees */
}

INLINE int round16(int n) { return (n + 15) & ~15; }

/* the head dim as a compile-time constant where it is a common one, so tiles stay in registers */
#define BY_HEAD_DIM(CALL)        \
    switch (a->D) {              \
    case 16: CALL(16); break;    \
    case 32: CALL(32); break;    \
    case 64: CALL(64); break;    \
    case 128: CALL(128); break;  \
    default: CALL(a->D); break;  \
    }


/* forward_item and backward_item over a file's forward_chunk and backward_pair, the head dim a
 * compile-time constant where it is a common one. A kernel defines those two, then DEFINE_ITEMS */
#define FWD_CALL(Dc) forward_chunk(a, b, h, i0, i1, buf, Dc)
#define BWD_CALL(Dc) backward_pair(a, b, h, buf, Dc)
#define DEFINE_ITEMS                                                                    \
    static void forward_item(const Args *a, int b, int h, int i0, int i1, float *buf) { \
        BY_HEAD_DIM(FWD_CALL)                                                           \
    }                                                                                   \
    static void backward_item(const Args *a, int b, int h, float *buf) { BY_HEAD_DIM(BWD_CALL) }

typedef void (*ChunkFn)(const Args *a, int b, int h, int i0, int i1, float *buf);
typedef void (*PairFn)(const Args *a, int b, int h, float *buf);

/* the forward's work: every CHUNK rows of every (batch, head) pair, split over the threads in
 * a fixed order; each thread has `per` floats of scratch */
static void run_chunks(const Args *a, int B, ChunkFn fn, float *scratch, long per, int threads) {
    const int H = a->H, Tq = a->Tq;
    const long chunks = (Tq + CHUNK - 1) / CHUNK;
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        float *buf = scratch + per * omp_get_thread_num();
#pragma omp for schedule(static)
        for (long item = 0; item < (long)B * H * chunks; item++) {
            long pair = item / chunks;
            int i0 = (int)(item % chunks) * CHUNK, i1 = i0 + CHUNK < Tq ? i0 + CHUNK : Tq;
            fn(a, (int)(pair / H), (int)(pair % H), i0, i1, buf);
        }
    }
}

/* the backward's work: every (batch, head) pair whole (its key and value gradients sum over
 * all its rows), split over the threads */
static void run_pairs(const Args *a, int B, PairFn fn, float *scratch, long per, int threads) {
    (void)threads;
#pragma omp parallel num_threads(threads)
    {
        float *buf = scratch + per * omp_get_thread_num();
#pragma omp for schedule(static)
        for (long pair = 0; pair < (long)B * a->H; pair++) fn(a, (int)(pair / a->H), (int)(pair % a->H), buf);
    }
}

#endif
