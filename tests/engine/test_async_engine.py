"""AsyncEngine: concurrent async streams, disconnects free blocks, bad input fails before queueing."""

from __future__ import annotations

import asyncio

import pytest

from bytediet.engine.async_engine import AsyncEngine
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from tests.engine.test_engine import make_llm


@pytest.fixture
def async_engine(tiny_model):
    llm = make_llm(tiny_model)
    engine = AsyncEngine(llm.engine)
    yield engine, llm
    engine.shutdown()


def test_concurrent_streams_equal_offline_generation(async_engine, tiny_model):
    engine, llm = async_engine
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    expected = [o.outputs[0].token_ids for o in make_llm(tiny_model).generate(prompts, params)]

    async def collect(p):
        ids = []
        async for out in engine.generate(p, params):
            ids += out.new_token_ids
        return ids

    async def main():
        return await asyncio.gather(*(collect(p) for p in prompts))

    assert asyncio.run(main()) == expected
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_client_disconnect_aborts_and_frees_blocks(async_engine):
    engine, llm = async_engine

    async def main():
        stream = engine.generate([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        async for _ in stream:
            break  # the client goes away after the first token
        await stream.aclose()
        for _ in range(100):
            if not llm.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.05)

    asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_bad_request_raises_before_queueing(async_engine):
    engine, llm = async_engine

    async def main():
        async for _ in engine.generate([], SamplingParams()):
            pass

    with pytest.raises(ConfigError, match="prompt"):
        asyncio.run(main())
    assert not llm.engine.has_unfinished_requests()
