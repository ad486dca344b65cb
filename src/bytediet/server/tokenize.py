"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` (vLLM's shapes): the served model's
tokenizer over HTTP (lm-evaluation-harness's ``tokenizer_backend=remote`` uses all three)."""

from __future__ import annotations

from typing import Optional

from pydantic import Field
from starlette.concurrency import run_in_threadpool

from ..errors import BytedietError, ConfigError
from .chat import chat_token_ids
from .errors import APIError
from .protocol import ChatCompletionRequest, ChatMessage, Text, _Schema
from .serving import ServerState, token_text


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


class TokenizerInfo(_Schema):
    """What a client needs to tokenize as the server does: the special tokens (as text) and the chat template."""

    tokenizer_class: str
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    pad_token: Optional[str] = None
    chat_template: Optional[str] = None
    model_max_length: int


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
    vocab = state.engine.info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError.bad_request(
            ConfigError(f"tokens: id {bad[0]} is outside the vocabulary [0, {vocab - 1}]"), fields=("tokens",)
        )
    return DetokenizeResponse(prompt=await run_in_threadpool(tok.decode, body.tokens))


async def tokenizer_info(state: ServerState) -> TokenizerInfo:
    tok = _tokenizer(state)

    def text(token_id: Optional[int]) -> Optional[str]:
        return None if token_id is None else token_text(tok, token_id)

    return TokenizerInfo(
        tokenizer_class=type(tok).__name__,
        bos_token=text(getattr(tok, "bos_token_id", None)),
        eos_token=text(getattr(tok, "eos_token_id", None)),
        chat_template=getattr(tok, "chat_template", None),
        model_max_length=state.max_model_len,
    )
