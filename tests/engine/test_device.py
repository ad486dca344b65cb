"""The GPU code path without a GPU: ``BYTEDIET_BACKEND=triton`` runs tiny random models through the same engine with
the Triton kernels in the interpreter, token for token as the CPU path; ``--device cuda`` without a GPU is a
one-line error; a layer with no GPU kernel is refused at start."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest
import torch

from bytediet.engine.device import check_kernels, resolve_device
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from bytediet.kernels import backend
from bytediet.models.quantize import quantize
from tests.conftest import model_from_state, random_state, tiny_config

pytest.importorskip("triton", reason="the Triton backend's tests need triton (the test extra)")

PROMPTS = [[1, 5, 9, 13, 17, 21], [2, 4, 6]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _tiny(arch: str, weights: str | None = None):
    config = tiny_config(arch, num_layers=2) if arch != "gemma3" else tiny_config(arch)
    model = model_from_state(config, random_state(config, seed=3))
    if weights:
        quantize(model, weights)
    return model


def _greedy(model, **kw):
    """(greedy tokens of PROMPTS, the first prompt's logits at every position, the runner)."""
    llm = LLM("tiny", loaded=(model, None), num_blocks=8, block_size=16, device="cpu", **kw)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)], llm.score(PROMPTS[0]), llm.engine.runner


@pytest.mark.parametrize("arch,weights", [("llama", None), ("qwen2", "int8"), ("gemma3", None), ("llama", "int4-g32")])
def test_triton_backend_greedy_tokens_equal_the_cpu_path(arch, weights, monkeypatch):
    model = _tiny(arch, weights)
    cpu_tokens, cpu_logits, cpu_runner = _greedy(copy.deepcopy(model))
    assert cpu_runner.describe()["backend"] == "native"
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    tokens, logits, runner = _greedy(model)
    described = runner.describe()
    assert described["backend"] == "triton" and runner.decoder is None and runner.decode_path == "triton"
    assert described["attention"].startswith("triton paged attention")
    if weights:  # the quantized linears ran the Triton GEMM over their block layout
        assert any(k.startswith("triton gemm_blocks") for k in described["linear"].values())
    assert tokens == cpu_tokens
    torch.testing.assert_close(logits, cpu_logits, atol=2e-3, rtol=2e-3)
    assert len(set(tokens[0] + tokens[1])) > 1 or (cpu_logits.std(-1) > 0.1).all()  # a model that says something


def test_triton_selected_follows_the_device_and_the_switch(monkeypatch):
    monkeypatch.delenv(backend.BACKEND_ENV, raising=False)
    assert not backend.triton_selected(torch.zeros(1)) and backend.name_for("cpu") == "native"
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    assert backend.triton_selected(torch.zeros(1)) and backend.name_for("cpu") == "triton"
    monkeypatch.setenv(backend.BACKEND_ENV, "cuda-please")
    with pytest.raises(ConfigError, match="BYTEDIET_BACKEND"):
        backend.triton_selected(torch.zeros(1))


def test_a_kv_codec_without_a_gpu_kernel_is_refused_at_start(monkeypatch):
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(ConfigError, match="no GPU attention kernel"):
        LLM("tiny", loaded=(_tiny("llama"), None), num_blocks=4, block_size=32, kv_cache_dtype="kivi2", device="cpu")


def test_a_weight_format_without_a_gpu_kernel_is_refused(monkeypatch):
    model = _tiny("llama", "int8")
    lin = model.model.layers[0].mlp.up_proj
    monkeypatch.setattr(lin.format, "native_layout", lambda packed: (12345, packed["qweight"]))  # no kernel reads it
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(ConfigError, match="no GPU kernel"):
        check_kernels(model, [])


def test_a_format_that_rounds_its_activations_is_refused_not_run_at_float_activations(monkeypatch):
    model = _tiny("llama", "int8-w8a8")
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(ConfigError, match=r"int8-w8a8 \(model\.layers\.0\..*rounds its activations"):
        check_kernels(model, [])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_a_one_line_error():
    with pytest.raises(ConfigError, match="--device cuda"):
        resolve_device("cuda")
    assert resolve_device("auto") == "cpu"
    r = subprocess.run(
        [sys.executable, "-m", "bytediet.cli", "generate", "--device", "cuda", "--prompt", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "--device cuda" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_an_unknown_device_is_refused():
    with pytest.raises(ConfigError, match="device must be one of"):
        resolve_device("tpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bench/device_check.py checks the GPU)")
def test_cuda_greedy_tokens_equal_the_cpu_path():
    model = _tiny("llama", "int8")
    cpu_tokens, _, _ = _greedy(copy.deepcopy(model))
    llm = LLM("tiny", loaded=(model, None), num_blocks=8, block_size=16, device="cuda")
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == cpu_tokens


@pytest.mark.parametrize("kv", ["int8", "rot-q8_0", "k=q8_0,v=q4_0", "turboquant"])
def test_triton_backend_reads_quantized_kv_pages_as_the_cpu_path(kv, monkeypatch):
    config = tiny_config("llama", head_dim=32)  # whole llama.cpp blocks of 32 values a head
    model = model_from_state(config, random_state(config, seed=3))
    cpu_tokens, cpu_logits, _ = _greedy(copy.deepcopy(model), kv_cache_dtype=kv)
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    tokens, logits, runner = _greedy(model, kv_cache_dtype=kv)
    assert runner.describe()["attention"].startswith("triton paged attention")
    assert tokens == cpu_tokens
    torch.testing.assert_close(logits, cpu_logits, atol=2e-2, rtol=2e-2)


def test_a_row_cut_mid_block_is_refused_at_start_on_the_gpu_path(monkeypatch):
    """int8 rows are blocks of 32 weights: a layer of K = 48 has no GPU kernel, said at start, not mid-step."""
    config = tiny_config("llama", num_layers=1, hidden_size=48, num_heads=6)
    model = model_from_state(config, random_state(config, seed=2))
    quantize(model, "int8")
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    with pytest.raises(ConfigError, match=r"weight format int8 \(model\.layers\.0\..*whole blocks.*--device cpu"):
        check_kernels(model, [])


def test_the_kv_budget_over_tensor_parallel_ranks_is_the_least_room(monkeypatch):
    """Every rank allocates rank 0's block count: the GPU with the least free memory decides; none left: one line."""
    from bytediet.engine.device import kv_budget_from_free_memory, kv_bytes_free

    model = _tiny("llama")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (6 << 30, 8 << 30))  # 2 GiB in use of 8
    assert kv_bytes_free(model, 0.5, 1 << 30) == (4 << 30) - (2 << 30) - (1 << 30)
    assert kv_budget_from_free_memory(model, 0.5, 0, per_rank=[3 << 30, 1 << 30]) == 1 << 30
    with pytest.raises(ConfigError, match=r"out of GPU memory at start.*larger --tensor-parallel-size") as e:
        kv_budget_from_free_memory(model, 0.5, 0, per_rank=[3 << 30, -5])
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="--gpu-memory-utilization must be in"):
        kv_budget_from_free_memory(model, 1.5, 0)
