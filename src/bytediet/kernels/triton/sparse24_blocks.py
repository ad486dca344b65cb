"""Block-structured GEMV for the 2:4 sparse layouts (SPARSE24_F16, SPARSE24_INT8): only the kept values are read.

Per run of 32 weights a program reads the 16 kept values (contiguous) and the 4 bytes of group codes, and gathers
the 16 activations they multiply: kept value i of group g = i // 2 sits at position 4g + p, p = code & 3 (first) or
code >> 2 (second), the code of group g in nibble g % 2 of byte g // 2 (``native_layouts``). SPARSE24_INT8's row
scale is applied once per row.
"""

from __future__ import annotations

from .block_decode import (
    SPARSE24_F16,
    SPARSE24_INT8,
    _f16,
    _f32,
    ids,
    round_bf16,
    tl,
    triton,
)

TYPES = ids(SPARSE24_F16, SPARSE24_INT8)


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
    """y[split, m, n-tile] = Σ over this split's K range (whole runs of 32) of W[n, k] · x[m, k], float32."""
    HEAD: tl.constexpr = 4 if TYPE == SPARSE24_INT8 else 0
    BB: tl.constexpr = 20 if TYPE == SPARSE24_INT8 else 36  # bytes per run: kept values, then 4 code bytes
    VB: tl.constexpr = BB - 4
    pid_n, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    row1 = w_ptr + n.to(tl.int64) * row_bytes
    i = tl.arange(0, 16)[None, None, :]  # kept value i of a run
    g = i // 2
    acc = tl.zeros((BN,), dtype=tl.float32)
    c_lo = split * (k_per_split // 32)
    for c0 in range(c_lo, c_lo + k_per_split // 32, NB):
        c = c0 + tl.arange(0, NB)
        mask = (n < N)[:, None] & (c * 32 < K)[None, :]  # (BN, NB)
        m3 = mask[:, :, None]
        blk = (row1[:, None] + HEAD + c[None, :] * BB)[:, :, None]  # (BN, NB, 1)
        code = (tl.load(blk + VB + (g >> 1), mask=m3, other=0).to(tl.int32) >> (4 * (g & 1))) & 15
        pos = tl.where(i % 2 == 1, code >> 2, code & 3)
        if TYPE == SPARSE24_INT8:
            v = tl.load(blk + i, mask=m3, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            v = _f16(blk + 2 * i, m3)
        xv = tl.load(x_ptr + m * stride_xm + c[None, :, None] * 32 + 4 * g + pos, mask=m3, other=0.0)
        acc += tl.sum(tl.sum(v * xv.to(tl.float32), axis=2), axis=1)
    if TYPE == SPARSE24_INT8:
        acc = acc * _f32(row1, n < N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=(n < N) & (split == 0), other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + split * stride_ys + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)
