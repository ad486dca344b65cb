"""W8A8 FP8 linear layers on FP8 tensor cores through ``torch._scaled_mm`` (cuBLASLt; torch's CPU kernel in tests).

The weight is the ``fp8`` format's E4M3 codes with one float32 scale per output channel (the FP8_ROW layout's
bytes); activations are rounded to E4M3 per token (:func:`bytediet.kernels.reference.quantize_rows_fp8`), so
y = s_x · s_w · (x_q · w_qᵀ), the E4M3 products accumulated in float32 by the tensor cores.
Twin: :func:`bytediet.kernels.reference.fp8_w8a8_linear`. Needs no triton.
"""

from __future__ import annotations

import torch

from .. import native_layouts
from ..reference import quantize_rows_fp8

FP8_MIN_CAPABILITY = (8, 9)  # Ada (sm_89), Hopper (sm_90), Blackwell: the chips with FP8 tensor cores
ROWWISE_MIN_CAPABILITY = (9, 0)  # per-row scales inside the GEMM (elsewhere they are applied after it)


def fp8_unsupported_reason(device: torch.device) -> str | None:
    """None where W8A8 FP8 runs on ``device``, else the one-line reason."""
    device = torch.device(device)
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no torch._scaled_mm: W8A8 fp8 needs torch ≥ 2.4"
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_MIN_CAPABILITY:
            return (
                f"W8A8 fp8 needs FP8 tensor cores (sm_89+: Ada, Hopper, Blackwell); this GPU is sm_{cap[0]}{cap[1]}:"
                " use the fp8 weight format as W8A16 (gemm_blocks) instead"
            )
    elif device.type != "cpu":
        return f"W8A8 fp8 runs on CUDA (sm_89+) or the CPU, not on {device.type}"
    return None


def fp8_weight_from_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8_ROW rows (N, 4 + K) uint8 → qweight (N, K) float8_e4m3fn and scale (N,) float32 (copies, on rows' device)."""
    if (
        rows.dtype != torch.uint8
        or rows.dim() != 2
        or rows.shape[1] <= native_layouts.row_header_bytes(native_layouts.FP8_ROW)
    ):
        raise ValueError(f"FP8_ROW rows must be a 2-D uint8 tensor (N, 4 + K), got {tuple(rows.shape)} {rows.dtype}")
    scale = rows[:, :4].contiguous().view(torch.float32).reshape(-1)
    return rows[:, 4:].contiguous().view(torch.float8_e4m3fn), scale


def _rowwise(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether _scaled_mm applies the per-row scales itself here (bf16 output, sm_90+ or the CPU)."""
    if out_dtype != torch.bfloat16:
        return False
    return device.type == "cpu" or torch.cuda.get_device_capability(device) >= ROWWISE_MIN_CAPABILITY


def fp8_linear(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    rowwise: bool | None = None,
) -> torch.Tensor:
    """y = x · (qweight · scale)ᵀ (+ bias) with x rounded to E4M3 per token, on FP8 tensor cores.

    x: (..., K) float on qweight's device; qweight: (N, K) float8_e4m3fn; scale: (N,) float32; K and N multiples
    of 16 → (..., N) in x's dtype. ``rowwise`` forces how the scales are applied (tests); default: in the GEMM
    where the chip can, else after it in float32."""
    reason = fp8_unsupported_reason(x.device)
    if reason:
        raise RuntimeError(reason)
    n, k = qweight.shape
    if k % 16 or n % 16:
        raise ValueError(f"W8A8 fp8 needs K and N multiples of 16 (torch._scaled_mm), got N={n}, K={k}")
    xq, sx = quantize_rows_fp8(x.reshape(-1, k))
    w_t = qweight.t()  # (K, N), column-major as _scaled_mm wants
    sw = scale.to(torch.float32).reshape(1, n)
    if _rowwise(x.device, x.dtype) if rowwise is None else rowwise:
        y = torch._scaled_mm(
            xq,
            w_t,
            scale_a=sx,
            scale_b=sw,
            out_dtype=torch.bfloat16,
            bias=None if bias is None else bias.to(torch.bfloat16),
        )
    else:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(xq, w_t, scale_a=one, scale_b=one, out_dtype=torch.float32) * sx * sw
        if bias is not None:
            y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
