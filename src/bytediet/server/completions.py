"""POST /v1/completions: text or token-id prompts (or a batch of them), whole or streamed as SSE."""
from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator, Optional

from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..engine.sampling import TokenLogprobs
from ..errors import BytedietError, ConfigError
from .errors import APIError
from .protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from .serving import (DONE, Choice, EventStream, Job, ServerState, collect, error_event, make_jobs, new_id,
                      run_jobs, sse, token_text, unless_disconnected, usage)

FIELDS = tuple(CompletionRequest.model_fields)


def prompt_token_ids(state: ServerState, prompt) -> list[list[int]]:
    """``prompt`` (text, ids, or a list of either) → one token-id list per prompt."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts:
        raise ConfigError("prompt: must not be empty")
    out = []
    for p in prompts:
        if not p:
            raise ConfigError("prompt: must not be empty")
        if isinstance(p, str):
            if state.tokenizer is None:
                raise ConfigError("prompt: this model has no tokenizer; send token ids instead of text")
            p = state.tokenizer.encode(p)
        out.append(list(p))
    return out


def logprobs_block(tokenizer, lps: list[TokenLogprobs], offset: int) -> tuple[CompletionLogprobs, int]:
    """OpenAI's legacy logprobs object for ``lps``; ``offset`` is where the first token's text starts."""
    block = CompletionLogprobs()
    for lp in lps:
        text = token_text(tokenizer, lp.token_id)
        block.tokens.append(text)
        block.token_logprobs.append(lp.logprob)
        block.top_logprobs.append({token_text(tokenizer, t): v for t, v in lp.top})
        block.text_offset.append(offset)
        offset += len(text)
    return block, offset


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.model_name(body.model)
    if (field := body.unsupported()) is not None:
        raise APIError(400, f"{field}: not supported by this server; leave it out", field)
    prompts, jobs = await run_in_threadpool(_prepare, state, body)  # tokenizing a long prompt must not block
    state.admit(len(jobs))
    rid, created = new_id("cmpl"), int(time.time())
    num_prompt = sum(len(p) for p in prompts)
    if body.stream:
        return EventStream(_events(state, jobs, rid, created, model, body, num_prompt))
    choices = await unless_disconnected(request, collect(state, jobs, rid))
    want_logprobs = body.logprobs is not None
    out = CompletionResponse(
        id=rid, created=created, model=model,
        choices=[CompletionChoice(index=c.index, text="".join(c.text), finish_reason=c.finish_reason,
                                  logprobs=logprobs_block(state.tokenizer, c.logprobs, 0)[0] if want_logprobs else None)
                 for c in choices],
        usage=usage(num_prompt, choices),
    )
    return Response(out.model_dump_json(), media_type="application/json")


def _prepare(state: ServerState, body: CompletionRequest) -> tuple[list[list[int]], list[Job]]:
    """Tokenize and validate (on a worker thread): the prompts' token ids and one job per choice."""
    try:
        params = body.to_sampling_params()
        if isinstance(body.prompt, list) and len(body.prompt) > state.config.max_prompts_per_request \
                and not isinstance(body.prompt[0], int):  # refuse before tokenizing a huge batch
            raise ConfigError(f"prompt: {len(body.prompt)} prompts in one request exceed the server's limit of "
                              f"{state.config.max_prompts_per_request}; split the batch over several requests")
        prompts = prompt_token_ids(state, body.prompt)
        return prompts, make_jobs(state, prompts, params, state.grammars.masks_for(body.response_format))
    except BytedietError as exc:
        raise APIError.bad_request(exc, fields=FIELDS) from exc


async def _events(state: ServerState, jobs: list[Job], rid: str, created: int, model: str,
                  body: CompletionRequest, num_prompt: int) -> AsyncIterator[str]:
    """One chunk per engine output that carries text or logprobs, one with ``finish_reason`` per choice."""
    exclude = None if body.include_usage else {"usage"}
    choices = {job.index: Choice(job.index) for job in jobs}
    offsets = {job.index: 0 for job in jobs}

    def chunk(index: int, text: str, logprobs: Optional[CompletionLogprobs], finish: Optional[str]) -> str:
        c = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return sse(CompletionResponse(id=rid, created=created, model=model, choices=[c]), exclude)

    try:
        async with aclosing(run_jobs(state, jobs, rid)) as stream:
            async for index, out in stream:
                choices[index].add(out)
                block = None
                if body.logprobs is not None and out.new_logprobs:
                    lps = [lp for lp in out.new_logprobs if lp is not None]
                    block, offsets[index] = logprobs_block(state.tokenizer, lps, offsets[index])
                if out.delta_text or block is not None:
                    yield chunk(index, out.delta_text, block, None)
                if out.finished:
                    yield chunk(index, "", None, out.finish_reason)
    except Exception as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            final = CompletionResponse(id=rid, created=created, model=model, choices=[],
                                       usage=usage(num_prompt, list(choices.values())))
            yield sse(final)
    yield DONE
