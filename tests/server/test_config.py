"""The served context length: checked at start against the KV cache, reported by /v1/models, enforced per request."""

from __future__ import annotations

import pytest

from bytediet.errors import ConfigError
from bytediet.server.config import ServerConfig
from tests.server.conftest import client, run


def models(s):
    async def go():
        async with client(s.app) as c:
            return (await c.get("/v1/models")).json(), (await c.get("/v1/models/tiny")).json()

    return run(go())


def test_a_kv_cache_smaller_than_the_context_caps_the_served_length(make_server):
    s = make_server(num_blocks=32)  # 32 blocks x 4 tokens = 128 tokens; the model's context is 256
    listing, card = models(s)
    assert listing["data"][0]["max_model_len"] == 128 and card["max_model_len"] == 128

    async def go():
        async with client(s.app) as c:
            over = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 200})
            unbounded = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": None, "ignore_eos": True})
            return over, unbounded

    over, unbounded = run(go())
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    assert "128" in over.json()["error"]["message"]
    body = unbounded.json()  # no max_tokens: up to the served length, never past what the cache holds
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == 128


def test_max_model_len_larger_than_the_kv_cache_refuses_to_start(make_server):
    with pytest.raises(
        ConfigError,
        match=r"--max-model-len 200 does not fit the KV cache, which holds 128.*"
        r"--kv-cache-memory",
    ):
        make_server(ServerConfig(max_model_len=200), num_blocks=32)
    with pytest.raises(ConfigError, match="exceeds the model's context window of 256"):
        make_server(ServerConfig(max_model_len=300))


def test_max_model_len_is_served_and_reported(make_server):
    s = make_server(ServerConfig(max_model_len=64))
    listing, card = models(s)
    assert listing["data"][0]["max_model_len"] == 64 == card["max_model_len"]

    async def go():
        async with client(s.app) as c:
            return await c.post("/v1/completions", json={"prompt": "x" * 70, "max_tokens": 1})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "64" in r.json()["error"]["message"]
