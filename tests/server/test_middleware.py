"""Request ids and the access log, the body limit, API keys, CORS, and a 500 that keeps the connection alive."""

from __future__ import annotations

import logging
import socket

import pytest

from bytediet.server.config import ServerConfig
from tests.server.conftest import client, live, run

BODY = {"prompt": "hi", "max_tokens": 2}


def raw_exchange(sock: socket.socket, request: bytes) -> bytes:
    """Send one HTTP/1.1 request on ``sock`` and read its whole (Content-Length framed) response."""
    sock.sendall(request)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def post(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_an_internal_error_is_a_500_and_the_keep_alive_connection_still_works(server, monkeypatch):
    monkeypatch.setattr(server.core.tokenizer, "encode", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    with live(server.app) as (host, port), socket.create_connection((host, port), timeout=20) as sock:
        first = raw_exchange(sock, post("/v1/completions", b'{"prompt": "hi", "max_tokens": 2}'))
        assert first.startswith(b"HTTP/1.1 500") and b"boom" in first and b"server_error" in first
        assert b"connection: close" not in first.lower()
        second = raw_exchange(sock, b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")  # same socket
        assert second.startswith(b"HTTP/1.1 200"), second


def test_request_id_is_echoed_or_generated_and_logged(server, caplog):
    async def go():
        async with client(server.app) as c:
            return (
                await c.post("/v1/completions", json=BODY, headers={"X-Request-Id": "abc-123"}),
                await c.get("/health"),
                await c.get("/health", headers={"X-Request-Id": "bad id\x7f"}),
            )

    with caplog.at_level(logging.INFO, logger="bytediet.server.access"):
        given, fresh, unsafe = run(go())
    assert given.headers["x-request-id"] == "abc-123"
    assert len(fresh.headers["x-request-id"]) == 32 and unsafe.headers["x-request-id"] != "bad id\x7f"
    lines = [r.getMessage() for r in caplog.records if r.name == "bytediet.server.access"]
    assert any('"POST /v1/completions" 200' in line and "request_id=abc-123" in line for line in lines), lines
    assert any(fresh.headers["x-request-id"] in line for line in lines)


def test_body_over_the_limit_is_a_413_before_parsing(make_server):
    s = make_server(ServerConfig(max_body_bytes=1000))
    big = b'{"prompt": "' + b"x" * 5000 + b'"}'

    async def chunks():
        for i in range(0, len(big), 512):
            yield big[i : i + 512]

    async def go():
        async with client(s.app) as c:
            by_length = await c.post("/v1/completions", content=big, headers={"content-type": "application/json"})
            chunked = await c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
            small = await c.post("/v1/completions", json=BODY)
            return by_length, chunked, small

    by_length, chunked, small = run(go())
    for r in (by_length, chunked):
        assert r.status_code == 413, r.text
        assert "--max-body-bytes" in r.json()["error"]["message"]
    assert small.status_code == 200


def test_the_default_body_limit_is_16_mib():
    assert ServerConfig().max_body_bytes == 16 * 2**20


def test_api_keys_guard_v1_but_not_health_or_metrics(make_server):
    s = make_server(ServerConfig(api_keys=("k1", "k2")))

    async def go():
        async with client(s.app) as c:
            out = {
                "none": await c.post("/v1/completions", json=BODY),
                "wrong": await c.get("/v1/models", headers={"Authorization": "Bearer nope"}),
                "tokenize": await c.post("/tokenize", json={"prompt": "a"}),
                "tokenizer_info": await c.get("/tokenizer_info"),
                "k1": await c.post("/v1/completions", json=BODY, headers={"Authorization": "Bearer k1"}),
                "k2": await c.get("/v1/models", headers={"Authorization": "bearer k2"}),
            }
            for path in ("/health", "/metrics", "/version"):
                out[path] = await c.get(path)
            return out

    out = run(go())
    for key in ("none", "wrong", "tokenize", "tokenizer_info"):
        assert out[key].status_code == 401, (key, out[key].text)
        error = out[key].json()["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    for key in ("k1", "k2", "/health", "/metrics", "/version"):
        assert out[key].status_code == 200, (key, out[key].text)


@pytest.mark.parametrize("origins,allowed", [((), False), (("http://ui.example",), True)])
def test_cors_is_off_unless_origins_are_given(make_server, origins, allowed):
    s = make_server(ServerConfig(allowed_origins=origins, api_keys=("k",)))

    async def go():
        async with client(s.app) as c:
            pre = await c.options(
                "/v1/chat/completions",
                headers={
                    "Origin": "http://ui.example",
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization,content-type",
                },
            )
            get = await c.get("/health", headers={"Origin": "http://ui.example"})
            return pre, get

    pre, get = run(go())
    assert ("access-control-allow-origin" in get.headers) is allowed
    assert (pre.headers.get("access-control-allow-origin") == "http://ui.example") is allowed
    if allowed:
        assert pre.status_code == 200  # the preflight carries no key and must still pass


def test_server_config_rejects_bad_values():
    from bytediet.errors import ConfigError

    for kw in ({"max_body_bytes": 0}, {"api_keys": ("",)}, {"shutdown_timeout": -1}, {"max_model_len": 1}):
        with pytest.raises(ConfigError):
            ServerConfig(**kw)
