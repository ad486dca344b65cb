"""Admission: tokenizing off the event loop, the cap on prompts per request, the bounded waiting queue."""

from __future__ import annotations

import asyncio
import time

from bytediet.server.config import ServerConfig
from tests.server.conftest import CharTokenizer, client, run


class SlowTokenizer(CharTokenizer):
    """Takes a second per call, as a multi-megabyte prompt does with a real tokenizer."""

    def encode(self, text, add_special_tokens=True):
        time.sleep(1.0)
        return super().encode(text, add_special_tokens)


def test_tokenizing_does_not_block_other_requests(make_server):
    s = make_server(tokenizer=SlowTokenizer())

    async def go():
        async with client(s.app) as c:

            async def health():
                t0 = time.perf_counter()
                await asyncio.sleep(0.2)  # the slow requests are being tokenized by now
                r = await c.get("/health")
                return r, time.perf_counter() - t0 - 0.2  # a blocked event loop delays the sleep's end too

            async def after_health_started(path, body):
                await asyncio.sleep(0.05)
                return await c.post(path, json=body)

            ok_waited, slow, chat = await asyncio.gather(
                health(),
                after_health_started("/v1/completions", {"prompt": "x", "max_tokens": 1}),
                after_health_started(
                    "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
                ),
            )
            return (slow, chat, *ok_waited)

    slow, chat, ok, waited = run(go())
    assert slow.status_code == 200 and chat.status_code == 200 and ok.status_code == 200
    assert waited < 0.5, f"/health waited {waited:.2f} s behind a tokenizing request"


def test_too_many_prompts_in_one_request_is_a_400(make_server):
    s = make_server(ServerConfig(max_prompts_per_request=4))

    async def go():
        async with client(s.app) as c:
            return (
                await c.post("/v1/completions", json={"prompt": ["a"] * 5, "max_tokens": 1}),
                await c.post("/v1/completions", json={"prompt": [[5, 6]] * 5, "max_tokens": 1}),
                await c.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 1}),
            )

    texts, ids, ok = run(go())
    for r in (texts, ids):
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "limit of 4" in r.text
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


def test_a_full_waiting_queue_is_a_503_with_retry_after(make_server):
    s = make_server(ServerConfig(max_waiting_sequences=2), max_num_seqs=1)
    long = {"prompt": "x", "max_tokens": 60, "ignore_eos": True, "n": 2}

    async def go():
        async with client(s.app) as c:
            too_many = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 3})
            first = asyncio.create_task(c.post("/v1/completions", json=long))  # one sequence runs, one waits
            while s.engine.num_running < 1:
                await asyncio.sleep(0.01)
            busy = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2})
            fits = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 1})
            assert (await first).status_code == 200
            return too_many, busy, fits

    too_many, busy, fits = run(go())
    for r in (too_many, busy):
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        assert r.json()["error"]["code"] == "server_busy"
    assert fits.status_code == 200
