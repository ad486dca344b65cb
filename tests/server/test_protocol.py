"""Request schemas: text that is not valid Unicode, the cap on ``n``, ``stream_options`` without ``stream``."""

from __future__ import annotations

import pytest

from tests.server.conftest import client, run

USER = [{"role": "user", "content": "hi"}]
# Bodies written as raw JSON: a lone surrogate cannot be encoded by httpx's json= (it is not valid Unicode).
SURROGATES = [
    ("completions", b'{"prompt": "\\udfff", "max_tokens": 2}', "prompt"),
    ("completions", b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt"),
    ("completions", b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages"),
    (
        "chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        "messages",
    ),
    ("completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
]


@pytest.mark.parametrize("endpoint,raw,param", SURROGATES, ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(SURROGATES)])
def test_lone_surrogate_is_a_400_naming_the_field(server, endpoint, raw, param):
    async def go():
        async with client(server.app) as c:
            return await c.post(f"/v1/{endpoint}", content=raw, headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "surrogate" in error["message"], error


@pytest.mark.parametrize("endpoint,extra", [("completions", {"prompt": "x"}), ("chat/completions", {"messages": USER})])
def test_n_is_capped_at_128_as_openai(server, endpoint, extra):
    async def go():
        async with client(server.app) as c:
            return await c.post(f"/v1/{endpoint}", json={**extra, "n": 20000, "max_tokens": 1})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "128" in r.json()["error"]["message"]
    assert not server.core.has_unfinished_requests()


@pytest.mark.parametrize("endpoint,extra", [("completions", {"prompt": "x"}), ("chat/completions", {"messages": USER})])
def test_stream_options_without_stream_is_a_400(server, endpoint, extra):
    async def go():
        async with client(server.app) as c:
            bad = await c.post(
                f"/v1/{endpoint}", json={**extra, "max_tokens": 1, "stream_options": {"include_usage": True}}
            )
            ok = await c.post(
                f"/v1/{endpoint}",
                json={**extra, "max_tokens": 1, "stream": True, "stream_options": {"include_usage": True}},
            )
            return bad, ok

    bad, ok = run(go())
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream_options", bad.text
    assert "stream" in bad.json()["error"]["message"]
    assert ok.status_code == 200 and '"usage":{' in ok.text


@pytest.mark.parametrize("endpoint,extra", [("completions", {"prompt": "x"}), ("chat/completions", {"messages": USER})])
@pytest.mark.parametrize("priority", ["high", 1.5, "3", None, [1]])
def test_priority_of_the_wrong_type_is_a_400(server, endpoint, extra, priority):
    async def go():
        async with client(server.app) as c:
            return await c.post(f"/v1/{endpoint}", json={**extra, "max_tokens": 1, "priority": priority})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
    assert not server.core.has_unfinished_requests()


def test_priority_reaches_the_scheduler(make_server):
    """Under the priority policy a request's ``priority`` orders the waiting queue (vLLM's field)."""
    srv = make_server(scheduling_policy="priority")
    seen = []
    add = srv.core.add_request

    def spy(ids, params, request_id=None, priority=0):
        seen.append(priority)
        return add(ids, params, request_id, priority)

    srv.core.add_request = spy

    async def go():
        async with client(srv.app) as c:
            return await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "priority": -4})

    r = run(go())
    assert r.status_code == 200, r.text
    assert seen == [-4]
