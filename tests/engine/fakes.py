"""Fake requests and a model-free step loop for the scheduler and block-manager tests (no tensors, no model)."""

from __future__ import annotations

from bytediet.config import SchedulerConfig
from bytediet.engine.block_manager import BlockManager
from bytediet.engine.params import SamplingParams
from bytediet.engine.request import Request
from bytediet.engine.scheduler import Scheduler, SchedulerOutput

MAX_MODEL_LEN = 1024


def make_request(
    rid: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    first_token: int = 0,
    priority: int = 0,
    arrival_time: float = 0.0,
) -> Request:
    """A request whose prompt is ``first_token, first_token + 1, ...`` (distinct prompts share no block)."""
    prompt = list(range(first_token, first_token + num_prompt_tokens))
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=arrival_time,
        priority=priority,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = False,
    long_prefill_token_threshold: int = 0,
    policy: str = "fcfs",
) -> Scheduler:
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
    config = SchedulerConfig(
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        policy=policy,
    )
    return Scheduler(config, bm, MAX_MODEL_LEN)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    """One engine step without a model: every request whose step reaches its last token samples ``token``.

    ``out.sampling`` keeps the ids of the requests that sampled (``samples`` reads live request state)."""
    out = sched.schedule()
    sampled = {s.request.request_id: (token, None) for s in out.scheduled if s.samples}
    out.sampling = set(sampled)
    return out, sched.update_from_output(out, sampled)


def scheduled(out: SchedulerOutput) -> dict[str, int]:
    """request id → tokens computed this step."""
    return {s.request.request_id: s.num_tokens for s in out.scheduled}


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]
