/* CoPE's whole causal attention in C, in the register tiles of tiles.h (as attention.c), so no
 * (T, T) tensor is ever written: gates, positions and probabilities live in a tile's rows, and
 * the backward recomputes them from the saved log-sum-exp. The formula and the pure-PyTorch
 * reference are CoPE's bias in posbench/schemes/cope.py; tests check this file against it,
 * values and gradients.
 *
 * For query row i (global index q0 + i), its n = q0 + i + 1 visible keys, L_j = q_i.k_j and
 * E_p = q_i.e[p] (e: the (D, P) table, column p a position's vector):
 *   forward   g_j = sigmoid(L_j s)               s = 1 / sqrt(head dim)
 *             pos_j = min(sum_{t=j..n-1} g_t, P-1)
 *             score_j = L_j s + E[lo] + w (E[hi] - E[lo]),  lo = floor(pos_j), w = pos_j - lo
 *             prob_j = softmax(score)_j,  o_i = sum_j prob_j v_j,  lse_i saved
 *   backward  dscore from dprob as in attention.c, then dE (the two interpolation weights),
 *             dpos_j = dscore_j (E[hi] - E[lo]), dg_t = sum_{j<=t} dpos_j,
 *             dL_j = s (dscore_j + dg_j g_j (1 - g_j)); dq_i = sum_j dL_j k_j + sum_p dE_p e[p],
 *             dk_j = sum_i dL_ij q_i, dv_j = sum_i prob_ij do_i, de[p] = sum_i dE_ip q_i.
 * Work is split over
 * OpenMP threads (torch's own pool: loaded after torch, this uses its OpenMP runtime, the same
 * soname, so the two share one pool instead of fighting over the cores) by rows or pairs,
 * each computed the same way whatever the thread count, so results are reproducible. */
#include "tiles.h"
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* the table (D, P) into ET[d * ldp + p], zero-padded to ldp columns, for q.e in a tile; and,
 * for the backward, its columns as rows EM[p * D + d] */
static void pack_table(const Args *a, int ldp, float *ET, float *EM) {
    const int D = a->D, P = a->P;
    for (int d = 0; d < D; d++) {
        memcpy(ET + d * ldp, a->table + (long)d * P, sizeof(float) * P);
        memset(ET + d * ldp + P, 0, sizeof(float) * (ldp - P));
        if (EM)
            for (int p = 0; p < P; p++) EM[p * D + d] = a->table[(long)d * P + p];
    }
}

/* The position scans run from the last key back, a running sum per row, so they go key by
 * key; the tile's R rows are transposed to one R-lane vector per key (XT[j * R + r]) so that
 * each step is a few vector operations over the rows rather than R scalar chains. */

/* GT[j * R + r] = sigmoid(S[r * ld + j]) for j < n[r], 0 up to hi (the tile's widest row) */
INLINE void gates(const float *S, float *GT, int ld, const int n[R], int hi) {
    for (int j = 0; j < hi; j++)
        for (int r = 0; r < R; r++) GT[j * R + r] = S[r * ld + j];
    MAP8(hi * R, GT, GT, 1.0f / (1.0f + vexp(-x)));
    for (int r = 0; r < R; r++)
        for (int j = n[r]; j < hi; j++) GT[j * R + r] = 0.0f;
}

/* one lane per tile row: doubles for the running sums, floats and ints beside them */
typedef double vRd __attribute__((vector_size(R * 8)));
typedef int64_t vRl __attribute__((vector_size(R * 8)));
typedef float vRf __attribute__((vector_size(R * 4)));
typedef int32_t vRi __attribute__((vector_size(R * 4)));

INLINE vRi row_offsets(int ldp) {
    vRi o;
    for (int r = 0; r < R; r++) o[r] = r * ldp;
    return o;
}

/* x[r] = E[r * ldp + i[r]] (at = i + r * ldp): each lane reads its own row of the tile's table */
INLINE vRf lookup(const float *E, vRi at) {
#if defined(__AVX2__) && R == 8
    return (vRf)_mm256_i32gather_ps(E, (__m256i)at, 4);
#elif defined(__AVX2__) && R == 4
    return (vRf)_mm_i32gather_ps(E, (__m128i)at, 4);
#else
    vRf x;
    for (int r = 0; r < R; r++) x[r] = E[at[r]];
    return x;
#endif
}

/* position c (the running sum), clamped to P-1, lies between table entries lo and up = lo+1
 * (up = lo at the clamp); returns the weight of up */
INLINE vRf interpolation(vRd c, vRd top, vRi *lo, vRi *up) {
    vRl under = c < top;
    vRd p = (vRd)((under & (vRl)c) | (~under & (vRl)top));
    *lo = __builtin_convertvector(p, vRi); /* p >= 0: truncation is floor */
    *up = *lo - (*lo < __builtin_convertvector(top, vRi)); /* a true lane compares as -1 */
    return __builtin_convertvector(p - __builtin_convertvector(*lo, vRd), vRf);
}

/* S[r * ld + j] += E[lo] + w (E[up] - E[lo]) at pos_j, the sum of the row's gates from j on
 * (a row's zero gates past its keys leave its sums to start at its last key); BT: R * hi floats */
INLINE void scan_scores(float *S, const float *GT, const float *E, float *BT, int ld, int ldp, int hi,
                        int P) {
    const vRd top = (vRd){0} + (P - 1);
    const vRi rows = row_offsets(ldp);
    vRd c = {0}; /* in double, as torch's cumsum accumulates fp32 */
    for (int j = hi - 1; j >= 0; j--) {
        vRf g, elo, eup;
        vRi lo, up;
        memcpy(&g, GT + j * R, sizeof g);
        c += __builtin_convertvector(g, vRd);
        vRf w = interpolation(c, top, &lo, &up);
        lo += rows, up += rows; /* from here, indexes into E (and dE) */
        elo = lookup(E, lo), eup = lookup(E, up);
        vRf b = elo + w * (eup - elo);
        memcpy(BT + j * R, &b, sizeof b);
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < hi; j++) S[r * ld + j] += BT[j * R + r];
}

/* dS: d scores in (0 past each row's keys), d logits L out; dE: d (q.e), zeroed here.
 * DT, PT: R * hi floats each (dS and dpos transposed) */
INLINE void scan_back(float *dS, const float *GT, const float *E, float *dE, float *DT, float *PT,
                      int ld, int ldp, int hi, int P, float scale) {
    for (int j = 0; j < hi; j++)
        for (int r = 0; r < R; r++) DT[j * R + r] = dS[r * ld + j];
    memset(dE, 0, sizeof(float) * R * ldp);
    const vRd top = (vRd){0} + (P - 1);
    const vRi rows = row_offsets(ldp);
    vRd c = {0};
    for (int j = hi - 1; j >= 0; j--) {
        vRf g, d, elo, eup;
        vRi lo, up;
        memcpy(&g, GT + j * R, sizeof g);
        memcpy(&d, DT + j * R, sizeof d);
        c += __builtin_convertvector(g, vRd);
        vRf w = interpolation(c, top, &lo, &up), to_lo = d - d * w, to_up = d * w;
        lo += rows, up += rows; /* from here, indexes into E (and dE) */
        elo = lookup(E, lo), eup = lookup(E, up);
        for (int r = 0; r < R; r++) {
            dE[lo[r]] += to_lo[r];
            dE[up[r]] += to_up[r];
        }
        vRf dpos = d * (eup - elo); /* 0 once clamped */
        memcpy(PT + j * R, &dpos, sizeof dpos);
    }
    vRf acc = {0};
    for (int j = 0; j < hi; j++) {
        vRf g, d, dpos;
        memcpy(&g, GT + j * R, sizeof g);
        memcpy(&d, DT + j * R, sizeof d);
        memcpy(&dpos, PT + j * R, sizeof dpos);
        acc += dpos; /* gate j is counted in the positions of keys t <= j */
        d = (d + acc * g * (1.0f - g)) * scale;
        memcpy(DT + j * R, &d, sizeof d);
    }
    for (int r = 0; r < R; r++)
        for (int j = 0; j < hi; j++) dS[r * ld + j] = DT[j * R + r];
}

/* a tile's scores S (rows of ld) from its query rows q: s q.k against the packed keys KT, plus
 * the position term, with its gates G (transposed), its q.e[p] in E and BT as scratch */
INLINE void scores(const float *q[R], const int n[R], int hi, const float *KT, const float *ET, float *S,
                   float *G, float *E, float *BT, int ld, int ldp, int D, int P, float scale) {
    rows_times_t(q, KT, ld, round16(hi), D, scale, S); /* L s */
    rows_times_t(q, ET, ldp, ldp, D, 1.0f, E);         /* q.e[p] */
    gates(S, G, ld, n, hi);
    scan_scores(S, G, E, BT, ld, ldp, hi, P);
}

INLINE void forward_chunk(const Args *a, int b, int h, int i0, int i1, float *buf, int D) {
    const int nk = a->q0 + i1 < a->Tk ? a->q0 + i1 : a->Tk, ld = round16(nk), P = a->P, ldp = round16(P);
    float *KT = buf, *S = KT + D * ld, *G = S + R * ld, *BT = G + R * ld, *ET = BT + R * ld, *E = ET + D * ldp;
    float *spare = E + R * ldp; /* D floats: the output of rows past Tq */
    pack_t(a, K, b, h, nk, ld, KT);
    pack_table(a, ldp, ET, NULL);
    for (int i = i0; i < i1; i += R) {
        int n[R];
        const float *q[R];
        float *o[R], inv[R];
        int hi = tile_rows(a, Q, b, h, i, n, q), nc = round16(hi);
        scores(q, n, hi, KT, ET, S, G, E, BT, ld, ldp, D, P, a->scale);
        for (int r = 0; r < R; r++) {
            float *s = S + r * ld, m = row_max(s, n[r], nc), sum = exp_row(s, n[r], nc, m);
            inv[r] = 1.0f / sum;
            if (i + r < a->Tq) a->lse[((long)b * a->H + h) * a->Tq + i + r] = m + logf(sum);
            o[r] = i + r < a->Tq ? row(a, OUT, b, h, i + r) : spare;
        }
        weights_times_rows(a, V, b, h, S, ld, hi, D, inv, o);
    }
}

INLINE void backward_pair(const Args *a, int b, int h, float *buf, int D) {
    const int nk = a->q0 + a->Tq < a->Tk ? a->q0 + a->Tq : a->Tk, ld = round16(nk), P = a->P, ldp = round16(P);
    float *KT = buf, *VT = KT + D * ld, *Pr = VT + D * ld, *dS = Pr + R * ld, *G = dS + R * ld;
    float *DT = G + R * ld, *PT = DT + R * ld, *ET = PT + R * ld, *EM = ET + D * ldp, *E = EM + P * D, *dE = E + R * ldp;
    float *tmp = dE + R * ldp, *spare = tmp + R * D; /* tmp: R rows of dq's table part */
    float *dK = spare + D, *dV = dK + (long)a->Tk * D, *dT = dV + (long)a->Tk * D; /* copied out at the end */
    pack_t(a, K, b, h, nk, ld, KT);
    pack_t(a, V, b, h, nk, ld, VT);
    pack_table(a, ldp, ET, EM);
    memset(dK, 0, sizeof(float) * (2L * a->Tk * D + (long)P * D));
    float ones[R], *t[R];
    for (int r = 0; r < R; r++) ones[r] = 1.0f, t[r] = tmp + r * D;
    for (int i = 0; i < a->Tq; i += R) {
        int n[R];
        const float *q[R], *dout[R];
        float *dq[R];
        int hi = tile_rows(a, Q, b, h, i, n, q), nc = round16(hi);
        tile_rows(a, DOUT, b, h, i, n, dout);
        scores(q, n, hi, KT, ET, Pr, G, E, DT, ld, ldp, D, P, a->scale);
        rows_times_t(dout, VT, ld, nc, D, 1.0f, dS); /* dP */
        for (int r = 0; r < R; r++) {
            int ir = i + r < a->Tq ? i + r : a->Tq - 1, valid = i + r < a->Tq;
            float *p = Pr + r * ld, *ds = dS + r * ld;
            /* a row past Tq repeats the last: no visible keys, so it adds nothing */
            exp_row(p, valid ? n[r] : 0, nc, a->lse[((long)b * a->H + h) * a->Tq + ir]);
            float delta = dot(dout[r], row(a, OUT, b, h, ir), D);
#pragma omp simd
            for (int j = 0; j < nc; j++) ds[j] = p[j] * (ds[j] - delta);
            dq[r] = valid ? row(a, DQ, b, h, ir) : spare;
        }
        scan_back(dS, G, E, dE, DT, PT, ld, ldp, hi, P, a->scale); /* dS: now d L */
        weights_times_rows(a, K, b, h, dS, ld, hi, D, ones, dq);
        weights_times_mat(EM, D, dE, ldp, P, D, ones, t);
        for (int r = 0; r < R; r++)
            for (int d = 0; d < D; d++) dq[r][d] += t[r][d];
        accumulate_rows(dK, dS, ld, hi, D, 1.0f, q);
        accumulate_rows(dV, Pr, ld, hi, D, 1.0f, dout);
        accumulate_rows(dT, dE, ldp, P, D, 1.0f, q);
    }
    for (int j = 0; j < a->Tk; j++) {
        memcpy(row(a, DK, b, h, j), dK + (long)j * D, sizeof(float) * D);
        memcpy(row(a, DV, b, h, j), dV + (long)j * D, sizeof(float) * D);
    }
    memcpy(a->dtable + ((long)b * a->H + h) * P * D, dT, sizeof(float) * P * D);
}

DEFINE_ITEMS

/* scratch per thread, in floats (the layouts of forward_chunk and backward_pair) */
long cope_scratch(int Tk, int D, int P, int backward) {
    const long ld = round16(Tk), ldp = round16(P);
    if (!backward) return (D + 3 * R) * ld + (D + R) * ldp + D;
    return (2 * D + 5 * R) * ld + (D + 2 * R) * ldp + 2L * P * D + (long)R * D + D + 2L * Tk * D;
}

void cope_forward(const float *q, const float *k, const float *v, const float *table, float *out,
                  float *lse, const long *st, int B, int H, int Tq, int Tk, int D, int P, int q0,
                  float scale, float *scratch, int threads) {
    Args a = {{q, k, v, NULL, out}, st, lse, NULL, H, Tq, Tk, D, q0, scale, table, NULL, P};
    run_chunks(&a, B, forward_item, scratch, cope_scratch(Tk, D, P, 0), threads);
}

/* dtable: the table's gradient per pair, (B, H, P, D); the caller sums the pairs */
void cope_backward(const float *q, const float *k, const float *v, const float *table,
                   const float *out, const float *dout, float *dq, float *dk, float *dv,
                   float *dtable, float *lse, const long *st, int B, int H, int Tq, int Tk, int D,
                   int P, int q0, float scale, float *scratch, int threads) {
    Args a = {{q, k, v, NULL, out, dout, dq, dk, dv}, st, lse, NULL, H, Tq, Tk, D, q0, scale, table, dtable, P};
    run_pairs(&a, B, backward_item, scratch, cope_scratch(Tk, D, P, 1), threads);
}
