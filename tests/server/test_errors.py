"""Bad input: HTTP 400 with OpenAI's error object naming the field; unknown model 404; the server keeps serving."""

from __future__ import annotations

import pytest

from tests.server.conftest import client, run

USER = [{"role": "user", "content": "hi"}]

CASES = [
    # (endpoint, body, status, param)
    ("completions", {}, 400, "prompt"),
    ("completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 255}, 400, "max_tokens"),  # 2 prompt tokens + 255 > 256
    ("completions", {"prompt": "x", "logprobs": 21}, 400, "logprobs"),
    ("completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 1.0}}, 400, "logit_bias"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": "x" * 300}, 400, "prompt"),  # longer than the 256-token context
    ("completions", {"prompt": [1, 500]}, 400, "prompt"),  # outside the 96-token vocabulary
    ("completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("chat/completions", {"messages": USER, "temperature": -1}, 400, "temperature"),
    ("chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": USER, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 300}]}, 400, "messages"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat/completions", {"messages": USER, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("endpoint,body,status,param", CASES, ids=[f"{c[0]}-{c[3]}-{i}" for i, c in enumerate(CASES)])
def test_bad_field_is_named_and_the_server_keeps_serving(server, endpoint, body, status, param):
    async def go():
        async with client(server.app) as c:
            bad = await c.post(f"/v1/{endpoint}", json=body)
            good = await c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
            return bad, good

    bad, good = run(go())
    assert bad.status_code == status, bad.text
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"] or status == 404
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] >= 1
    assert not server.core.has_unfinished_requests()


@pytest.mark.parametrize(
    "content,headers",
    [
        (b'{"prompt": "x",', {"content-type": "application/json"}),
        (b"[1, 2]", {"content-type": "application/json"}),
        (b"not json", {}),
    ],
)
def test_malformed_body_is_a_400(server, content, headers):
    async def go():
        async with client(server.app) as c:
            return await c.post("/v1/completions", content=content, headers=headers)

    r = run(go())
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None and "JSON" in error["message"]


def test_unknown_route_is_a_404_error_object(server):
    async def go():
        async with client(server.app) as c:
            return await c.get("/v1/nothing")

    r = run(go())
    assert r.status_code == 404 and "message" in r.json()["error"]


def test_an_engine_failure_is_reported_and_the_server_recovers(server, monkeypatch):
    import httpx

    from tests.server.conftest import parse_sse

    real_run = server.core.runner.run
    monkeypatch.setattr(server.core.runner, "run", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))

    async def go(body):
        transport = httpx.ASGITransport(server.app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as c:
            return await c.post("/v1/completions", json=body)

    whole = run(go({"prompt": "x", "max_tokens": 4}))
    assert whole.status_code == 500 and whole.json()["error"]["type"] == "server_error"
    assert "boom" in whole.json()["error"]["message"]
    events = parse_sse(run(go({"prompt": "x", "max_tokens": 4, "stream": True})).text)
    assert events[-1] == "[DONE]" and "boom" in events[-2]["error"]["message"]
    monkeypatch.setattr(server.core.runner, "run", real_run)
    assert run(go({"prompt": "x", "max_tokens": 4})).status_code == 200
    assert server.core.num_free_blocks == server.core.block_manager.num_blocks
