"""Pack b-bit unsigned codes (b = 1…8) densely into bytes, little-endian bit order.

``pack(codes, bits)``: codes (..., n) integer in [0, 2**bits) → uint8 (..., n * bits / 8).
``unpack(packed, bits, n)``: the inverse. ``n * bits`` must be a multiple of 8 (head dims are).

Layout: bit t of code k is bit (k·b + t) of the stream, i.e. bit (k·b + t) mod 8 of byte ⌊(k·b + t)/8⌋.
Eight codes fill exactly b bytes, so both directions work on *words* of 8 codes: the b bytes of a word,
read as one little-endian 64-bit integer, hold code j in bits j·b … j·b + b − 1 (a few shifts and masks
per code instead of one operation per bit). :func:`pack_bitwise` / :func:`unpack_bitwise` are the
plain bit-by-bit reference the tests compare with. Codes of a head dim that is not a multiple of 8 are
padded to a whole word internally.
"""

from __future__ import annotations

import torch


def packed_size(n: int, bits: int) -> int:
    """Bytes needed for ``n`` codes of ``bits`` bits."""
    if (n * bits) % 8:
        raise ValueError(f"cannot pack {n} codes of {bits} bits into whole bytes")
    return n * bits // 8


def _word_shifts(count: int, step: int, device) -> torch.Tensor:
    return torch.arange(count, device=device, dtype=torch.int64) * step


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    n = codes.shape[-1]
    nbytes = packed_size(n, bits)
    if bits == 8:
        return codes.to(torch.uint8)
    pad = -n % 8
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    words = (c.reshape(*c.shape[:-1], -1, 8) << _word_shifts(8, bits, c.device)).sum(-1)  # (..., n/8)
    out = (words.unsqueeze(-1) >> _word_shifts(bits, 8, c.device)) & 0xFF  # (..., n/8, b)
    return out.reshape(*c.shape[:-1], -1)[..., :nbytes].to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 (..., n * bits / 8) → int64 codes (..., n)."""
    if bits == 8:
        return packed.to(torch.int64)
    if 8 % bits == 0:  # 1, 2, 4 bits: no code straddles a byte
        codes = (packed.unsqueeze(-1) >> _word_shifts(8 // bits, bits, packed.device).to(torch.uint8)) & (
            (1 << bits) - 1
        )
        return codes.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.int64)
    p = packed.to(torch.int64)
    pad = -p.shape[-1] % bits
    if pad:
        p = torch.nn.functional.pad(p, (0, pad))
    words = (p.reshape(*p.shape[:-1], -1, bits) << _word_shifts(bits, 8, p.device)).sum(-1)  # (..., words)
    codes = (words.unsqueeze(-1) >> _word_shifts(8, bits, p.device)) & ((1 << bits) - 1)  # (..., words, 8)
    return codes.reshape(*p.shape[:-1], -1)[..., :n]


def pack_bitwise(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference for :func:`pack`: expand every code into its bits, regroup the bit stream by bytes."""
    n = codes.shape[-1]
    nbytes = packed_size(n, bits)
    shifts = torch.arange(bits, device=codes.device, dtype=torch.int32)
    stream = (codes.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (..., n, bits)
    stream = stream.reshape(*codes.shape[:-1], nbytes, 8)
    weights = 1 << torch.arange(8, device=codes.device, dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.uint8)


def unpack_bitwise(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Reference for :func:`unpack`."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.int32)
    stream = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (..., nbytes, 8)
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    weights = 1 << torch.arange(bits, device=packed.device, dtype=torch.int32)
    return (stream * weights).sum(-1).to(torch.int64)
