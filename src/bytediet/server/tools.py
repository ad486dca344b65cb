"""``tools`` / ``tool_choice`` in chat: the call is produced by constrained decoding, then parsed into ``tool_calls``.

Neither bundled model's chat template knows tools, so the server does what works for any model:
the function signatures go into a system message, and with ``tool_choice: "required"`` (any of the
tools) or a named function the output is *constrained* (``engine.grammar``) to one JSON object
``{"name": ..., "arguments": {...}}`` whose arguments match the function's JSON Schema. The reply
then carries ``tool_calls`` and ``finish_reason: "tool_calls"``. ``tool_choice: "auto"`` needs a model
that decides by itself and a parser for its own call syntax, so it is refused with a message saying so.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal, Optional, Union

from pydantic import Field, TypeAdapter, ValidationError

from ..errors import ConfigError
from .protocol import Text, _Schema


class FunctionDef(_Schema):
    name: Text = Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: Optional[Text] = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})


class Tool(_Schema):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(_Schema):
    name: Text


class NamedToolChoice(_Schema):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class FunctionCall(_Schema):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Schema):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ToolCallDelta(ToolCall):
    index: int = 0


_TOOLS = TypeAdapter(list[Tool])
_CHOICE = TypeAdapter(ToolChoice)


def parse(tools: Optional[list[dict]], tool_choice) -> tuple[list[Tool], ToolChoice]:
    """The request's raw ``tools`` and ``tool_choice``, validated (``ConfigError`` naming the field)."""
    if tool_choice is not None and not tools and tool_choice != "none":
        raise ConfigError("tool_choice: needs tools; send tools or leave tool_choice out")
    try:
        parsed = _TOOLS.validate_python(tools or [])
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"tools: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None
    try:
        choice = _CHOICE.validate_python(tool_choice if tool_choice is not None else ("auto" if parsed else "none"))
    except ValidationError:
        raise ConfigError(
            "tool_choice: expected 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
        ) from None
    return parsed, choice


def call_schema(tools: list[Tool], choice: ToolChoice) -> Optional[dict]:
    """The JSON Schema a constrained reply must match, or None when tools are off (``"none"``)."""
    if choice == "none":
        return None
    if choice == "auto":
        raise ConfigError(
            "tool_choice: 'auto' needs a model whose chat template can call tools, and this "
            "model's cannot; send tool_choice 'required' or {'type': 'function', 'function': "
            "{'name': ...}} (the reply is then constrained to a call), or leave tools out"
        )
    chosen = tools
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise ConfigError(
                f"tool_choice: no tool named {choice.function.name!r} in tools "
                f"({', '.join(t.function.name for t in tools)})"
            )
    shapes = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "arguments": t.function.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    return shapes[0] if len(shapes) == 1 else {"anyOf": shapes}


def system_text(tools: list[Tool]) -> str:
    """The tools described to the model, as a system message."""
    lines = [
        "You can call these functions. To call one, reply with only a JSON object "
        '{"name": <function name>, "arguments": <its arguments>}.'
    ]
    for t in tools:
        lines.append(
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description or "",
                    "parameters": t.function.parameters,
                }
            )
        )
    return "\n".join(lines)


def parse_call(text: str) -> Optional[ToolCall]:
    """The constrained reply as a tool call (None if it is not one: a reply cut short by max_tokens)."""
    try:
        value = json.loads(text)
        name, arguments = value["name"], value["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=json.dumps(arguments))
    )
