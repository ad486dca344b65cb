"""OpenAI request and response schemas (pydantic), and the request → ``SamplingParams`` mapping.

Field names and defaults follow the OpenAI API reference (https://platform.openai.com/docs/api-reference)
plus vLLM's extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``). Value ranges are not checked here:
:class:`bytediet.engine.params.SamplingParams` is the one place that knows them, and its
``ConfigError`` names the field (the server turns it into an HTTP 400 with that ``param``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator

from ..engine.params import SamplingParams
from ..errors import ConfigError

MAX_LOGPROBS = 20  # most top log-probabilities a request may ask for (vLLM's default max_logprobs)
MAX_N = 128  # most choices per prompt (OpenAI's own limit on ``n``)


def _utf8(text: str) -> str:
    """JSON may spell a lone UTF-16 surrogate (``"\\ud800"``); it is not a character, so no tokenizer takes it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise ValueError(
            f"holds a lone UTF-16 surrogate (\\u{ord(bad):04x}) at character {exc.start}, "
            "which is not valid Unicode; send the full surrogate pair or the character itself"
        ) from None
    return text


# Every string a request carries into the tokenizer or back into a message is valid Unicode.
Text = Annotated[str, AfterValidator(_utf8)]


class _Schema(BaseModel):
    # OpenAI clients send fields the server does not use (user, metadata, store): accept and ignore them.
    model_config = ConfigDict(extra="ignore")


def _omit_none(value) -> bool:
    return value is None


class StreamOptions(_Schema):
    include_usage: bool = False


class _SamplingRequest(_Schema):
    """Fields shared by /v1/completions and /v1/chat/completions. ``None`` means the default."""

    model: Optional[Text] = None
    n: int = Field(1, le=MAX_N)
    temperature: Optional[float] = None  # OpenAI's default is 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[Text, list[Text]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[dict[str, float]] = None
    priority: StrictInt = 0  # vLLM's field: smaller runs first under --scheduling-policy priority

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream"):  # as OpenAI and vLLM (``stream`` is validated first)
            raise ValueError("only allowed when stream is true; leave it out or set stream to true")
        return value

    def sampling_params(
        self, max_tokens: Optional[int], logprobs: Optional[int], prompt_logprobs: Optional[int] = None
    ) -> SamplingParams:
        """The engine's parameters; raises ``ConfigError`` naming the field for a bad value."""
        if self.logit_bias:
            raise ConfigError("logit_bias: not supported by this server; leave it out")
        given = {
            key: getattr(self, key)
            for key in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "presence_penalty",
                "frequency_penalty",
                "repetition_penalty",
                "seed",
            )
            if getattr(self, key) is not None
        }
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            logprobs=logprobs,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=prompt_logprobs,
            **given,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ---------------------------------------------------------------------------------------- requests
class JSONSchemaFormat(_Schema):
    """OpenAI's ``response_format.json_schema``: a named JSON Schema the output must match."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Text = "response"
    description: Optional[Text] = None
    json_schema: dict = Field(default_factory=dict, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(_Schema):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None

    @field_validator("json_schema")
    @classmethod
    def _schema_needs_its_type(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("type") != "json_schema":
            raise ValueError("only allowed with type json_schema")
        return value


class CompletionRequest(_SamplingRequest):
    """POST /v1/completions. ``prompt``: text, token ids, or a batch of either.

    ``echo``: each choice starts with its prompt; with ``logprobs`` the prompt tokens are scored too (the
    first has none), which is how lm-evaluation-harness and others compute log-likelihoods. ``max_tokens``
    0 is allowed with ``echo`` (the prompt alone, as OpenAI's legacy API and vLLM).
    """

    prompt: Union[Text, list[int], list[Text], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # vLLM's extension: constrained completions too

    def unsupported(self) -> Optional[str]:
        """The first field set to a value this server cannot honour, or None."""
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        if self.suffix:
            return "suffix"
        return None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens`` 0: the engine still makes one token (its step scores the prompt), unshown."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(
            1 if self.echo_only else self.max_tokens, self.logprobs, self.logprobs if self.echo else None
        )


class ContentPart(_Schema):
    type: str
    text: Optional[Text] = None


class ChatMessage(_Schema):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, list[ContentPart]]] = None
    tool_calls: Optional[list[dict]] = None  # an assistant's earlier calls
    tool_call_id: Optional[Text] = None  # a tool message: the call it answers

    def template_dict(self, index: int) -> dict:
        """The ``{"role", "content"}`` dict a chat template expects (text parts joined by newlines).

        An assistant's earlier tool calls are written as the JSON the model was constrained to produce.
        """
        content = self.content
        if isinstance(content, list):
            other = [p.type for p in content if p.type != "text"]
            if other:
                raise ConfigError(f"messages: message {index} has a {other[0]!r} part; only text parts are supported")
            content = "\n".join(p.text or "" for p in content)
        if not content and self.tool_calls:
            content = "\n".join(
                json.dumps(
                    {
                        "name": c.get("function", {}).get("name"),
                        "arguments": _arguments(c.get("function", {}).get("arguments")),
                    }
                )
                for c in self.tool_calls
            )
        role = "system" if self.role == "developer" else self.role  # OpenAI's new name for the system role
        return {"role": role, "content": content or ""}


def _arguments(text):
    try:
        return json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return text


class ChatCompletionRequest(_SamplingRequest):
    """POST /v1/chat/completions. ``max_tokens`` (or ``max_completion_tokens``) ``None``: until the context ends."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[list[dict]] = None  # validated in server/tools.py
    tool_choice: Optional[Union[str, dict]] = None
    parallel_tool_calls: Optional[bool] = None
    response_format: Optional[ResponseFormat] = None

    def unsupported(self) -> Optional[str]:
        if self.parallel_tool_calls:
            return "parallel_tool_calls"
        return None

    def to_sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ConfigError("top_logprobs: needs logprobs set to true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)

    @property
    def max_tokens_field(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# --------------------------------------------------------------------------------------- responses
class PromptTokensDetails(_Schema):
    cached_tokens: int  # prompt tokens not computed: found in the KV pool or a tier below it
    cached_tokens_by_tier: dict[str, int] = Field(default_factory=dict)  # bytediet's: "pool", "ram", "disk"


class Usage(_Schema):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = Field(None, exclude_if=_omit_none)  # with KV tiers on


class CompletionLogprobs(_Schema):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Schema):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class CompletionResponse(_Schema):
    """The response of /v1/completions, and (``usage`` null or left out) each chunk of its stream."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(_Schema):
    token: str
    logprob: float
    bytes: list[int]


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Schema):
    content: list[ChatLogprob] = Field(default_factory=list)


class AssistantMessage(_Schema):
    role: Literal["assistant"] = "assistant"
    content: Optional[str]
    tool_calls: Optional[list[dict]] = Field(None, exclude_if=_omit_none)


class ChatChoice(_Schema):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionResponse(_Schema):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(_Schema):
    role: Optional[Literal["assistant"]] = Field(None, exclude_if=_omit_none)
    content: Optional[str] = Field(None, exclude_if=_omit_none)
    tool_calls: Optional[list[dict]] = Field(None, exclude_if=_omit_none)


class ChatChunkChoice(_Schema):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(_Schema):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class ModelCard(_Schema):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "bytediet"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(_Schema):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Schema):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(_Schema):
    error: ErrorInfo
