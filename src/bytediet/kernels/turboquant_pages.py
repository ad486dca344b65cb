"""TurboQuant pages as the native decode step reads and writes them: the plain-PyTorch twin of
``cpu/csrc/turboquant_pages.cpp`` (used by :func:`bytediet.kernels.reference.decode_step`).

The layout is kvcache's ``turboquant`` codec (MSE variant, arXiv 2504.19874; :class:`TurboQuantPageSpec`):
x − mean, channels in the stored order, cut in parts; each part keeps ‖x_p‖ (fp16) and the nearest centroid
of every coordinate of u = x_p R_pᵀ / ‖x_p‖, b bits per code, packed little-endian. Written independently of
``bytediet.kvcache`` (kernels import no codec), with the same float steps, so both leave the same codes.
"""
from __future__ import annotations

import torch

from .decoder_spec import TurboQuantPageSpec


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes (..., n) in [0, 2**bits) → uint8 (..., n·bits/8): bit t of code k is bit k·bits + t of the stream."""
    stream = (codes.long().unsqueeze(-1) >> torch.arange(bits)) & 1                      # (..., n, bits)
    stream = stream.reshape(*codes.shape[:-1], -1, 8)
    return (stream << torch.arange(8)).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_codes` → int64 (..., n)."""
    stream = (packed.long().unsqueeze(-1) >> torch.arange(8)) & 1                        # (..., bytes, 8)
    stream = stream.reshape(*packed.shape[:-1], n, bits)
    return (stream << torch.arange(bits)).sum(-1)


def _split(pages: TurboQuantPageSpec, x: torch.Tensor) -> list[torch.Tensor]:
    """(T, H, D) → per part (T, H, d_part), mean removed, in the stored channel order."""
    if pages.mean is not None:
        x = x - pages.mean
    if pages.channels is not None:
        x = torch.gather(x, -1, pages.channels.expand(x.shape[0], -1, -1))
    return list(torch.split(x, [p.dim for p in pages.parts], dim=-1))


def write(pages: TurboQuantPageSpec, x: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantize x (T, H, D) into ``slots`` (T,)."""
    for p, xp in zip(pages.parts, _split(pages, x.float())):
        norm = xp.norm(dim=-1)                                                            # (T, H)
        u = (xp / norm.clamp(min=1e-12)[..., None]) @ p.rotation.T
        idx = torch.bucketize(u.contiguous(), (p.codebook[1:] + p.codebook[:-1]) / 2)    # nearest centroid
        p.norm[slots] = norm.to(torch.float16)
        p.idx[slots] = pack_codes(idx, p.bits)


def read(pages: TurboQuantPageSpec, slots: torch.Tensor) -> torch.Tensor:
    """float32 reconstruction of ``slots`` (any shape) → slots.shape + (H, D)."""
    out = []
    for p in pages.parts:
        u = p.codebook[unpack_codes(p.idx[slots], p.bits, p.dim)] * p.norm[slots].float()[..., None]
        out.append(u @ p.rotation)
    x = torch.cat(out, dim=-1)
    if pages.channels is not None:
        x = torch.empty_like(x).scatter_(-1, pages.channels.expand(*x.shape[:-2], -1, -1), x)
    return x if pages.mean is None else x + pages.mean
