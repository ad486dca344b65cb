"""The server with KV tiers: usage says which tier served the prompt, /metrics counts hits, misses, bytes, latency."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from bytediet.engine.async_engine import AsyncEngine
from bytediet.server.app import build_app
from tests.server.conftest import client, run, tiny_llm
from tests.server.test_metrics import scrape

PROMPT = "The system prompt that every request shares, long enough for ten blocks."
OTHERS = [f"{c} unrelated text that pushes the shared prompt out of the small pool {c}" for c in "abcd"]


@pytest.fixture
def tiered():
    llm = tiny_llm(num_blocks=24, kv_offload_size="1MiB")
    engine = AsyncEngine(llm.engine)
    yield SimpleNamespace(app=build_app(engine, ["tiny"]), engine=engine, llm=llm)
    engine.shutdown()


def complete(app, prompt: str) -> dict:
    async def go():
        async with client(app) as c:
            r = await c.post(
                "/v1/completions", json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            )
            return r.json()

    return run(go())


def test_usage_and_metrics_report_the_ram_tier(tiered):
    cold = complete(tiered.app, PROMPT)
    assert cold["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "cached_tokens_by_tier": {"pool": 0}}
    for other in OTHERS:
        complete(tiered.app, other)
    hit = complete(tiered.app, PROMPT)
    details = hit["usage"]["prompt_tokens_details"]
    assert details["cached_tokens_by_tier"].get("ram", 0) > 0
    assert details["cached_tokens"] == sum(details["cached_tokens_by_tier"].values())
    assert hit["choices"][0]["text"] == cold["choices"][0]["text"]
    m = scrape(tiered.app)
    assert m[("bytediet:kv_offload_hit_tokens_total", (("tier", "ram"),))] == details["cached_tokens_by_tier"]["ram"]
    assert m[("bytediet:kv_offload_bytes", (("tier", "ram"),))] > 0
    assert m[("bytediet:kv_offload_load_seconds_count", (("tier", "ram"),))] == 1
    assert m[("bytediet:kv_offload_load_seconds_sum", (("tier", "ram"),))] > 0
    assert m[("bytediet:kv_offload_miss_tokens_total", ())] > 0


def test_without_tiers_usage_has_no_details(server):
    assert "prompt_tokens_details" not in complete(server.app, PROMPT)["usage"]
