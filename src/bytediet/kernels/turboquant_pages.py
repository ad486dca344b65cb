"""TurboQuant pages as the native decode step reads and writes them: the plain-PyTorch twin of
``cpu/csrc/turboquant_pages.cpp`` (used by :func:`bytediet.kernels.reference.decode_step`).

The layout is kvcache's ``turboquant`` codec (MSE variant, arXiv 2504.19874; :class:`TurboQuantPageSpec`):
x − mean, channels in the stored order, cut in parts; each part keeps ‖x_p‖ (fp16) and the nearest centroid
of every coordinate of u = x_p R_pᵀ / ‖x_p‖, b bits per code, packed little-endian. Written independently of
``bytediet.kvcache`` (kernels import no codec), with the same float steps, so both leave the same codes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .decoder_spec import TurboQuantPageSpec


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) in [0, 2**bits) → uint8 (..., n·bits/8): bit t of code k is bit k·bits + t of the stream."""
    stream = (codes.long().unsqueeze(-1) >> torch.arange(bits)) & 1  # (..., n, bits)
    stream = stream.reshape(*codes.shape[:-1], -1, 8)
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes` → int64 (..., n)."""
    stream = (packed.long().unsqueeze(-1) >> torch.arange(8)) & 1  # (..., bytes, 8)
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    return (stream << torch.arange(bits)).sum(-1)


def rotated_mean(pages: TurboQuantPageSpec, positions: torch.Tensor) -> torch.Tensor:
    """RoPE(μ, p) of the pre-RoPE key mean at ``positions`` (any shape) → positions.shape + (H, D) float32
    (rotate-half RoPE with the layer's frequencies, angles p·θ_i in float32 as the model's RotaryEmbedding)."""
    freqs = positions.float()[..., None] * pages.inv_freq  # (..., D/2)
    cos, sin = freqs.cos()[..., None, :], freqs.sin()[..., None, :]  # (..., 1, D/2)
    m1, m2 = pages.rope_mean.chunk(2, dim=-1)  # (H, D/2)
    return torch.cat((m1 * cos - m2 * sin, m2 * cos + m1 * sin), dim=-1)


def _split(pages: TurboQuantPageSpec, x: torch.Tensor, positions=None) -> list[torch.Tensor]:
    """(T, H, D) → per part (T, H, d_part), mean removed, in the stored channel order."""
    if pages.rope_mean is not None:
        x = x - rotated_mean(pages, positions)
    if pages.mean is not None:
        x = x - pages.mean
    if pages.channels is not None:
        x = torch.gather(x, -1, pages.channels.expand(x.shape[0], -1, -1))
    return list(torch.split(x, [p.dim for p in pages.parts], dim=-1))


def write(
    pages: TurboQuantPageSpec, x: torch.Tensor, slots: torch.Tensor, positions: Optional[torch.Tensor] = None
) -> None:
    """Quantize x (T, H, D) into ``slots`` (T,); ``positions`` (T,) for keys with a pre-RoPE mean."""
    for p, xp in zip(pages.parts, _split(pages, x.float(), positions)):
        norm = xp.norm(dim=-1)  # (T, H)
        u = (xp / norm.clamp(min=1e-12)[..., None]) @ p.rotation.T
        idx = torch.bucketize(u.contiguous(), (p.codebook[1:] + p.codebook[:-1]) / 2)  # nearest centroid
        p.norm[slots] = norm.to(torch.float16)
        p.idx[slots] = pack_codes(idx, p.bits)


def read(pages: TurboQuantPageSpec, slots: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 reconstruction of ``slots`` (any shape) → slots.shape + (H, D); ``positions`` (slots' shape) for keys
    with a pre-RoPE mean. Inner-product keys add their residual's QJL estimate √(π/2)/dim · ‖r‖ · Sᵀ sign."""
    out = []
    for p in pages.parts:
        u = p.codebook[unpack_codes(p.idx[slots], p.bits, p.dim)]
        if p.signs is not None:
            signs = unpack_codes(p.signs[slots], 1, p.dim).float() * 2 - 1
            u = u + ((math.sqrt(math.pi / 2) / p.dim) * p.res_norm[slots].float())[..., None] * (signs @ p.sketch)
        out.append((u * p.norm[slots].float()[..., None]) @ p.rotation)
    x = torch.cat(out, dim=-1)
    if pages.channels is not None:
        x = torch.empty_like(x).scatter_(-1, pages.channels.expand(*x.shape[:-2], -1, -1), x)
    if pages.rope_mean is not None:
        x = x + rotated_mean(pages, positions)
    return x if pages.mean is None else x + pages.mean
