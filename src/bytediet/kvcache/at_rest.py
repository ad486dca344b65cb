"""KV as a tier hit returns it when the tiers re-encode blocks at rest (``--kv-offload-codec``), for ``eval``.

:class:`AtRestRoundTrip` wraps the pool's codec: every block that fills up is decoded, written into the at-rest
codec's pages, decoded from them and written back through the pool's codec — what
:class:`bytediet.engine.kv_tiers.pages.BlockPages` does to a block that goes down to a tier and comes back. Scored
with it, every full block of the context has made that trip (the worst case: a whole prefix from the tier); the
last, partly filled block keeps the pool's precision, as in the engine (only full blocks are offloaded).
"""

from __future__ import annotations

from typing import Optional

import torch

from .base import KVCodec, LayerKVCache


class AtRestRoundTrip(KVCodec):
    """The pool's codec ``pool`` with every full block round-tripped through ``at_rest``."""

    def __init__(self, pool: KVCodec, at_rest: KVCodec) -> None:
        self.pool, self.at_rest = pool, at_rest
        self.name = f"{pool.name} (blocks round-tripped through {at_rest.name} at rest)"

    def bytes_per_token(self, num_kv_heads: int, head_dim: int) -> float:
        return self.pool.bytes_per_token(num_kv_heads, head_dim)

    def min_block_size(self) -> int:
        return max(self.pool.min_block_size(), self.at_rest.min_block_size())

    def describe(self, head_dim: Optional[int] = None) -> str:
        return f"{self.pool.describe(head_dim)}, full blocks round-tripped through {self.at_rest.describe(head_dim)}"

    def create_cache(self, layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device) -> LayerKVCache:
        args = (layer, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        return RoundTripCache(self.pool.create_cache(*args), self.at_rest.create_cache(*args))


class RoundTripCache:
    """One layer's pool pages (every other call goes to them) whose full blocks make the at-rest trip."""

    def __init__(self, pool: LayerKVCache, at_rest: LayerKVCache) -> None:
        self._pool, self._rest = pool, at_rest
        slots = pool.num_blocks * pool.block_size
        self._positions = torch.zeros(slots, dtype=torch.int64, device=pool.tensors()[0].device)

    def __getattr__(self, name):
        return getattr(self._pool, name)

    def write(
        self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, positions: Optional[torch.Tensor] = None
    ) -> None:
        self._pool.write(k, v, slot_mapping, positions)
        bs = self._pool.block_size
        self._positions[slot_mapping] = positions if positions is not None else slot_mapping
        full = torch.unique(slot_mapping[slot_mapping % bs == bs - 1] // bs)  # blocks whose last slot came now
        if full.numel():
            slots = (full[:, None] * bs + torch.arange(bs, device=full.device)).reshape(-1)
            pos = self._positions[slots]
            kf, vf = self._pool.decode(slots, pos)
            self._rest.write(kf.cpu(), vf.cpu(), slots.cpu(), pos.cpu())
            kr, vr = self._rest.decode(slots.cpu(), pos.cpu())
            self._pool.write(kr.to(k.device), vr.to(k.device), slots, pos)
