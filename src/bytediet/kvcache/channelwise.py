"""Per-channel integer quantization of keys over groups of G consecutive tokens (asymmetric, fp16 scale and zero).

The key layout of KIVI (arXiv 2402.02750 §3.2) and of Hugging Face's ``QuantizedCache``: a channel's scale is
shared by G tokens, so the outlier channels typical of keys get their own range. A group can only be quantized
once all its tokens exist, so this half is used behind a full-precision window
(:class:`~bytediet.kvcache.window.WindowHalf`) whose chunks are whole groups: every write is a run of complete,
aligned groups.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kernels.decoder_spec import CodePageSide
from . import bitpack
from .halves import HalfCodec, HalfPages
from .kivi import quantize_groups


class ChannelwisePages(HalfPages):
    def __init__(self, num_slots, num_heads, head_dim, device, bits: int, group: int) -> None:
        super().__init__(num_slots, num_heads, head_dim, device)
        self.bits, self.group = bits, group
        self.codes = torch.zeros(
            num_slots, num_heads, bitpack.packed_size(head_dim, bits), dtype=torch.uint8, device=device
        )
        self.scale = torch.zeros(num_slots // group, num_heads, head_dim, dtype=torch.float16, device=device)
        self.zero = torch.zeros_like(self.scale)

    def write(self, x, slots):
        """x (n·G, H, D) for the slots of n whole groups, in slot order."""
        order = torch.argsort(slots)
        slots, x = slots[order], x[order]
        if slots.shape[0] % self.group or bool((slots[:: self.group] % self.group).any()):
            raise ValueError(f"per-channel keys are written in whole aligned groups of {self.group} tokens")
        n = slots.shape[0] // self.group
        codes, scale, zero = quantize_groups(x.float().reshape(n, self.group, self.num_heads, self.head_dim), self.bits)
        g = slots[:: self.group] // self.group
        self.codes.index_copy_(0, slots, bitpack.pack(codes.reshape(-1, self.num_heads, self.head_dim), self.bits))
        self.scale.index_copy_(0, g, scale)
        self.zero.index_copy_(0, g, zero)

    def decode(self, slots):
        g = slots // self.group
        q = bitpack.unpack(self.codes[slots], self.bits, self.head_dim).float()
        return q * self.scale[g].float() + self.zero[g].float()

    def native_pages(self):
        """KIVI's key layout (code pages ``kivi<bits>-keys``) at 2 and 4 bits; the window in front adds its staging."""
        if self.bits not in (2, 4) or self.head_dim % 8:
            return None
        return f"kivi{self.bits}-keys", self.codes, None, CodePageSide(self.scale, self.zero, group=self.group)

    def tensors(self):
        return [self.codes, self.scale, self.zero]


class ChannelwiseHalf(HalfCodec):
    def __init__(self, bits: int, group: int) -> None:
        if not 2 <= bits <= 8:
            raise ConfigError(f"per-channel integer keys support 2 to 8 bits, got {bits}")
        self.bits, self.group = bits, group
        self.name = f"int{bits}-channel-g{group}"

    def check(self, num_heads, head_dim, block_size):
        if block_size % self.group:
            raise ConfigError(
                f"{self.name}: the key group ({self.group} tokens) must divide the block size {block_size}"
            )

    def bytes_per_token(self, num_heads, head_dim):
        return num_heads * (head_dim * self.bits / 8 + 2 * 2 * head_dim / self.group)

    def create(self, layer, role, num_blocks, block_size, num_heads, head_dim, device):
        return ChannelwisePages(num_blocks * block_size, num_heads, head_dim, device, self.bits, self.group)
