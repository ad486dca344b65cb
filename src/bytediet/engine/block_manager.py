"""Fixed-size KV blocks: a free list, reference counts and prefix caching by chained block hashes.

The block manager owns memory bookkeeping only; it never touches tensors (the KV codec's pages are
indexed by the block ids it hands out). A full block is identified by the hash of its tokens chained
with the previous block's hash, so a repeated prefix (a system prompt) maps to the same blocks.
Freed blocks keep their hash until they are reused (least recently freed first), so a prefix can be
revived after its request finished. With KV tiers (:mod:`bytediet.engine.kv_tiers`) a reused block's bytes are
first handed to the tier store, and a prefix the pool lost is looked up there and loaded into free blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from .request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None
    tier_key: Optional[bytes] = None  # the block's key below the pool (KV tiers), beside its hash
    position: int = 0  # the position of its first token


def chain_hash(parent: Optional[int], tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    """Allocates blocks of ``block_size`` token slots to requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, tiers=None) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0  # blocks found
        self.tiers = tiers  # a kv_tiers.TierStore (moves bytes below the pool), or None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Extra blocks ``request`` needs to hold ``num_new_tokens`` more computed tokens."""
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(request.block_ids))

    def can_allocate(self, request: Request, num_new_tokens: int) -> bool:
        return self.blocks_needed(request, num_new_tokens) <= self.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError("allocate() without can_allocate(): the scheduler must preempt first")
        for _ in range(needed):
            request.block_ids.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict its cached prefix
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                if self.tiers is not None and block.tier_key is not None:
                    self.tiers.save(block.tier_key, block_id, block.position)  # its bytes go down a tier
            block.block_hash = block.tier_key = None
        block.ref_count = 1
        return block_id

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained hashes of the request's first full blocks, memoised on the request (tokens never change)."""
        hashes, bs = request.block_hashes, self.block_size
        if len(hashes) < num_full_blocks:
            tokens = request.all_token_ids
            for i in range(len(hashes), num_full_blocks):
                hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes[:num_full_blocks]

    def _tier_keys(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The tier store's (salted, process-stable) keys of the same chain, memoised on the request."""
        keys, bs = request.tier_keys, self.block_size
        if len(keys) < num_full_blocks:
            tokens = request.all_token_ids
            for i in range(len(keys), num_full_blocks):
                keys.append(self.tiers.key(keys[-1] if keys else None, tokens[i * bs : (i + 1) * bs]))
        return keys[:num_full_blocks]

    def allocate_cached_prefix(self, request: Request) -> Optional[int]:
        """For a request with nothing computed: reuse cached blocks of its longest cached prefix.

        At least the last token is left to compute (its logits are needed), as in vLLM; a request that wants
        prompt logprobs reuses nothing (vLLM skips the cache for it too). Returns the
        number of tokens served from the cache and advances ``num_computed_tokens`` by it, or None while
        blocks found below the pool are still loading (call again; other requests run meanwhile).
        """
        if request.tier_load is not None:
            return self._finish_tier_load(request)
        if not self.enable_prefix_caching or request.num_computed_tokens or request.block_ids:
            return 0
        if request.prompt_logprobs is not None:  # every prompt position is computed, to be scored
            return 0
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        self.prefix_queries += len(hashes)
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_blocks[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
        hits = len(request.block_ids)
        self.prefix_hits += hits
        request.num_registered_blocks = hits
        request.cached_tokens_by_tier = {"pool": hits * self.block_size}
        if self.tiers is not None and hits < len(hashes):
            self._start_tier_load(request, len(hashes))
            if request.tier_load is not None:
                return self._finish_tier_load(request)
        request.num_computed_tokens = hits * self.block_size
        return request.num_computed_tokens

    def _start_tier_load(self, request: Request, num_full_blocks: int) -> None:
        """Load the run of blocks after the pool's hits that the tiers hold, where the policy predicts it pays."""
        start = len(request.block_ids)
        keys = self._tier_keys(request, num_full_blocks)[start:]
        found = self.tiers.find(keys)
        take = 0
        worth = {t: self.tiers.worth(t, found.count(t)) for t in set(found)}
        while take < len(found) and worth[found[take]]:
            take += 1
        take = min(take, self.num_free_blocks)
        for t in set(found[take:]):
            self.tiers.skipped(t, found[take:].count(t))
        if not take:
            return
        entries = []
        for j in range(take):
            block_id = self._take_free_block()
            request.block_ids.append(block_id)
            entries.append((keys[j], found[j], block_id, (start + j) * self.block_size))
        request.tier_load = self.tiers.start(entries)

    def _finish_tier_load(self, request: Request) -> Optional[int]:
        """Once a request's load is complete: its blocks join the prefix cache and its prefill starts after them."""
        load = request.tier_load
        if not load.done():
            return None
        request.tier_load = None
        start = request.num_registered_blocks
        n = self.tiers.finish(load)
        for block_id in request.block_ids[start + n :]:  # lost or corrupt: those tokens are recomputed
            self._release(block_id)
        del request.block_ids[start + n :]
        for j in range(start, start + n):
            block = self.blocks[request.block_ids[j]]
            block.block_hash, block.tier_key, block.position = (
                request.block_hashes[j],
                request.tier_keys[j],
                j * self.block_size,
            )
            self.hash_to_block.setdefault(block.block_hash, block.block_id)
        for entry in load.entries[:n]:
            tier = entry[1]
            request.cached_tokens_by_tier[tier] = request.cached_tokens_by_tier.get(tier, 0) + self.block_size
        request.num_registered_blocks = start + n
        request.num_computed_tokens = (start + n) * self.block_size
        return request.num_computed_tokens

    def _release(self, block_id: int) -> None:
        """A block no request holds and no prefix names: first in line for reuse."""
        block = self.blocks[block_id]
        block.ref_count, block.block_hash, block.tier_key = 0, None, None
        self.free_blocks[block_id] = None
        self.free_blocks.move_to_end(block_id, last=False)

    def offload_cached(self) -> int:
        """Hand every cached block still in the pool to the tiers (at shutdown, so a restart finds them)."""
        if self.tiers is None:
            return 0
        saved = 0
        for block in self.blocks:
            if block.block_hash is not None and block.tier_key is not None:
                self.tiers.save(block.tier_key, block.block_id, block.position, wait=True)
                saved += 1
        return saved

    def cache_full_blocks(self, request: Request) -> None:
        """Register the hashes of the request's blocks that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        full = request.num_computed_tokens // self.block_size
        for i, h in enumerate(self._block_hashes(request, full)):
            if i < request.num_registered_blocks:
                continue
            block = self.blocks[request.block_ids[i]]
            if block.block_hash is None:
                block.block_hash = h
                self.hash_to_block.setdefault(h, block.block_id)
                if self.tiers is not None:
                    block.tier_key, block.position = self._tier_keys(request, i + 1)[i], i * self.block_size
        request.num_registered_blocks = max(request.num_registered_blocks, full)

    def trim(self, request: Request) -> None:
        """Give back the blocks beyond the request's computed tokens (rejected speculative drafts' slots)."""
        keep = -(-request.num_computed_tokens // self.block_size)
        for block_id in reversed(request.block_ids[keep:]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        del request.block_ids[keep:]

    def free(self, request: Request) -> None:
        """Release the request's blocks (last block first, so a shared prefix's head stays cached longest)."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0
        request.tier_load = None  # a load in flight is dropped; its blocks went back above

    def reset_prefix_cache(self) -> None:
        self.hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = block.tier_key = None
