"""The scheduler on its own: fake requests, a real block manager, no model (vLLM's tests/v1/core/test_scheduler.py)."""

from __future__ import annotations

from bytediet.config import SchedulerConfig
from bytediet.engine.block_manager import BlockManager
from bytediet.engine.request import FinishReason, RequestStatus
from bytediet.engine.scheduler import Scheduler
from tests.engine.fakes import make_request, make_scheduler, ref_counts, scheduled, step
from tests.engine.test_block_manager import FakeTiers, computed


def test_token_budget_splits_a_prompt_across_steps():
    """Chunked prefill: the budget is filled in arrival order and the prompt that overflows it is split."""
    sched = make_scheduler(max_num_batched_tokens=16)
    a, b, c = (make_request(r, num_prompt_tokens=10, first_token=100 * i) for i, r in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)

    out, _ = step(sched)
    assert scheduled(out) == {"a": 10, "b": 6} and out.num_tokens == 16
    assert out.sampling == {"a"}  # b's chunk does not reach its last token
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0 and b.num_computed_tokens == 6
    assert list(sched.waiting) == [c]

    out, _ = step(sched)  # running requests first (a's decode, b's last chunk), then c with what is left
    assert scheduled(out) == {"a": 1, "b": 4, "c": 10}
    assert b.num_output_tokens == 1 and c.num_output_tokens == 1 and not sched.waiting


def test_budget_smaller_than_a_decode_batch():
    sched = make_scheduler(max_num_batched_tokens=2)
    reqs = [make_request(r, num_prompt_tokens=1, first_token=10 * i) for i, r in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 1}
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 1}  # running requests keep the budget; c still waits
    assert list(sched.waiting) == [reqs[2]]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    a, b = make_request("a", 10), make_request("b", 10, first_token=100)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched)
    assert scheduled(out) == {"a": 10}
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 10}


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    reqs = [make_request(r, num_prompt_tokens=4, max_tokens=2, first_token=10 * i) for i, r in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert scheduled(out) == {"a": 4, "b": 4} and len(sched.running) == 2
    out, finished = step(sched)  # a and b produce their second (last) token and finish
    assert scheduled(out) == {"a": 1, "b": 1} and {r.request_id for r in finished} == {"a", "b"}
    out, _ = step(sched)
    assert scheduled(out) == {"c": 4}


def test_preemption_takes_the_youngest_and_it_resumes_by_recompute():
    # 4 blocks of 4 tokens: two 8-token prompts fill the cache; their first decode needs a fifth block
    sched = make_scheduler(num_blocks=4, block_size=4)
    bm = sched.block_manager
    old, young = make_request("old", 8, max_tokens=3), make_request("young", 8, max_tokens=3, first_token=100)
    sched.add_request(old)
    sched.add_request(young)
    out, _ = step(sched, token=1)
    assert scheduled(out) == {"old": 8, "young": 8} and bm.num_free_blocks == 0

    out, _ = step(sched, token=2)
    assert out.preempted == [young] and scheduled(out) == {"old": 1}
    assert young.status is RequestStatus.WAITING and sched.waiting[0] is young
    assert young.num_computed_tokens == 0 and young.block_ids == [] and young.num_preemptions == 1
    assert young.output_token_ids == [1]  # generated tokens are kept and recomputed with the prompt
    assert sched.num_preemptions == 1 and len(old.block_ids) == 3

    out, finished = step(sched, token=3)
    assert finished == [old] and old.output_token_ids == [1, 2, 3]
    out, _ = step(sched, token=4)  # the prompt and the kept token are computed again, then sampling goes on
    assert scheduled(out) == {"young": 9} and out.sampling == {"young"}
    assert young.output_token_ids == [1, 4] and young.status is RequestStatus.RUNNING
    assert young.num_computed_tokens == 9


def test_preemption_order_among_three():
    sched = make_scheduler(num_blocks=6, block_size=4)
    reqs = [make_request(r, 8, max_tokens=4, first_token=100 * i) for i, r in enumerate("abc")]
    for r in reqs:
        sched.add_request(r)
    step(sched)
    out, _ = step(sched)  # a needs a block: c (youngest) goes; b then needs one and gets c's
    assert out.preempted == [reqs[2]] and scheduled(out) == {"a": 1, "b": 1}
    assert list(sched.waiting) == [reqs[2]]
    assert sum(ref_counts(sched.block_manager)) == len(reqs[0].block_ids) + len(reqs[1].block_ids)


def test_a_request_preempts_itself_when_it_is_the_youngest():
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b = make_request("a", 3, max_tokens=8), make_request("b", 8, max_tokens=8, first_token=100)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: 1 block with one slot left, b: 2 full blocks, none free
    out, _ = step(sched)  # a's decode fits its own block; b (the youngest) needs a block and gives its own back
    assert out.preempted == [b] and scheduled(out) == {"a": 1}
    assert b.status is RequestStatus.WAITING and b.block_ids == [] and sched.block_manager.num_free_blocks == 2


def test_a_request_that_can_never_fit_finishes_with_length():
    # 2 blocks of 4 = 8 slots for one request that wants 7 + 10 tokens
    sched = make_scheduler(num_blocks=2, block_size=4)
    bm = sched.block_manager
    req = make_request("big", 7, max_tokens=10)
    sched.add_request(req)
    step(sched)  # 7 computed, 1 sampled
    step(sched)  # the 8th slot, 2 sampled
    out, _ = step(sched)  # a 9th slot cannot exist
    assert out.finished == [req] and not out.scheduled
    assert req.status is RequestStatus.FINISHED and req.finish_reason is FinishReason.LENGTH
    assert req.num_output_tokens == 2
    assert bm.num_free_blocks == 2 and ref_counts(bm) == [0, 0] and not sched.has_unfinished()


def test_a_prompt_longer_than_the_cache_is_computed_as_far_as_it_fits():
    sched = make_scheduler(num_blocks=2, block_size=4)
    req = make_request("long", 12, max_tokens=4)
    sched.add_request(req)
    out, _ = step(sched)
    assert scheduled(out) == {"long": 8} and not out.sampling
    out, _ = step(sched)
    assert out.finished == [req] and req.finish_reason is FinishReason.LENGTH
    assert sched.block_manager.num_free_blocks == 2


def test_finish_requests_frees_blocks_and_ignores_unknown_ids():
    sched = make_scheduler()
    bm = sched.block_manager
    a, b = make_request("a", 8), make_request("b", 5, first_token=100)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    released = []
    sched.release_hook = released.append
    assert sched.finish_requests(["a", "nope"], FinishReason.ABORT) == [a]
    assert a.finish_reason is FinishReason.ABORT and released == [a] and a.block_ids == []
    assert sched.finish_requests("a", FinishReason.ABORT) == []  # already finished
    assert sched.finish_requests("b", FinishReason.STOP) == [b]
    assert bm.num_free_blocks == bm.num_blocks and set(ref_counts(bm)) == {0}
    assert not sched.has_unfinished()


def test_every_block_returns_when_all_requests_finish():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True)
    shared = list(range(8))
    for i in range(5):  # shared prefixes, chunked prefills and preemptions all on the way
        req = make_request(f"r{i}", 0, max_tokens=3 + i)
        req.prompt_token_ids = shared + [50 + i, 60 + i]
        sched.add_request(req)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    bm = sched.block_manager
    assert not sched.has_unfinished() and sched.num_preemptions > 0
    assert set(ref_counts(bm)) == {0} and bm.num_free_blocks == bm.num_blocks


def test_a_preempted_request_resumes_before_requests_that_never_ran():
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b, c = (make_request(r, 8, max_tokens=2, first_token=100 * i) for i, r in enumerate("abc"))
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)  # a and b fill the cache; max_num_seqs keeps c waiting
    out, finished = step(sched)  # a's decode needs b's blocks; a then reaches max_tokens
    assert out.preempted == [b] and finished == [a] and list(sched.waiting) == [b, c]
    out, _ = step(sched)  # b comes back first (all 9 tokens recomputed); c waits for blocks
    assert scheduled(out) == {"b": 9} and list(sched.waiting) == [c]


def test_a_request_whose_blocks_are_loading_lets_the_next_ones_go_first():
    tiers = FakeTiers(ready=False)
    bm = BlockManager(16, 4, tiers=tiers)
    bm.free(computed(bm, make_request("a", 9), 9))
    bm.free(computed(bm, make_request("fill", 60, first_token=200), 60))  # a's blocks go down a tier
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    loading, other = make_request("a2", 9), make_request("b", 5, first_token=100)
    sched.add_request(loading)
    sched.add_request(other)
    out, _ = step(sched)
    assert scheduled(out) == {"b": 5} and list(sched.waiting) == [loading]
    tiers.ready = True
    out, _ = step(sched)
    assert scheduled(out) == {"a2": 1, "b": 1} and loading.num_cached_tokens == 8


def test_a_tier_hit_without_room_waits_in_line_while_requests_run():
    tiers = FakeTiers()
    bm = BlockManager(6, 4, tiers=tiers)
    bm.free(computed(bm, make_request("a", 9), 9))
    bm.free(computed(bm, make_request("fill", 24, first_token=200), 24))  # a's two blocks go down a tier
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    running = make_request("r", 17, first_token=300)
    sched.add_request(running)
    step(sched)  # r holds 5 of the 6 blocks
    hit, later = make_request("a2", 9), make_request("c", 2, first_token=400)
    sched.add_request(hit)
    sched.add_request(later)
    out, _ = step(sched)
    assert scheduled(out) == {"r": 1} and list(sched.waiting) == [hit, later]  # first come, first served
    assert hit.block_ids == [] and tiers.skipped_blocks == 0  # nothing taken, nothing recomputed
    sched.finish_requests("r", FinishReason.ABORT)
    out, _ = step(sched)
    assert scheduled(out)["a2"] == 1 and hit.cached_tokens_by_tier == {"pool": 0, "ram": 8}


def test_with_nothing_running_requests_behind_the_first_give_back_the_blocks_it_needs():
    tiers = FakeTiers()
    bm = BlockManager(6, 4, tiers=tiers)
    first, second = make_request("a", 13), make_request("b", 13, first_token=100)
    bm.free(computed(bm, make_request("a0", 13), 12))  # a's three full blocks cached in the pool
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    sched.add_request(first)
    sched.add_request(second)
    assert bm.allocate_cached_prefix(first) == 12  # a holds its 3 cached blocks, b takes the other 3
    bm.allocate(second, 12)
    second.num_computed_tokens = 0  # b holds blocks without having run: a cannot grow, nothing runs
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1} and second.block_ids == [] and second.num_computed_tokens == 0


def test_a_request_ahead_keeps_its_loading_blocks():
    tiers = FakeTiers(ready=False)
    bm = BlockManager(6, 4, tiers=tiers)
    bm.free(computed(bm, make_request("a", 9), 9))
    bm.free(computed(bm, make_request("fill", 24, first_token=200), 24))  # a's two blocks go down a tier
    sched = Scheduler(SchedulerConfig(), bm, 1024)
    ahead, behind = make_request("a2", 9), make_request("b", 17, first_token=300)
    sched.add_request(ahead)
    sched.add_request(behind)
    out, _ = step(sched)  # a2 loads into 2 blocks; b, behind it, computes what the other 4 hold
    assert scheduled(out) == {"b": 16} and ahead.tier_load is not None and len(ahead.block_ids) == 2
