"""FP4 E2M1 elements and nibble packing, shared by MXFP4, NVFP4 and INT4.

E2M1 (OCP Microscaling Formats v1.0, §5.3.3): 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit,
no Inf/NaN. The 8 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6; code = sign << 3 | exponent << 1 | mantissa.
Conversion from float rounds to nearest, ties to even (the code with mantissa bit 0), and saturates
at ±6 (OCP MX v1.0 §6.3, "quantization": values beyond the element range are clamped).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

#: code (0..15) → value. Codes 8..15 are the negatives (8 is -0).
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float32
)
E2M1_MAX = 6.0
#: emax of the element type: largest power of two not above E2M1_MAX (OCP MX v1.0, Table 1).
E2M1_EMAX = 2

# Midpoints between consecutive magnitudes and whether a tie rounds *up* (ties go to the even code).
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
    """float tensor (any shape) → uint8 E2M1 codes (same shape), round-to-nearest-even, saturating at ±6."""
    a = x.float().abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        mag += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return mag | ((x < 0).to(torch.uint8) << 3)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (any shape) → float32 values."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """(..., n) values in 0..15 → (..., n/2) uint8; element 2i goes to the low nibble, 2i+1 to the high one."""
    if codes.shape[-1] % 2:
        raise ConfigError(f"cannot pack an odd number ({codes.shape[-1]}) of 4-bit values per row")
    c = codes.to(torch.uint8)
    return (c[..., 0::2] & 0x0F) | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(..., n/2) uint8 → (..., n) uint8 in 0..15 (inverse of :func:`pack_nibbles`)."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
