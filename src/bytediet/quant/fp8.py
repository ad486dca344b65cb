"""FP8 E4M3 weights with one float32 scale per output channel (W8A16).

E4M3 as in "FP8 Formats for Deep Learning" (Micikevicius et al. 2022, arXiv 2209.05433): 4 exponent
bits (bias 7), 3 mantissa bits, max ±448, no Inf (torch.float8_e4m3fn). Each row is scaled so its
absmax lands on 448; PyTorch's cast rounds to nearest-even and saturates.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels import native_layouts
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import check_weight, no_parameters, shard_columns_in_units

E4M3_MAX = 448.0


@WEIGHT_FORMATS.register("fp8")
class FP8(WeightFormat):
    """packed = qweight (out, in) float8_e4m3fn, scale (out,) float32; w ≈ qweight · scale.

    Where the native kernels exist, a layer multiplies through :meth:`native_layout` (the same bytes, each row
    its scale then its codes, ``kernels/native_layouts.py`` ``FP8_ROW``), widening the codes to float in
    registers: FP8 values are not integers, so the activations stay float (``activations = "f32"``).
    """

    name = "fp8"
    rows_independent = True
    activations = "f32"  # how the native kernel multiplies (no integer path for E4M3 codes)

    from_spec = classmethod(no_parameters)

    def native_layout(self, packed: Packed):
        return native_layouts.FP8_ROW, native_layouts.pack_fp8_rows(packed["qweight"], packed["scale"])

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 8.0 + 32.0 / in_features

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        w = check_weight(weight, self.name)
        scale = w.abs().amax(dim=1) / E4M3_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = (w / scale[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return {"qweight": q, "scale": scale}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return packed["qweight"].float() * packed["scale"][:, None]

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows keep their scales; a column slice keeps every row's scale (set by the whole row's absmax)."""
        return shard_columns_in_units(packed, dim, start, stop, self.name, columns={"qweight": 1})

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = F.linear(x, packed["qweight"].to(x.dtype)) * packed["scale"].to(x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
