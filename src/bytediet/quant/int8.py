"""INT8 weights, one symmetric scale per output channel: W8A16, and W8A8 with dynamic per-token activations.

W8A8 follows LLM.int8()/SmoothQuant's execution scheme (Xiao et al. 2023, arXiv 2211.10438): each
token's activations get their own scale (absmax / 127) at run time, the product is an int8 × int8
→ int32 matrix multiply, and the int32 result is rescaled by s_x · s_w.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels import native_layouts
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import NativeActivations, activations_only, check_weight, no_parameters, shard_columns_in_units

QMAX = 127


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) float32 → int8 (rows, cols) and float32 scale (rows,), symmetric absmax / 127, round-half-even."""
    scale = w.abs().amax(dim=1) / QMAX
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    q = torch.round(w * inv[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a: (M, K) int8, b: (K, N) int8 → (M, N) int32, exactly.

    Uses ``torch._int_mm`` where the backend supports the shape, else an int32 matmul (exact: |sum| ≤ 127²·K
    stays far below 2³¹ for any K < 133 000).
    """
    try:
        return torch._int_mm(a, b)
    except RuntimeError:
        return a.to(torch.int32) @ b.to(torch.int32)


@WEIGHT_FORMATS.register("int8")
class Int8(NativeActivations, WeightFormat):
    """W8A16: int8 weight (out, in) + float32 per-output-channel scale (out,).

    ``apply`` multiplies in float. Where the native kernels exist, a model's layers multiply through
    :meth:`native_layout` instead (``kernels/native_layouts.py``: the same bytes, read once per product), with
    activations in the format's ``activations`` mode: ``int8`` (q16, the default), ``int8-a8``, ``int8-af32``.
    """

    name = "int8"
    rows_independent = True

    from_spec = classmethod(activations_only)

    def spec(self) -> str:
        return self.name + self.activation_suffix()

    def native_layout(self, packed: Packed):
        return native_layouts.INT8_ROW, native_layouts.pack_int8_rows(packed["qweight"], packed["scale"])

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 8.0 + 32.0 / in_features

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        q, scale = quantize_rows_int8(check_weight(weight, self.name))
        return {"qweight": q, "scale": scale}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return packed["qweight"].float() * packed["scale"][:, None]

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows keep their own scales; a column slice keeps every row's scale (computed over the whole row,
        so the ranks' partial products sum to exactly the unsplit layer's)."""
        return shard_columns_in_units(packed, dim, start, stop, self.spec(), columns={"qweight": 1})

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = F.linear(x, packed["qweight"].to(x.dtype)) * packed["scale"].to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)


@WEIGHT_FORMATS.register("int8-w8a8")
class Int8W8A8(Int8):
    """W8A8: the int8 weight of :class:`Int8`, and activations quantized per token at run time.

    Natively it is the int8 row kernel (``INT8_ROW``) with each activation row rounded to int8 with its own scale
    (``activations = "q8-token"``, :func:`bytediet.kernels.reference.quantize_rows_per_token`): the numbers of
    :meth:`apply`, up to float32 summation order. SmoothQuant's smoothing factors are folded into the preceding
    norms and into these weights at calibration time, so nothing extra runs here.
    """

    name = "int8-w8a8"
    activation_bits = 8  # tells callers (and the test matrix) that apply() also rounds the activations
    activations = "q8-token"
    from_spec = classmethod(no_parameters)

    def spec(self) -> str:
        return self.name

    def with_activations(self, activations: str):
        """The per-token int8 activations are this format's definition: a model-wide mode leaves them as they are."""
        return self

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        lead, k = x.shape[:-1], x.shape[-1]
        xf = x.reshape(-1, k).float()  # (T, in)
        xq, sx = quantize_rows_int8(xf)  # (T, in) int8, (T,)
        acc = int8_matmul(xq, packed["qweight"].t())  # (T, out) int32
        y = acc.float() * sx[:, None] * packed["scale"][None, :]
        if bias is not None:
            y = y + bias.float()
        return y.reshape(*lead, -1).to(x.dtype)
