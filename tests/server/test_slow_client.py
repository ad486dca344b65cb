"""A client that reads its stream slowly (or not at all for a while) does not slow the others.

When a client stops reading, its socket buffers fill and the ASGI server's ``send`` waits (uvicorn's flow control).
Only that response's coroutine waits: the engine keeps stepping, the other streams get a token every step, the
stalled request still runs to its end (its blocks freed), and its client gets every token once it reads again.
Progress is counted in engine steps, not seconds, so a loaded machine cannot make these tests flaky.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import socket
import struct
import termios
import threading
import time

import httpx
import uvicorn

from tests.server.conftest import parse_sse, run
from tests.server.test_completions import stream_text
from tests.server.test_disconnect import scope, settled

N_FAST, N_SLOW = 24, 160
FAST = [{"prompt": p, "stream": True, "max_tokens": N_FAST, "ignore_eos": True, "temperature": 0} for p in ("ab", "cd")]
SLOW = {"prompt": "slow", "stream": True, "max_tokens": N_SLOW, "ignore_eos": True, "temperature": 0}


class StepLog:
    """The engine's steps as the engine thread runs them: (step, request id, tokens, text) per output."""

    def __init__(self, core) -> None:
        self.rows: list[tuple[int, str, int, str]] = []
        self.count = 0
        step = core.step

        def logged():
            outputs = step()
            self.count += 1
            self.rows += [(self.count, o.request_id, len(o.new_token_ids), o.delta_text) for o in outputs]
            return outputs

        core.step = logged  # AsyncEngine calls self.engine.step(): the instance attribute wins

    def text(self, request_id: str) -> str:
        """All the text the engine produced for one request."""
        return "".join(text for _, rid, _, text in self.rows if rid == request_id)

    def requests(self, since: int = 0) -> dict[str, list[int]]:
        """Request id → the steps (after ``since``) that gave it tokens, one entry per token."""
        out: dict[str, list[int]] = {}
        for step, rid, n, _ in self.rows:
            if step > since:
                out.setdefault(rid, []).extend([step] * n)
        return out


def one_token_every_step(steps: list[int], n: int) -> bool:
    """``n`` tokens in ``n`` consecutive steps: the request was never skipped from its first token to its last."""
    return len(steps) == n and steps == list(range(steps[0], steps[0] + n))


async def stream(app, body: dict, gate: asyncio.Event | None = None, stalled: asyncio.Event | None = None):
    """One streaming request spoken in ASGI, as uvicorn does; with ``gate``, ``send`` of every body chunk after the
    first waits until the gate opens (sets ``stalled`` then): a client whose socket buffer is full."""
    chunks: list[bytes] = []
    request = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]
    stays = asyncio.Event()  # never set: the client does not leave

    async def receive():
        if request:
            return request.pop()
        await stays.wait()

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            if gate is not None and chunks:
                stalled.set()
                await gate.wait()
            chunks.append(message["body"])

    await app(scope("/v1/completions"), receive, send)
    return chunks


def test_a_stalled_stream_does_not_hold_back_the_others(make_server):
    server = make_server(num_blocks=256)
    core = server.core
    log = StepLog(core)

    async def go():
        alone = await asyncio.wait_for(asyncio.gather(*(stream(server.app, b) for b in FAST)), 30)
        baseline = log.requests()
        gate, stalled = asyncio.Event(), asyncio.Event()
        since = log.count
        slow = asyncio.create_task(stream(server.app, SLOW, gate, stalled))
        await asyncio.wait_for(stalled.wait(), 30)  # the slow client read its first chunk and no more
        beside = await asyncio.wait_for(asyncio.gather(*(stream(server.app, b) for b in FAST)), 30)
        assert not slow.done() and not gate.is_set()  # every other stream ended while the slow one stalled
        await settled(core)  # ... and the engine ran the slow request to its end meanwhile
        assert not core.has_unfinished_requests() and core.num_free_blocks == core.block_manager.num_blocks
        assert not slow.done()
        gate.set()
        return alone, baseline, beside, log.requests(since), await asyncio.wait_for(slow, 30)

    alone, baseline, beside, steps, slow_chunks = run(go())
    ids = {}
    for label, streams in (("alone", alone), ("beside", beside), ("slow", [slow_chunks])):
        for chunks in streams:  # every stream complete: all the text the engine made for it, then [DONE]
            events = parse_sse(b"".join(chunks).decode())
            rid = f"{events[0]['id']}-0"  # the engine's id of the response's one choice
            assert events[-1] == "[DONE]" and stream_text(events)[0] == log.text(rid)
            ids.setdefault(label, []).append(rid)
    assert sorted(baseline) == sorted(ids["alone"])
    assert all(one_token_every_step(baseline[rid], N_FAST) for rid in ids["alone"])
    assert sorted(steps) == sorted(ids["beside"] + ids["slow"])
    fast = [steps[rid] for rid in ids["beside"]]
    assert all(one_token_every_step(s, N_FAST) for s in fast), "a fast stream skipped a step beside the stalled one"
    slow = steps[ids["slow"][0]]
    assert one_token_every_step(slow, N_SLOW)  # the engine never waited on the stalled client
    assert slow[0] < min(s[0] for s in fast) and slow[-1] > max(s[-1] for s in fast)  # it ran beside them


def test_a_client_that_stops_reading_its_socket_does_not_slow_the_others(make_server):
    """Over a real uvicorn socket with small buffers (the listening socket's, inherited by its connections): the slow
    client sends its request and reads nothing until the others are done, then reads every event."""
    server = make_server(num_blocks=256, context=2048, block_size=16)
    core = server.core
    log = StepLog(core)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app, log_level="warning"))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    body = json.dumps({**SLOW, "max_tokens": 1200, "logprobs": 5}).encode()  # ~0.5 MB of events
    slow = socket.socket()
    try:
        deadline = time.monotonic() + 20
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert uv.started, "uvicorn did not start"
        slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        slow.connect(("127.0.0.1", port))
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        while not log.rows:  # the slow request is running
            time.sleep(0.01)
        since = log.count
        fast_ids = []
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            for b in FAST:
                events = parse_sse(c.post("/v1/completions", json=b).text)
                fast_ids.append(f"{events[0]['id']}-0")  # the engine's id of the response's one choice
                assert events[-1] == "[DONE]" and stream_text(events)[0] == log.text(fast_ids[-1])
        deadline = time.monotonic() + 60
        while core.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not core.has_unfinished_requests()  # the engine ran the unread request to its end
        assert core.num_free_blocks == core.block_manager.num_blocks
        steps = log.requests(since)
        assert all(one_token_every_step(steps[rid], N_FAST) for rid in fast_ids), "a fast stream skipped a step"
        (slow_id,) = set(steps) - set(fast_ids)
        slow_steps = steps[slow_id]  # a token every step, and still running when the others were done
        assert one_token_every_step(slow_steps, len(slow_steps)) and slow_steps[-1] > steps[fast_ids[-1]][-1]
        queued = struct.unpack("i", fcntl.ioctl(slow.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
        data = b""
        slow.settimeout(30)
        while chunk := slow.recv(1 << 16):
            data += chunk
    finally:
        slow.close()
        uv.should_exit = True
        thread.join(timeout=10)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert queued < len(rest) // 4  # most of the stream was held at the server while the client did not read
    events = [e.strip() for e in rest.split(b"\r\n") if e.startswith(b"data: ")]  # one HTTP chunk per event
    assert events[-1] == b"data: [DONE]"
    lps = [json.loads(e[6:])["choices"][0]["logprobs"] for e in events[:-1]]
    assert sum(len(lp["tokens"]) for lp in lps if lp) == 1200  # every token reached the client
