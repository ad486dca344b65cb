"""Tensor parallelism on the GPU path: rank r on GPU r with NCCL on CUDA; without a GPU, the same ranks with the
Triton kernels in the interpreter (``BYTEDIET_BACKEND=triton``, gloo) give the CPU engine's greedy tokens."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.kernels import backend
from tests.distributed.conftest import run_batch

pytest.importorskip("triton", reason="the GPU path's kernels need triton (the test extra)")

PROMPTS = [[(5 * i + j) % 90 + 1 for j in range(3 + (i * 4) % 9)] for i in range(3)]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True) for _ in PROMPTS]
ENGINE = dict(num_blocks=12, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)


def _kernels(model) -> tuple[str, str]:
    """(the rank's device, the kernel its first MLP projection ran on the GPU path), as collective_rpc answers."""
    lin = model.model.layers[0].mlp.up_proj
    return str(model.device), lin._device_weight[0].kernel if lin._device_weight else "never ran"


def test_tp2_on_the_triton_path_equals_the_cpu_engine(blocky_checkpoint, monkeypatch):
    path = str(blocky_checkpoint[0])  # every rank's int8 rows whole blocks of 32
    want, _ = run_batch(LLM(path, weights="int8", kv_cache_dtype="int8", device="cpu", **ENGINE), PROMPTS, PARAMS)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")  # the spawned worker inherits it
    llm = LLM(path, weights="int8", kv_cache_dtype="int8", tensor_parallel_size=2, device="cpu", **ENGINE)
    try:
        assert llm.engine.runner.decode_path == "triton, tensor parallel over 2 ranks, eager"
        got, _ = run_batch(llm, PROMPTS, PARAMS)
        ranks = llm.collective_rpc(_kernels)
    finally:
        llm.shutdown()
    assert got == want
    assert [kernel.startswith("triton gemm_blocks") for _, kernel in ranks] == [True, True]


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="tensor parallelism on CUDA needs two GPUs (the triton-path test above runs the same code on the CPU)",
)
def test_tp2_on_cuda_puts_rank_r_on_gpu_r_and_equals_one_gpu(blocky_checkpoint):
    path = str(blocky_checkpoint[0])
    one = LLM(path, weights="int8", device="cuda", enforce_eager=True, **ENGINE)
    want, _ = run_batch(one, PROMPTS, PARAMS)
    llm = LLM(path, weights="int8", tensor_parallel_size=2, device="cuda", gpu_memory_utilization=0.5)
    try:
        got, _ = run_batch(llm, PROMPTS, PARAMS)
        assert [d for d, _ in llm.collective_rpc(_kernels)] == ["cuda:0", "cuda:1"]
    finally:
        llm.shutdown()
    assert got == want
