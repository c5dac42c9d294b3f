"""The Triton kernels behind `model.attention=triton`: causal attention, its bias made in its tiles.

Forward and backward; a learned bias's own gradient is summed in the tiles too.

One program takes BLOCK queries (forward, dq) or BLOCK keys (dk, dv) of one (batch, head) and
walks the other side in tiles of BLOCK, as FlashAttention-2 does; the (Tq, Tk) scores exist
only a tile at a time. The bias of a tile is one of:

  NONE    nothing (NoPE, RoPE)
  SLOPES  -slope[h] * (qpos[i] - kpos[j])                              ALiBi
  TABLE   values[h, qpos[i] - kpos[j] - lo]                            T5, KERPLE: a table over distances
  FIRE    A[h, s] * x + C[h, s],  x = log1p(c d) / (log1p(c max(qpos[i], thr)) + eps),
          d = max(qpos[i] - kpos[j], 0), s = the number of kinks below x   FIRE's MLP as its lines
  DENSE   bias[b, h, i, j], read from memory, for every other scheme (its batch stride 0 when shared)

A learned bias's gradient is a sum of the scores' gradients dS over the pairs that share a
parameter. DENSE writes dS itself (adds it, for a bias the batch shares). TABLE sums each
tile's diagonals: one gather in registers, then one atomic add per distance and tile, where
flex makes one per pair, all colliding in the same few cells. FIRE sums each tile's pairs per
segment the tile meets, and its c and threshold's gradients once per program.
"""

from __future__ import annotations

import triton
import triton.language as tl

# the bias's form (BIAS); constexpr, as every global a kernel reads must be
NONE, SLOPES, TABLE, FIRE, DENSE = (tl.constexpr(mode) for mode in range(5))
# lengths, offsets and strides: Triton would compile a kernel again for each new one divisible by
# 16 or not (a length scored, a block of queries), for no gain that its constexpr D leaves
LENGTHS = ["Tq", "Tk", "q0", "lo", "n_values", "sbb", "sbh", "sbt", "sbk"]


@triton.jit
def _log1p(y):
    """log(1 + y) to within rounding for small y too, as torch.log1p (Kahan's correction), so
    that x lands on the same side of a kink as FIRE.bias's does."""
    u = 1.0 + y
    exact = u == 1.0
    return tl.where(exact, y, tl.log(u) * (y / tl.where(exact, 1.0, u - 1.0)))


@triton.jit
def _fire_x(qp, kp, FIREP, eps):
    """x (BM, BN) for FIRE, and the pieces its gradient reuses."""
    c = tl.load(FIREP)
    thr = tl.load(FIREP + 1)
    dist = tl.maximum(qp[:, None] - kp[None, :], 0).to(tl.float32)  # (BM, BN); the future is masked
    norm = tl.maximum(qp.to(tl.float32), thr)  # (BM,)
    u = _log1p(c * dist)  # (BM, BN)
    w = _log1p(c * norm) + eps  # (BM,)
    return u / w[:, None], dist, norm, u, w, c, thr


@triton.jit
def _fire_segments(x, visible, KINKS, KW: tl.constexpr):
    """Each x's segment, the number of (sorted) kinks below it, and the tile's lowest and
    highest: the kinks below the tile's smallest x count for every pair, so only those between
    its smallest and largest are compared pair by pair."""
    kinks = tl.load(KINKS + tl.arange(0, KW))  # (KW,), padded with +inf
    lo = tl.sum((kinks < tl.min(tl.where(visible, x, float("inf")))).to(tl.int32))
    hi = tl.sum((kinks < tl.max(tl.where(visible, x, -float("inf")))).to(tl.int32))
    seg = tl.zeros(x.shape, tl.int32) + lo
    for k in range(lo, hi):
        seg += (x > tl.load(KINKS + k)).to(tl.int32)
    return seg, lo, hi


@triton.jit
def _tile_scores(
    q, k, qp, kp, b, h, rows, cols, Tq, Tk, q0, lo, n_values, scale, eps,
    SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr, DOT: tl.constexpr,
    BLOCK: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """The tile's scores q.k * scale + bias (fp32, (BM, BN)) and which pairs count: seen, by a
    query below Tq (rows past it are computed, never stored). MASKED: some pair of the tile is
    unseen or out of range, and its score is -inf; else every pair counts, and no mask is made."""
    if MASKED:
        seen = ((q0 + rows)[:, None] >= cols[None, :]) & (cols[None, :] < Tk)
        visible = seen & (rows[:, None] < Tq)
    else:
        seen = tl.full((BLOCK, BLOCK), 1, tl.int1)
        visible = seen
    s = tl.dot(q, tl.trans(k), input_precision=DOT) * scale
    if BIAS == SLOPES:
        s += -tl.load(SLOPES_ + h) * (qp[:, None] - kp[None, :]).to(tl.float32)
    elif BIAS == TABLE:
        idx = tl.minimum(tl.maximum(qp[:, None] - kp[None, :] - lo, 0), n_values - 1)
        s += tl.load(VALUES + h * n_values + idx)
    elif BIAS == FIRE:
        x, _, _, _, _, _, _ = _fire_x(qp, kp, FIREP, eps)
        seg, _, _ = _fire_segments(x, visible, KINKS, KW)
        s += tl.load(A + h * S + seg) * x + tl.load(C + h * S + seg)
    elif BIAS == DENSE:
        # int64: a (B, H, 256, 65536) bias's batch stride times b passes 2^31 from b = 11
        at = BIASP + b.to(tl.int64) * sbb + h.to(tl.int64) * sbh + rows[:, None] * sbt + cols[None, :] * sbk
        if MASKED:
            s += tl.load(at, mask=visible, other=0.0).to(tl.float32)
        else:
            s += tl.load(at, mask=rows[:, None] < Tq, other=0.0).to(tl.float32)  # a last block's rows past Tq
    if MASKED:
        s = tl.where(seen, s, -float("inf"))
    return s, visible


@triton.jit
def _key_tile(
    q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
    Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    D: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr,
    DOT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Keys n0.. for a block of queries: their k and v, and the tile's scores and pairs that count."""
    cols = n0 + tl.arange(0, BLOCK)  # (BN,)
    kmask = (cols[:, None] < Tk) & (dims[None, :] < D)
    k = tl.load(K + (bh * Tk + cols[:, None]) * D + dims[None, :], mask=kmask, other=0.0)
    v = tl.load(V + (bh * Tk + cols[:, None]) * D + dims[None, :], mask=kmask, other=0.0)
    kp = tl.load(KPOS + cols, mask=cols < Tk, other=0)
    s, visible = _tile_scores(
        q, k, qp, kp, b, h, rows, cols, Tq, Tk, q0, lo, n_values, scale, eps,
        SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk, BIAS, S, KW, DOT, BLOCK, MASKED,
    )  # fmt: skip
    return k, v, s, visible


@triton.jit
def _forward_step(
    acc, m_i, l_i, q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
    Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    D: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr,
    DOT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One tile of keys n0.. into the running softmax (m_i, l_i) and output acc."""
    _, v, s, _ = _key_tile(
        q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
        Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
        D, BLOCK, BIAS, S, KW, DOT, MASKED,
    )  # fmt: skip
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # -inf while a row has seen no key: a window's or chunk's dense bias hides whole tiles from it
    m_use = tl.where(m_new == -float("inf"), 0.0, m_new)
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=LENGTHS)
def forward_kernel(
    Q, K, V, OUT, LSE, QPOS, KPOS, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    H, Tq, Tk, q0, lo, n_values, scale, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """Output and log-sum-exp for BLOCK queries: first the tiles of keys every one of them sees,
    unmasked, then the diagonal's."""
    m0 = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = m0 + tl.arange(0, BLOCK)  # (BM,)
    dims = tl.arange(0, BLOCK_D)
    dmask = dims[None, :] < D
    q = tl.load(Q + (bh * Tq + rows[:, None]) * D + dims[None, :], mask=(rows[:, None] < Tq) & dmask, other=0.0)
    qp = tl.load(QPOS + rows, mask=rows < Tq, other=0)
    m_i = tl.full((BLOCK,), -float("inf"), tl.float32)
    l_i = tl.zeros((BLOCK,), tl.float32)
    acc = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    end = tl.minimum(Tk, q0 + m0 + BLOCK)  # the block's last query sees the keys below it
    full = ((q0 + m0 + 1) // BLOCK) * BLOCK  # its first query, every key below this
    for n0 in range(0, full, BLOCK):
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, False,
        )  # fmt: skip
    for n0 in range(full, end, BLOCK):
        acc, m_i, l_i = _forward_step(
            acc, m_i, l_i, q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, True,
        )  # fmt: skip
    out = acc / l_i[:, None]
    at = OUT + (bh * Tq + rows[:, None]) * D + dims[None, :]
    tl.store(at, out.to(OUT.dtype.element_ty), mask=(rows[:, None] < Tq) & dmask)
    tl.store(LSE + bh * Tq + rows, m_i + tl.log(l_i), mask=rows < Tq)


@triton.jit
def _kv_step(
    dk, dv, d_c, d_thr, k, v, kp, k_off, m0, n0, bh, b, h, cols, dims, Q, DO, LSE, DELTA, QPOS, KPOS,
    DVALUES, DA, DC, DBIAS,
    Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    D: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr,
    DOT: tl.constexpr, MASKED: tl.constexpr, LEARNED: tl.constexpr, SHARED: tl.constexpr,
):  # fmt: skip
    """One tile of queries m0.. into dk and dv, and with LEARNED into the bias's gradient."""
    rows = m0 + tl.arange(0, BLOCK)  # (BM,)
    qmask = (rows[:, None] < Tq) & (dims[None, :] < D)
    q = tl.load(Q + (bh * Tq + rows[:, None]) * D + dims[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + (bh * Tq + rows[:, None]) * D + dims[None, :], mask=qmask, other=0.0)
    lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=float("inf"))  # rows past Tq: p = 0
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    qp = tl.load(QPOS + rows, mask=rows < Tq, other=0)
    # FIRE's x and segments serve its bias and then its gradient, so they are made once, here
    FIRE_HERE: tl.constexpr = BIAS == FIRE and LEARNED
    s, visible = _tile_scores(
        q, k, qp, kp, b, h, rows, cols, Tq, Tk, q0, lo, n_values, scale, eps,
        SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
        NONE if FIRE_HERE else BIAS, S, KW, DOT, BLOCK, MASKED,
    )  # fmt: skip
    if FIRE_HERE:
        x, _, _, _, _, _, _ = _fire_x(qp, kp, FIREP, eps)
        seg, seg_lo, seg_hi = _fire_segments(x, visible, KINKS, KW)
        a = tl.load(A + h * S + seg)  # (BM, BN): each pair's line
        s += a * x + tl.load(C + h * S + seg)  # -inf stays -inf where unseen
    p = tl.exp(s - lse[:, None])  # (BM, BN)
    if MASKED:
        p = tl.where(visible, p, 0.0)
    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=DOT)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT) - delta[:, None])  # (BM, BN): the scores' gradient
    dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=DOT)
    if LEARNED:
        if BIAS == DENSE:
            at = rows[:, None] * Tk + cols[None, :]
            inside = (rows[:, None] < Tq) & (cols[None, :] < Tk)
            if SHARED:
                tl.atomic_add(DBIAS + h.to(tl.int64) * Tq * Tk + at, ds, mask=inside)
            else:
                tl.store(DBIAS + bh.to(tl.int64) * Tq * Tk + at, ds, mask=inside)
        elif BIAS == TABLE:
            # on a tile whose positions run on by one, pairs with one distance lie on one
            # diagonal: gather the diagonals as rows of a (2 BLOCK, BLOCK) tile and sum them
            lane = tl.arange(0, BLOCK)
            q_off = tl.sum(tl.where(rows < Tq, qp != tl.load(QPOS + m0) + lane, 0).to(tl.int32))
            if k_off + q_off == 0:
                for half in range(2):  # the diagonals below the main one, then the rest
                    diag = half * BLOCK + lane  # (B,): r - c = diag - (BLOCK - 1)
                    r = lane[None, :] + diag[:, None] - (BLOCK - 1)  # (B, BN): the row on that diagonal
                    on = (r >= 0) & (r < BLOCK)
                    sums = tl.sum(tl.where(on, tl.gather(ds, tl.where(on, r, 0), axis=0), 0.0), axis=1)  # (B,)
                    col = tl.load(QPOS + m0) - tl.load(KPOS + n0) + diag - (BLOCK - 1) - lo
                    ok = (diag < 2 * BLOCK - 1) & (col >= 0) & (col < n_values)
                    tl.atomic_add(DVALUES + h * n_values + col, sums, mask=ok)
            else:
                idx = tl.minimum(tl.maximum(qp[:, None] - kp[None, :] - lo, 0), n_values - 1)
                tl.atomic_add(DVALUES + h * n_values + idx, ds, mask=visible)
        elif BIAS == FIRE:
            for sg in range(seg_lo, seg_hi + 1):
                on = visible & (seg == sg)
                tl.atomic_add(DA + h * S + sg, tl.sum(tl.where(on, ds * x, 0.0)))
                tl.atomic_add(DC + h * S + sg, tl.sum(tl.where(on, ds, 0.0)))
            dx = ds * a  # (BM, BN): the gradient of x
            _, dist, norm, u, w, c, thr = _fire_x(qp, kp, FIREP, eps)  # made again: kept, they spill
            # x = u / w: dx/dc from u = log1p(c d) and w = log1p(c norm) + eps
            dw = norm / (1.0 + c * norm) / (w * w)  # (BM,): -(d x / d c) through w, over u
            d_c += tl.sum(dx * (dist / (1.0 + c * dist) / w[:, None] - u * dw[:, None]))
            # norm = max(qpos, thr): thr's share, half at a tie as torch.maximum's gradient
            qf = qp.to(tl.float32)
            share = (thr > qf).to(tl.float32) + 0.5 * (thr == qf).to(tl.float32)
            d_thr += tl.sum(dx * u * (-c / (1.0 + c * norm) / (w * w) * share)[:, None])
    return dk, dv, d_c, d_thr


@triton.jit(do_not_specialize=LENGTHS)
def backward_kv_kernel(
    Q, K, V, DO, DK, DV, LSE, DELTA, QPOS, KPOS, SLOPES_, VALUES, DVALUES, A, C, DA, DC, KINKS, FIREP, DFIREP,
    BIASP, sbb, sbh, sbt, sbk, DBIAS,
    H, Tq, Tk, q0, lo, n_values, scale, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr, DOT: tl.constexpr,
    LEARNED: tl.constexpr, SHARED: tl.constexpr,
):  # fmt: skip
    """dk and dv for BLOCK keys; with LEARNED, the bias's gradient from every tile they meet
    (DENSE's into DBIAS, (B or 1, H, Tq, Tk) fp32, added across the batch where SHARED). The
    tiles of queries go in three runs: the diagonal's (masked), those that see every key of the
    block (unmasked), and a last one past Tq (masked)."""
    n0 = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    cols = n0 + tl.arange(0, BLOCK)  # (BN,)
    dims = tl.arange(0, BLOCK_D)
    kmask = (cols[:, None] < Tk) & (dims[None, :] < D)
    k = tl.load(K + (bh * Tk + cols[:, None]) * D + dims[None, :], mask=kmask, other=0.0)
    v = tl.load(V + (bh * Tk + cols[:, None]) * D + dims[None, :], mask=kmask, other=0.0)
    kp = tl.load(KPOS + cols, mask=cols < Tk, other=0)
    k_off = tl.sum(tl.where(cols < Tk, kp != tl.load(KPOS + n0) + tl.arange(0, BLOCK), 0).to(tl.int32))
    dk = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    d_c = 0.0
    d_thr = 0.0
    first = (tl.maximum(n0 - q0, 0) // BLOCK) * BLOCK  # the first tile of queries that sees one of them
    seen_all = ((tl.maximum(n0 + BLOCK - 1 - q0, 0) + BLOCK - 1) // BLOCK) * BLOCK  # from here on, all
    whole = (Tq // BLOCK) * BLOCK  # tiles below this lie inside Tq
    for m0 in range(first, tl.minimum(seen_all, Tq), BLOCK):
        dk, dv, d_c, d_thr = _kv_step(
            dk, dv, d_c, d_thr, k, v, kp, k_off, m0, n0, bh, b, h, cols, dims, Q, DO, LSE, DELTA, QPOS, KPOS,
            DVALUES, DA, DC, DBIAS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, True, LEARNED, SHARED,
        )  # fmt: skip
    for m0 in range(seen_all, whole, BLOCK):
        dk, dv, d_c, d_thr = _kv_step(
            dk, dv, d_c, d_thr, k, v, kp, k_off, m0, n0, bh, b, h, cols, dims, Q, DO, LSE, DELTA, QPOS, KPOS,
            DVALUES, DA, DC, DBIAS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, False, LEARNED, SHARED,
        )  # fmt: skip
    for m0 in range(tl.maximum(seen_all, whole), Tq, BLOCK):
        dk, dv, d_c, d_thr = _kv_step(
            dk, dv, d_c, d_thr, k, v, kp, k_off, m0, n0, bh, b, h, cols, dims, Q, DO, LSE, DELTA, QPOS, KPOS,
            DVALUES, DA, DC, DBIAS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, True, LEARNED, SHARED,
        )  # fmt: skip
    if LEARNED:
        if BIAS == FIRE:
            tl.atomic_add(DFIREP, d_c)
            tl.atomic_add(DFIREP + 1, d_thr)
    tl.store(DK + (bh * Tk + cols[:, None]) * D + dims[None, :], (dk * scale).to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + (bh * Tk + cols[:, None]) * D + dims[None, :], dv.to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _q_step(
    dq, q, do, lse, delta, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
    Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    D: tl.constexpr, BLOCK: tl.constexpr, BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr,
    DOT: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """One tile of keys n0.. into dq."""
    k, v, s, visible = _key_tile(
        q, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
        Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
        D, BLOCK, BIAS, S, KW, DOT, MASKED,
    )  # fmt: skip
    p = tl.exp(s - lse[:, None])  # 0 in rows past Tq, whose lse reads as +inf
    if MASKED:
        p = tl.where(visible, p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v), input_precision=DOT) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT)


@triton.jit(do_not_specialize=LENGTHS)
def backward_q_kernel(
    Q, K, V, DO, DQ, LSE, DELTA, QPOS, KPOS, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
    H, Tq, Tk, q0, lo, n_values, scale, eps,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr,
    BIAS: tl.constexpr, S: tl.constexpr, KW: tl.constexpr, DOT: tl.constexpr,
):  # fmt: skip
    """dq for BLOCK queries, over their tiles of keys as the forward walks them."""
    m0 = tl.program_id(0) * BLOCK
    bh = tl.program_id(1)
    b, h = bh // H, bh % H
    rows = m0 + tl.arange(0, BLOCK)
    dims = tl.arange(0, BLOCK_D)
    qmask = (rows[:, None] < Tq) & (dims[None, :] < D)
    q = tl.load(Q + (bh * Tq + rows[:, None]) * D + dims[None, :], mask=qmask, other=0.0)
    do = tl.load(DO + (bh * Tq + rows[:, None]) * D + dims[None, :], mask=qmask, other=0.0)
    lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=float("inf"))  # rows past Tq: p = 0
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    qp = tl.load(QPOS + rows, mask=rows < Tq, other=0)
    dq = tl.zeros((BLOCK, BLOCK_D), tl.float32)
    end = tl.minimum(Tk, q0 + m0 + BLOCK)
    full = ((q0 + m0 + 1) // BLOCK) * BLOCK
    for n0 in range(0, full, BLOCK):
        dq = _q_step(
            dq, q, do, lse, delta, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, False,
        )  # fmt: skip
    for n0 in range(full, end, BLOCK):
        dq = _q_step(
            dq, q, do, lse, delta, qp, n0, bh, b, h, rows, dims, K, V, KPOS,
            Tq, Tk, q0, lo, n_values, scale, eps, SLOPES_, VALUES, A, C, KINKS, FIREP, BIASP, sbb, sbh, sbt, sbk,
            D, BLOCK, BIAS, S, KW, DOT, True,
        )  # fmt: skip
    tl.store(DQ + (bh * Tq + rows[:, None]) * D + dims[None, :], (dq * scale).to(DQ.dtype.element_ty), mask=qmask)
