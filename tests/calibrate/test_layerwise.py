"""Calibration of a packed checkpoint, one block's float weights at a time, equals today's on its fp32 load."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch

from bytediet.calibrate import calibrate_and_quantize
from bytediet.calibrate.base import BlockRunner
from bytediet.models.quantize import QuantizeConfig
from bytediet.models.share import float_layers_as_loaded, shared_copy
from tests.models.test_share import assert_same_weights, loads, packed_state, tiny_gguf

CASES = [
    ("awq", "int4-g32", {"n_grid": 4, "search_tokens": 64}),
    ("gptq", "int4-g32", {}),
    ("smoothquant", "int8-w8a8", {}),
    ("wanda", "sparse24", {}),
    ("sparsegpt", "sparse24", {}),
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return loads(tiny_gguf(tmp_path_factory.mktemp("layerwise") / "m.gguf", gguf.GGMLQuantizationType.Q8_0))


def norms(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if "norm" in n or n.endswith("bias")}


@pytest.mark.parametrize("method,fmt,settings", CASES, ids=[c[0] for c in CASES])
def test_layerwise_equals_todays_calibration_bit_for_bit(models, method, fmt, settings):
    fp32, packed = models
    before = {k: v.clone() for k, v in packed_state(packed).items()}
    windows = torch.randint(0, fp32.config.vocab_size, (3, 24), generator=torch.Generator().manual_seed(1))
    config = QuantizeConfig(format=fmt)
    today = copy.deepcopy(fp32)
    calibrate_and_quantize(today, config, method, windows, **settings)
    lean = shared_copy(packed)
    calibrate_and_quantize(lean, config, method, windows, **settings)
    kept = {n for n, _ in lean.linear_layers() if config.spec_for(n) is None}
    float_layers_as_loaded(lean, kept)  # as optimize: its blocks at float activations
    assert_same_weights(today, lean, kept)
    for name, p in norms(today).items():  # AWQ and SmoothQuant fold their scales into the norms: the same ones
        assert torch.equal(p, norms(lean)[name]), name
    assert lean.quantize_config.calibration == today.quantize_config.calibration
    for k, v in packed_state(packed).items():
        assert torch.equal(v, before[k]), k


def test_the_runner_holds_one_blocks_float_weights_at_a_time(models):
    _, packed = models
    lean = shared_copy(packed)
    runner = BlockRunner(lean, torch.zeros(1, 4, dtype=torch.long), config=QuantizeConfig(format="int8"))
    floats = lambda: sorted(n for n, lin in lean.linear_layers() if lin.format.spec() == "fp32")
    runner.begin(0)
    assert floats() and all(n.startswith("model.layers.0.") for n in floats())
    runner.end(0)
    assert floats() == [] and set(runner.packed) == runner.floated


@pytest.mark.parametrize("method,fmt", [("gptq", "int4-g32"), ("sparsegpt", "sparse24")])
def test_a_calibrated_block_keeps_no_repacked_copy_once_it_has_run(models, monkeypatch, method, fmt):
    """The packed planes of every calibrated block stay (they are the result); the kernels' repacked copies made
    while a block computes the next one's inputs are let go, so the candidate is not held twice."""
    _, packed = models
    lean = shared_copy(packed)
    held = []
    begin = BlockRunner.begin

    def spy(self, i):
        held.extend(n for n, lin in lean.linear_layers() if lin._native is not None and _block(n) < i)
        return begin(self, i)

    monkeypatch.setattr(BlockRunner, "begin", spy)
    windows = torch.randint(0, packed.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    calibrate_and_quantize(lean, QuantizeConfig(format=fmt), method, windows)
    assert held == []


def _block(name: str) -> int:
    return int(name.split(".")[2]) if name.startswith("model.layers.") else -1
