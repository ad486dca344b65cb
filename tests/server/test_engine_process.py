"""The engine core in its own process (``EngineProcess``): the server behaves as with the engine on a thread."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import signal
import time
from types import SimpleNamespace

import jsonschema
import pytest

from bytediet.engine.engine_process import EngineProcess
from bytediet.errors import ConfigError
from bytediet.server.app import build_app, engine_alive
from tests.server.conftest import MODEL, client, parse_sse, run, tiny_engine
from tests.server.test_disconnect import call_and_leave
from tests.server.test_structured import SCHEMA, USER

LONG = {"prompt": "x", "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def remote():
    engine = EngineProcess(tiny_engine)
    yield SimpleNamespace(app=build_app(engine, [MODEL, "tiny-alias"]), engine=engine)
    engine.shutdown()


def post(app, path: str, body: dict):
    async def go():
        async with client(app) as c:
            return await c.post(path, json=body)

    return run(go())


def wait_idle(engine, timeout: float = 20.0) -> None:
    """Until the engine reports no request and every KV block free."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        c = engine.counters()
        if c.num_running == 0 and c.num_waiting == 0 and c.num_free_blocks == engine.info.num_blocks:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {engine.counters()}")


def test_outputs_equal_the_engine_on_a_thread(remote, server):
    body = {"prompt": "Hello", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    here, there = post(server.app, "/v1/completions", body), post(remote.app, "/v1/completions", body)
    assert here.status_code == there.status_code == 200, there.text
    assert there.json()["choices"] == here.json()["choices"] and there.json()["usage"] == here.json()["usage"]
    streamed = post(remote.app, "/v1/completions", {**body, "stream": True, "n": 2})
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]"
    for i in range(2):
        text = "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"][0]["index"] == i)
        assert text == here.json()["choices"][0]["text"]


def test_a_client_that_leaves_frees_its_blocks(remote):
    chunks = run(
        call_and_leave(remote.app, "/v1/completions", {**LONG, "stream": True}, lambda c: c is not None and len(c) >= 3)
    )
    assert len(chunks) >= 3
    wait_idle(remote.engine)
    metrics = post(remote.app, "/v1/completions", {"prompt": "ab", "max_tokens": 2})  # and it keeps serving
    assert metrics.status_code == 200


def test_metrics_show_the_engine_counters(remote):
    assert post(remote.app, "/v1/completions", {"prompt": "abcdefgh" * 4, "max_tokens": 3}).status_code == 200
    wait_idle(remote.engine)

    async def scrape():
        async with client(remote.app) as c:
            return (await c.get("/metrics")).text

    text = run(scrape())
    value = lambda name: float(re.search(rf"^bytediet:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE).group(1))
    assert value("kv_cache_usage_perc") == 0.0 and value("num_requests_running") == 0.0
    assert value("prefix_cache_queries_total") > 0
    assert 'kv_codec="' in text and value("kv_cache_compression_ratio") > 0


def test_priority_and_bad_input(remote):
    assert post(remote.app, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "priority": 3}).status_code == 200
    r = post(remote.app, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "priority": "high"})
    assert r.status_code == 400 and "priority" in r.text
    r = post(remote.app, "/v1/completions", {"prompt": [500], "max_tokens": 2})
    assert r.status_code == 400 and "vocabulary" in r.text
    r = post(remote.app, "/v1/completions", {"prompt": "ab", "max_tokens": 100000})
    assert r.status_code == 400 and "max_tokens" in r.text
    wait_idle(remote.engine)


def test_structured_output_is_compiled_in_the_engine_process(remote):
    r = post(
        remote.app,
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 60,
            "temperature": 1.0,
            "seed": 1,
            "n": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA}},
        },
    )
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
    bad = post(
        remote.app,
        "/v1/chat/completions",
        {
            "messages": USER,
            "max_tokens": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        },
    )
    assert bad.status_code == 400


def test_a_dead_engine_process_fails_the_streams_and_health():
    engine = EngineProcess(functools.partial(tiny_engine, num_blocks=128))
    app = build_app(engine, MODEL)
    try:

        async def go():
            async with client(app) as c:
                assert (await c.get("/health")).status_code == 200
                stream = asyncio.create_task(c.post("/v1/completions", json={**LONG, "stream": True}))
                while engine.counters().num_running == 0 and not stream.done():
                    await asyncio.sleep(0.02)
                os.kill(engine.pid, signal.SIGKILL)
                events = parse_sse((await stream).text)
                health = await c.get("/health")
                return events, health

        events, health = run(go())
        assert events[-1] == "[DONE]" and "engine process has stopped" in events[-2]["error"]["message"]
        assert health.status_code == 503 and not engine_alive(engine)
    finally:
        engine.shutdown()


def broken_engine():
    raise ConfigError("--model: no such model; pick one of `bytediet models`")


def test_a_factory_error_is_raised_in_the_api_process():
    with pytest.raises(ConfigError, match="no such model"):
        EngineProcess(broken_engine)
