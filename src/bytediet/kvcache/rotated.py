"""Rotated 8-bit KV codecs: ``rot-int8`` and ``rot-q8_0`` store each head vector after a fixed randomized Hadamard
rotation, in the pages of ``int8`` (one fp16 scale per token and head: 8 + 16/D bits) or llama.cpp's ``q8_0``
(an fp16 scale per 32 channels: 8.5 bits).

Real keys carry outlier channels (a few channels far above the rest, KV_RESULTS §1 and §9a): one int8 scale over a
head of 256 channels is set by them and rounds every other channel coarsely. An orthogonal R spreads each vector's
energy over all channels (QuaRot arXiv 2404.00456 §4, SpinQuant arXiv 2405.16406; TurboQuant rotates for the same
reason), so the same scale — per token, or per 32-channel block — quantizes far more finely, for no stored byte:
R is a per-layer constant seeded by layer and side, not a page.

R = ``random_rotation(D, "hadamard", seed)`` = H_D · diag(s) / √D (a Haar-random QR rotation where D is not a power
of two). The inner codec stores x' = x Rᵀ in its own pages, and reading them needs no decode back:

* keys:   q · k = (q Rᵀ) · (k Rᵀ) — the query is rotated once per step and scored against the stored codes;
* values: Σ_j p_j v_j = (Σ_j p_j v'_j) R — accumulated in the rotated basis, the output rotated back once.

So the native paged attention reads the inner pages in place between a rotation of q and one of the output
(:meth:`bytediet.kvcache.compressed.CompressedCache.attend_natively`), and the one-call native decode step rotates q
and k after RoPE and v before it writes the pages, and the attention output after (``LayerSpec.k_rot``/``v_rot``).
``native_pages()`` is None for these caches (their pages are not in the model's basis); ``attention_pages()`` gives
them to the readers that know the halves' :attr:`~RotatedPages.rotation`. A split spec mixes them with any other
half (``k=rot-q8_0,v=int8``), as ``auto:<bits>`` plans do.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from .base import KV_CODECS
from .compressed import CompressedCodec
from .ggml_block import GGMLBlockHalf
from .halves import HalfCodec, HalfPages
from .rotation import random_rotation, rotation_kind
from .tokenwise import TokenwiseHalf


class RotatedPages(HalfPages):
    """The inner half's pages holding x Rᵀ; :attr:`rotation` R (D, D) float32 tells the cache to rotate q and the
    output around the native attention."""

    def __init__(self, inner: HalfPages, rotation: torch.Tensor) -> None:
        super().__init__(inner.num_slots, inner.num_heads, inner.head_dim, inner.device)
        self.inner, self.rotation = inner, rotation.to(inner.device)

    def write(self, x, slots):
        self.inner.write(x.float() @ self.rotation.T, slots)

    def decode(self, slots):
        return self.inner.decode(slots) @ self.rotation  # (L, H, D) in the model's basis

    def native_pages(self):
        return self.inner.native_pages()  # in the rotated basis

    def prepare_query(self, qg):
        return self.inner.prepare_query(qg @ self.rotation.T)

    def scores(self, prepared, slots):
        return self.inner.scores(prepared, slots)

    def weighted_sum(self, p, slots):
        return self.inner.weighted_sum(p, slots)

    def finish(self, acc):
        return self.inner.finish(acc) @ self.rotation

    def tensors(self):
        return self.inner.tensors()


class RotatedHalf(HalfCodec):
    """One of K or V stored by ``inner`` (a per-token half: int8's or a llama.cpp block type) after a rotation."""

    ROTATABLE = (TokenwiseHalf, GGMLBlockHalf)  # stateless, position-free halves whose scales a rotation helps

    def __init__(self, inner: HalfCodec, rotation: str = "hadamard") -> None:
        if not isinstance(inner, self.ROTATABLE):
            raise ConfigError(f"rot-: cannot rotate {inner.name} (per-token int and llama.cpp block halves can be)")
        self.inner, self.rotation = inner, rotation
        self.name = f"rot-{inner.name}"

    def bytes_per_token(self, num_heads, head_dim):
        return self.inner.bytes_per_token(num_heads, head_dim)  # R is a per-layer constant, not a page

    def check(self, num_heads, head_dim, block_size):
        self.inner.check(num_heads, head_dim, block_size)

    def min_block_size(self):
        return self.inner.min_block_size()

    def describe(self, head_dim: Optional[int] = None) -> str:
        if head_dim is None:
            return self.name
        return f"{self.name} ({rotation_kind(head_dim, self.rotation)} rotation of {head_dim})"

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        seed = 7919 * layer + (0 if role == "k" else 104729) + 31
        inner = self.inner.create(layer, role, num_blocks, block_size, num_heads, head_dim, device)
        return RotatedPages(inner, random_rotation(head_dim, self.rotation, seed))


def rotated_codec_class(name: str, inner: str):
    """A codec class storing K and V both as ``inner``'s halves after a rotation (registered as ``name``)."""

    class RotatedCodec(CompressedCodec):
        __doc__ = f"``{inner}`` pages of rotated K and V; see :mod:`bytediet.kvcache.rotated`."

        def __init__(self) -> None:
            base = KV_CODECS.build(inner)
            super().__init__(name, RotatedHalf(base.key_half), RotatedHalf(base.value_half))

    RotatedCodec.__name__ = RotatedCodec.__qualname__ = "Rot" + inner.upper().replace("_", "") + "Codec"
    return RotatedCodec


RotInt8Codec = KV_CODECS.register("rot-int8")(rotated_codec_class("rot-int8", "int8"))
RotQ8_0Codec = KV_CODECS.register("rot-q8_0")(rotated_codec_class("rot-q8_0", "q8_0"))
