"""Unquantized weights (fp32 / bf16 / fp16): one more weight format, and the baseline."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .base import WEIGHT_FORMATS, Packed, WeightFormat


class Unquantized(WeightFormat):
    storage_dtype: torch.dtype = torch.float32

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return float(torch.finfo(self.storage_dtype).bits)

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        return {"weight": weight.detach().to(self.storage_dtype).contiguous()}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return packed["weight"].float()

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        return {"weight": packed["weight"].narrow(dim, start, stop - start).contiguous()}

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        w = packed["weight"]
        if w.dtype != x.dtype:
            w = w.to(x.dtype)
        return F.linear(x, w, None if bias is None else bias.to(x.dtype))


@WEIGHT_FORMATS.register("fp32")
class Float32(Unquantized):
    name = "fp32"
    storage_dtype = torch.float32


@WEIGHT_FORMATS.register("bf16")
class BFloat16(Unquantized):
    name = "bf16"
    storage_dtype = torch.bfloat16


@WEIGHT_FORMATS.register("fp16")
class Float16(Unquantized):
    name = "fp16"
    storage_dtype = torch.float16
