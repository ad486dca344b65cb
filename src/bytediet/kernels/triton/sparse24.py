"""2:4 sparse linear layers on sparse tensor cores through PyTorch's semi-structured sparse tensors
(``torch.sparse.to_sparse_semi_structured``: cuSPARSELt, else CUTLASS; sm_80+).

A ``sparse24`` weight (kept fp16 values + 2-bit positions, the SPARSE24_F16 layout) is expanded once at load
time to its dense 2:4 matrix in the activations' dtype and compressed by PyTorch into its own layout (the kept
values and metadata: the same 9 bits a weight); a step is then one ``F.linear``. Twin:
:func:`bytediet.kernels.reference.sparse24_matmul`. Its weight is expanded by the Triton decoder (:mod:`.gemm_blocks`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import native_layouts

MIN_CAPABILITY = (8, 0)  # Ampere: the first sparse tensor cores


def semi_structured_unsupported_reason(device: torch.device) -> str | None:
    """None where 2:4 semi-structured sparse GEMMs run on ``device``, else the one-line reason."""
    device = torch.device(device)
    if not hasattr(torch.sparse, "to_sparse_semi_structured"):
        return f"this torch ({torch.__version__}) has no semi-structured sparse tensors: sparse24 needs torch ≥ 2.1"
    if device.type != "cuda":
        return f"2:4 sparse tensor cores are on CUDA GPUs (sm_80+) only, not on {device.type}"
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return f"2:4 sparse tensor cores need sm_80+ (Ampere or newer); this GPU is sm_{cap[0]}{cap[1]}"
    return None


def to_semi_structured(dense: torch.Tensor):
    """A dense 2:4 weight (N, K) fp16/bf16 on the GPU → PyTorch's compressed semi-structured tensor."""
    reason = semi_structured_unsupported_reason(dense.device)
    if reason:
        raise RuntimeError(reason)
    if dense.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"2:4 sparse weights are multiplied in float16 or bfloat16, not {dense.dtype}")
    n, k = dense.shape
    if n % 64 or k % 128:  # the strictest of cuSPARSELt's and CUTLASS's minimum tiles
        raise ValueError(f"2:4 sparse tensor cores need N a multiple of 64 and K of 128, got N={n}, K={k}")
    return torch.sparse.to_sparse_semi_structured(dense.contiguous())


def sparse24_weight_from_rows(rows: torch.Tensor, dtype: torch.dtype = torch.float16):
    """SPARSE24_F16 rows (N, K/32 · 36) uint8 on the GPU → the compressed semi-structured weight in ``dtype``
    (expanded by the Triton decoder, exactly: fp16 values, zeros elsewhere)."""
    from .gemm_blocks import dequantize_blocks

    reason = semi_structured_unsupported_reason(rows.device)
    if reason:
        raise RuntimeError(reason)
    return to_semi_structured(dequantize_blocks(native_layouts.SPARSE24_F16, rows, dtype))


def sparse24_linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x · Wᵀ (+ bias) for ``weight`` from :func:`to_semi_structured`: x (..., K) in its dtype → (..., N)."""
    n, k = weight.shape
    y = F.linear(x.reshape(-1, k).to(weight.dtype), weight, None if bias is None else bias.to(weight.dtype))
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
