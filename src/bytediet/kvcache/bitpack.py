"""Pack b-bit unsigned codes (b = 1…8) densely into bytes, little-endian bit order.

``pack(codes, bits)``: codes (..., n) integer in [0, 2**bits) → uint8 (..., n * bits / 8).
``unpack(packed, bits, n)``: the inverse. ``n * bits`` must be a multiple of 8 (head dims are).
"""
from __future__ import annotations

import torch


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    if (n * bits) % 8:
        raise ValueError(f"cannot pack {n} codes of {bits} bits into whole bytes")
    return n * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.shape[-1]
    nbytes = packed_size(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1          # (..., n, bits)
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    weights = (1 << torch.arange(8, device=codes.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 (..., n * bits / 8) → int64 codes (..., n)."""
    if bits == 8:
        return packed.to(torch.int64)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1          # (..., nbytes, 8)
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    weights = (1 << torch.arange(bits, device=packed.device, dtype=torch.int32))
    return (stream * weights).sum(-1).to(torch.int64)
