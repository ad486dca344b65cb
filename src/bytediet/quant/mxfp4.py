"""MXFP4 (OCP Microscaling Formats MX v1.0, 2023): E2M1 elements, one E8M0 scale per block of 32.

For each block of k = 32 values along the input dimension (spec §6.3, Algorithm 1):

    shared_exp = floor(log2(max |V_i|)) − emax_elem        (emax_elem = 2 for E2M1)
    X          = 2^shared_exp, stored as the E8M0 byte shared_exp + 127 (clamped to the E8M0 range)
    P_i        = E2M1(V_i / X)                              (round-to-nearest-even, saturating at ±6)

and decoding is V_i ≈ X · P_i. An all-zero block gets X = 2^−127. bits per weight = 4 + 8/32 = 4.25.
"""

from __future__ import annotations

import torch

from ..kernels import native_layouts
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import NativeActivations, activations_only, check_weight, shard_columns_in_units
from .fp4 import E2M1_EMAX, decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles

BLOCK = 32
E8M0_BIAS = 127


def mx_shared_exponent(amax: torch.Tensor) -> torch.Tensor:
    """Block absmax (float32, any shape) → int32 shared exponent floor(log2(amax)) − emax_elem, in [−127, 127].

    ``torch.frexp`` gives amax = m · 2^e with m ∈ [0.5, 1), so floor(log2(amax)) = e − 1 exactly (no log rounding).
    """
    _, e = torch.frexp(amax)
    shared = e.to(torch.int32) - 1 - E2M1_EMAX
    shared = torch.where(amax > 0, shared, torch.full_like(shared, -E8M0_BIAS))
    return shared.clamp_(-E8M0_BIAS, E8M0_BIAS)


def e8m0_to_float(byte: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes → float32 2^(byte − 127) (byte 255 is NaN per the spec)."""
    x = torch.ldexp(torch.ones(byte.shape, device=byte.device), byte.to(torch.int32) - E8M0_BIAS)
    return torch.where(byte == 255, torch.full_like(x, float("nan")), x)


@WEIGHT_FORMATS.register("mxfp4")
class MXFP4(NativeActivations, WeightFormat):
    """packed = qweight (out, in/2) uint8 E2M1 codes, scale (out, in/32) uint8 E8M0."""

    name = "mxfp4"
    rows_independent = True

    from_spec = classmethod(activations_only)

    def spec(self) -> str:
        return self.name + self.activation_suffix()

    def native_layout(self, packed: Packed):
        """Native kernels read the E2M1 codes as int8 2·v with the block scale (kernels/native_layouts.py);
        ``-a8``/``-af32`` choose their activation precision (default q16)."""
        return native_layouts.MXFP4_BLOCKS, native_layouts.pack_mxfp4(packed["qweight"], packed["scale"])

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 4.0 + 8.0 / BLOCK

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        w = check_weight(weight, self.name, BLOCK)
        out, k = w.shape
        blocks = w.view(out, k // BLOCK, BLOCK)
        shared = mx_shared_exponent(blocks.abs().amax(-1))  # (out, blocks)
        scaled = torch.ldexp(blocks, -shared[..., None].to(torch.float32))  # exact: division by a power of two
        codes = encode_e2m1(scaled).view(out, k)
        return {"qweight": pack_nibbles(codes), "scale": (shared + E8M0_BIAS).to(torch.uint8)}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        scale = e8m0_to_float(packed["scale"])  # (out, blocks)
        out, nblocks = scale.shape
        values = decode_e2m1(unpack_nibbles(packed["qweight"])).view(out, nblocks, BLOCK)
        return (values * scale[..., None]).view(out, -1)

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Columns are cut on whole blocks of 32 (codes two per byte, one E8M0 scale per block)."""
        return shard_columns_in_units(
            packed, dim, start, stop, self.spec(), block=BLOCK, columns={"qweight": 2, "scale": BLOCK}
        )
