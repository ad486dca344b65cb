"""Uncompressed KV cache (fp32 / bf16 / fp16): the reference every codec is compared with."""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels.reference import paged_attention
from .base import KV_CODECS, AttentionMetadata, KVCodec, LayerKVCache

_PAGE_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class FullPrecisionCache(LayerKVCache):
    """Pages as two tensors of shape (num_blocks * block_size, num_kv_heads, head_dim)."""

    def __init__(
        self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        slots = num_blocks * block_size
        self.k = torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(slots, num_kv_heads, head_dim, dtype=dtype, device=device)

    def write(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> None:
        self.k.index_copy_(0, slot_mapping, k.to(self.k.dtype))
        self.v.index_copy_(0, slot_mapping, v.to(self.v.dtype))

    def decode(
        self, slots: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(L,) slots → float32 (k, v), each (L, H, D) (as :meth:`CompressedCache.decode`)."""
        return self.k[slots].float(), self.v[slots].float()

    def native_pages(self) -> Optional[dict]:
        k_dtype = _PAGE_TYPES.get(self.k.dtype)
        return None if k_dtype is None else dict(k_dtype=k_dtype, k_cache=self.k, v_cache=self.v)

    def attend(
        self, q: torch.Tensor, meta: AttentionMetadata, scale: float, window: Optional[int] = None
    ) -> torch.Tensor:
        out = self.attend_natively(q, meta, scale, window)
        if out is not None:
            return out
        return paged_attention(q, meta, scale, window, lambda slots: (self.k[slots], self.v[slots]))

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v]


class FullPrecisionCodec(KVCodec):
    """Stores K and V unchanged in ``storage_dtype``."""

    storage_dtype: torch.dtype = torch.float32

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        return 2 * num_kv_heads * head_dim * torch.finfo(self.storage_dtype).bits / 8

    def create_cache(self, layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> LayerKVCache:
        return FullPrecisionCache(num_blocks, block_size, num_kv_heads, head_dim, self.storage_dtype, device)


@KV_CODECS.register("fp32")
class Float32Codec(FullPrecisionCodec):
    name = "fp32"
    storage_dtype = torch.float32


@KV_CODECS.register("bf16")
class BFloat16Codec(FullPrecisionCodec):
    name = "bf16"
    storage_dtype = torch.bfloat16


@KV_CODECS.register("fp16")
class Float16Codec(FullPrecisionCodec):
    name = "fp16"
    storage_dtype = torch.float16
