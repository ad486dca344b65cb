"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's shapes): the served model's tokenizer over HTTP."""
from __future__ import annotations

from typing import Optional

from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ..errors import BytedietError, ConfigError
from .chat import chat_token_ids
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, Text, _Schema
from .serving import ServerState


class TokenizeRequest(_Schema):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template, as /v1/chat/completions does)."""

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: bool = True


class TokenizeResponse(_Schema):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Schema):
    model: Optional[Text] = None
    tokens: list[int]


class DetokenizeResponse(_Schema):
    prompt: str


def _tokenizer(state: ServerState):
    if state.tokenizer is None:
        raise APIError(400, "this model has no tokenizer, so it cannot tokenize text", "model")
    return state.tokenizer


async def tokenize(body: TokenizeRequest, state: ServerState) -> TokenizeResponse:
    state.model_name(body.model)
    tok = _tokenizer(state)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: give exactly one of prompt (text) or messages (a chat)", "prompt")

    def work() -> list[int]:
        if body.prompt is not None:
            return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        try:
            return chat_token_ids(state, ChatCompletionRequest(messages=body.messages))
        except BytedietError as exc:
            raise APIError.bad_request(exc, fields=("messages",)) from exc

    ids = await run_in_threadpool(work)
    return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids)


async def detokenize(body: DetokenizeRequest, state: ServerState) -> DetokenizeResponse:
    state.model_name(body.model)
    tok = _tokenizer(state)
    vocab = state.engine.engine.model.config.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError.bad_request(ConfigError(f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab - 1}]"),
                                   fields=("tokens",))
    return DetokenizeResponse(prompt=await run_in_threadpool(tok.decode, body.tokens))
