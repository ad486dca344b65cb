"""A tiny random model behind the app, with a character-level stand-in tokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from types import SimpleNamespace

import httpx
import pytest

from bytediet.engine.async_engine import AsyncEngine
from bytediet.engine.llm import LLM
from bytediet.server.app import build_app
from tests.conftest import model_from_state, random_state, tiny_config

MODEL = "tiny"


class CharTokenizer:
    """One token per printable ASCII character, for the 96-token tiny model: 0 = BOS, 1 = EOS, ' '..'}' → 2..95."""

    bos_token_id, eos_token_id = 0, 1
    eos_token_ids = frozenset({1})
    FIRST = 32

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [
            2 + (ord(c) - self.FIRST if self.FIRST <= ord(c) < self.FIRST + 94 else ord("?") - self.FIRST) for c in text
        ]
        return ([self.bos_token_id] if add_special_tokens else []) + ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        special = {0: "<s>", 1: "</s>"}
        return "".join(
            ("" if skip_special_tokens else special[i]) if i in special else chr(i - 2 + self.FIRST) for i in ids
        )

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        text = "".join(f"[{m['role']}]{m['content']}" for m in messages)
        return text + ("[assistant]" if add_generation_prompt else "")


def tiny_llm(context: int = 256, **kw) -> LLM:
    config = tiny_config("llama", max_position_embeddings=context)
    model = model_from_state(config, random_state(config, seed=7))
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLM(loaded=(model, CharTokenizer()), **kw)


def tiny_engine(**kw):
    """``tiny_llm(**kw)``'s engine: the factory an ``EngineProcess`` runs in its own process."""
    return tiny_llm(**kw).engine


@pytest.fixture
def server():
    """``server.app`` (the ASGI app), ``server.engine`` (its AsyncEngine), ``server.llm`` (the offline twin)."""
    llm = tiny_llm()
    engine = AsyncEngine(llm.engine)
    yield SimpleNamespace(app=build_app(engine, [MODEL, "tiny-alias"]), engine=engine, llm=llm, core=llm.engine)
    engine.shutdown()


@pytest.fixture
def make_server():
    """``make_server(config=ServerConfig(...), tokenizer=..., **llm_kwargs)`` → a server like the fixture above."""
    engines = []

    def make(config=None, tokenizer=None, **kw):
        llm = tiny_llm(**kw)
        if tokenizer is not None:
            llm.engine.tokenizer = llm.tokenizer = tokenizer
        engine = AsyncEngine(llm.engine)
        engines.append(engine)
        return SimpleNamespace(
            app=build_app(engine, [MODEL, "tiny-alias"], config=config), engine=engine, llm=llm, core=llm.engine
        )

    yield make
    for engine in engines:
        engine.shutdown()


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=60))


def parse_sse(raw: str) -> list:
    """Split an SSE body into its payloads (dicts, or the string '[DONE]'), checking the framing."""
    assert raw.endswith("\n\n"), "every event ends with a blank line"
    events = raw[:-2].split("\n\n")
    out = []
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, f"bad SSE event {event!r}"
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


@contextlib.contextmanager
def live(app):
    """``app`` behind a real uvicorn socket on a free loopback port (a thread); yields (host, port)."""
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not uv.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert uv.started, "uvicorn did not start"
        yield "127.0.0.1", port
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
