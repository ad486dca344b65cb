"""``tools`` / ``tool_choice``: a constrained call, parsed into ``tool_calls`` (whole and streamed)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.conftest import client, live, parse_sse, run

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Bath", "Derby"]}, "days": {"enum": [1, 2, 3]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "time",
        "parameters": {
            "type": "object",
            "properties": {"utc": {"type": "boolean"}},
            "required": ["utc"],
            "additionalProperties": False,
        },
    },
}
USER = [{"role": "user", "content": "weather?"}]


@pytest.fixture
def server(make_server):
    """A context long enough for the tools' description (one character per token)."""
    return make_server(context=1024, num_blocks=256)


def chat(app, **body):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 100, **body})

    return run(go())


def check_call(call: dict, tools: list[dict]) -> None:
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call["type"] == "function" and call["id"].startswith("call_")
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec[call["function"]["name"]])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "time"}}])
def test_a_required_or_named_call_is_parsed_into_tool_calls(server, choice):
    r = chat(server.app, tools=[WEATHER, TIME], tool_choice=choice, temperature=0)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None, c
    (call,) = c["message"]["tool_calls"]
    check_call(call, [WEATHER, TIME])
    if isinstance(choice, dict):
        assert call["function"]["name"] == "time"


def test_a_streamed_call_arrives_as_a_tool_calls_delta(server):
    r = chat(server.app, tools=[WEATHER], tool_choice="required", temperature=0, stream=True)
    events = parse_sse(r.text)
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and calls[0][0]["index"] == 0
    check_call(calls[0][0], [WEATHER])
    assert events[-2]["choices"][0]["finish_reason"] == "tool_calls" and events[-1] == "[DONE]"
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize(
    "body,message",
    [
        ({"tools": [WEATHER]}, "auto"),  # the default choice with tools is auto: this model cannot decide itself
        ({"tools": [WEATHER], "tool_choice": "auto"}, "auto"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool call"),
    ],
)
def test_unusable_tool_requests_are_400s_that_say_why(server, body, message):
    r = chat(server.app, **body)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_tool_choice_none_answers_in_text_and_history_with_calls_renders(server):
    history = USER + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Bath", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]
    r = chat(server.app, tools=[WEATHER], tool_choice="none", messages=history, max_tokens=3)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] is not None, r.text


def test_openai_client_tools(server):
    with live(server.app) as (host, port):
        with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0) as c:
            r = c.chat.completions.create(
                model="tiny",
                messages=USER,
                tools=[WEATHER, TIME],
                tool_choice="required",
                max_tokens=100,
                temperature=0,
            )
            stream = c.chat.completions.create(
                model="tiny",
                messages=USER,
                tools=[WEATHER],
                tool_choice={"type": "function", "function": {"name": "weather"}},
                max_tokens=100,
                temperature=0,
                stream=True,
            )
            streamed = [d for ch in stream for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in ("weather", "time")
    json.loads(call.function.arguments)
    assert len(streamed) == 1 and streamed[0].function.name == "weather"
    assert json.loads(streamed[0].function.arguments)["city"] in ("Bath", "Derby")
