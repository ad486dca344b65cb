"""The scheduler decides who runs: one token budget per step, running requests first, then waiting ones.

Contract (vLLM v1): ``add_request``, ``schedule`` → :class:`SchedulerOutput`, ``update_from_output``,
``finish_requests``. It never touches tensors. Chunked prefill: a prompt longer than the remaining
budget (or than ``long_prefill_token_threshold``) is computed over several steps, mixed with other requests'
decodes, which are scheduled first. Preemption by recompute: when blocks run out, the youngest running request
(under the ``priority`` policy: the lowest in priority) gives its blocks back and is requeued, keeping its
generated tokens (they are recomputed with the prompt later).
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
    num_tokens: int  # tokens computed this step, starting at request.num_computed_tokens (drafts included)
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the last one, verified this step

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last token, so its logits give the next token."""
        return self.request.num_computed_tokens + self.num_tokens - len(self.drafts) == self.request.num_tokens

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
        """Pick the requests and token counts of the next step within the budget: every running decode first,
        then running prompts' next chunks, then waiting prompts (each chunk at most ``prefill_chunk`` tokens)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in sorted(self.running, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.config.prefill_chunk)
            drafts = self._drafts(req, budget) if n == 1 else []
            n += len(drafts)
            while not self.block_manager.can_allocate(req, n):
                victim = self._victim(req)
                if victim is None:
                    break  # alone and still out of blocks: handled below
                budget += self._unschedule(out, victim)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue  # req itself was preempted
            if not self.block_manager.can_allocate(req, n):
                drafts, n = [], min(n - len(drafts), self._capacity(req))
                if n == 0:  # the whole cache holds this one sequence and it cannot grow
                    self._finish(req, FinishReason.LENGTH)
                    out.finished.append(req)
                    continue
            self.block_manager.allocate(req, n)
            out.scheduled.append(ScheduledRequest(req, n, drafts))
            budget -= n
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        loading: set[int] = set()  # requests whose cached blocks are still coming back from a lower tier
        while len(self.waiting) > len(loading) and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self._next_waiting(loading)
            if req.num_computed_tokens == 0:
                cached = bm.allocate_cached_prefix(req, others_running=True)
                if cached is None and req.tier_wait:  # its prefix is below the pool and the pool has no room yet
                    if self.running or out.scheduled or loading:
                        break  # wait in line for the requests running (or loading) ahead of it to free blocks
                    self._release_waiting(req)  # nothing runs: take back what the requests behind it hold
                    cached = bm.allocate_cached_prefix(req)  # and load what fits
                if cached is None:
                    loading.add(id(req))  # still loading: the others go ahead of it
                    continue
                if req.num_preemptions == 0:
                    req.num_cached_tokens = cached
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining > budget and not self.config.enable_chunked_prefill:
                break
            n = min(remaining, budget, self.config.prefill_chunk)
            if not bm.can_allocate(req, n):
                if self.running or out.scheduled:
                    break  # wait for running requests to free blocks
                self._release_waiting(req)  # nothing runs: the requests behind it must not hold the blocks it needs
                if not bm.can_allocate(req, n):
                    n = self._capacity(req)  # alone: compute what fits (chunked prefill continues next step)
                if n == 0:
                    break
            bm.allocate(req, n)
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, tuple]) -> list[Request]:
        """Advance computed counts, append sampled tokens, finish requests that hit a token stop.

        ``sampled`` maps request id → (token id, logprobs), or for a request that verified drafts (token ids,
        logprobs) lists: its accepted drafts and the target's own token. The KV written for rejected drafts is
        rolled back: the computed count and the block table return to the accepted length.
        Returns the requests that finished in this step.
        """
        finished = []
        for s in out.scheduled:
            req = s.request
            got = sampled.get(req.request_id)
            tokens, logprobs = (
                ([], []) if got is None else ((got[0], got[1]) if isinstance(got[0], list) else ([got[0]], [got[1]]))
            )
            rejected = len(s.drafts) - (len(tokens) - 1) if s.drafts and tokens else len(s.drafts)
            req.num_computed_tokens += s.num_tokens - rejected
            reason = None
            for token, lp in zip(tokens, logprobs):
                req.append_token(token, lp)
                reason = req.check_token_stop(self.max_model_len)
                if reason is not None:
                    break
            if s.drafts:  # the KV of rejected drafts (and of drafts after a stop) is not the text's
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
                self.block_manager.trim(req)
            self.block_manager.cache_full_blocks(req)
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
    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The request's speculative drafts that fit this step: the budget, the context window, ``max_tokens``."""
        if not req.draft_token_ids:
            return []
        room = min(budget - 1, self.max_model_len - req.num_tokens - 1)
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return req.draft_token_ids[: max(0, room)]

    def _rank(self, req: Request) -> tuple:
        """Sort key of the policy: smaller runs first and is preempted last."""
        if self.config.policy == "priority":
            return (req.priority, req.arrival_time)
        return (req.arrival_time,)

    def _next_waiting(self, skip: set[int]) -> Request:
        """The waiting request admitted next, past those in ``skip`` (ids): the first in the queue (fcfs), or the
        first by priority then arrival."""
        ready = (r for r in self.waiting if id(r) not in skip)
        if self.config.policy == "priority":
            return min(ready, key=self._rank)
        return next(ready)

    def _victim(self, req: Request):
        """Whom ``req`` preempts when blocks run out: the youngest running request (fcfs) or the lowest in
        priority, possibly ``req`` itself; None when ``req`` is alone."""
        if len(self.running) == 1:
            return None
        if self.config.policy == "priority":
            return max(self.running, key=self._rank)
        return self.running[-1]

    def _unschedule(self, out: SchedulerOutput, req: Request) -> int:
        """Take ``req`` out of this step's batch (it is about to be preempted); returns the tokens it had."""
        for i, s in enumerate(out.scheduled):
            if s.request is req:
                return out.scheduled.pop(i).num_tokens
        return 0

    def _release_waiting(self, first: Request) -> None:
        """The waiting requests behind ``first`` (in the policy's order) give back the blocks they hold (a cached
        prefix taken, a tier load in flight): with nothing running, nothing else would free them. Their prefixes stay
        cached (in the pool, or below it) and are found again when their turn comes."""
        queue = list(self.waiting)
        if self.config.policy == "priority":
            behind = [r for r in queue if self._rank(r) > self._rank(first)]
        else:
            behind = queue[queue.index(first) + 1 :]
        for req in behind:
            if req.block_ids or req.tier_load is not None:
                self.block_manager.free(req)
                req.num_computed_tokens = 0

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
        req.draft_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self.release_hook(req)
