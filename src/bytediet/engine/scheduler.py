"""The scheduler decides who runs: one token budget per step, running requests first, then waiting ones.

Contract (vLLM v1): ``add_request``, ``schedule`` → :class:`SchedulerOutput`, ``update_from_output``,
``finish_requests``. It never touches tensors. Chunked prefill: a prompt longer than the remaining
budget is computed over several steps, mixed with other requests' decodes. Preemption by recompute:
when blocks run out, the youngest running request gives its blocks back and is requeued at the front,
keeping its generated tokens (they are recomputed with the prompt later).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .request import FinishReason, Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so its logits give the next token."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens

    @property
    def prompt_logprob_positions(self) -> range:
        """Positions computed this step whose logits score a prompt token not yet scored (the next one).

        Empty unless the request asked for prompt logprobs; after a preemption the recomputed positions
        that were scored before are left out.
        """
        req = self.request
        if req.prompt_logprobs is None:
            return range(0)
        start = max(req.num_computed_tokens, len(req.prompt_logprobs) - 1)
        return range(start, min(req.num_computed_tokens + self.num_tokens, req.num_prompt_tokens - 1))


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # ended by the scheduler (cache too small)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- contract -----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a validated request (validation happens before it gets here)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick the requests and token counts of the next step within the budget."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(req, n):
                victim = self.running[-1]  # the youngest
                if victim is req and len(self.running) == 1:
                    break  # alone and still out of blocks: handled below
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted: nobody younger is left
            if not self.block_manager.can_allocate(req, n):
                n = self._capacity(req)
                if n == 0:  # the whole cache holds this one sequence and it cannot grow
                    self._finish(req, FinishReason.LENGTH)
                    out.finished.append(req)
                    continue
            self.block_manager.allocate(req, n)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        loading = 0  # requests at the head whose cached blocks are still coming back from a lower tier
        while len(self.waiting) > loading and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[loading]
            if req.num_computed_tokens == 0:
                cached = bm.allocate_cached_prefix(req)
                if cached is None:  # not ready: the others go ahead of it
                    loading += 1
                    continue
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget)
            if not bm.can_allocate(req, n):
                if self.running or out.scheduled:
                    break  # wait for running requests to free blocks
                n = self._capacity(req)  # alone: compute what fits (chunked prefill continues next step)
                if n == 0:
                    break
            bm.allocate(req, n)
            del self.waiting[loading]
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple[int, object]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a token stop.

        ``sampled`` maps request id → (token id, logprobs) for the requests whose step sampled.
        Returns the requests that finished in this step.
        """
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_tokens
            self.block_manager.cache_full_blocks(req)
            if req.request_id not in sampled:
                continue
            token, logprobs = sampled[req.request_id]
            req.append_token(token, logprobs)
            reason = req.check_token_stop(self.max_model_len)
            if reason is not None:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def finish_requests(self, request_ids, reason: FinishReason) -> list[Request]:
        """Finish (e.g. abort, or stop-string hit) requests by id; unknown or finished ids are ignored."""
        done = []
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            req = self.requests.get(rid)
            if req is not None and not req.is_finished:
                self._finish(req, reason)
                done.append(req)
        return done

    # -- internals ------------------------------------------------------------------------------
    def _capacity(self, req: Request) -> int:
        """Tokens ``req`` could still compute with its own blocks plus every free block."""
        bm = self.block_manager
        room = (len(req.block_ids) + bm.num_free_blocks) * bm.block_size - req.num_computed_tokens
        return max(0, min(room, req.num_tokens - req.num_computed_tokens))

    def _finish(self, req: Request, reason: FinishReason) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        self.release_hook(req)

    def release_hook(self, req: Request) -> None:
        """Overridden by the engine to release per-sequence codec state; no tensors here."""

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.release_hook(req)
