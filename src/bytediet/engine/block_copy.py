"""Copies one pool block's KV pages onto another in every layer (token-granular prefix reuse)."""

from __future__ import annotations

from typing import Callable, Optional

import torch


def slot_tensors(cache, block_size: int) -> Optional[list[torch.Tensor]]:
    """The layer cache's tensors when every one is indexed by slot in its first dimension, else None (the codec
    keeps state per block or per sequence)."""
    tensors = cache.tensors()
    slots = cache.num_blocks * block_size
    if not tensors or any(t.dim() == 0 or t.shape[0] != slots for t in tensors):
        return None
    return tensors


def block_copier(caches, block_size: int) -> Optional[Callable[[int, int], None]]:
    """``copy(src, dst)`` over every layer's pages, or None where some layer's codec is not per slot."""
    layers = [slot_tensors(c, block_size) for c in caches]
    if any(t is None for t in layers):
        return None
    flat = [t for layer in layers for t in layer]

    def copy(src: int, dst: int) -> None:
        a, b = src * block_size, dst * block_size
        for t in flat:
            t[b : b + block_size].copy_(t[a : a + block_size])

    return copy
