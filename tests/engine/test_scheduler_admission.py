"""Admission under load: decodes first, the per-request prefill cap, arrivals joining the next step, priority."""

from __future__ import annotations

import random

import pytest

from bytediet.config import SchedulerConfig
from bytediet.errors import ConfigError
from tests.engine.fakes import make_request, make_scheduler, scheduled, step


def test_running_decodes_go_before_an_older_requests_prompt_chunk():
    sched = make_scheduler(max_num_batched_tokens=8)
    old, young = make_request("old", 20, first_token=0), make_request("young", 2, first_token=100)
    sched.add_request(young)
    step(sched)  # young's prompt, then it decodes
    sched.add_request(old)
    out, _ = step(sched)
    assert scheduled(out) == {"young": 1, "old": 7}
    out, _ = step(sched)  # old is running now, mid-prompt: young's decode still goes first
    assert list(scheduled(out)) == ["young", "old"] and scheduled(out) == {"young": 1, "old": 7}


def test_a_prompt_that_arrives_during_a_step_joins_the_next_one():
    sched = make_scheduler(max_num_batched_tokens=64)
    a = make_request("a", 8, max_tokens=8)
    sched.add_request(a)
    out = sched.schedule()
    sched.add_request(make_request("b", 8, first_token=100))  # arrives while the step runs
    sched.update_from_output(out, {"a": (7, None)})
    out, _ = step(sched)
    assert scheduled(out) == {"a": 1, "b": 8}


def test_long_prefill_threshold_caps_each_requests_chunk():
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    for i, r in enumerate("abc"):
        sched.add_request(make_request(r, 20, first_token=100 * i))
    out, _ = step(sched)
    assert scheduled(out) == {"a": 8, "b": 8, "c": 8}
    out, _ = step(sched)
    assert scheduled(out) == {"a": 8, "b": 8, "c": 8}
    out, _ = step(sched)
    assert scheduled(out) == {"a": 4, "b": 4, "c": 4}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_budget_and_threshold_are_never_exceeded(policy):
    """Random arrivals, prompt lengths and priorities over a small cache (preemptions included)."""
    rng = random.Random(0)
    budget, cap = 24, 10
    sched = make_scheduler(
        num_blocks=40,
        block_size=4,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=cap,
        policy=policy,
        max_num_seqs=6,
    )
    made = 0
    for _ in range(300):
        if made < 60 and rng.random() < 0.4:
            sched.add_request(
                make_request(
                    f"r{made}",
                    rng.randint(1, 40),
                    max_tokens=rng.randint(1, 12),
                    first_token=1000 * made,
                    priority=rng.randint(0, 3),
                    arrival_time=float(made),
                )
            )
            made += 1
        before = {r.request_id: (r.num_computed_tokens, r.num_prompt_tokens) for r in sched.running}
        out, _ = step(sched)
        assert out.num_tokens <= budget
        for s in out.scheduled:
            computed, prompt = before.get(s.request.request_id, (0, s.request.num_prompt_tokens))
            assert s.num_tokens <= max(cap, 1) or computed >= prompt
    while sched.has_unfinished():
        step(sched)
    assert sched.block_manager.num_free_blocks == 40


def test_priority_policy_admits_the_smallest_priority_first_then_arrival():
    sched = make_scheduler(max_num_batched_tokens=8, policy="priority")
    reqs = [
        make_request("low", 8, priority=5, arrival_time=0.0, first_token=0),
        make_request("high", 8, priority=-1, arrival_time=1.0, first_token=100),
        make_request("mid-late", 8, priority=1, arrival_time=3.0, first_token=200),
        make_request("mid", 8, priority=1, arrival_time=2.0, first_token=300),
    ]
    for r in reqs:
        sched.add_request(r)
    order = []
    while sched.waiting:
        out, _ = step(sched)
        order += [s.request.request_id for s in out.scheduled if s.request.request_id not in order]
    assert order == ["high", "mid", "mid-late", "low"]


def test_fcfs_ignores_priority():
    sched = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("first", 8, priority=9))
    sched.add_request(make_request("second", 8, priority=-9, first_token=100))
    out, _ = step(sched)
    assert scheduled(out) == {"first": 8}


def test_priority_policy_preempts_the_lowest_priority_not_the_youngest():
    # 4 blocks of 4: two 8-token prompts fill the cache; the first decode needs a fifth block
    sched = make_scheduler(num_blocks=4, block_size=4, policy="priority")
    low = make_request("low", 8, max_tokens=3, priority=3, arrival_time=0.0)
    high = make_request("high", 8, max_tokens=3, priority=0, arrival_time=1.0, first_token=100)
    sched.add_request(low)
    sched.add_request(high)
    step(sched)
    out, _ = step(sched)
    assert out.preempted == [low] and scheduled(out) == {"high": 1}


def test_a_victim_already_scheduled_in_the_step_gives_its_tokens_back():
    # young decodes first (scheduled), then old's prompt chunk needs blocks and preempts young (the youngest)
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, long_prefill_token_threshold=4)
    young = make_request("young", 4, max_tokens=8, first_token=100)
    old = make_request("old", 12, max_tokens=2)
    sched.add_request(old)
    sched.add_request(young)
    step(sched)  # old 4 of 12 (1 block), young 4 (1 block) and samples
    step(sched)  # young decodes (block 3), old 4 more (block 2 ... )
    out, _ = step(sched)  # young's decode fits its block and is scheduled; old's chunk needs a block: young goes
    assert out.preempted == [young] and scheduled(out) == {"old": 4}
    assert young.block_ids == [] and sched.block_manager.num_free_blocks == 1


def test_config_refuses_a_threshold_above_the_budget_and_an_unknown_policy():
    with pytest.raises(ConfigError, match="--long-prefill-token-threshold"):
        SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=32)
    with pytest.raises(ConfigError, match="--scheduling-policy"):
        SchedulerConfig(policy="lifo")
