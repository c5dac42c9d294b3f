/* Causal attention in C: softmax(q.k s + bias, future masked) v, s = 1 / sqrt(head dim), and its
 * backward, fused so that a (batch, head) pair's keys and values stay in cache while its rows are
 * scored. At the lengths posbench trains (~100) PyTorch's CPU attention is dominated by the
 * overhead of its many small block products; here each is a register tile of R query rows.
 * The reference is posbench/attention.py (SDPA, and BiasedAttention for a learned bias);
 * tests/test_native.py checks this file against it, values and gradients.
 *
 * For query row i (global index q0 + i) and the n_i = q0 + i + 1 keys it sees:
 *   forward   S_ij = s q_i.k_j + b_ij,  P_ij = exp(S_ij - lse_i),  o_i = sum_j P_ij v_j,
 *             lse_i = log sum_j exp(S_ij)                      (saved for the backward)
 *   backward  P recomputed from lse, dP_ij = do_i.v_j, D_i = do_i.o_i, dS_ij = P_ij (dP_ij - D_i)
 *             db_ij = dS_ij,  dq_i = s sum_j dS_ij k_j,  dk_j = s sum_i dS_ij q_i,
 *             dv_j = sum_i P_ij do_i
 * With a relative term (Transformer-XL's position term: qr and rk given), each score also gets
 *   s qr_i.rk[q0 + i - j]        (rk: one row per distance 0..Tk-1, shared by the batch)
 * computed in the same register tiles from a reversed, transposed copy of rk, so the (T, T)
 * bias is never written, and its backward gives dqr_i = s sum_j dS_ij rk[q0+i-j] and
 * drk[d] = s sum_{i-j=d} dS_ij qr_i (per batch row; the caller sums them).
 * Every tensor is passed with its (batch, head, row) strides and a contiguous last dim, so the
 * head-major views of the qkv projection are read in place. Probabilities below exp(-60) are
 * exact zeros (subnormal floats make every product with them ~100x slower; see TINY_PROB).
 * Work is split over OpenMP threads (torch's own pool, see cope.c) by whole rows or pairs, each
 * computed the same way whatever the thread count, so results are reproducible. */
#include "tiles.h"

#define PAD 16 /* zero columns before the reversed rk: a tile's window starts up to R-1 early */

/* S row r gets the bias of query i over its n keys */
INLINE void add_bias(const Args *a, int b, int h, int i, int n, float *s) {
    if (a->t[BIAS]) {
        const float *bias = row(a, BIAS, b, h, i);
        for (int j = 0; j < n; j++) s[j] += bias[j];
    }
}

/* columns of the reversed rk: PAD zeros, Tk distances (Tk-1 first), zeros that a window's
 * last 16-wide load may reach (see rel_scores) */
INLINE int rel_ld(int Tk) { return PAD + round16(Tk) + 32; }

/* rk's Tk rows reversed: column PAD + Tk-1-d of RT holds distance d, transposed (RT[dd * ldr + c])
 * for the score tiles; the same, untransposed (RR[c * D + dd]), for the products back */
static void pack_rel(const Args *a, int b, int h, int ldr, float *RT, float *RR) {
    const int D = a->D, Tk = a->Tk;
    memset(RT, 0, sizeof(float) * D * ldr);
    if (RR) memset(RR, 0, sizeof(float) * D * ldr);
    for (int d = 0; d < Tk; d++) {
        const float *x = row(a, RK, b, h, d);
        const int c = PAD + Tk - 1 - d;
        for (int dd = 0; dd < D; dd++) RT[dd * ldr + c] = x[dd];
        if (RR) memcpy(RR + (long)c * D, x, sizeof(float) * D);
    }
}

/* the relative scores of the tile at row i, added to its scores S: row r's score for key j is
 * first computed into W[r * ldr + R-1-r + j] (rows skewed so that one window of the table
 * serves them all); returns the window's first column */
INLINE int rel_scores(const Args *a, int i, const float *qr[R], const float *RT, int ldr, int nc,
                      int D, float *W, float *S, int ld) {
    const int start = PAD + (a->Tk - 1 - a->q0 - i) - (R - 1); /* distance q0+i+R-1 to key 0 */
    rows_times_t(qr, RT + start, ldr, nc + 16, D, a->scale, W);
    for (int r = 0; r < R; r++)
        for (int j = 0; j < nc; j++) S[r * ld + j] += W[r * ldr + R - 1 - r + j];
    return start;
}

INLINE void forward_chunk(const Args *a, int b, int h, int i0, int i1, float *buf, int D) {
    const int nk = a->q0 + i1 < a->Tk ? a->q0 + i1 : a->Tk, ld = round16(nk);
    float *KT = buf, *S = buf + D * ld;
    const int rel = a->t[QR] != NULL, ldr = rel_ld(a->Tk);
    float *RT = S + (R + 1) * ld + D, *W = RT + D * ldr; /* rel only */
    pack_t(a, K, b, h, nk, ld, KT);
    if (rel) pack_rel(a, b, h, ldr, RT, NULL);
    for (int i = i0; i < i1; i += R) {
        int n[R];
        const float *q[R], *qr[R] = {0};
        float *o[R];
        int hi = tile_rows(a, Q, b, h, i, n, q), nc = round16(hi);
        rows_times_t(q, KT, ld, nc, D, a->scale, S);
        if (rel) {
            tile_rows(a, QR, b, h, i, n, qr);
            rel_scores(a, i, qr, RT, ldr, nc, D, W, S, ld);
        }
        float inv[R]; /* each row's 1 / sum: applied to its output, not to every probability */
        for (int r = 0; r < R; r++) {
            int ir = i + r < a->Tq ? i + r : a->Tq - 1;
            float *s = S + r * ld;
            add_bias(a, b, h, ir, n[r], s);
            float m = row_max(s, n[r], nc), sum = exp_row(s, n[r], nc, m);
            inv[r] = 1.0f / sum;
            if (i + r < a->Tq) a->lse[((long)b * a->H + h) * a->Tq + i + r] = m + logf(sum);
            o[r] = i + r < a->Tq ? row(a, OUT, b, h, i + r) : S + R * ld; /* spare row: dropped */
        }
        weights_times_rows(a, V, b, h, S, ld, hi, D, inv, o);
    }
}

INLINE void backward_pair(const Args *a, int b, int h, float *buf, int D) {
    const int nk = a->q0 + a->Tq < a->Tk ? a->q0 + a->Tq : a->Tk, ld = round16(nk);
    float *KT = buf, *VT = buf + D * ld, *P = VT + D * ld, *dS = P + R * ld;
    float *spare = dS + R * ld; /* D floats for rows past Tq */
    float *dK = spare + D, *dV = dK + (long)a->Tk * D; /* (Tk, D) each, copied out at the end */
    const int rel = a->t[QR] != NULL, ldr = rel_ld(a->Tk);
    float *RT = dV + (long)a->Tk * D, *RR = RT + D * ldr, *dRR = RR + D * ldr, *W = dRR + D * ldr;
    pack_t(a, K, b, h, nk, ld, KT);
    pack_t(a, V, b, h, nk, ld, VT);
    memset(dK, 0, sizeof(float) * 2 * a->Tk * D);
    if (rel) {
        pack_rel(a, b, h, ldr, RT, RR);
        memset(dRR, 0, sizeof(float) * D * ldr);
    }
    for (int i = 0; i < a->Tq; i += R) {
        int n[R], start = 0;
        const float *q[R], *dout[R], *qr[R] = {0};
        float *dq[R], *dqr[R];
        int hi = tile_rows(a, Q, b, h, i, n, q), nc = round16(hi);
        tile_rows(a, DOUT, b, h, i, n, dout);
        rows_times_t(q, KT, ld, nc, D, a->scale, P);
        if (rel) {
            tile_rows(a, QR, b, h, i, n, qr);
            start = rel_scores(a, i, qr, RT, ldr, nc, D, W, P, ld);
        }
        rows_times_t(dout, VT, ld, nc, D, 1.0f, dS); /* dP */
        for (int r = 0; r < R; r++) {
            int ir = i + r < a->Tq ? i + r : a->Tq - 1, valid = i + r < a->Tq;
            float *p = P + r * ld, *ds = dS + r * ld;
            float lse = a->lse[((long)b * a->H + h) * a->Tq + ir];
            add_bias(a, b, h, ir, n[r], p);
            /* a row past Tq repeats the last: no visible keys, so it adds nothing to dk and dv */
            exp_row(p, valid ? n[r] : 0, nc, lse);
            float delta = dot(dout[r], row(a, OUT, b, h, ir), D);
#pragma omp simd
            for (int j = 0; j < nc; j++) ds[j] = p[j] * (ds[j] - delta);
            if (a->ds && valid) {
                float *out = a->ds + (((long)b * a->H + h) * a->Tq + ir) * a->Tk;
                memcpy(out, ds, sizeof(float) * n[r]);
                memset(out + n[r], 0, sizeof(float) * (a->Tk - n[r]));
            }
            dq[r] = valid ? row(a, DQ, b, h, ir) : spare;
        }
        float scales[R];
        for (int r = 0; r < R; r++) scales[r] = a->scale;
        weights_times_rows(a, K, b, h, dS, ld, hi, D, scales, dq);
        accumulate_rows(dK, dS, ld, hi, D, a->scale, q);
        accumulate_rows(dV, P, ld, hi, D, 1.0f, dout);
        if (rel) { /* dS skewed as the scores were: then one window of rk serves every row */
            memset(W, 0, sizeof(float) * R * ldr);
            for (int r = 0; r < R; r++) {
                memcpy(W + r * ldr + R - 1 - r, dS + r * ld, sizeof(float) * nc);
                dqr[r] = i + r < a->Tq ? (float *)row(a, DQR, b, h, i + r) : spare;
            }
            weights_times_mat(RR + (long)start * D, D, W, ldr, nc + R - 1, D, scales, dqr);
            accumulate_rows(dRR + (long)start * D, W, ldr, nc + R - 1, D, a->scale, qr);
        }
    }
    for (int j = 0; j < a->Tk; j++) {
        memcpy(row(a, DK, b, h, j), dK + (long)j * D, sizeof(float) * D);
        memcpy(row(a, DV, b, h, j), dV + (long)j * D, sizeof(float) * D);
    }
    if (rel)
        for (int d = 0; d < a->Tk; d++)
            memcpy(row(a, DRK, b, h, d), dRR + (long)(PAD + a->Tk - 1 - d) * D, sizeof(float) * D);
}

DEFINE_ITEMS

/* scratch per thread, in floats: the forward's K^T, S (R rows) and a spare row; the backward's
 * K^T, V^T, P, dS, a spare row, and dk and dv (Tk x D each); with a relative term, its tables
 * (the forward's RT and skewed scores, the backward's RT, RR, dRR and skewed scores) */
long attention_scratch(int Tk, int D, int backward, int rel) {
    const long ld = round16(Tk), ldr = rel_ld(Tk);
    const long extra = rel ? (backward ? 3 * D + R : D + R) * ldr : 0;
    return extra + (backward ? (2 * D + 2 * R) * ld + D + 2L * Tk * D : (D + R + 1) * ld + D);
}

/* qr, rk: the relative term, or NULL (then the strides' rows for them are ignored) */
void attention_forward(const float *q, const float *k, const float *v, const float *bias,
                       const float *qr, const float *rk, float *out, float *lse, const long *st,
                       int B, int H, int Tq, int Tk, int D, int q0, float scale, float *scratch,
                       int threads) {
    Args a = {{q, k, v, bias, out, NULL, NULL, NULL, NULL, qr, rk}, st, lse, NULL, H, Tq, Tk, D, q0, scale};
    run_chunks(&a, B, forward_item, scratch, attention_scratch(Tk, D, 0, qr != NULL), threads);
}

/* ds: (B, H, Tq, Tk) for the bias's gradient, or NULL; dqr, drk: the relative term's (drk per
 * batch row), with qr and rk, or NULL */
void attention_backward(const float *q, const float *k, const float *v, const float *bias,
                        const float *qr, const float *rk, const float *out, const float *dout,
                        float *dq, float *dk, float *dv, float *dqr, float *drk, float *lse,
                        float *ds, const long *st, int B, int H, int Tq, int Tk, int D, int q0,
                        float scale, float *scratch, int threads) {
    Args a = {{q, k, v, bias, out, dout, dq, dk, dv, qr, rk, dqr, drk}, st, lse, ds, H, Tq, Tk, D, q0, scale};
    run_pairs(&a, B, backward_item, scratch, attention_scratch(Tk, D, 1, qr != NULL), threads);
}
