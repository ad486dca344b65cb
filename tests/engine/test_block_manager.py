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
    b = make_request("b", 10)  # the same prompt
    assert bm.allocate_cached_prefix(b) == 8
    assert b.block_ids == a.block_ids[:2] and b.num_computed_tokens == 8
    assert ref_counts(bm)[:3] == [2, 2, 1] and bm.prefix_queries == 2 and bm.prefix_hits == 2
    bm.allocate(b, 2)
    assert b.block_ids[2] != a.block_ids[2]  # the partial block is never shared


def test_prefix_miss_and_partial_hit():
    bm = BlockManager(8, 4)
    computed(bm, make_request("a", 12), 12)
    other = make_request("b", 12, first_token=100)
    assert bm.allocate_cached_prefix(other) == 0 and other.block_ids == [] and bm.prefix_hits == 0
    half = make_request("c", 12)
    half.prompt_token_ids[5] = 999  # the second block differs, and so does every hash after it
    assert bm.allocate_cached_prefix(half) == 4 and len(half.block_ids) == 1


def test_the_last_prompt_token_is_always_computed():
    bm = BlockManager(8, 4)
    computed(bm, make_request("a", 8), 8)
    b = make_request("b", 8)  # two full cached blocks, but its last token needs logits
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
    assert bm.num_free_blocks == 6 - 2 - 1  # b's prefix and b's own third block are held
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
    bm.free(a)  # freed last block first: the free list is 2, 3, 1, 0
    assert list(bm.free_blocks) == [2, 3, 1, 0]
    c = make_request("c", 12, first_token=100)
    bm.allocate(c, 12)
    assert c.block_ids == [2, 3, 1]  # block 1 (a's tail) is evicted before block 0 (a's head)
    assert bm.blocks[1].block_hash is None and len(bm.hash_to_block) == 1
    d = make_request("d", 9)  # a's prompt again: only the head block is still cached
    assert bm.allocate_cached_prefix(d) == 4 and d.block_ids == [0]


def test_reset_prefix_cache_forgets_every_hash():
    bm = BlockManager(4, 4)
    a = computed(bm, make_request("a", 8), 8)
    bm.free(a)
    bm.reset_prefix_cache()
    assert not bm.hash_to_block and all(b.block_hash is None for b in bm.blocks)
    assert bm.allocate_cached_prefix(make_request("b", 8)) == 0


class FakeTiers:
    """A tier store without tensors: records what the block manager asks, holds keys in a dict."""

    def __init__(self, worth: bool = True, ready: bool = True) -> None:
        self.held: dict = {}  # key → (tier, pool block it came from)
        self.saved: list = []
        self.loaded: list = []
        self.worth_it, self.ready, self.skipped_blocks = worth, ready, 0
        self.batches: list = []  # the block ids of each save_many call
        self.cancelled = 0

    def key(self, parent, tokens):
        return (parent, tuple(tokens))

    def save(self, key, block_id, first_position, wait=False):
        self.saved.append((block_id, first_position))
        self.held[key] = ("ram", block_id)

    def save_many(self, entries, wait=False):
        self.batches.append([block_id for _, block_id, _ in entries])
        for key, block_id, first_position in entries:
            self.save(key, block_id, first_position, wait)

    def cancel(self, load):
        self.cancelled += 1

    def find(self, keys, count=True):
        out = []
        for k in keys:
            if k not in self.held:
                break
            out.append(self.held[k][0])
        return out

    def worth(self, tier, n):
        return self.worth_it

    def skipped(self, tier, n):
        self.skipped_blocks += n

    def start(self, entries):
        tiers = self

        class Load:
            def __init__(self):
                self.entries = [list(e) + [None] for e in entries]

            def done(self):
                return tiers.ready

        return Load()

    def finish(self, load):
        self.loaded += [(e[2], e[3]) for e in load.entries]
        return len(load.entries)


def test_evicted_blocks_go_to_the_tiers_oldest_freed_first_and_come_back_before_prefill():
    tiers = FakeTiers()
    bm = BlockManager(4, 4, tiers=tiers)
    a = computed(bm, make_request("a", 13), 13)  # 3 full blocks (0, 1, 2) + 1 partial (3)
    bm.free(a)  # freed last block first: 3, 2, 1, 0
    b = computed(bm, make_request("b", 8, first_token=100), 8)  # takes 3 (no hash) then 2 (a's third block)
    assert b.block_ids == [3, 2] and tiers.saved == [(2, 8)]
    bm.free(b)
    again = make_request("a2", 13)
    assert bm.allocate_cached_prefix(again) == 12  # blocks 0, 1 from the pool; the third from the tiers
    assert again.cached_tokens_by_tier == {"pool": 8, "ram": 4}
    assert tiers.loaded == [(again.block_ids[2], 8)] and len(again.block_ids) == 3


def evicted_prefix(tiers) -> BlockManager:
    """A 6-block pool whose request a (9 tokens: two full blocks) was pushed down to ``tiers`` by b."""
    bm = BlockManager(6, 4, tiers=tiers)
    bm.free(computed(bm, make_request("a", 9), 9))
    bm.free(computed(bm, make_request("b", 24, first_token=100), 24))  # takes every block: a's two go down
    assert sorted(tiers.saved) == [(0, 0), (1, 4)] and len(tiers.batches) == 1  # one allocation: one batch
    return bm


def test_a_pending_load_returns_none_until_done_and_an_abort_gives_the_blocks_back():
    tiers = FakeTiers(ready=False)
    bm = evicted_prefix(tiers)
    again = make_request("a2", 9)
    assert bm.allocate_cached_prefix(again) is None and bm.allocate_cached_prefix(again) is None
    assert again.num_computed_tokens == 0 and len(again.block_ids) == 2 and bm.num_free_blocks == 4
    tiers.ready = True
    assert bm.allocate_cached_prefix(again) == 8 and again.cached_tokens_by_tier == {"pool": 0, "ram": 8}
    assert again.num_registered_blocks == 2 and again.block_hashes[1] in bm.hash_to_block
    bm.free(again)
    tiers.held.clear()
    other = make_request("a3", 9)
    assert bm.allocate_cached_prefix(other) == 8 and other.cached_tokens_by_tier == {"pool": 8}  # loaded: in the pool
    bm2 = evicted_prefix(tiers2 := FakeTiers(ready=False))
    pending = make_request("a4", 9)
    assert bm2.allocate_cached_prefix(pending) is None and bm2.num_free_blocks == 4
    bm2.free(pending)  # aborted while its blocks were loading: the load is cancelled before they are free
    assert pending.tier_load is None and bm2.num_free_blocks == 6 and ref_counts(bm2) == [0] * 6
    assert tiers2.cancelled == 1


def test_a_tier_hit_without_room_waits_for_running_requests_and_loads_in_part_alone():
    tiers = FakeTiers()
    bm = evicted_prefix(tiers)  # a's two blocks are in the tiers; every block free
    running = computed(bm, make_request("r", 20, first_token=200), 20)  # holds 5 of the 6 blocks
    again = make_request("a2", 9)  # its 2 blocks below the pool, and 1 after them: 3 needed, 1 free
    assert bm.allocate_cached_prefix(again, others_running=True) is None and again.tier_wait
    assert again.block_ids == [] and bm.num_free_blocks == 1 and tiers.skipped_blocks == 0 and not tiers.loaded
    bm.free(running)  # the running request finished: now it fits, and loads whole
    assert bm.allocate_cached_prefix(again, others_running=True) == 8 and not again.tier_wait
    assert again.cached_tokens_by_tier == {"pool": 0, "ram": 8}
    bm2 = evicted_prefix(tiers2 := FakeTiers())
    computed(bm2, make_request("r", 20, first_token=200), 20)
    alone = make_request("a3", 9)  # nothing else will free blocks: what fits is loaded, the rest recomputed
    assert bm2.allocate_cached_prefix(alone, others_running=False) == 4 and tiers2.skipped_blocks == 1


def test_a_load_predicted_slower_than_recompute_is_skipped():
    tiers = FakeTiers(worth=False)
    bm = evicted_prefix(tiers)
    again = make_request("a2", 9)
    assert bm.allocate_cached_prefix(again) == 0 and again.block_ids == [] and tiers.skipped_blocks == 2


def reusing(num_blocks: int = 8, block_size: int = 4):
    """A block manager with token-granular reuse and a copy hook that records (src, dst)."""
    bm = BlockManager(num_blocks, block_size)
    copies = []
    bm.enable_token_reuse(lambda src, dst: copies.append((src, dst)))
    return bm, copies


def test_a_finished_requests_tail_is_taken_over_by_a_prompt_that_starts_like_it():
    bm, copies = reusing()
    a = computed(bm, make_request("a", 10), 10)  # blocks 0, 1 full; block 2 holds tokens 8, 9
    blocks = list(a.block_ids)
    bm.free(a)
    b = make_request("b", 11)  # tokens 0..10: its third block starts with a's tail (8, 9)
    tail = blocks[2]
    assert bm.allocate_cached_prefix(b) == 10 and b.block_ids == blocks
    assert copies == [] and bm.blocks[tail].ref_count == 1 and bm.partial_hit_tokens == 2
    assert b.cached_tokens_by_tier == {"pool": 10} and tail not in bm.free_blocks
    c = make_request("c", 11)  # the tail belongs to b now: c gets the full blocks only
    assert bm.allocate_cached_prefix(c) == 8


def test_the_head_of_a_cached_full_block_is_copied_into_a_fresh_block():
    bm, copies = reusing()
    a = computed(bm, make_request("a", 8), 8)  # two full blocks, both cached
    b = make_request("b", 7)  # tokens 0..6: block 1's head (4, 5) can be served, token 6 is computed
    assert bm.allocate_cached_prefix(b) == 6
    assert b.block_ids[0] == a.block_ids[0] and b.block_ids[1] not in a.block_ids
    assert copies == [(a.block_ids[1], b.block_ids[1])]
    assert bm.blocks[a.block_ids[1]].block_hash is not None  # the source stays cached


def test_a_cached_source_in_the_free_list_is_never_its_own_copy_destination():
    bm, copies = reusing(num_blocks=2)
    a = computed(bm, make_request("a", 8), 8)
    blocks = list(a.block_ids)
    bm.free(a)  # both blocks cached and free
    b = make_request("b", 7)
    assert bm.allocate_cached_prefix(b) == 4  # block 0 is shared; no other free block to copy block 1's head into
    assert copies == [] and bm.blocks[blocks[1]].block_hash is not None and blocks[1] in bm.free_blocks


def test_longest_match_wins_and_a_different_parent_never_matches():
    bm, copies = reusing(num_blocks=16)
    a = computed(bm, make_request("a", 6), 6)  # tail: tokens 4, 5 after block (0..3)
    blocks = list(a.block_ids)
    bm.free(a)
    other = computed(bm, make_request("o", 7, first_token=100), 7)  # another parent
    bm.free(other)
    b = make_request("b", 9)  # tokens 0..8: block 1 wants 4..7; a's tail gives 4, 5
    assert bm.allocate_cached_prefix(b) == 6 and b.block_ids == blocks
    lone = make_request("l", 3, first_token=104)  # starts like o's tail, but o's tail has a parent, lone has none
    assert bm.allocate_cached_prefix(lone) == 0


def test_an_indexed_tail_is_forgotten_when_its_block_is_reused():
    bm, _ = reusing(num_blocks=3)
    a = computed(bm, make_request("a", 6), 6)
    bm.free(a)
    computed(bm, make_request("x", 12, first_token=50), 12)  # takes every block, the tail included
    assert all(first >= 50 for _, first in bm.by_head)  # only x's own full blocks are indexed
    b = make_request("b", 7)
    assert bm.allocate_cached_prefix(b) == 0


def test_without_reuse_the_tail_is_not_indexed():
    bm = BlockManager(8, 4)
    a = computed(bm, make_request("a", 10), 10)
    bm.free(a)
    assert not bm.by_head and bm.allocate_cached_prefix(make_request("b", 11)) == 8
