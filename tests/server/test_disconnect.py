"""A client that goes away aborts its engine requests, and their KV blocks are freed at once.

httpx's ASGITransport buffers whole responses, so these tests speak ASGI directly (as uvicorn does:
spec 2.3, ``http.disconnect`` from ``receive``) and, once, through a real uvicorn socket.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import uvicorn

from tests.server.conftest import run

LONG = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}


def scope(path: str) -> dict:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 40000),
        "server": ("test", 80),
    }


async def call_and_leave(app, path: str, body: dict, leave) -> list[bytes]:
    """Run one request; ``leave(chunks)`` says when the client disconnects (checked on every send)."""
    gone = asyncio.Event()
    chunks: list[bytes] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if request:
            return request.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
        if leave(chunks):
            gone.set()

    async def watch_engine():  # a non-streaming client leaves once its request is running
        while not gone.is_set():
            if leave(None):
                gone.set()
            await asyncio.sleep(0.01)

    watcher = asyncio.create_task(watch_engine())
    try:
        await asyncio.wait_for(app(scope(path), receive, send), timeout=30)
    finally:
        watcher.cancel()
    return chunks


async def settled(core, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


def assert_aborted_and_freed(server) -> None:
    core = server.core
    assert not core.has_unfinished_requests()
    assert core.num_free_blocks == core.block_manager.num_blocks
    assert core.stats.generated_tokens < 200, "the request ran to the end instead of being aborted"
    registry = server.app.state.server.metrics.registry
    aborted = registry.get_sample_value(
        "bytediet:request_success_total", {"model_name": "tiny", "finished_reason": "abort"}
    )
    assert aborted is not None and aborted >= 1


def test_stream_disconnect_after_one_chunk_aborts_and_frees_blocks(server):
    async def go():
        chunks = await call_and_leave(
            server.app,
            "/v1/completions",
            {"prompt": "bye", "stream": True, **LONG},
            lambda chunks: chunks is not None and len(chunks) >= 1,
        )
        await settled(server.core)
        return chunks

    chunks = run(go())
    assert chunks[0].startswith(b"data: {")
    assert_aborted_and_freed(server)


def test_chat_stream_disconnect_aborts_every_choice(server):
    body = {"messages": [{"role": "user", "content": "bye"}], "stream": True, "n": 3, **LONG}

    async def go():
        await call_and_leave(
            server.app, "/v1/chat/completions", body, lambda chunks: chunks is not None and len(chunks) >= 4
        )  # 3 role chunks + 1
        await settled(server.core)

    run(go())
    assert_aborted_and_freed(server)


def test_non_streaming_disconnect_aborts_and_frees_blocks(server):
    core = server.core

    async def go():
        chunks = await call_and_leave(
            server.app,
            "/v1/completions",
            {"prompt": "bye", **LONG},
            lambda chunks: chunks is None and core.stats.generated_tokens > 0,
        )
        await settled(core)
        return chunks

    run(go())
    assert_aborted_and_freed(server)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_socket_disconnect_frees_blocks(server):
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(server.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert uv.started, "uvicorn did not start"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": "bye", "stream": True, **LONG}) as r:
                assert r.status_code == 200
                first = next(r.iter_lines())
                assert first.startswith("data: {")
            # leaving the block closes the connection mid-stream
        deadline = time.monotonic() + 10
        while server.core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert_aborted_and_freed(server)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
