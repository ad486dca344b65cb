"""Where a model's tensors live: each tensor-parallel rank's device, and a move that keeps a tied head tied."""

from __future__ import annotations

import pytest
import torch

from bytediet.kernels import backend
from bytediet.models.placement import move_model, one_copy_on_gpu_path, rank_device
from bytediet.models.quantize import quantize
from tests.conftest import model_from_state, random_state, tiny_config


def test_each_rank_gets_its_own_gpu_and_the_cpu_stays_the_cpu():
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cpu", 1) == "cpu"


def test_a_move_keeps_a_tied_head_on_the_embedding_table_and_drops_the_cpu_kernel_copies():
    config = tiny_config("llama", num_layers=1, tie_word_embeddings=True)
    model = model_from_state(config, random_state(config, seed=1))
    quantize(model, "int8")
    lin = model.model.layers[0].mlp.up_proj
    assert lin.native_weight() is not None  # the CPU kernels' copy exists before the move
    move_model(model, "meta")  # a device other than the CPU, without a GPU
    assert lin._native is None and lin._device_weight is None
    head, table = model.lm_head, model.model.embed_tokens.weight
    if head.format is not None and "weight" in head.packed:  # the tied head reads the moved table itself
        assert head.packed["weight"].data_ptr() == table.data_ptr()
    assert table.device == torch.device("meta")


@pytest.mark.parametrize("weights", ["int8", "int4-g32", "gguf-q4_0"])
def test_on_the_gpu_path_a_served_model_keeps_one_copy_of_each_layer(weights, monkeypatch):
    """The packed planes go where the Triton GEMM reads a repacked copy (int8, int4); GGML blocks are read in place
    and stay. The logits are the same, the format's bytes are still counted, and a move takes the copy along."""
    pytest.importorskip("triton", reason="the GPU path's kernels need triton (the test extra)")
    config = tiny_config("llama", num_layers=1)
    model = model_from_state(config, random_state(config, seed=4))
    quantize(model, weights)
    ids = torch.arange(1, 20) % config.vocab_size
    monkeypatch.setenv(backend.BACKEND_ENV, "triton")
    want, bytes_before = model.score(ids), model.weight_bytes()
    up = model.model.layers[0].mlp.up_proj
    planes = sum(t.numel() * t.element_size() for t in up.packed.values())
    freed = one_copy_on_gpu_path(model)
    if weights.startswith("gguf-"):  # read in place (its int8 lm_head still drops its planes)
        assert up.packed and not up.planes_dropped and freed == model.lm_head.dropped_plane_bytes
    else:
        assert freed >= planes > 0 and up.packed == {} and up.planes_dropped
    assert model.weight_bytes() == bytes_before
    torch.testing.assert_close(model.score(ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(up.dequantized_weight(), up.dequantized_weight())  # decodes the kept copy
    monkeypatch.delenv(backend.BACKEND_ENV)
    assert one_copy_on_gpu_path(model) == 0  # off the GPU path nothing more is dropped
    move_model(model, "meta")
    if up.planes_dropped:
        assert up._native[1].device == torch.device("meta")  # the only copy moved, not lost
