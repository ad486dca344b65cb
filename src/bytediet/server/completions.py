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
from .serving import (
    DONE,
    Choice,
    EventStream,
    Job,
    ServerState,
    collect,
    error_event,
    make_jobs,
    new_id,
    run_jobs,
    sse,
    token_text,
    unless_disconnected,
    usage,
)

FIELDS = tuple(CompletionRequest.model_fields)


def split_prompts(prompt) -> list:
    """``prompt`` (text, ids, or a list of either) → one text or token-id list per prompt."""
    prompts = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not prompts or not all(prompts):
        raise ConfigError("prompt: must not be empty")
    return prompts


def prompt_token_ids(state: ServerState, prompt) -> list[list[int]]:
    """``prompt`` (text, ids, or a list of either) → one token-id list per prompt."""
    out = []
    for p in split_prompts(prompt):
        if isinstance(p, str):
            if state.tokenizer is None:
                raise ConfigError("prompt: this model has no tokenizer; send token ids instead of text")
            p = state.tokenizer.encode(p)
        out.append(list(p))
    return out


def echo_text(tokenizer, prompt, ids: list[int]) -> str:
    """What ``echo`` puts before a choice's text: the prompt as sent, or its token ids decoded."""
    if isinstance(prompt, str):
        return prompt
    return "".join(token_text(tokenizer, t) for t in ids) if tokenizer is None else tokenizer.decode(ids)


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


def prompt_logprobs_block(tokenizer, ids: list[int], lps: list[Optional[TokenLogprobs]]) -> CompletionLogprobs:
    """The echoed prompt's logprobs object: each token's log-probability given the tokens before it (null for
    the first), and its most likely alternatives plus the token itself (as vLLM: it was not sampled)."""
    block, offset = CompletionLogprobs(), 0
    for token, lp in zip(ids, lps):
        text = token_text(tokenizer, token)
        block.tokens.append(text)
        block.text_offset.append(offset)
        offset += len(text)
        block.token_logprobs.append(None if lp is None else lp.logprob)
        block.top_logprobs.append(
            None if lp is None else {**{token_text(tokenizer, t): v for t, v in lp.top}, text: lp.logprob}
        )
    return block


def join(first: Optional[CompletionLogprobs], second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(**{k: getattr(first, k) + getattr(second, k) for k in CompletionLogprobs.model_fields})


def _generated(choice: Choice, body: CompletionRequest) -> Choice:
    """The choice as shown: with ``echo`` and ``max_tokens`` 0, none of the token the engine made."""
    if not body.echo_only:
        return choice
    return Choice(choice.index, finish_reason="length", prompt_logprobs=choice.prompt_logprobs)


async def create_completion(body: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.model_name(body.model)
    if (field := body.unsupported()) is not None:
        raise APIError(400, f"{field}: not supported by this server; leave it out", field)
    prompts, jobs, echoes = await run_in_threadpool(_prepare, state, body)  # tokenizing a long prompt must not block
    state.admit(len(jobs))
    rid, created = new_id("cmpl"), int(time.time())
    num_prompt = sum(len(p) for p in prompts)
    if body.stream:
        return EventStream(_events(state, jobs, rid, created, model, body, num_prompt, echoes))
    choices = [_generated(c, body) for c in await unless_disconnected(request, collect(state, jobs, rid))]
    out = CompletionResponse(
        id=rid,
        created=created,
        model=model,
        choices=[
            _choice(state.tokenizer, body, c, prompts[c.index // body.n], echoes[c.index // body.n]) for c in choices
        ],
        usage=usage(num_prompt, choices),
    )
    return Response(out.model_dump_json(), media_type="application/json")


def _choice(tokenizer, body: CompletionRequest, c: Choice, prompt_ids: list[int], echo: str) -> CompletionChoice:
    """One whole choice: the echoed prompt (if asked), the generated text, their logprobs (if asked)."""
    logprobs = None
    if body.logprobs is not None:
        logprobs = logprobs_block(tokenizer, c.logprobs, len(echo))[0]
        if body.echo:
            logprobs = join(prompt_logprobs_block(tokenizer, prompt_ids, c.prompt_logprobs or [None]), logprobs)
    return CompletionChoice(
        index=c.index, text=echo + "".join(c.text), finish_reason=c.finish_reason, logprobs=logprobs
    )


def _prepare(state: ServerState, body: CompletionRequest) -> tuple[list[list[int]], list[Job], list[str]]:
    """Tokenize and validate (on a worker thread): the prompts' token ids, one job per choice, and per prompt
    the text ``echo`` puts first ("" without echo)."""
    try:
        params = body.to_sampling_params()
        if (
            isinstance(body.prompt, list)
            and len(body.prompt) > state.config.max_prompts_per_request
            and not isinstance(body.prompt[0], int)
        ):  # refuse before tokenizing a huge batch
            raise ConfigError(
                f"prompt: {len(body.prompt)} prompts in one request exceed the server's limit of "
                f"{state.config.max_prompts_per_request}; split the batch over several requests"
            )
        prompts = prompt_token_ids(state, body.prompt)
        jobs = make_jobs(state, prompts, params, state.grammars.masks_for(body.response_format), body.priority)
        echoes = [
            echo_text(state.tokenizer, p, ids) if body.echo else ""
            for p, ids in zip(split_prompts(body.prompt), prompts)
        ]
        return prompts, jobs, echoes
    except BytedietError as exc:
        raise APIError.bad_request(exc, fields=FIELDS) from exc


async def _events(
    state: ServerState,
    jobs: list[Job],
    rid: str,
    created: int,
    model: str,
    body: CompletionRequest,
    num_prompt: int,
    echoes: list[str],
) -> AsyncIterator[str]:
    """One chunk per engine output that carries text or logprobs, one with ``finish_reason`` per choice.

    With ``echo`` a choice's first chunk starts with its prompt (and the prompt's logprobs).
    """
    exclude = None if body.include_usage else {"usage"}
    choices = {job.index: Choice(job.index) for job in jobs}
    prompt_ids = {job.index: job.prompt_ids for job in jobs}
    offsets = {job.index: 0 for job in jobs}
    echoed: set[int] = set()
    want = body.logprobs is not None

    def chunk(index: int, text: str, logprobs: Optional[CompletionLogprobs], finish: Optional[str]) -> str:
        c = CompletionChoice(index=index, text=text, logprobs=logprobs, finish_reason=finish)
        return sse(CompletionResponse(id=rid, created=created, model=model, choices=[c]), exclude)

    try:
        async with aclosing(run_jobs(state, jobs, rid)) as stream:
            async for index, out in stream:
                choices[index].add(out)
                text = "" if body.echo_only else out.delta_text
                lps = [] if body.echo_only else [lp for lp in out.new_logprobs if lp is not None]
                block = None
                if body.echo and index not in echoed:  # the choice's first output: its prompt goes first
                    echoed.add(index)
                    echo = echoes[index // body.n]
                    text, offsets[index] = echo + text, len(echo)
                    if want:
                        block = prompt_logprobs_block(
                            state.tokenizer, prompt_ids[index], choices[index].prompt_logprobs or [None]
                        )
                if want and lps:
                    generated, offsets[index] = logprobs_block(state.tokenizer, lps, offsets[index])
                    block = join(block, generated)
                if text or block is not None:
                    yield chunk(index, text, block, None)
                if out.finished:
                    yield chunk(index, "", None, "length" if body.echo_only else out.finish_reason)
    except Exception as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            final = CompletionResponse(
                id=rid,
                created=created,
                model=model,
                choices=[],
                usage=usage(num_prompt, [_generated(c, body) for c in choices.values()]),
            )
            yield sse(final)
    yield DONE
