"""Block-structured dequantize-GEMV and GEMM for the layouts whose codes lie in runs of 32 weights: Q4_0, Q4_1,
Q5_0, Q5_1 (their fifth bits in a 32-bit word beside), INT4_GROUPS (± zero point), MXFP4, NVFP4 (4-bit, GGML's Q4
order) and Q8_0, INT8_ROW, FP8_ROW (a byte a weight).

Per K step a program reads a (BN rows, NB runs, 16 or 32 bytes) tile of codes with contiguous (vector) loads and
each run's scales once, instead of decoding every weight by address arithmetic (:mod:`.block_decode`):

* GEMV: sums codes · x per run in float32, then applies the run's scales (llama.cpp's ``vec_dot``:
  y = Σ_runs d · Σ q·x + m · Σ x);
* GEMM: scales the codes into a weight tile whose columns are in *run order* (a 4-bit run's byte j gives
  columns 2j and 2j + 1: elements j and j + 16) and multiplies it by x's tile loaded in the same column order.

The other layouts take :mod:`.gemm_blocks`'s per-element kernels.
"""

from __future__ import annotations

from .block_decode import (
    FP8_ROW,
    INT4_FIRST,
    INT4_LAST,
    INT8_ROW,
    MXFP4,
    NVFP4,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    _e2m1,
    _e4m3,
    _e8m0,
    _f16,
    _f32,
    ids,
    round_bf16,
    tl,
    triton,
)

NIBBLE_TYPES = ids(Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, NVFP4) | frozenset(range(INT4_FIRST.value, INT4_LAST.value + 1))
BYTE_TYPES = ids(Q8_0, INT8_ROW, FP8_ROW)
TYPES = NIBBLE_TYPES | BYTE_TYPES


def run_geometry(type_id: int, group: int, symmetric: bool) -> tuple[int, int, int, int]:
    """(row header bytes, weights per block, bytes per block, offset of the codes in a block) of a layout."""
    fixed = {
        Q4_0: (0, 32, 18, 2),
        Q4_1: (0, 32, 20, 4),
        Q5_0: (0, 32, 22, 6),
        Q5_1: (0, 32, 24, 8),
        MXFP4: (0, 32, 17, 1),
        NVFP4: (4, 32, 18, 2),
        Q8_0: (0, 32, 34, 2),
        INT8_ROW: (4, 32, 32, 0),
        FP8_ROW: (4, 32, 32, 0),
    }
    fixed = {c.value: geometry for c, geometry in fixed.items()}
    if type_id in fixed:
        return fixed[type_id]
    return (0, group, (2 if symmetric else 4) + group // 2, 2 if symmetric else 4)  # INT4_GROUPS


@triton.jit
def _code_values(b, TYPE: tl.constexpr):
    """Code bytes (int32) → the float values the codes stand for before the run's scale."""
    if TYPE == MXFP4 or TYPE == NVFP4:
        return _e2m1(b)
    elif TYPE == FP8_ROW:
        return _e4m3(b)
    elif TYPE == Q8_0 or TYPE == INT8_ROW:
        return b.to(tl.int8).to(tl.float32)
    else:
        return b.to(tl.float32)


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
    SYM: tl.constexpr,
    HEAD: tl.constexpr,
    BW: tl.constexpr,
    BB: tl.constexpr,
    CO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
):
    """y[split, m, n-tile] = Σ over this split's K range (whole runs of 32) of W[n, k] · x[m, k], float32."""
    NIBBLES: tl.constexpr = (TYPE != Q8_0 and TYPE != INT8_ROW) and TYPE != FP8_ROW
    HALF: tl.constexpr = 16 if NIBBLES else 32  # code bytes per run
    INT4: tl.constexpr = TYPE >= INT4_FIRST and TYPE <= INT4_LAST
    pid_n, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    nmask = (n < N)[:, None]  # (BN, 1)
    row1 = w_ptr + n.to(tl.int64) * row_bytes
    row = row1[:, None]  # (BN, 1)
    j = tl.arange(0, HALF)
    acc = tl.zeros((BN,), dtype=tl.float32)
    row_scale = _f32(row1, n < N)  # (BN,): INT8_ROW/FP8_ROW's row scale, NVFP4's tensor scale (else unused)
    c_lo = split * (k_per_split // 32)
    for c0 in range(c_lo, c_lo + k_per_split // 32, NB):
        c = c0 + tl.arange(0, NB)  # runs of 32 weights
        cm = c * 32 < K  # (NB,)
        mask = nmask & cm[None, :]  # (BN, NB)
        blk = row + HEAD + (c * 32 // BW)[None, :] * BB  # (BN, NB)
        codes = blk + CO + ((c * 32 % BW) // 32 * HALF)[None, :]
        b = tl.load(codes[:, :, None] + j[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
        xo = m * stride_xm + c[:, None] * 32 + j[None, :]  # (NB, HALF)
        x_lo = tl.load(x_ptr + xo, mask=cm[:, None], other=0.0).to(tl.float32)
        if NIBBLES:
            x_hi = tl.load(x_ptr + xo + 16, mask=cm[:, None], other=0.0).to(tl.float32)
            q_lo, q_hi = _nibbles(b, blk, j, mask, TYPE)
            s_lo = tl.sum(_code_values(q_lo, TYPE) * x_lo[None, :, :], axis=2)  # (BN, NB)
            s_hi = tl.sum(_code_values(q_hi, TYPE) * x_hi[None, :, :], axis=2)
            if (TYPE == Q4_0 or TYPE == Q5_0) or (INT4 and SYM):
                sx = tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1)
                part = _f16(blk, mask) * (s_lo + s_hi - (16.0 if TYPE == Q5_0 else 8.0) * sx[None, :])
            elif (TYPE == Q4_1 or TYPE == Q5_1) or INT4:
                sx = tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1)
                part = _f16(blk, mask) * (s_lo + s_hi) + _f16(blk + 2, mask) * sx[None, :]
            elif TYPE == MXFP4:
                part = _e8m0(tl.load(blk, mask=mask, other=0).to(tl.int32)) * (s_lo + s_hi)
            else:  # NVFP4: one E4M3 scale per 16 weights (the low nibbles, then the high ones)
                s0 = _e4m3(tl.load(blk, mask=mask, other=0).to(tl.int32))
                s1 = _e4m3(tl.load(blk + 1, mask=mask, other=0).to(tl.int32))
                part = (s0 * row_scale[:, None]) * s_lo + (s1 * row_scale[:, None]) * s_hi
        else:
            s = tl.sum(_code_values(b, TYPE) * x_lo[None, :, :], axis=2)
            if TYPE == Q8_0:
                part = _f16(blk, mask) * s
            else:
                part = s
        acc += tl.sum(tl.where(mask, part, 0.0), axis=1)
    if HEAD == 4 and TYPE != NVFP4:
        acc = acc * row_scale
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=(n < N) & (split == 0), other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + split * stride_ys + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _run_scales(blk, row_scale, mask, TYPE: tl.constexpr, SYM: tl.constexpr):
    """A run's (multiplier for its first 16 weights, for its last 16, additive term): (BN, NB, 1) each."""
    INT4: tl.constexpr = TYPE >= INT4_FIRST and TYPE <= INT4_LAST
    zero = tl.zeros(blk.shape, dtype=tl.float32)
    if TYPE == MXFP4:
        d = _e8m0(tl.load(blk, mask=mask, other=0).to(tl.int32))
        lo, hi, add = d, d, zero
    elif TYPE == NVFP4:
        lo = _e4m3(tl.load(blk, mask=mask, other=0).to(tl.int32)) * row_scale
        hi = _e4m3(tl.load(blk + 1, mask=mask, other=0).to(tl.int32)) * row_scale
        add = zero
    elif TYPE == INT8_ROW or TYPE == FP8_ROW:
        lo, hi, add = row_scale + zero, row_scale + zero, zero
    else:  # a float16 scale (Q4_0, Q8_0, INT4 symmetric) and an offset (Q4_1, INT4 asymmetric)
        d = _f16(blk, mask)
        if (TYPE == Q4_1 or TYPE == Q5_1) or (INT4 and not SYM):
            add = _f16(blk + 2, mask)
        else:
            add = zero
        lo, hi = d, d
    return lo[:, :, None], hi[:, :, None], add[:, :, None]


@triton.jit
def _nibbles(b, blk, j, mask, TYPE: tl.constexpr):
    """Code bytes b (BN, NB, 16) of runs at blk (BN, NB) → the codes of elements j and j + 16 (int32); Q5_0/Q5_1
    add bit e of their 32-bit ``qh`` (2 bytes after Q5_0's scale, 4 after Q5_1's scale and offset)."""
    q_lo = b & 15
    q_hi = b >> 4
    if TYPE == Q5_0 or TYPE == Q5_1:
        qh = blk[:, :, None] + (2 if TYPE == Q5_0 else 4) + (j >> 3)[None, None, :]
        bit = (j & 7)[None, None, :]
        q_lo = q_lo | (((tl.load(qh, mask=mask[:, :, None], other=0).to(tl.int32) >> bit) & 1) << 4)
        q_hi = q_hi | (((tl.load(qh + 2, mask=mask[:, :, None], other=0).to(tl.int32) >> bit) & 1) << 4)
    return q_lo, q_hi


@triton.jit
def _weights(b, q_lo, q_hi, lo, hi, add, TYPE: tl.constexpr, SYM: tl.constexpr):
    """Codes (bytes b (BN, NB, 32), or the 4/5-bit codes q_lo, q_hi (BN, NB, 16)) and a run's scales → weights
    (BN, NB·32) in run order, as the reference decoder computes them (same float32 operations)."""
    INT4: tl.constexpr = TYPE >= INT4_FIRST and TYPE <= INT4_LAST
    BN: tl.constexpr = b.shape[0]
    NB: tl.constexpr = b.shape[1]
    if (TYPE == Q8_0 or TYPE == INT8_ROW) or TYPE == FP8_ROW:  # one return: compiled code keeps every statement
        w = tl.reshape(_code_values(b, TYPE) * lo, (BN, NB * 32))
    else:
        v_lo = _code_values(q_lo, TYPE)
        v_hi = _code_values(q_hi, TYPE)
        if (TYPE == Q4_0 or TYPE == Q5_0) or (INT4 and SYM):
            bias: tl.constexpr = 16.0 if TYPE == Q5_0 else 8.0
            w_lo, w_hi = (v_lo - bias) * lo, (v_hi - bias) * hi
        elif (TYPE == Q4_1 or TYPE == Q5_1) or INT4:
            w_lo, w_hi = v_lo * lo + add, v_hi * hi + add
        else:  # MXFP4, NVFP4
            w_lo, w_hi = v_lo * lo, v_hi * hi
        w = tl.reshape(tl.join(w_lo, w_hi), (BN, NB * 32))
    return w


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
    SYM: tl.constexpr,
    HEAD: tl.constexpr,
    BW: tl.constexpr,
    BB: tl.constexpr,
    CO: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    NB: tl.constexpr,
):
    """y[m-tile, n-tile] = x[m-tile] · W[n-tile]ᵀ over K steps of NB runs, float32 accumulation."""
    NIBBLES: tl.constexpr = (TYPE != Q8_0 and TYPE != INT8_ROW) and TYPE != FP8_ROW
    HALF: tl.constexpr = 16 if NIBBLES else 32
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    row1 = w_ptr + n.to(tl.int64) * row_bytes
    row_scale = _f32(row1, n < N)[:, None]  # (BN, 1), used by INT8_ROW, FP8_ROW, NVFP4
    j = tl.arange(0, HALF)
    col = tl.arange(0, NB * 32)
    if NIBBLES:  # run order: column 2j + h of a run is its element 16h + j
        elem = (col // 32) * 32 + (col % 2) * 16 + (col % 32) // 2
    else:
        elem = col
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for c0 in range(0, K // 32, NB):
        c = c0 + tl.arange(0, NB)
        mask = (n < N)[:, None] & (c * 32 < K)[None, :]  # (BN, NB)
        blk = row1[:, None] + HEAD + (c * 32 // BW)[None, :] * BB
        codes = blk + CO + ((c * 32 % BW) // 32 * HALF)[None, :]
        b = tl.load(codes[:, :, None] + j[None, None, :], mask=mask[:, :, None], other=0).to(tl.int32)
        lo, hi, add = _run_scales(blk, row_scale, mask, TYPE, SYM)
        if NIBBLES:
            q_lo, q_hi = _nibbles(b, blk, j, mask, TYPE)
        else:
            q_lo, q_hi = b, b
        w = _weights(b, q_lo, q_hi, lo, hi, add, TYPE, SYM)  # (BN, NB·32)
        k = c0 * 32 + elem
        xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
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
