"""Fixed-size KV blocks: a free list, reference counts and prefix caching by chained block hashes.

The block manager owns memory bookkeeping only; it never touches tensors (the KV codec's pages are
indexed by the block ids it hands out). A full block is identified by the hash of its tokens chained
with the previous block's hash, so a repeated prefix (a system prompt) maps to the same blocks.
Freed blocks keep their hash until they are reused (least recently freed first), so a prefix can be
revived after its request finished. With KV tiers (:mod:`bytediet.engine.kv_tiers`) a reused block's bytes are
first handed to the tier store (the blocks one allocation evicts, in one batch, before anything overwrites them),
and a prefix the pool lost is looked up there and loaded into free blocks while other requests run.

Token-granular reuse (SGLang's radix cache, at block level): after a request's cached full blocks, the head of
its next block is looked up among cached blocks with the same parent — full blocks, and the unshared tails that
finished requests leave behind. A tail is taken over as it is (its stale slots are overwritten before they are
read); a full block still cached is copied into a fresh block (``copy_block``). Only for codecs whose pages are
all indexed by slot (``enable_token_reuse``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Optional

from .request import Request


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[int] = None
    tier_key: Optional[bytes] = None  # the block's key below the pool (KV tiers), beside its hash
    position: int = 0  # the position of its first token
    parent: Optional[int] = None  # token-granular reuse: the chained hash of the block before it
    tokens: tuple[int, ...] = ()  # token-granular reuse: the tokens its computed slots hold (empty: not indexed)


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
        self.token_reuse = False  # token-granular reuse of a block's head (enable_token_reuse)
        self.copy_block: Optional[Callable[[int, int], None]] = None  # (src, dst): copies one block's pages
        self.by_head: dict[tuple[Optional[int], int], dict[int, None]] = {}  # (parent, first token) → blocks
        self.partial_query_tokens = 0  # prompt tokens after the full blocks, looked up at the head of a block
        self.partial_hit_tokens = 0  # prompt tokens served from the head of a block
        self._evicted: list[tuple[bytes, int, int]] = []  # cached blocks taken for reuse, not yet handed to the tiers

    def enable_token_reuse(self, copy_block: Optional[Callable[[int, int], None]]) -> None:
        """Turn on token-granular reuse (the codec's pages are all per slot); ``copy_block`` copies a block's
        pages onto another (None: only unshared tails are reused, taken over without a copy)."""
        self.token_reuse = self.enable_prefix_caching
        self.copy_block = copy_block

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
        self._save_evicted()

    def _take_free_block(self) -> int:
        block_id, _ = self.free_blocks.popitem(last=False)
        block = self.blocks[block_id]
        self._unindex(block)
        if block.block_hash is not None:  # evict its cached prefix
            if self.hash_to_block.get(block.block_hash) == block_id:
                del self.hash_to_block[block.block_hash]
                if self.tiers is not None and block.tier_key is not None:
                    self._evicted.append((block.tier_key, block_id, block.position))  # its bytes go down a tier
            block.block_hash = block.tier_key = None
        block.ref_count = 1
        return block_id

    def _save_evicted(self) -> None:
        """Hand the blocks evicted since the last call to the tiers (before their pages are overwritten)."""
        if self._evicted:
            self.tiers.save_many(self._evicted)
            self._evicted = []

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

    def allocate_cached_prefix(self, request: Request, others_running: bool = False) -> Optional[int]:
        """For a request with nothing computed: reuse cached blocks of its longest cached prefix.

        At least the last token is left to compute (its logits are needed), as in vLLM; a request that wants
        prompt logprobs reuses nothing (vLLM skips the cache for it too). Returns the
        number of tokens served from the cache and advances ``num_computed_tokens`` by it, or None while
        blocks found below the pool are still loading (call again; other requests run meanwhile). With
        ``others_running``, a prefix the tiers hold that the pool has no room for yet is not recomputed (its whole
        prefill) nor loaded in part: None again, nothing taken, and ``request.tier_wait`` set — call again once the
        running requests free blocks.
        """
        request.tier_wait = False
        if request.tier_load is not None:
            return self._finish_tier_load(request)
        if not self.enable_prefix_caching or request.num_computed_tokens or request.block_ids:
            return 0
        if request.prompt_logprobs is not None:  # every prompt position is computed, to be scored
            return 0
        hashes = self._block_hashes(request, (request.num_tokens - 1) // self.block_size)
        if others_running and self.tiers is not None and not self._tier_hit_fits(request, hashes):
            request.tier_wait = True
            return None
        self.prefix_queries += len(hashes)
        if self.token_reuse:  # the tokens after the full blocks are looked up too
            self.partial_query_tokens += request.num_tokens - 1 - len(hashes) * self.block_size
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
        request.num_computed_tokens = hits * self.block_size + self._reuse_head(request, hits)
        return request.num_computed_tokens

    def _reuse_head(self, request: Request, hits: int) -> int:
        """Tokens of block ``hits`` found at the head of a cached block with the same parent (0: none)."""
        if not self.token_reuse:
            return 0
        start = hits * self.block_size
        want = request.all_token_ids[start : min(start + self.block_size, request.num_tokens - 1)]
        if not want:
            return 0
        parent = request.block_hashes[hits - 1] if hits else None
        best, best_len = None, 0
        for block_id in self.by_head.get((parent, want[0]), ()):
            n = _common_prefix(self.blocks[block_id].tokens, want)
            if n > best_len or (n == best_len and self._is_free_tail(block_id)):
                best, best_len = block_id, n
        if best is None:
            return 0
        block = self.blocks[best]
        if self._is_free_tail(best):  # a finished request's tail that nothing else names: take it over
            del self.free_blocks[best]
            self._unindex(block)
            block.ref_count = 1
            request.block_ids.append(best)
        else:
            was_free = block.ref_count == 0
            if self.copy_block is None or len(self.free_blocks) <= int(was_free):  # no block to copy into
                return 0
            if was_free:  # keep the source out of _take_free_block's reach while it is copied
                del self.free_blocks[best]
            dst = self._take_free_block()
            self._save_evicted()
            self.copy_block(best, dst)
            if was_free:
                self.free_blocks[best] = None  # back in line, as the most recently used
            request.block_ids.append(dst)
        self.partial_hit_tokens += best_len
        request.cached_tokens_by_tier["pool"] = request.cached_tokens_by_tier.get("pool", 0) + best_len
        return best_len

    def _is_free_tail(self, block_id: int) -> bool:
        block = self.blocks[block_id]
        return block.block_hash is None and block.ref_count == 0

    def _index(self, block: Block, parent: Optional[int], tokens: tuple[int, ...]) -> None:
        if self.token_reuse and tokens:
            block.parent, block.tokens = parent, tokens
            self.by_head.setdefault((parent, tokens[0]), {})[block.block_id] = None

    def _unindex(self, block: Block) -> None:
        if block.tokens:
            key = (block.parent, block.tokens[0])
            entries = self.by_head.get(key)
            if entries is not None:
                entries.pop(block.block_id, None)
                if not entries:
                    del self.by_head[key]
            block.parent, block.tokens = None, ()

    def _worth_loading(self, found: list[str]) -> int:
        """How many of the leading blocks the tiers hold (``found``: each one's tier) the policy would load."""
        worth = {t: self.tiers.worth(t, found.count(t)) for t in set(found)}
        take = 0
        while take < len(found) and worth[found[take]]:
            take += 1
        return take

    def _tier_hit_fits(self, request: Request, hashes: list[int]) -> bool:
        """Whether the blocks the tiers would load for ``request``, and one block after them, fit the free pool."""
        hits = pinned = 0
        for h in hashes:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits += 1
            pinned += self.blocks[block_id].ref_count == 0  # free now, no longer once taken as a hit
        if hits == len(hashes):
            return True
        load = self._worth_loading(self.tiers.find(self._tier_keys(request, len(hashes))[hits:], count=False))
        return load == 0 or load + 1 <= self.num_free_blocks - pinned

    def _start_tier_load(self, request: Request, num_full_blocks: int) -> None:
        """Load the run of blocks after the pool's hits that the tiers hold, where the policy predicts it pays."""
        start = len(request.block_ids)
        keys = self._tier_keys(request, num_full_blocks)[start:]
        found = self.tiers.find(keys)
        take = min(self._worth_loading(found), self.num_free_blocks)
        for t in set(found[take:]):
            self.tiers.skipped(t, found[take:].count(t))
        if not take:
            return
        entries = []
        for j in range(take):
            block_id = self._take_free_block()
            request.block_ids.append(block_id)
            entries.append((keys[j], found[j], block_id, (start + j) * self.block_size))
        self._save_evicted()
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
        self._unindex(block)
        block.ref_count, block.block_hash, block.tier_key = 0, None, None
        self.free_blocks[block_id] = None
        self.free_blocks.move_to_end(block_id, last=False)

    def offload_cached(self) -> int:
        """Hand every cached block still in the pool to the tiers (at shutdown, so a restart finds them)."""
        if self.tiers is None:
            return 0
        cached = [(b.tier_key, b.block_id, b.position) for b in self.blocks if b.block_hash is not None and b.tier_key]
        for i in range(0, len(cached), 64):  # in batches: RAM for one batch of copies at a time
            self.tiers.save_many(cached[i : i + 64], wait=True)
        return len(cached)

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
                bs = self.block_size
                self._index(
                    block,
                    request.block_hashes[i - 1] if i else None,
                    tuple(request.all_token_ids[i * bs : (i + 1) * bs]),
                )
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
        """Release the request's blocks (last block first, so a shared prefix's head stays cached longest); a
        partly filled last block is kept for token-granular reuse until its slots are needed."""
        if request.tier_load is not None:  # a load in flight is dropped: it writes nothing once this returns
            self.tiers.cancel(request.tier_load)
            request.tier_load = None
        full, tail = divmod(request.num_computed_tokens, self.block_size)
        if self.token_reuse and tail and full < len(request.block_ids):
            block = self.blocks[request.block_ids[full]]
            if block.ref_count == 1 and block.block_hash is None:
                parent = self._block_hashes(request, full)[-1] if full else None
                self._index(
                    block, parent, tuple(request.all_token_ids[full * self.block_size : request.num_computed_tokens])
                )
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        request.block_ids = []
        request.num_registered_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.hash_to_block.clear()
        self.by_head.clear()
        for block in self.blocks:
            block.block_hash = block.tier_key = block.parent = None
            block.tokens = ()


def _common_prefix(a: tuple[int, ...], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
