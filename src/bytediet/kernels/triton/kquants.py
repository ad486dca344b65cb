"""Block-structured dequantize-GEMV and GEMM for GGML's K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 weights).

Per K step a program reads, for BN rows and NB super-blocks, the code bytes of each super-block's parts with
contiguous (vector) loads, sums codes · x per sub-block in float32 and applies the sub-block scales once
(llama.cpp's ``vec_dot_q4_K``… shape), instead of decoding every weight by address arithmetic:

* Q4_K/Q5_K: part p (0..3) is 32 bytes whose low nibbles are sub-block 2p and high nibbles 2p + 1 (Q5_K adds bit
  2p / 2p + 1 of the 32 ``qh`` bytes); y += d·Σ_s sc_s·Σq·x − dmin·Σ_s mn_s·Σx.
* Q6_K: half h (0, 1) is ql bytes A = ql[64h + l], B = ql[64h + 32 + l] and qh byte C = qh[32h + l] (l < 32);
  its quarters t = 0..3 are (A, B, A, B) low/high nibbles with 2 bits of C each; one int8 scale per 16 weights.

The GEMM decodes a super-block as its 8 sub-blocks of 32 consecutive weights (each a contiguous x range), one
``tl.dot`` each, with the reference decoder's float32 operations.
"""

from __future__ import annotations

from .block_decode import (
    Q4_K,
    Q5_K,
    Q6_K,
    _f16,
    _k_scale_min,
    ids,
    round_bf16,
    tl,
    triton,
)

TYPES = ids(Q4_K, Q5_K, Q6_K)


@triton.jit
def _q45_part(blk, x_ptr, xo, p, mask, xmask, TYPE: tl.constexpr):
    """Part p (0..3) of Q4_K/Q5_K super-blocks blk (BN, NB): Σ_s sc_s·Σq·x and Σ_s mn_s·Σx over its 2 sub-blocks."""
    l = tl.arange(0, 32)
    QS: tl.constexpr = 16 if TYPE == Q4_K else 48
    b = tl.load(blk[:, :, None] + QS + 32 * p + l[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
    q_lo = b & 15
    q_hi = b >> 4
    if TYPE == Q5_K:
        h = tl.load(blk[:, :, None] + 16 + l[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
        q_lo = q_lo | (((h >> (2 * p)) & 1) << 4)
        q_hi = q_hi | (((h >> (2 * p + 1)) & 1) << 4)
    x_lo = tl.load(x_ptr + xo + 64 * p + l[None, :], mask=xmask[:, None], other=0.0).to(tl.float32)  # (NB, 32)
    x_hi = tl.load(x_ptr + xo + 64 * p + 32 + l[None, :], mask=xmask[:, None], other=0.0).to(tl.float32)
    s_lo = tl.sum(q_lo.to(tl.float32) * x_lo[None, :, :], axis=2)  # (BN, NB)
    s_hi = tl.sum(q_hi.to(tl.float32) * x_hi[None, :, :], axis=2)
    sc_lo, mn_lo = _k_scale_min(blk + 4, 2 * p, mask)
    sc_hi, mn_hi = _k_scale_min(blk + 4, 2 * p + 1, mask)
    scaled = sc_lo * s_lo + sc_hi * s_hi
    mins = mn_lo * tl.sum(x_lo, axis=1)[None, :] + mn_hi * tl.sum(x_hi, axis=1)[None, :]
    return scaled, mins


@triton.jit
def _q6_half(blk, x_ptr, xo, h, u, mask, xmask):
    """Σ_t scale_t·Σq·x over the 4 quarters' 16-weight pieces u (0, 1) of half h of Q6_K super-blocks blk."""
    l = 16 * u + tl.arange(0, 16)
    a = tl.load(blk[:, :, None] + 64 * h + l[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
    b = tl.load(blk[:, :, None] + 64 * h + 32 + l[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
    c = tl.load(blk[:, :, None] + 128 + 32 * h + l[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
    total = tl.zeros(mask.shape, dtype=tl.float32)
    for t in tl.static_range(4):
        src = a if t % 2 == 0 else b
        q = ((src >> (4 * (t // 2))) & 15) | (((c >> (2 * t)) & 3) << 4)
        xv = tl.load(x_ptr + xo + 128 * h + 32 * t + l[None, :], mask=xmask[:, None], other=0.0).to(tl.float32)
        s = tl.sum((q - 32).to(tl.float32) * xv[None, :, :], axis=2)
        sc = tl.load(blk + 192 + 8 * h + 2 * t + u, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        total += sc * s
    return total


@triton.jit
def gemv_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_ys,
    stride_ym,
    k_per_split,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
):
    """y[split, m, n-tile] = Σ over this split's K range (whole super-blocks) of W[n, k] · x[m, k], float32."""
    SB: tl.constexpr = 144 if TYPE == Q4_K else (176 if TYPE == Q5_K else 210)
    pid_n, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    row = (w_ptr + n.to(tl.int64) * row_bytes)[:, None]  # (BN, 1)
    acc = tl.zeros((BN,), dtype=tl.float32)
    s_lo = split * (k_per_split // 256)
    for s0 in range(s_lo, s_lo + k_per_split // 256, NB):
        s = s0 + tl.arange(0, NB)  # super-blocks
        xmask = s * 256 < K
        mask = (n < N)[:, None] & xmask[None, :]  # (BN, NB)
        blk = row + s[None, :] * SB
        xo = m * stride_xm + s[:, None] * 256  # (NB, 1)
        if TYPE == Q6_K:
            part = tl.zeros((BN, NB), dtype=tl.float32)
            for h in tl.static_range(2):
                for u in tl.static_range(2):
                    part += _q6_half(blk, x_ptr, xo, h, u, mask, xmask)
            part = _f16(blk + 208, mask) * part
        else:
            scaled = tl.zeros((BN, NB), dtype=tl.float32)
            mins = tl.zeros((BN, NB), dtype=tl.float32)
            for p in tl.static_range(4):
                sc, mn = _q45_part(blk, x_ptr, xo, p, mask, xmask, TYPE)
                scaled += sc
                mins += mn
            part = _f16(blk, mask) * scaled - _f16(blk + 2, mask) * mins
        acc += tl.sum(tl.where(mask, part, 0.0), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=(n < N) & (split == 0), other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + split * stride_ys + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _sub_block(blk, s: tl.constexpr, mask, TYPE: tl.constexpr):
    """Weights 32s..32s+31 of super-blocks blk (BN, NB) → (BN, NB, 32) float32, as ggml_codecs decodes them."""
    l = tl.arange(0, 32)[None, None, :]
    at = blk[:, :, None]
    m3 = mask[:, :, None]
    if TYPE == Q6_K:
        h: tl.constexpr = s // 4
        t: tl.constexpr = s % 4
        lo = (tl.load(at + 64 * h + 32 * (t % 2) + l, mask=m3, other=0).to(tl.int32) >> (4 * (t // 2))) & 15
        hi = (tl.load(at + 128 + 32 * h + l, mask=m3, other=0).to(tl.int32) >> (2 * t)) & 3
        sc = tl.load(at + 192 + 2 * s + (l >> 4), mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        d = _f16(blk + 208, mask)[:, :, None] * sc
        return d * ((lo | (hi << 4)) - 32).to(tl.float32)
    else:
        QS: tl.constexpr = 16 if TYPE == Q4_K else 48
        q = (tl.load(at + QS + 32 * (s // 2) + l, mask=m3, other=0).to(tl.int32) >> (4 * (s % 2))) & 15
        if TYPE == Q5_K:
            q = q | (((tl.load(at + 16 + l, mask=m3, other=0).to(tl.int32) >> s) & 1) << 4)
        sc, mn = _k_scale_min(blk + 4, s, mask)
        ds = (_f16(blk, mask) * sc)[:, :, None]
        dm = (_f16(blk + 2, mask) * mn)[:, :, None]
        return ds * q.to(tl.float32) - dm


@triton.jit
def gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    K,
    row_bytes,
    stride_xm,
    stride_ym,
    TYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
):
    """y[m-tile, n-tile] = x[m-tile] · W[n-tile]ᵀ over K steps of NB super-blocks, float32 accumulation."""
    SB: tl.constexpr = 144 if TYPE == Q4_K else (176 if TYPE == Q5_K else 210)
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    row = (w_ptr + n.to(tl.int64) * row_bytes)[:, None]  # (BN, 1)
    col = tl.arange(0, NB * 32)  # column nb·32 + l of a sub-block tile: weight 256·nb + 32s + l
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for s0 in range(0, K // 256, NB):
        sb = s0 + tl.arange(0, NB)
        mask = (n < N)[:, None] & (sb * 256 < K)[None, :]  # (BN, NB)
        blk = row + sb[None, :] * SB
        for s in tl.static_range(8):
            w = tl.reshape(_sub_block(blk, s, mask, TYPE), (BN, NB * 32))
            k = (s0 + col // 32) * 256 + 32 * s + col % 32
            xt = tl.load(
                x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0
            )
            if DOT_F32:
                acc += tl.dot(xt.to(tl.float32), tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xt, tl.trans(w.to(xt.dtype)))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(
        y_ptr + m[:, None] * stride_ym + n[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(m[:, None] < M) & (n[None, :] < N),
    )
