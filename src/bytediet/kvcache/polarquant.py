"""PolarQuant KV cache (Han, Kacham, Karbasi, Mirrokni, Zandieh; arXiv 2502.02617): spec ``polarquant``.

1. Random preconditioning: y = R x with a random orthogonal R (randomized Hadamard; QR when D is not a
   power of two).
2. Recursive polar transform over L = 4 levels: level 1 turns each coordinate pair (y₂ᵢ, y₂ᵢ₊₁) into a
   radius and an angle in [0, 2π); level ℓ ≥ 2 turns each pair of level-(ℓ−1) radii into a radius and an
   angle in [0, π/2]. What remains are D/16 radii (fp16) and D/2 + D/4 + D/8 + D/16 angles.
3. After preconditioning the angles are independent with known densities (Lemma 2): uniform at level 1,
   ∝ sin^(2^(ℓ−1) − 1)(2ψ) at level ℓ ≥ 2. Each level is quantized with the Lloyd–Max codebook of its
   density — 4 bits at level 1, 2 bits above (the paper's setting) — so no per-block scale or zero point.

All-in: (D/2·4 + (D/4 + D/8 + D/16)·2 + D/16·16) / D = 3.875 bits per coordinate.
Keys are scored in the rotated domain (the query is rotated once); values are accumulated there and
rotated back once per query. A row's angle codes are stored level after level in one byte row (23·D/64 bytes).

Attention: the native kernel reads these pages in place (``native_pages``: code page ``polarquant``,
``kernels/cpu/csrc/code_pages.h``) for decodes and prefill chunks: the query rotated once per call, each key and value
row widened in the rotated basis from its radii down the polar tree in an L1 tile (cos and sin of the centroids from a
table), the values' sum rotated back once per head — the numbers of this file's own read. The one-call decode step
does not write these pages (it says so in one line; the module path runs, its attention native).
"""

from __future__ import annotations

import math

import torch

from ..errors import ConfigError
from ..kernels.decoder_spec import POLAR_MAX_DIM, CodePageSide
from . import bitpack
from .base import KV_CODECS
from .compressed import CompressedCodec
from .halves import HalfCodec, HalfPages
from .lloyd_max import nearest, sine_power_codebook
from .rotation import random_rotation

LEVELS = 4
LEVEL_BITS = (4, 2, 2, 2)


def level_codebooks() -> list[torch.Tensor]:
    uniform = (torch.arange(2 ** LEVEL_BITS[0], dtype=torch.float32) + 0.5) * (2 * math.pi / 2 ** LEVEL_BITS[0])
    return [uniform] + [sine_power_codebook(2 ** (lvl - 1) - 1, LEVEL_BITS[lvl - 1]) for lvl in range(2, LEVELS + 1)]


def polar_encode(y: torch.Tensor, codebooks: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """y (..., D) → (angle codes per level, each (..., D / 2^ℓ) int64; final radii (..., D / 16))."""
    codes, r = [], y
    for lvl, cb in enumerate(codebooks):
        a, b = r[..., 0::2], r[..., 1::2]
        psi = torch.atan2(b, a)
        if lvl == 0:
            psi = torch.remainder(psi, 2 * math.pi)
            codes.append(torch.clamp((psi / (2 * math.pi) * len(cb)).long(), max=len(cb) - 1))
        else:
            codes.append(nearest(psi, cb))
        r = torch.sqrt(a * a + b * b)
    return codes, r


def polar_decode(codes: list[torch.Tensor], radii: torch.Tensor, codebooks: list[torch.Tensor]) -> torch.Tensor:
    r = radii
    for c, cb in zip(reversed(codes), reversed(codebooks)):
        psi = cb[c]
        r = torch.stack([r * torch.cos(psi), r * torch.sin(psi)], dim=-1).flatten(-2)
    return r


class PolarPages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, rotation: torch.Tensor) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.R = rotation.to(device)
        self.codebooks = [cb.to(device) for cb in level_codebooks()]
        # cos then sin of each level's centroids, as polar_decode computes them: the native read's table
        self.table = torch.cat([torch.cat([cb.cos(), cb.sin()]) for cb in self.codebooks])
        self.sizes = [bitpack.packed_size(head_dim >> (lvl + 1), bits) for lvl, bits in enumerate(LEVEL_BITS)]
        self.codes = torch.zeros(num_slots, num_heads, sum(self.sizes), dtype=torch.uint8, device=device)
        self.radii = torch.zeros(num_slots, num_heads, head_dim >> LEVELS, dtype=torch.float16, device=device)

    def write(self, x, slots):
        codes, radii = polar_encode(x @ self.R.T, self.codebooks)
        packed = torch.cat([bitpack.pack(c, bits) for c, bits in zip(codes, LEVEL_BITS)], dim=-1)
        self.codes.index_copy_(0, slots, packed)
        self.radii.index_copy_(0, slots, radii.to(torch.float16))

    def rotated(self, slots: torch.Tensor) -> torch.Tensor:
        """(L,) slots → (L, H, D) reconstruction in the preconditioned domain."""
        codes = [
            bitpack.unpack(s, bits, self.head_dim >> (lvl + 1))
            for lvl, (s, bits) in enumerate(zip(torch.split(self.codes[slots], self.sizes, -1), LEVEL_BITS))
        ]
        return polar_decode(codes, self.radii[slots].float(), self.codebooks)

    def native_pages(self):
        """The codes and radii, widened in the rotated basis by the native attention (``decoder_spec.CodePageSide``:
        radii as ``scale``, R as ``transform``, the centroids' cos and sin as ``table``); the numbers of
        :meth:`scores` and :meth:`weighted_sum` + :meth:`finish`."""
        if self.head_dim > POLAR_MAX_DIM:
            return None
        return "polarquant", self.codes, None, CodePageSide(self.radii, transform=self.R, table=self.table)

    def decode(self, slots):
        return self.rotated(slots) @ self.R

    def prepare_query(self, qg):
        return qg @ self.R.T

    def scores(self, qr, slots):
        return torch.bmm(qr, self.rotated(slots).permute(1, 2, 0))

    def weighted_sum(self, p, slots):
        return torch.bmm(p, self.rotated(slots).transpose(0, 1))

    def finish(self, acc):
        return acc @ self.R

    def tensors(self):
        return [self.codes, self.radii]


class PolarHalf(HalfCodec):
    name = "polarquant"

    def check(self, num_heads, head_dim, block_size):
        if head_dim % (2**LEVELS) or (head_dim >> LEVELS) * 2 % 8:
            raise ConfigError(
                f"polarquant needs a head_dim divisible by {2 ** (LEVELS + 2)} "
                f"({LEVELS} polar levels, packed 2-bit angles), got {head_dim}"
            )

    def bytes_per_token(self, num_heads, head_dim):
        angle_bits = sum((head_dim >> (lvl + 1)) * bits for lvl, bits in enumerate(LEVEL_BITS))
        return num_heads * (angle_bits + (head_dim >> LEVELS) * 16) / 8

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        seed = 4099 * layer + (0 if role == "k" else 1)
        return PolarPages(
            num_blocks * block_size, num_heads, head_dim, device, random_rotation(head_dim, "hadamard", seed)
        )


@KV_CODECS.register("polarquant")
class PolarQuantCodec(CompressedCodec):
    def __init__(self) -> None:
        super().__init__("polarquant", PolarHalf(), PolarHalf())

    @classmethod
    def from_spec(cls, rest: str) -> "PolarQuantCodec":
        raise ConfigError(f"polarquant takes no parameters (4/2/2/2-bit levels, 3.875 bits), got 'polarquant{rest}'")
