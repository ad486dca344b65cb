"""Fixed-size KV blocks: a free list, reference counts and prefix caching by chained block hashes.

The block manager owns memory bookkeeping only; it never touches tensors (the KV codec's pages are
indexed by the block ids it hands out). A full block is identified by the hash of its tokens chained
with the previous block's hash, so a repeated prefix (a system prompt) maps to the same blocks.
Freed blocks keep their hash until they are reused (least recently freed first), so a prefix can be
revived after its request finished.
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


def chain_hash(parent: Optional[int], tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    """Allocates blocks of ``block_size`` token slots to requests."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_queries = 0  # blocks looked up
        self.prefix_hits = 0     # blocks found

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
            block.block_hash = None
        block.ref_count = 1
        return block_id

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[int]:
        """Chained hashes of the request's first full blocks, memoised on the request (tokens never change)."""
        hashes, bs = request.block_hashes, self.block_size
        if len(hashes) < num_full_blocks:
            tokens = request.all_token_ids
            for i in range(len(hashes), num_full_blocks):
                hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(tokens[i * bs:(i + 1) * bs])))
        return hashes[:num_full_blocks]

    def allocate_cached_prefix(self, request: Request) -> int:
        """For a request with nothing computed: reuse cached blocks of its longest cached prefix.

        At least the last token is left to compute (its logits are needed), as in vLLM; a request that wants
        prompt logprobs reuses nothing (vLLM skips the cache for it too). Returns the
        number of tokens served from the cache and advances ``num_computed_tokens`` by it.
        """
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
        request.num_computed_tokens = hits * self.block_size
        return request.num_computed_tokens

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

    def reset_prefix_cache(self) -> None:
        self.hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
