"""The engine at tensor-parallel size 2: one spawned worker process (gloo), against the same engine at size 1."""

from __future__ import annotations

import asyncio
import operator
import os
import signal
import threading
import time

import httpx
import pytest
import torch

from bytediet.distributed.launch import TensorParallelError
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from tests.distributed.conftest import run_batch

PROMPTS = [[(7 * i + j) % 90 + 1 for j in range(3 + (i * 5) % 17)] for i in range(8)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6 + (i % 3) * 4, ignore_eos=True) for i in range(8)]
# 20 blocks × 4 tokens cannot hold all eight sequences: preemption; a budget of 16 tokens: chunked prefill
ENGINE = dict(num_blocks=20, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)


@pytest.mark.parametrize("arch, weights, kv", [("llama", "fp32", "auto"), ("gemma3", "int8", "int8")])
def test_tp2_engine_equals_tp1_with_preemption(tiny_checkpoints, arch, weights, kv):
    path = str(tiny_checkpoints[arch][0])
    want, _ = run_batch(LLM(path, weights=weights, kv_cache_dtype=kv, **ENGINE), PROMPTS, PARAMS)
    llm = LLM(path, weights=weights, kv_cache_dtype=kv, tensor_parallel_size=2, **ENGINE)
    try:
        assert llm.engine.runner.decode_path.startswith("modules (tensor parallel")
        got, preemptions = run_batch(llm, PROMPTS, PARAMS)
    finally:
        llm.shutdown()
    assert preemptions > 0, "the test is meant to exercise preemption"
    assert got == want
    assert not any(p.is_alive() for p in llm.workers.procs)


def test_a_killed_worker_fails_the_engine_within_30_s_naming_the_rank(tiny_checkpoints):
    llm = LLM(str(tiny_checkpoints["llama"][0]), weights="fp32", tensor_parallel_size=2, kv_cache_memory="4MiB")
    try:
        engine = llm.engine
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=240, ignore_eos=True))
        for _ in range(3):
            engine.step()
        worker = llm.workers.procs[0]
        threading.Timer(0.2, os.kill, (worker.pid, signal.SIGKILL)).start()  # while the engine is stepping
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - t0 < 30
        with pytest.raises(TensorParallelError, match="rank 1"):  # the engine stays failed, it does not hang
            engine.step()
        assert health(engine) == (503, llm.engine.failure) and "rank 1" in llm.engine.failure
    finally:
        llm.shutdown()


def health(engine) -> tuple[int, str]:
    """The server's ``GET /health`` over ``engine``: (status, error message or "ok")."""
    from bytediet.engine.async_engine import AsyncEngine
    from bytediet.server.app import build_app

    served = AsyncEngine(engine)

    async def get():
        transport = httpx.ASGITransport(build_app(served, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get("/health")

    try:
        r = asyncio.run(get())
    finally:
        served.shutdown()
    body = r.json()
    return r.status_code, body.get("error", {}).get("message", body.get("status"))


@pytest.mark.slow  # a spawn and a deliberate timeout; the killed-worker test above covers the same failure path
def test_a_hung_worker_fails_the_engine_after_the_collective_timeout(tiny_checkpoints):
    from bytediet.distributed.launch import launch
    from bytediet.engine.config import EngineConfig
    from bytediet.engine.engine import LLMEngine
    from bytediet.kvcache.config import CacheConfig

    workers, model, tokenizer = launch(2, dict(spec=str(tiny_checkpoints["llama"][0]), weights="fp32"), timeout_s=3)
    try:
        engine = LLMEngine(model, tokenizer, EngineConfig(cache=CacheConfig(num_blocks=32)), workers=workers)
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        engine.step()
        os.kill(workers.procs[0].pid, signal.SIGSTOP)  # alive but silent
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=r"rank\(s\) 1 did not answer"):
            engine.step()
        assert time.monotonic() - t0 < 3 + 10
    finally:
        os.kill(workers.procs[0].pid, signal.SIGCONT)
        workers.shutdown()


def test_score_collective_rpc_and_a_rebuilt_engine_at_tp2_equal_tp1(tiny_checkpoints):
    """LLM.score runs the forward pass on both ranks (logits of size 1); collective_rpc answers from each rank;
    rebuild_engine re-sizes the pool and the scheduler on the same ranks (the workers reallocate their pages)."""
    path, ids = str(tiny_checkpoints["llama"][0]), PROMPTS[3]
    one = LLM(path, weights="fp32", **ENGINE)
    llm = LLM(path, weights="fp32", tensor_parallel_size=2, **ENGINE)
    try:
        for kv in (None, "int8"):
            torch.testing.assert_close(llm.score(ids, kv_codec=kv), one.score(ids, kv_codec=kv), rtol=1e-5, atol=1e-5)
        assert llm.collective_rpc(operator.attrgetter("tensor_parallel")) == [(0, 2), (1, 2)]
        assert one.collective_rpc(operator.attrgetter("tensor_parallel")) == [None]
        settings = dict(kv_cache_dtype="int8", kv_cache_memory="1MiB", max_num_seqs=2)
        for engine in (one, llm):
            engine.rebuild_engine(**settings)
        assert llm.engine.scheduler.config.max_num_seqs == 2 and llm.config.cache.num_blocks is None
        assert llm.engine.block_manager.num_blocks > ENGINE["num_blocks"]
        want, _ = run_batch(one, PROMPTS, PARAMS)
        got, _ = run_batch(llm, PROMPTS, PARAMS)
        assert got == want
        with pytest.raises(ConfigError, match="unknown setting"):
            llm.rebuild_engine(max_seqs=3)
    finally:
        llm.shutdown()
    assert not any(p.is_alive() for p in llm.workers.procs)
