"""``response_format``: constrained decoding makes the output parse (and validate) whatever the model is."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from bytediet.engine.async_engine import AsyncEngine
from bytediet.engine.grammar import GrammarCompiler
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.server.app import build_app
from tests.server.conftest import client, live, run, tiny_llm

SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
USER = [{"role": "user", "content": "pick"}]


def chat(app, **body):
    async def go():
        async with client(app) as c:
            return await c.post("/v1/chat/completions", json={"messages": USER, **body})

    return run(go())


@pytest.mark.parametrize("temperature,seed", [(0, None), (1.0, 1), (1.5, 3)])
def test_json_schema_output_validates_on_a_random_model(server, temperature, seed):
    r = chat(
        server.app,
        max_tokens=60,
        temperature=temperature,
        seed=seed,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


def test_completions_take_response_format_too(server):
    async def go():
        async with client(server.app) as c:
            return await c.post(
                "/v1/completions",
                json={
                    "prompt": ["a", "b"],
                    "max_tokens": 60,
                    "temperature": 0,
                    "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
                },
            )

    r = run(go())
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_the_sampler_masks_forbidden_tokens(server):
    """Without the mask the random model's greedy text is not JSON; with it, it is."""
    free = chat(server.app, max_tokens=20, temperature=0).json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(free)
    offline = tiny_llm()  # the server's engine runs on its own thread: generate offline on a twin
    mask = GrammarCompiler(offline.tokenizer, 96).json_mask(SCHEMA)
    out = offline.generate("pick", SamplingParams(max_tokens=60, temperature=0, logits_processors=(mask,)))
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMA)
    assert mask.is_completed


@pytest.mark.parametrize(
    "fmt,param",
    [
        ({"type": "json_schema"}, "response_format"),
        ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "response_format"),
        ({"type": "xml"}, "response_format"),
        ({"type": "text", "json_schema": {"schema": SCHEMA}}, "response_format"),
    ],
)
def test_bad_response_format_is_a_400(server, fmt, param):
    r = chat(server.app, max_tokens=5, response_format=fmt)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert not server.core.has_unfinished_requests()


def test_text_response_format_is_free_text(server):
    r = chat(server.app, max_tokens=5, temperature=0, response_format={"type": "text"})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def smol():
    """The real default model (SmolLM2-135M, byte-level BPE) behind a socket, with the openai client."""
    llm = LLM("default", kv_cache_memory="64MiB")
    engine = AsyncEngine(llm.engine)
    with live(build_app(engine, "smol")) as (host, port):
        with openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=120) as c:
            yield c
    engine.shutdown()


def test_openai_client_json_schema_on_the_real_model(smol):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = smol.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    text = r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_openai_client_json_object_streamed_on_the_real_model(smol):
    stream = smol.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "Give a city and its country as JSON."}],
        max_tokens=80,
        temperature=0,
        stream=True,
        response_format={"type": "json_object"},
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert isinstance(json.loads(text), dict), text
