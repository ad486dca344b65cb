"""Vectorised PyTorch codecs for GGML's block formats (the byte layouts of ggml-common.h / ggml-quants.c).

``DECODERS[type](blocks)``: blocks (n, type_size) uint8 → (n, block_size) float32, bit-identical to
``gguf.quants.dequantize`` (same float32 operations in the same order).
``ENCODERS[type](x)``: x (n, block_size) float32 → (n, type_size) uint8, bit-identical to
``gguf.quants.quantize`` (the reference ggml quantizers), for the types that have a float quantizer here.
"""

from __future__ import annotations

from typing import Callable

import torch
from gguf import GGMLQuantizationType as T

QK_K = 256


def _f16(b: torch.Tensor) -> torch.Tensor:
    """(n, 2) uint8 little-endian → (n, 1) float32."""
    return b.contiguous().view(torch.float16).float()


def _to_f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """(n, 1) float32 → (n, 2) uint8 (round-to-nearest-even to float16, as numpy's astype)."""
    return x.half().contiguous().view(torch.uint8)


def _nibbles_halves(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) uint8 → (n, 32): low nibbles are elements 0..15, high nibbles 16..31 (ggml's Q4/Q5 layout)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(b: torch.Tensor, nbits: int) -> torch.Tensor:
    """(n, m) uint8 → (n, m·8) uint8 in {0, 1}: bit j of the little-endian bit string (np.packbits "little")."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[..., None] >> shifts) & 1).flatten(-2)[..., :nbits]


def _q5_high(qh: torch.Tensor) -> torch.Tensor:
    return _bits(qh, 32) << 4


def decode_q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    return d * (_nibbles_halves(b[:, 2:]).to(torch.int8) - 8).float()


def decode_q4_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return d * _nibbles_halves(b[:, 4:]).float() + m


def decode_q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[:, 0:2])
    q = _nibbles_halves(b[:, 6:]) | _q5_high(b[:, 2:6])
    return d * (q.to(torch.int8) - 16).float()


def decode_q5_1(b: torch.Tensor) -> torch.Tensor:
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles_halves(b[:, 8:]) | _q5_high(b[:, 4:8])
    return d * q.float() + m


def decode_q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, 12) uint8 packed 6-bit scales and mins of the 8 sub-blocks → two (n, 8) uint8."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) uint8 → (n, 8, 32): sub-block 2i = low nibbles of bytes 32i..32i+31, 2i+1 = their high nibbles."""
    q = qs.reshape(-1, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8, device=qs.device).reshape(1, 1, 2, 1)
    return (q & 0x0F).reshape(-1, 8, 32)


def _k_affine(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    ds = (d * sc.float())[..., None]  # (n, 8, 1)
    dm = (dmin * mn.float())[..., None]
    return (ds * q.float() - dm).reshape(-1, QK_K)


def decode_q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_affine(b, _k_low_nibbles(b[:, 16:144]))


def decode_q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[:, 16:48].reshape(-1, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).reshape(1, 1, 8, 1)
    q = _k_low_nibbles(b[:, 48:176]) | ((qh & 1).reshape(-1, 8, 32) << 4)
    return _k_affine(b, q)


def decode_q6_k(b: torch.Tensor) -> torch.Tensor:
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).reshape(-1, 16, 1)
    lo = ql.reshape(-1, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8, device=b.device).reshape(1, 1, 2, 1)
    hi = qh.reshape(-1, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).reshape(1, 1, 4, 1)
    q = ((lo & 0x0F).reshape(-1, 8, 32) | ((hi & 0x03).reshape(-1, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(-1, 16, 16).float()).reshape(-1, QK_K)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero, with gguf's np_roundf float32 operations."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def _inv(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude (first one on ties), sign kept: (n, bs) → (n, 1)."""
    return torch.gather(x, 1, x.abs().argmax(dim=1, keepdim=True))


def _pack_halves(q: torch.Tensor) -> torch.Tensor:
    """(n, 32) uint8 → (n, 16): element j in the low nibble of byte j, element j+16 in its high nibble."""
    return (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def _pack_high_bits(q: torch.Tensor) -> torch.Tensor:
    """(n, 32) 5-bit codes → (n, 4) uint8 of their bit 4, little-endian bit order."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8)
    return (bits << torch.arange(8, dtype=torch.uint8, device=q.device)).sum(-1, dtype=torch.uint8)


def _trunc_codes(x: torch.Tensor, top: int) -> torch.Tensor:
    return torch.trunc(x).clamp(0, 255).to(torch.uint8).clamp_(0, top)


def encode_q8_0(x: torch.Tensor) -> torch.Tensor:
    d = x.abs().amax(dim=1, keepdim=True) / 127
    q = _roundf(x * _inv(d)).to(torch.int8).view(torch.uint8)
    return torch.cat((_to_f16_bytes(d), q), dim=1)


def encode_q4_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(x) / -8
    q = _trunc_codes(x * _inv(d) + 8.5, 15)
    return torch.cat((_to_f16_bytes(d), _pack_halves(q)), dim=1)


def encode_q4_1(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 15
    q = _trunc_codes((x - lo) * _inv(d) + 0.5, 15)
    return torch.cat((_to_f16_bytes(d), _to_f16_bytes(lo), _pack_halves(q)), dim=1)


def encode_q5_0(x: torch.Tensor) -> torch.Tensor:
    d = _signed_absmax(x) / -16
    q = _trunc_codes(x * _inv(d) + 16.5, 31)
    return torch.cat((_to_f16_bytes(d), _pack_high_bits(q), _pack_halves(q & 0x0F)), dim=1)


def encode_q5_1(x: torch.Tensor) -> torch.Tensor:
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)
    d = (hi - lo) / 31
    q = _trunc_codes((x - lo) * _inv(d) + 0.5, 31)
    return torch.cat((_to_f16_bytes(d), _to_f16_bytes(lo), _pack_high_bits(q), _pack_halves(q & 0x0F)), dim=1)


Codec = Callable[[torch.Tensor], torch.Tensor]

DECODERS: dict[T, Codec] = {
    T.Q4_0: decode_q4_0,
    T.Q4_1: decode_q4_1,
    T.Q5_0: decode_q5_0,
    T.Q5_1: decode_q5_1,
    T.Q8_0: decode_q8_0,
    T.Q4_K: decode_q4_k,
    T.Q5_K: decode_q5_k,
    T.Q6_K: decode_q6_k,
}
ENCODERS: dict[T, Codec] = {
    T.Q4_0: encode_q4_0,
    T.Q4_1: encode_q4_1,
    T.Q5_0: encode_q5_0,
    T.Q5_1: encode_q5_1,
    T.Q8_0: encode_q8_0,
}


def block_size_of(ggml_type: T) -> int:
    """Weights per block (32, or 256 for the K-quants)."""
    return QK_K if ggml_type in (T.Q4_K, T.Q5_K, T.Q6_K) else 32
