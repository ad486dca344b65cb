"""A request: prompt, generated tokens, status, and how far the model has computed it.

vLLM v1's single idea: there is no separate prefill and decode phase. ``num_computed_tokens`` catches
up with ``num_tokens`` (prompt + output); chunked prefill, prefix caching and preemption fall out of it.
"""

from __future__ import annotations

import enum
import time
from typing import Optional

import torch

from .params import SamplingParams
from .sampling import TokenLogprobs, make_generator


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token, stop token id or stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the caller (or a disconnected client)


class Request:
    """One sequence being generated. ``block_ids`` is owned by the block manager."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        eos_token_ids: frozenset[int] = frozenset(),
        priority: int = 0,
    ) -> None:
        self.request_id = request_id
        self.seq_id = -1  # the engine's integer id, for codecs that keep per-sequence state
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[Optional[TokenLogprobs]] = []
        # prompt logprobs (params.prompt_logprobs): entry i scores prompt token i; the first has no context
        self.prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = (
            None if params.prompt_logprobs is None else [None]
        )
        self.params = params
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.priority = priority  # the "priority" policy runs smaller values first (vLLM's meaning)
        self.first_token_time: Optional[float] = None
        self.finish_time: Optional[float] = None
        self.status = RequestStatus.WAITING
        self.finish_reason: Optional[FinishReason] = None
        self.stop_reason: Optional[str | int] = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first scheduling
        self.num_preemptions = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of full blocks, memoised by the block manager
        self.num_registered_blocks = 0
        self.tier_keys: list[bytes] = []  # the same chain as the tiers key it (KV tiers only)
        self.tier_load = None  # blocks coming back from a tier below the pool (kv_tiers.TierLoad)
        self.tier_wait = False  # its tiers' hit waits for room in the pool (BlockManager.allocate_cached_prefix)
        self.cached_tokens_by_tier: dict[str, int] = {}  # prompt tokens served by "pool", "ram", "disk"
        self.eos_token_ids = eos_token_ids
        self.generator: Optional[torch.Generator] = make_generator(params.seed)
        self.draft_token_ids: list[int] = []  # speculative drafts for the next step (engine/speculative.py)
        self.draft = None  # its AdaptiveDraft, made on the first proposal

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int, logprobs: Optional[TokenLogprobs] = None) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self.output_token_ids.append(token_id)
        self.output_logprobs.append(logprobs)

    def check_token_stop(self, max_model_len: int) -> Optional[FinishReason]:
        """Stop conditions that depend only on token ids (stop strings are checked on text by the engine)."""
        last = self.output_token_ids[-1]
        if not self.params.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = last
            return FinishReason.STOP
        if last in self.params.stop_token_ids:
            self.stop_reason = last
            return FinishReason.STOP
        if self.params.max_tokens is not None and self.num_output_tokens >= self.params.max_tokens:
            return FinishReason.LENGTH
        if self.num_tokens >= max_model_len:
            return FinishReason.LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )
