"""Fused dequantize-GEMV/GEMM in Triton over packed block rows: y = x · Wᵀ (+ b), W decoded in registers.

The twin is :func:`bytediet.kernels.reference.gemm_blocks` with ``activations="f32"`` (the float activations
are multiplied as they are). Every layout of :mod:`.block_decode` is read: GGML Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/
Q5_K/Q6_K and bytediet's INT8_ROW, INT4_GROUPS (± zero point), MXFP4, NVFP4, FP8_ROW, SPARSE24_INT8/F16.

* M ≤ :data:`GEMV_MAX_M` rows (decode): one program per (BN outputs, row, K split), float32 sums on CUDA cores
  (the step is bound by reading W), the K range split when N alone leaves SMs idle.
* larger M (prefill, big batches): a tiled ``tl.dot`` with float32 accumulation; on the GPU W is rounded to x's
  dtype (bf16/fp16 tensor cores), in the interpreter both operands are float32 (its bf16 dot is wrong).

Three kernel families, chosen by layout: :mod:`.runs` (codes in runs of 32: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, INT8_ROW,
INT4_GROUPS, MXFP4, NVFP4, FP8_ROW), :mod:`.kquants` (Q4_K/Q5_K/Q6_K), each a GEMV and a GEMM, and the
per-element decoder of :mod:`.block_decode` here (every layout: sparse24's GEMM, dequantize_blocks);
:mod:`.sparse24_blocks` is the 2:4 layouts' GEMV.
"""

from __future__ import annotations

import os

import torch

from .. import native_layouts
from . import kquants, runs, sparse24_blocks
from .block_decode import round_bf16, tl, triton, weight_tile

GEMV_MAX_M = 4
_GGML = {
    2: (32, 18),
    3: (32, 20),
    6: (32, 22),
    7: (32, 24),
    8: (32, 34),
    12: (256, 144),
    13: (256, 176),
    14: (256, 210),
}  # type → (weights, bytes) per block, as gguf.GGML_QUANT_SIZES
TYPES = frozenset(_GGML) | native_layouts.TYPES


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET=1): then every tl.dot is done in float32."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _round_bf16(dtype: torch.dtype) -> bool:
    """Whether a kernel rounds its bf16 output itself (the interpreter's float32 → bf16 cast truncates)."""
    return dtype == torch.bfloat16 and interpreting()


def row_weights(type_id: int, row_bytes: int) -> int:
    """K of a packed row of ``row_bytes`` bytes in layout ``type_id``; a clear error for a layout not read here."""
    t = int(type_id)
    if t not in TYPES:
        ggml = ", ".join(_name(i).split()[-1] for i in sorted(_GGML))
        raise NotImplementedError(
            f"weight layout {_name(t)} has no Triton kernel (they read GGML {ggml} and "
            f"bytediet's layouts {min(native_layouts.TYPES)}–{max(native_layouts.TYPES)})"
        )
    if t in _GGML:
        weights, nbytes = _GGML[t]
        if row_bytes % nbytes:
            raise ValueError(f"GGML type {t}: {row_bytes} bytes per row is not a whole number of blocks")
        return row_bytes // nbytes * weights
    return native_layouts.row_weights(t, row_bytes)


def _name(t: int) -> str:
    """A layout's name: GGML's type name (Q4_K…) or bytediet's layout id."""
    from gguf import GGMLQuantizationType

    if t in native_layouts.TYPES:
        return f"bytediet layout {t}"
    try:
        return f"GGML {GGMLQuantizationType(t).name}"
    except ValueError:
        return f"unknown layout {t}"


def _int4_params(t: int) -> tuple[int, bool]:
    """(group, symmetric) of an INT4_GROUPS layout; (32, False) for the others (unused there)."""
    for (group, symmetric), tid in native_layouts.INT4_GROUPS.items():
        if tid == t:
            return group, symmetric
    return 32, False


@triton.jit
def _gemv_kernel(
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
    GROUP: tl.constexpr,
    SYM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[split, m, n-tile] = Σ over this split's K range of W[n, k] · x[m, k] (float32)."""
    pid_n, m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BN,), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(k_lo, k_lo + k_per_split, BK):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + m * stride_xm + k, mask=k < K, other=0.0).to(tl.float32)
        w = weight_tile(w_ptr, row_bytes, n[:, None], k[None, :], N, K, TYPE, GROUP, SYM)
        acc += tl.sum(w * xv[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=(n < N) & (split == 0), other=0.0).to(tl.float32)
    if ROUND_BF16:
        acc = round_bf16(acc)
    tl.store(y_ptr + split * stride_ys + m * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _gemm_kernel(
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
    GROUP: tl.constexpr,
    SYM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_F32: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[m-tile, n-tile] = x[m-tile] · W[n-tile]ᵀ, the W tile decoded per K step, float32 accumulation."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xt = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        w = weight_tile(w_ptr, row_bytes, n[:, None], k[None, :], N, K, TYPE, GROUP, SYM)  # (BN, BK)
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


@triton.jit
def _dequant_kernel(
    w_ptr,
    y_ptr,
    N,
    K,
    row_bytes,
    TYPE: tl.constexpr,
    GROUP: tl.constexpr,
    SYM: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """y[n-tile, k-tile] = W decoded, rounded to y's dtype."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)[:, None]
    k = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    w = weight_tile(w_ptr, row_bytes, n, k, N, K, TYPE, GROUP, SYM)
    if ROUND_BF16:
        w = round_bf16(w)
    tl.store(y_ptr + n.to(tl.int64) * K + k, w.to(y_ptr.dtype.element_ty), mask=(n < N) & (k < K))


def _check(type_id: int, blocks: torch.Tensor, x: torch.Tensor | None = None) -> int:
    """K of ``blocks`` (N, row bytes) uint8, checked (and that blocks and x are where the kernels can run)."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(f"packed weight rows must be a 2-D uint8 tensor, got {tuple(blocks.shape)} {blocks.dtype}")
    if blocks.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"the Triton weight kernels run on CUDA tensors (or with TRITON_INTERPRET=1), not on {blocks.device}"
        )
    if x is not None and x.device != blocks.device:
        raise ValueError(f"activations on {x.device}, weight rows on {blocks.device}: put them on one device")
    return row_weights(type_id, blocks.shape[1])


def _split_k(n_tiles: int, m: int, k_steps: int, device: torch.device) -> int:
    """K splits that give the GPU about two programs per SM (1 in the interpreter and for long grids)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(k_steps, (2 * sms) // max(1, n_tiles * m)))


def gemm_blocks(
    type_id: int, blocks: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None, split_k: int | None = None
) -> torch.Tensor:
    """y = x · Wᵀ (+ bias) for W (N, K) in packed rows ``blocks`` (N, row bytes) uint8 of layout ``type_id``.

    x: (..., K) float (fp32/fp16/bf16, on blocks' device) → y (..., N) in x's dtype, accumulated in float32.
    ``split_k`` forces the GEMV's K split (tests); by default it is chosen from the SM count."""
    t = int(type_id)
    k = _check(t, blocks, x)
    if x.shape[-1] != k:
        raise ValueError(f"weight rows hold {k} values, activations {x.shape[-1]}")
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    blocks = blocks.contiguous()
    bias = None if bias is None else bias.contiguous()
    if x2.shape[0] == 0:  # no rows: no launch (a grid of size 0 is an error)
        return x.new_empty(*x.shape[:-1], blocks.shape[0])
    y = _gemv(t, blocks, x2, bias, split_k) if x2.shape[0] <= GEMV_MAX_M else _gemm(t, blocks, x2, bias)
    return y.reshape(*x.shape[:-1], blocks.shape[0])


def _gemv(t: int, blocks: torch.Tensor, x2: torch.Tensor, bias, split_k) -> torch.Tensor:
    """The GEMV of a few rows (M, K): block-structured where the layout allows (:mod:`.runs`, :mod:`.kquants`,
    :mod:`.sparse24_blocks`), else per element; the K range split over programs (partial sums in float32) when N
    leaves SMs idle."""
    (m, k), n = x2.shape, blocks.shape[0]
    family = next((name for name, mod in _FAMILIES.items() if t in mod.TYPES), "elements")
    bn, bk = _GEMV_TILES[family][interpreting()]
    k_steps = triton.cdiv(k, bk)
    splits = split_k or _split_k(triton.cdiv(n, bn), m, k_steps, x2.device)
    k_per_split = triton.cdiv(k_steps, splits) * bk
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(splits, m, n, dtype=x2.dtype if splits == 1 else torch.float32, device=x2.device)
    grid = (triton.cdiv(n, bn), m, splits)
    args = (
        x2,
        blocks,
        blocks if bias is None else bias,
        out,
        n,
        k,
        blocks.shape[1],
        x2.stride(0),
        out.stride(0),
        out.stride(1),
        k_per_split,
    )
    flags = {"TYPE": t, "HAS_BIAS": bias is not None, "ROUND_BF16": _round_bf16(out.dtype), "BN": bn, "num_warps": 4}
    group, sym = _int4_params(t)
    if family == "runs":
        head, bw, bb, co = runs.run_geometry(t, group, sym)
        runs.gemv_kernel[grid](*args, SYM=sym, HEAD=head, BW=bw, BB=bb, CO=co, NB=bk // 32, **flags)
    elif family == "kquants":
        kquants.gemv_kernel[grid](*args, NB=bk // 256, **flags)
    elif family == "sparse24":
        sparse24_blocks.gemv_kernel[grid](*args, NB=bk // 32, **flags)
    else:
        _gemv_kernel[grid](*args, GROUP=group, SYM=sym, BK=bk, **flags)
    return out[0] if splits == 1 else out.sum(0).to(x2.dtype)


# (BN rows, BK weights) per GEMV program, for the GPU (False) and the interpreter (True: one or two programs)
_GEMV_TILES = {
    "runs": {False: (16, 256), True: (16, 64)},
    "kquants": {False: (16, 512), True: (16, 256)},
    "sparse24": {False: (16, 256), True: (16, 64)},
    "elements": {False: (32, 128), True: (16, 64)},
}
_FAMILIES = {"runs": runs, "kquants": kquants, "sparse24": sparse24_blocks}


def _gemm(t: int, blocks: torch.Tensor, x2: torch.Tensor, bias) -> torch.Tensor:
    """The tiled tl.dot product of many rows (M, K): block-structured where the layout allows (:mod:`.runs`,
    :mod:`.kquants`), else per element."""
    (m, k), n = x2.shape, blocks.shape[0]
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn, bk = (16, 32) if interpreting() else (64 if m <= 32 else 128, 64)
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    args = (x2, blocks, blocks if bias is None else bias, y, m, n, k, blocks.shape[1], x2.stride(0), y.stride(0))
    flags = {
        "TYPE": t,
        "HAS_BIAS": bias is not None,
        "DOT_F32": interpreting() or x2.dtype == torch.float32,
        "ROUND_BF16": _round_bf16(y.dtype),
        "BM": bm,
        "BN": bn,
        "num_warps": 4,
        "num_stages": 3,
    }
    group, sym = _int4_params(t)
    if t in runs.TYPES:
        head, bw, bb, co = runs.run_geometry(t, group, sym)
        runs.gemm_kernel[grid](*args, SYM=sym, HEAD=head, BW=bw, BB=bb, CO=co, NB=bk // 32, **flags)
    elif t in kquants.TYPES:
        kquants.gemm_kernel[grid](*args, NB=1, **flags)
    else:
        _gemm_kernel[grid](*args, GROUP=group, SYM=sym, BK=bk, **flags)
    return y


def dequantize_blocks(type_id: int, blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows (N, row bytes) uint8 of layout ``type_id`` → W (N, K) in ``dtype``, on blocks' device
    (twin: :func:`bytediet.kernels.reference.dequantize_blocks`)."""
    t = int(type_id)
    k = _check(t, blocks)
    n = blocks.shape[0]
    group, sym = _int4_params(t)
    blocks = blocks.contiguous()
    y = torch.empty(n, k, dtype=dtype, device=blocks.device)
    bn, bk = (16, 64) if interpreting() else (32, 256)
    _dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        blocks,
        y,
        n,
        k,
        blocks.shape[1],
        TYPE=t,
        GROUP=group,
        SYM=sym,
        ROUND_BF16=_round_bf16(dtype),
        BN=bn,
        BK=bk,
        num_warps=4,
    )
    return y
