"""Per-token integer quantization of K or V: one scale (and zero point) per token, head and channel group.

Used by ``int8`` (symmetric, 8 bits, one group = the whole head), by KIVI's values and by QJL's values
(asymmetric, 2 or 4 bits, groups of 32 channels; KIVI arXiv 2402.02750 §3.2). Scales and zero points are
stored in fp16 and the codes are computed with the fp16-rounded scale, so decode is exact to the stored data.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kernels.decoder_spec import CodePageSide
from . import bitpack
from .halves import HalfCodec, HalfPages


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    s = scale.clamp(min=1e-6).to(torch.float16)
    return s


class TokenwisePages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, bits: int, group: int, symmetric: bool) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.bits, self.group, self.symmetric = bits, group, symmetric
        ngroups = head_dim // group
        self.codes = torch.zeros(
            num_slots, num_heads, bitpack.packed_size(head_dim, bits), dtype=torch.uint8, device=device
        )
        self.scale = torch.zeros(num_slots, num_heads, ngroups, dtype=torch.float16, device=device)
        self.zero = None if symmetric else torch.zeros_like(self.scale)

    def native_pages(self):
        if self.bits == 8 and self.symmetric and self.group == self.head_dim:  # the ``int8`` codec: code = q + 128
            return "int8", self.codes, self.scale
        if self.bits in (2, 4) and not self.symmetric and self.group in (32, 64):  # KIVI's, QJL's, HF's values
            return f"int{self.bits}-token-g{self.group}-asym", self.codes, None, CodePageSide(self.scale, self.zero)
        return None

    def write(self, x, slots):
        t, h, d = x.shape
        xg = x.reshape(t, h, d // self.group, self.group)
        if self.symmetric:
            qmax = 2 ** (self.bits - 1) - 1
            scale = _fp16_scale(xg.abs().amax(-1) / qmax)
            q = torch.round(xg / scale.float()[..., None]).clamp(-qmax, qmax) + 2 ** (self.bits - 1)
        else:
            lo, hi = xg.amin(-1), xg.amax(-1)
            zero = lo.to(torch.float16)
            scale = _fp16_scale((hi - zero.float()) / (2**self.bits - 1))
            q = torch.round((xg - zero.float()[..., None]) / scale.float()[..., None]).clamp(0, 2**self.bits - 1)
            self.zero.index_copy_(0, slots, zero)
        self.scale.index_copy_(0, slots, scale)
        self.codes.index_copy_(0, slots, bitpack.pack(q.reshape(t, h, d).to(torch.int64), self.bits))

    def decode(self, slots):
        n = slots.shape[0]
        q = bitpack.unpack(self.codes[slots], self.bits, self.head_dim).float()
        q = q.reshape(n, self.num_heads, -1, self.group)
        scale = self.scale[slots].float()[..., None]
        if self.symmetric:
            x = (q - 2 ** (self.bits - 1)) * scale
        else:
            x = q * scale + self.zero[slots].float()[..., None]
        return x.reshape(n, self.num_heads, self.head_dim)

    def tensors(self):
        return [self.codes, self.scale] + ([] if self.zero is None else [self.zero])


class TokenwiseHalf(HalfCodec):
    """``bits`` in 2…8; ``group`` channels share a scale (None = the whole head)."""

    def __init__(self, bits: int, group: int | None = None, symmetric: bool = True) -> None:
        if not 2 <= bits <= 8:
            raise ConfigError(f"per-token integer quantization supports 2 to 8 bits, got {bits}")
        self.bits, self.group, self.symmetric = bits, group, symmetric
        self.name = f"int{bits}-token" + ("" if group is None else f"-g{group}") + ("" if symmetric else "-asym")

    def _group(self, head_dim: int) -> int:
        return head_dim if self.group is None else min(self.group, head_dim)

    def check(self, num_heads, head_dim, block_size):
        g = self._group(head_dim)
        if head_dim % g or (g * self.bits) % 8:
            raise ConfigError(f"{self.name}: head_dim {head_dim} must be a multiple of the group size {g}")

    def bytes_per_token(self, num_heads, head_dim):
        ngroups = head_dim // self._group(head_dim)
        side = 2 if self.symmetric else 4  # fp16 scale (+ fp16 zero point)
        return num_heads * (head_dim * self.bits / 8 + ngroups * side)

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        return TokenwisePages(
            num_blocks * block_size, num_heads, head_dim, device, self.bits, self._group(head_dim), self.symmetric
        )
