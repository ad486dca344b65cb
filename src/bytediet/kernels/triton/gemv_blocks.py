"""Block-structured dequantize-GEMV (decode, a few activation rows) for the layouts whose codes lie in 32-weight
runs: Q4_0, Q4_1, INT4_GROUPS (± zero point), MXFP4, NVFP4 (4-bit, GGML's Q4 order) and Q8_0, INT8_ROW, FP8_ROW
(one byte a weight).

Per K step a program reads a (BN rows, NB runs, 16 or 32 bytes) tile of codes with contiguous (vector) loads and
each run's scales once, sums codes · x per run in float32 and applies the scales per run (llama.cpp's
``vec_dot``: y = Σ_runs d · Σ q·x + m · Σ x), instead of decoding every weight by address arithmetic
(:mod:`.block_decode`). The other layouts take :mod:`.gemm_blocks`'s per-element GEMV.
"""
from __future__ import annotations

from .block_decode import (FP8_ROW, INT4_FIRST, INT4_LAST, INT8_ROW, MXFP4, NVFP4, Q4_0, Q4_1, Q8_0, _e2m1, _e4m3,
                           _e8m0, _f16, _f32, round_bf16, tl, triton)

NIBBLE_TYPES = frozenset({Q4_0, Q4_1, MXFP4, NVFP4, *range(INT4_FIRST, INT4_LAST + 1)})
BYTE_TYPES = frozenset({Q8_0, INT8_ROW, FP8_ROW})
TYPES = NIBBLE_TYPES | BYTE_TYPES


def run_geometry(type_id: int, group: int, symmetric: bool) -> tuple[int, int, int, int]:
    """(row header bytes, weights per block, bytes per block, offset of the codes in a block) of a layout."""
    fixed = {Q4_0: (0, 32, 18, 2), Q4_1: (0, 32, 20, 4), MXFP4: (0, 32, 17, 1), NVFP4: (4, 32, 18, 2),
             Q8_0: (0, 32, 34, 2), INT8_ROW: (4, 32, 32, 0), FP8_ROW: (4, 32, 32, 0)}
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
def gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, row_bytes, stride_xm, stride_ys, stride_ym, k_per_split,
                TYPE: tl.constexpr, SYM: tl.constexpr, HEAD: tl.constexpr, BW: tl.constexpr, BB: tl.constexpr,
                CO: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND_BF16: tl.constexpr, BN: tl.constexpr,
                NB: tl.constexpr):
    """y[split, m, n-tile] = Σ over this split's K range (whole runs of 32) of W[n, k] · x[m, k], float32."""
    NIBBLES: tl.constexpr = TYPE != Q8_0 and TYPE != INT8_ROW and TYPE != FP8_ROW
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
            s_lo = tl.sum(_code_values(b & 15, TYPE) * x_lo[None, :, :], axis=2)  # (BN, NB)
            s_hi = tl.sum(_code_values(b >> 4, TYPE) * x_hi[None, :, :], axis=2)
            if TYPE == Q4_0 or (INT4 and SYM):
                sx = tl.sum(x_lo, axis=1) + tl.sum(x_hi, axis=1)
                part = _f16(blk, mask) * (s_lo + s_hi - 8.0 * sx[None, :])
            elif TYPE == Q4_1 or INT4:
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
