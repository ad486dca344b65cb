"""Graceful shutdown: new requests get 503, running ones finish or, after the timeout, end with an error event.

The drain sequence runs in-process on the tiny model; one real ``bytediet serve`` process checks the
signal handling (SIGTERM, then a second signal) end to end: exit status 0 and no traceback.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

from tests.server.conftest import client, parse_sse, run
from tests.server.test_disconnect import free_port

LONG = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}


def test_drain_finishes_short_requests_and_aborts_long_ones_with_an_error_event(server, monkeypatch):
    state, core = server.app.state.server, server.core
    real_run = core.runner.run

    def slow_run(*args, **kwargs):  # >= 20 ms a step: 200 tokens cannot finish within the 2 s timeout
        time.sleep(0.02)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(core.runner, "run", slow_run)

    async def go():
        async with client(server.app) as c:
            streamed = asyncio.create_task(c.post("/v1/completions", json={**LONG, "stream": True}))
            whole = asyncio.create_task(
                c.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 200, "ignore_eos": True},
                )
            )
            short = asyncio.create_task(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}))
            while core.stats.generated_tokens < 4 or state.drain.num_active < 3:
                await asyncio.sleep(0.01)
            t0 = time.monotonic()
            drain = asyncio.create_task(state.drain.drain(timeout=2.0))
            await asyncio.sleep(0.05)
            refused = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            health = await c.get("/health")
            await drain
            return await streamed, await whole, await short, refused, health, time.monotonic() - t0

    streamed, whole, short, refused, health, took = run(go())
    assert took < 2.0 + 2.5
    events = parse_sse(streamed.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutting_down", events[-3:]
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "shutting_down"
    assert short.status_code == 200 and short.json()["choices"][0]["finish_reason"] == "length"
    for r in (refused, health):
        assert r.status_code == 503 and r.headers["retry-after"] and r.headers["connection"] == "close"
    deadline = time.monotonic() + 5
    while core.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert core.num_free_blocks == core.block_manager.num_blocks


def test_drain_with_nothing_running_returns_at_once(server):
    t0 = time.monotonic()
    run(server.app.state.server.drain.drain(timeout=30))
    assert time.monotonic() - t0 < 1


def _stream(base: str, body: dict, out: dict, key: str) -> None:
    try:
        with httpx.Client(base_url=base, timeout=120) as c, c.stream("POST", "/v1/completions", json=body) as r:
            out[key + "_status"] = r.status_code
            out[key] = ""
            for line in r.iter_lines():
                out[key] += line + "\n\n" if line else ""
    except httpx.HTTPError as exc:
        out[key + "_error"] = repr(exc)


@pytest.mark.parametrize("mode", ["--engine-process", "--no-engine-process"])
def test_sigterm_then_sigint_exits_0_without_traceback(mode):
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bytediet.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "info",
            "--kv-cache-memory",
            "64MiB",
            "--shutdown-timeout",
            "60",
            mode,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base, out = f"http://127.0.0.1:{port}", {}
    try:
        _wait_healthy(proc, base, log)
        long = threading.Thread(target=_stream, args=(base, {**LONG, "max_tokens": 1400, "stream": True}, out, "long"))
        long.start()
        deadline = time.monotonic() + 60
        while not out.get("long") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert out.get("long_status") == 200, out
        short = threading.Thread(
            target=_stream,
            args=(base, {"prompt": "Hi", "max_tokens": 30, "stream": True, "ignore_eos": True}, out, "short"),
        )
        short.start()
        while not out.get("short") and short.is_alive():  # it runs before the signal
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        refused = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
        short.join(timeout=60)
        assert proc.poll() is None, "the server must keep running while a request is in flight"
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)  # the second signal: abort what still runs
        rc = proc.wait(timeout=20)
        exited_after = time.monotonic() - t0
        long.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    text = _read(log)
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    short_events = parse_sse(out["short"])
    assert short_events[-1] == "[DONE]" and short_events[-2]["choices"][0]["finish_reason"] == "length", short_events
    long_events = parse_sse(out["long"])
    assert long_events[-1] == "[DONE]" and long_events[-2]["error"]["code"] == "shutting_down", long_events[-3:]
    assert rc == 0 and exited_after < 10, text
    assert "Traceback" not in text, text
    assert "KV blocks in use: 0" in text, text


def _wait_healthy(proc, base, log) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"bytediet serve exited early: {_read(log)}"
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    pytest.fail(f"bytediet serve did not come up within 120 s: {_read(log)}")


def _read(log) -> str:
    log.seek(0)
    return log.read().decode(errors="replace")[-6000:]
