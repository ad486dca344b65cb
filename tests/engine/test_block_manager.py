"""The block manager on its own: free list, reference counts, prefix caching by chained hashes (no tensors)."""
from __future__ import annotations

import pytest

from bytediet.engine.block_manager import BlockManager
from tests.engine.fakes import make_request, ref_counts


def computed(bm: BlockManager, req, n: int):
    """Allocate and 'compute' ``n`` more tokens of ``req``, registering its full blocks (what a step does)."""
    bm.allocate(req, n)
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)
    return req


def test_allocation_counts_blocks_and_refuses_beyond_the_free_list():
    bm = BlockManager(4, 4)
    req = make_request("a", 9)
    assert bm.blocks_needed(req, 9) == 3 and bm.can_allocate(req, 9)
    bm.allocate(req, 9)
    assert req.block_ids == [0, 1, 2] and bm.num_free_blocks == 1 and ref_counts(bm) == [1, 1, 1, 0]
    req.num_computed_tokens = 9
    assert bm.blocks_needed(req, 3) == 0 and bm.blocks_needed(req, 4) == 1  # 12 slots hold 9 + 3
    other = make_request("b", 8, first_token=100)
    assert not bm.can_allocate(other, 8)
    with pytest.raises(RuntimeError, match="can_allocate"):
        bm.allocate(other, 8)
    assert other.block_ids == [] and bm.num_free_blocks == 1


def test_prefix_hit_shares_blocks_and_counts_references():
    bm = BlockManager(8, 4)
    a = computed(bm, make_request("a", 10), 10)  # two full blocks registered, a third partly filled
    b = make_request("b", 10)                    # the same prompt
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_ids == a.block_ids[:2] and b.num_computed_tokens == 8
    assert ref_counts(bm)[:3] == [2, 2, 1] and bm.prefix_queries == 2 and bm.prefix_hits == 2
    bm.allocate(b, 2)
    assert b.block_ids[2] != a.block_ids[2]      # the partial block is never shared


def test_prefix_miss_and_partial_hit():
    bm = BlockManager(8, 4)
    computed(bm, make_request("a", 12), 12)
    other = make_request("b", 12, first_token=100)
    assert bm.allocate_cached_prefix(other) == 0 and other.block_ids == [] and bm.prefix_hits == 0
    half = make_request("c", 12)
    half.prompt_token_ids[5] = 999             # the second block differs, and so does every hash after it
    assert bm.allocate_cached_prefix(half) == 4 and len(half.block_ids) == 1


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(8, 4)
    computed(bm, make_request("a", 8), 8)
    b = make_request("b", 8)                   # two full cached blocks, but its last token needs logits
    assert bm.allocate_cached_prefix(b) == 4 and b.num_computed_tokens == 4


def test_no_prefix_caching():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    computed(bm, make_request("a", 12), 12)
    b = make_request("b", 12)
    assert bm.allocate_cached_prefix(b) == 0 and b.block_ids == [] and not bm.hash_to_block


def test_reference_counts_return_to_zero():
    bm = BlockManager(6, 4)
    a = computed(bm, make_request("a", 10), 10)
    b = make_request("b", 10)
    bm.allocate_cached_prefix(b)
    computed(bm, b, 2)
    assert max(ref_counts(bm)) == 2
    bm.free(a)
    assert a.block_ids == [] and ref_counts(bm)[:2] == [1, 1]  # b still holds the shared prefix
    assert bm.num_free_blocks == 6 - 2 - 1                     # b's prefix and b's own third block are held
    bm.free(b)
    assert ref_counts(bm) == [0] * 6 and bm.num_free_blocks == 6


def test_a_freed_prefix_is_revived_until_its_blocks_are_reused():
    bm = BlockManager(4, 4)
    a = computed(bm, make_request("a", 9), 9)  # blocks 0, 1 registered; block 2 partly filled
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.hash_to_block) == 2
    b = make_request("b", 9)
    assert bm.allocate_cached_prefix(b) == 8 and b.block_ids == [0, 1]
    assert ref_counts(bm) == [1, 1, 0, 0] and bm.num_free_blocks == 2  # revived blocks left the free list


def test_eviction_takes_never_cached_blocks_then_the_least_recently_freed():
    bm = BlockManager(4, 4)
    a = computed(bm, make_request("a", 8), 8)  # blocks 0, 1 registered
    bm.free(a)                                 # freed last block first: the free list is 2, 3, 1, 0
    assert list(bm.free_blocks) == [2, 3, 1, 0]
    c = make_request("c", 12, first_token=100)
    bm.allocate(c, 12)
    assert c.block_ids == [2, 3, 1]            # block 1 (a's tail) is evicted before block 0 (a's head)
    assert bm.blocks[1].block_hash is None and len(bm.hash_to_block) == 1
    d = make_request("d", 9)                   # a's prompt again: only the head block is still cached
    assert bm.allocate_cached_prefix(d) == 4 and d.block_ids == [0]


def test_reset_prefix_cache_forgets_every_hash():
    bm = BlockManager(4, 4)
    a = computed(bm, make_request("a", 8), 8)
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.hash_to_block and all(b.block_hash is None for b in bm.blocks)
    assert bm.allocate_cached_prefix(make_request("b", 8)) == 0
