"""Running one API request on the engine: validation, n sequences merged into one stream, disconnects, SSE.

An API request becomes several engine requests (one per prompt × ``n``), each a :class:`Job`.
:func:`run_jobs` streams them together as ``(choice index, StepOutput)``; closing it (a client
that went away) cancels every job, and each job's ``AsyncEngine.generate`` aborts its engine
request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import AsyncIterator, Awaitable, Callable, Optional, Sequence, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from ..engine.async_engine import AsyncEngine
from ..engine.engine import StepOutput
from ..engine.params import SamplingParams
from ..engine.sampling import TokenLogprobs
from ..errors import ConfigError
from .config import ServerConfig
from .errors import APIError
from .metrics import ServerMetrics
from .protocol import PromptTokensDetails, Usage
from .shutdown import Drain
from .structured import Grammars

T = TypeVar("T")
DONE = "data: [DONE]\n\n"


@dataclass
class ServerState:
    """What every endpoint needs: the engine, the names it answers to, the metrics, limits and shutdown state.

    ``max_model_len`` is the context length served (``config.served_model_len``), never more than one
    sequence's worth of KV cache; ``sequences`` counts engine sequences in flight (for the waiting-queue bound).
    """

    engine: AsyncEngine
    model_names: list[str]
    metrics: ServerMetrics
    max_model_len: int
    config: ServerConfig = field(default_factory=ServerConfig)
    drain: Drain = field(default_factory=Drain)
    created: int = field(default_factory=lambda: int(time.time()))
    sequences: int = 0
    grammars: Grammars = None  # set in __post_init__

    def __post_init__(self) -> None:
        self.grammars = Grammars(self.engine.info)

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    @property
    def num_waiting(self) -> int:
        """Sequences accepted but not yet running (queued in the engine, or on their way to it)."""
        return max(self.sequences - self.engine.num_running, 0)

    def admit(self, num_sequences: int) -> None:
        """503 with ``Retry-After`` when the waiting queue cannot take ``num_sequences`` more."""
        limit = self.config.max_waiting_sequences
        if self.num_waiting + num_sequences > limit:
            raise APIError(
                503,
                f"the server is busy: {self.num_waiting} sequences are waiting (limit {limit}); "
                "retry after a few seconds",
                type="server_error",
                code="server_busy",
                headers={"Retry-After": str(self.config.retry_after)},
            )

    def model_name(self, requested: Optional[str]) -> str:
        """The name to answer with; an unknown name is a 404 (as OpenAI's ``model_not_found``)."""
        if requested is None:
            return self.model_names[0]
        if requested not in self.model_names:
            raise APIError(
                404,
                f"The model `{requested}` does not exist; this server serves {', '.join(self.model_names)}.",
                "model",
                code="model_not_found",
            )
        return requested


@dataclass
class Job:
    """One engine sequence: the ``index``-th choice of the response."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams  # n == 1, its own seed
    priority: int = 0  # the scheduler's order under --scheduling-policy priority (smaller first)


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_logprobs: Optional[list[Optional[TokenLogprobs]]] = None  # the engine's, with the first token
    cached_tokens: Optional[dict[str, int]] = None  # prompt tokens per KV tier (with KV tiers on)

    def add(self, out: StepOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.cached_tokens is not None:
            self.cached_tokens = out.cached_tokens
        self.text.append(out.delta_text)
        self.token_ids += out.new_token_ids
        self.logprobs += [lp for lp in out.new_logprobs if lp is not None]
        if out.finished:
            self.finish_reason = out.finish_reason


def usage(num_prompt_tokens: int, choices: Sequence[Choice]) -> Usage:
    generated = sum(len(c.token_ids) for c in choices)
    tiers = [c.cached_tokens for c in choices if c.cached_tokens is not None]
    details = None
    if tiers:  # the prompt is counted once: the choice that found the most of it
        best = max(tiers, key=lambda t: sum(t.values()))
        details = PromptTokensDetails(cached_tokens=sum(best.values()), cached_tokens_by_tier=best)
    return Usage(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=generated,
        total_tokens=num_prompt_tokens + generated,
        prompt_tokens_details=details,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def make_jobs(
    state: ServerState,
    prompts: Sequence[list[int]],
    params: SamplingParams,
    new_mask: Optional[Callable[[], Callable]] = None,
    priority: int = 0,
) -> list[Job]:
    """Validate every sequence before any is queued (so a bad one fails the request with nothing running).

    As vLLM and OpenAI do, ``max_tokens`` that cannot fit after the prompt is an error, not a silent cut;
    no ``max_tokens`` means up to the served context length. ``new_mask`` makes each sequence's own
    grammar mask (structured output).
    """
    limit = state.config.max_prompts_per_request
    if len(prompts) > limit:
        raise ConfigError(
            f"prompt: {len(prompts)} prompts in one request exceed the server's limit of {limit}; "
            "split the batch over several requests"
        )
    jobs = []
    for p, ids in enumerate(prompts):
        if len(ids) >= state.max_model_len:
            raise ConfigError(
                f"prompt: {len(ids)} tokens do not fit the served context of {state.max_model_len} "
                "tokens (at least one token must be generated); shorten the prompt"
            )
        for i in range(params.n):
            sub = params.for_completion(i)
            ids = state.engine.validate(ids, sub)
            room = state.max_model_len - len(ids)
            if sub.max_tokens is None:
                sub = replace(sub, max_tokens=room)
            elif sub.max_tokens > room:
                raise ConfigError(
                    f"max_tokens: {sub.max_tokens} new tokens after a {len(ids)}-token prompt exceed the context "
                    f"window of {state.max_model_len} tokens; ask for at most {room}"
                )
            if new_mask is not None:
                sub = replace(sub, logits_processors=(new_mask(),))
            jobs.append(Job(p * params.n + i, ids, sub, priority))
    return jobs


async def run_jobs(state: ServerState, jobs: list[Job], request_id: str) -> AsyncIterator[tuple[int, StepOutput]]:
    """Stream every job's outputs, interleaved as the engine produces them, until all have finished.

    Raises :class:`~.shutdown.ShuttingDown` when the server's shutdown timeout ends first.
    """
    arrival = time.perf_counter()
    outputs: asyncio.Queue = asyncio.Queue()
    state.drain.register(outputs)
    state.sequences += len(jobs)

    async def pump(job: Job) -> None:
        stream = state.engine.generate(job.prompt_ids, job.params, f"{request_id}-{job.index}", job.priority)
        try:
            async with aclosing(state.metrics.track(stream, len(job.prompt_ids), arrival)) as tracked:
                async for out in tracked:
                    outputs.put_nowait((job.index, out))
        except Exception as exc:  # an engine failure ends the whole response
            outputs.put_nowait((job.index, exc))

    tasks = [asyncio.create_task(pump(job)) for job in jobs]
    try:
        pending = len(jobs)
        while pending:
            index, item = await outputs.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            pending -= int(item.finished)
    finally:
        state.drain.unregister(outputs)
        state.sequences -= len(jobs)
        for task in tasks:  # cancelling a job aborts its engine request (AsyncEngine.generate's finally)
            task.cancel()


async def collect(state: ServerState, jobs: list[Job], request_id: str) -> list[Choice]:
    """Run the jobs to the end; choices in index order."""
    choices = {job.index: Choice(job.index) for job in jobs}
    async with aclosing(run_jobs(state, jobs, request_id)) as stream:
        async for index, out in stream:
            choices[index].add(out)
    return [choices[i] for i in sorted(choices)]


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` but cancel it (aborting its engine requests) if the client disconnects first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its engine requests are aborted by now
    if task.cancelled():
        raise APIError(499, "the client closed the connection before the response was ready")
    return task.result()


def token_text(tokenizer, token_id: int) -> str:
    """One token as text (special tokens spelled out); ``token_id:N`` without a tokenizer, as vLLM."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def sse(payload: BaseModel | dict, exclude: Optional[set[str]] = None) -> str:
    """One Server-Sent Event: ``data: {json}`` and a blank line."""
    body = payload.model_dump_json(exclude=exclude) if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


class EventStream(StreamingResponse):
    """A ``text/event-stream`` response that always closes its event generator, however the stream ends.

    Starlette cancels the stream when the ASGI server reports ``http.disconnect``; closing the
    generator here as well makes the abort independent of garbage collection timing.
    """

    def __init__(self, events: AsyncIterator[str]) -> None:
        super().__init__(
            events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
        self._events = events

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


def error_event(exc: Exception) -> str:
    """A failure after the stream started: OpenAI's error object as one more event."""
    if isinstance(exc, APIError):
        return sse({"error": {"message": exc.message, "type": exc.type, "param": exc.param, "code": exc.code}})
    kind = "invalid_request_error" if isinstance(exc, ConfigError) else "server_error"
    return sse({"error": {"message": f"{type(exc).__name__}: {exc}", "type": kind, "param": None, "code": None}})
