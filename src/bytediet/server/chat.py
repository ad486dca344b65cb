"""POST /v1/chat/completions: messages rendered with the model's chat template, whole or streamed as SSE."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import AsyncIterator, Optional

import jinja2
from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..engine.sampling import TokenLogprobs
from ..errors import BytedietError, ConfigError
from . import tools
from .errors import APIError
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    DeltaMessage,
    TopLogprob,
)
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

FIELDS = tuple(ChatCompletionRequest.model_fields)


def chat_token_ids(state: ServerState, body: ChatCompletionRequest, system: Optional[str] = None) -> list[int]:
    """Render the conversation with the tokenizer's template; the template writes BOS and special tokens.

    ``system`` (the tools' description) joins the first system message, or becomes one.
    """
    if state.tokenizer is None:
        raise ConfigError("messages: this model has no tokenizer, so it cannot render chat messages")
    messages = [m.template_dict(i) for i, m in enumerate(body.messages)]
    if system:
        if messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{system}".strip()}
        else:
            messages.insert(0, {"role": "system", "content": system})
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except jinja2.TemplateError as exc:
        raise ConfigError(f"messages: the model's chat template rejected them: {exc}") from exc
    except BytedietError as exc:
        raise ConfigError(f"messages: {exc}") from exc
    return state.tokenizer.encode(text, add_special_tokens=False)


def chat_logprobs(tokenizer, lps: list[TokenLogprobs]) -> ChatLogprobs:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return dict(token=text, logprob=logprob, bytes=list(text.encode("utf-8")))

    return ChatLogprobs(
        content=[
            ChatLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
            for lp in lps
        ]
    )


async def create_chat_completion(body: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.model_name(body.model)
    if (field := body.unsupported()) is not None:
        raise APIError(400, f"{field}: not supported by this server; leave it out", field)
    prompt, jobs, calls = await run_in_threadpool(_prepare, state, body)  # render and tokenize off the event loop
    state.admit(len(jobs))
    rid, created = new_id("chatcmpl"), int(time.time())
    if body.stream:
        return EventStream(_events(state, jobs, rid, created, model, body, len(prompt), calls))
    choices = await unless_disconnected(request, collect(state, jobs, rid))
    replies = [_reply("".join(c.text), c.finish_reason, calls) for c in choices]
    out = ChatCompletionResponse(
        id=rid,
        created=created,
        model=model,
        choices=[
            ChatChoice(
                index=c.index,
                message=message,
                finish_reason=finish,
                logprobs=chat_logprobs(state.tokenizer, c.logprobs) if body.logprobs else None,
            )
            for c, (message, finish) in zip(choices, replies)
        ],
        usage=usage(len(prompt), choices),
    )
    return Response(out.model_dump_json(), media_type="application/json")


def _prepare(state: ServerState, body: ChatCompletionRequest) -> tuple[list[int], list[Job], bool]:
    """Render, tokenize and validate (on a worker thread): the prompt's ids, one job per choice, and
    whether the reply is a constrained tool call."""
    try:
        params = body.to_sampling_params()
        specs, choice = tools.parse(body.tools, body.tool_choice)
        schema = tools.call_schema(specs, choice) if specs else None
        if schema is not None and body.response_format is not None and body.response_format.type != "text":
            raise ConfigError(
                "response_format: cannot be combined with a tool call, which has its own format; leave one of them out"
            )
        masks = state.grammars.masks(schema) if schema is not None else state.grammars.masks_for(body.response_format)
        prompt = chat_token_ids(state, body, tools.system_text(specs) if schema is not None else None)
        return prompt, make_jobs(state, [prompt], params, masks, body.priority), schema is not None
    except BytedietError as exc:
        aliases = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": body.max_tokens_field}
        raise APIError.bad_request(exc, aliases, FIELDS) from exc


def _reply(text: str, finish: Optional[str], calls: bool) -> tuple[AssistantMessage, Optional[str]]:
    """The assistant's message and finish reason: a tool call when the reply was constrained to one."""
    call = tools.parse_call(text) if calls and finish == "stop" else None
    if call is None:
        return AssistantMessage(content=text), finish
    return AssistantMessage(content=None, tool_calls=[call.model_dump()]), "tool_calls"


async def _events(
    state: ServerState,
    jobs: list[Job],
    rid: str,
    created: int,
    model: str,
    body: ChatCompletionRequest,
    num_prompt: int,
    calls: bool = False,
) -> AsyncIterator[str]:
    """OpenAI's chunk sequence per choice: the role, content deltas, an empty delta with ``finish_reason``.

    A tool call is sent whole, as one ``tool_calls`` delta when its choice finishes (a valid OpenAI stream).
    """
    exclude = None if body.include_usage else {"usage"}
    choices = {job.index: Choice(job.index) for job in jobs}

    def chunk(
        index: int, delta: DeltaMessage, logprobs: Optional[ChatLogprobs] = None, finish: Optional[str] = None
    ) -> str:
        c = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)
        return sse(ChatCompletionChunk(id=rid, created=created, model=model, choices=[c]), exclude)

    try:
        for index in choices:
            yield chunk(index, DeltaMessage(role="assistant", content=""))
        async with aclosing(run_jobs(state, jobs, rid)) as stream:
            async for index, out in stream:
                choices[index].add(out)
                lps = [lp for lp in out.new_logprobs if lp is not None] if body.logprobs else []
                if (out.delta_text or lps) and not calls:
                    logprobs = chat_logprobs(state.tokenizer, lps) if lps else None
                    yield chunk(index, DeltaMessage(content=out.delta_text), logprobs)
                if out.finished:
                    finish = out.finish_reason
                    if calls:
                        message, finish = _reply("".join(choices[index].text), finish, True)
                        delta = DeltaMessage(
                            content=message.content,
                            tool_calls=[{"index": i, **c} for i, c in enumerate(message.tool_calls or [])] or None,
                        )
                        yield chunk(index, delta)
                    yield chunk(index, DeltaMessage(), finish=finish)
    except Exception as exc:
        yield error_event(exc)
    else:
        if body.include_usage:
            final = ChatCompletionChunk(
                id=rid, created=created, model=model, choices=[], usage=usage(num_prompt, list(choices.values()))
            )
            yield sse(final)
    yield DONE
