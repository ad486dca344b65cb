"""NVFP4 (NVIDIA Blackwell): E2M1 elements, an FP8-E4M3 scale per block of 16, one FP32 scale per tensor.

Two-level scaling as NVIDIA defines it (NVIDIA Blackwell architecture / TensorRT Model Optimizer
"NVFP4" recipe, and "Pretraining LLMs with NVFP4", arXiv 2509.25149 §2):

    s_tensor = amax(W) / (6 · 448)                        float32, decode direction
    s_block  = E4M3(amax(block) / (6 · s_tensor))          round-to-nearest-even, ≤ 448
    q_i      = E2M1(w_i / (s_block · s_tensor))            round-to-nearest-even, saturating at ±6
    w_i     ≈ q_i · s_block · s_tensor

A block whose E4M3 scale underflows to 0 decodes to 0. bits per weight = 4 + 8/16 + 32/(out·in).
"""

from __future__ import annotations

import torch

from ..kernels import native_layouts
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import NativeActivations, activations_only, check_weight, shard_columns_in_units
from .fp4 import E2M1_MAX, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from .fp8 import E4M3_MAX

BLOCK = 16


def nvfp4_tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """Tensor absmax → the float32 second-level scale amax / (6 · 448), or 1 for an all-zero tensor."""
    s = amax.float() / (E2M1_MAX * E4M3_MAX)
    return torch.where(s > 0, s, torch.ones_like(s))


@WEIGHT_FORMATS.register("nvfp4")
class NVFP4(NativeActivations, WeightFormat):
    """packed = qweight (out, in/2) uint8 E2M1 codes, scale (out, in/16) float8_e4m3fn, tensor_scale (1,) float32."""

    name = "nvfp4"

    from_spec = classmethod(activations_only)

    def spec(self) -> str:
        return self.name + self.activation_suffix()

    def native_layout(self, packed: Packed):
        """Native kernels read the E2M1 codes as int8 2·v with the block scale (kernels/native_layouts.py);
        ``-a8``/``-af32`` choose their activation precision (default q16)."""
        return native_layouts.NVFP4_BLOCKS, native_layouts.pack_nvfp4(
            packed["qweight"], packed["scale"], packed["tensor_scale"]
        )

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 4.0 + 8.0 / BLOCK + 32.0 / (out_features * in_features)

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        w = check_weight(weight, self.name, BLOCK)
        out, k = w.shape
        blocks = w.view(out, k // BLOCK, BLOCK)
        s_tensor = nvfp4_tensor_scale(w.abs().amax()).reshape(1)
        block_scale = (blocks.abs().amax(-1) / (E2M1_MAX * s_tensor)).clamp_(max=E4M3_MAX).to(torch.float8_e4m3fn)
        step = block_scale.float() * s_tensor  # (out, blocks): the decode multiplier
        scaled = torch.where(step[..., None] > 0, blocks / step[..., None], torch.zeros_like(blocks))
        codes = encode_e2m1(scaled).view(out, k)
        return {"qweight": pack_nibbles(codes), "scale": block_scale, "tensor_scale": s_tensor}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        step = packed["scale"].float() * packed["tensor_scale"].float()  # (out, blocks)
        out, nblocks = step.shape
        values = decode_e2m1(unpack_nibbles(packed["qweight"])).view(out, nblocks, BLOCK)
        return (values * step[..., None]).view(out, -1)

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Columns are cut on whole blocks of 16; every shard keeps the tensor scale of the whole weight (each
        rank's blocks were scaled by it, so the shards decode to exactly the unsplit weight's slices)."""
        return shard_columns_in_units(
            packed,
            dim,
            start,
            stop,
            self.spec(),
            block=BLOCK,
            columns={"qweight": 2, "scale": BLOCK},
            whole=("tensor_scale",),
        )
