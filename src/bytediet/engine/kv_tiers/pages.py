"""A pool block's KV pages as one flat byte buffer, and back: the only code of the tiers that touches the pool.

Lossless (the default): every per-slot tensor of every layer (``LayerKVCache.tensors()``, each indexed by slot in
its first dimension) is copied for the block's slots, bit for bit, so a hit is exactly what a recompute with the pool's
codec would have written. Re-encoded (``--kv-offload-codec``): each layer's block is decoded to float and written
into a one-block cache of the smaller codec; a load decodes it and writes it back through the pool's codec.
"""

from __future__ import annotations

import json
from typing import Optional

import torch

from ...errors import ConfigError
from ..block_copy import slot_tensors


def _slot_tensors(cache, block_size: int, what: str) -> list[torch.Tensor]:
    tensors = slot_tensors(cache, block_size)
    if tensors is None:
        bad = [tuple(t.shape) for t in cache.tensors()]
        raise ConfigError(
            f"KV tiers: {what} keeps state outside its per-slot pages (tensor shapes {bad or 'none'}); "
            "offloading needs a codec whose pages are all indexed by slot (e.g. bf16, q8_0, turboquant)"
        )
    return tensors


class BlockPages:
    """Reads and writes one block's bytes across every layer's pages (``caches``: the runner's, one per layer)."""

    def __init__(self, caches, block_size: int, codec_name: str, at_rest=None, model_dtype=torch.float32) -> None:
        self.caches, self.block_size = caches, block_size
        self.at_rest = None
        if at_rest is None:
            self.tensors = [_slot_tensors(c, block_size, f"KV codec {codec_name!r}") for c in caches]
        else:  # one staging block of the smaller codec per layer
            for c in caches:
                if not hasattr(c, "decode"):
                    raise ConfigError(
                        f"--kv-offload-codec: the pool's codec {codec_name!r} cannot be decoded to "
                        "re-encode it; leave --kv-offload-codec out (lossless)"
                    )
            self.at_rest = [
                at_rest.create_cache(i, 1, block_size, c.num_kv_heads, c.head_dim, model_dtype, "cpu")
                for i, c in enumerate(caches)
            ]
            self.tensors = [_slot_tensors(c, block_size, f"--kv-offload-codec {at_rest.name!r}") for c in self.at_rest]
        self._parts = [
            (t.shape[1:], t.dtype, t[0].numel() * t.element_size() * block_size)
            for layer in self.tensors
            for t in layer
        ]
        self.block_bytes = sum(n for _, _, n in self._parts)

    def layout(self) -> str:
        """The page layout as text (part of the tier key's salt)."""
        return json.dumps([[list(shape), str(dtype)] for shape, dtype, _ in self._parts])

    def _slices(self, tensors, block: int) -> list[torch.Tensor]:
        lo, hi = block * self.block_size, (block + 1) * self.block_size
        return [t[lo:hi] for layer in tensors for t in layer]

    def read(self, block_id: int, first_position: int) -> torch.Tensor:
        """The block's bytes: a new (block_bytes,) uint8 CPU tensor."""
        if self.at_rest is not None:
            self._encode(block_id, first_position)
            parts = self._slices(self.tensors, 0)
        else:
            parts = self._slices(self.tensors, block_id)
        return torch.cat([p.detach().contiguous().reshape(-1).view(torch.uint8).cpu() for p in parts])

    def write(self, block_id: int, data: torch.Tensor, first_position: int) -> None:
        """Put ``read``'s bytes back into the pool's block ``block_id``."""
        if data.numel() != self.block_bytes:
            raise ValueError(f"a block holds {self.block_bytes} bytes, got {data.numel()}")
        dest = self._slices(self.tensors, 0 if self.at_rest is not None else block_id)
        offset = 0
        for d, (_shape, dtype, n) in zip(dest, self._parts):
            d.copy_(data[offset : offset + n].view(dtype).reshape(d.shape), non_blocking=False)
            offset += n
        if self.at_rest is not None:
            self._decode(block_id, first_position)

    def _positions(self, first_position: int, device) -> torch.Tensor:
        return torch.arange(first_position, first_position + self.block_size, device=device)

    def _encode(self, block_id: int, first_position: int) -> None:
        for pool, rest in zip(self.caches, self.at_rest):
            slots = torch.arange(
                block_id * self.block_size, (block_id + 1) * self.block_size, device=pool.tensors()[0].device
            )
            k, v = pool.decode(slots, self._positions(first_position, slots.device))
            rest.write(k.cpu(), v.cpu(), torch.arange(self.block_size), self._positions(first_position, "cpu"))

    def _decode(self, block_id: int, first_position: int) -> None:
        for pool, rest in zip(self.caches, self.at_rest):
            k, v = rest.decode(torch.arange(self.block_size), self._positions(first_position, "cpu"))
            device = pool.tensors()[0].device
            slots = torch.arange(block_id * self.block_size, (block_id + 1) * self.block_size, device=device)
            pool.write(k.to(device), v.to(device), slots, self._positions(first_position, device))


def offload_codec(name: Optional[str], model_dtype):
    """The at-rest codec object for ``--kv-offload-codec`` (None: store the pool's pages as they are)."""
    if not name:
        return None
    from ...kvcache import get_kv_codec

    return get_kv_codec(name, model_dtype)
