"""SmoothQuant: the scale formula, exact folding, balanced ranges, and less W8A8 error on outlier activations."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.base import BlockRunner, block_linears, capture
from bytediet.calibrate.folding import group_weight, scale_groups
from bytediet.calibrate.smoothquant import SmoothQuantConfig, smooth_scales, smoothquant_model
from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize
from tests.conftest import model_from_state, random_state, tiny_config


def test_scale_formula():
    x, w = torch.tensor([4.0, 0.25, 0.0, 9.0]), torch.tensor([1.0, 4.0, 2.0, 0.0])
    s = smooth_scales(x, w, 0.5)
    assert torch.allclose(s, torch.tensor([2.0, 0.25, 1.0, 1.0], dtype=torch.float64))
    assert torch.allclose(smooth_scales(x[:2], w[:2], 0.75), x[:2].double() ** 0.75 / w[:2].double() ** 0.25)
    with pytest.raises(ConfigError):
        SmoothQuantConfig(alpha=1.5)


def outlier_model(arch, seed=0):
    cfg = tiny_config(arch)
    model = model_from_state(cfg, random_state(cfg, seed))
    for block in model.model.layers:  # LLM-like outlier channels in the activations
        block.input_layernorm.weight.data[[3, 17]] *= 40
        block.mlp.up_proj.packed["weight"][[5, 40]] *= 30
    return cfg, model


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_smoothing_is_exact(arch):
    cfg, model = outlier_model(arch)
    windows = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    ref = [model.score(w) for w in windows]
    record = smoothquant_model(model, windows, SmoothQuantConfig(alpha=0.5))
    assert len(record["results"]) == 4 * cfg.num_layers
    for w, r in zip(windows, ref):
        assert (model.score(w) - r).abs().max() < 1e-4 * r.abs().max()  # float32 rounding only


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_half_strength_balances_activation_and_weight_ranges(arch):
    """Only the norm-fed groups, whose weights no other group rescales afterwards."""
    cfg, model = outlier_model(arch)
    windows = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(0))
    smoothquant_model(model, windows, SmoothQuantConfig(alpha=0.5, groups=("qkv", "gate_up")))
    runner = BlockRunner(model, windows)
    block = model.model.layers[0]
    with capture(block_linears(block, "model.layers.0")) as stats:
        runner.run_block(0, runner.embed())
    for group in scale_groups(block, "model.layers.0", ("qkv", "gate_up")):
        x_max = stats[group.linears[0][0]].abs_max
        w_max = group_weight(group).abs().amax(0)
        assert torch.allclose(x_max, w_max, rtol=1e-3)  # α = 0.5: max|X̂_j| = max|Ŵ_j| = √(max|X_j| max|W_j|)


def test_w8a8_error_drops_after_smoothing():
    cfg, model = outlier_model("llama", seed=3)
    windows = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(1))
    ref = torch.stack([model.score(w) for w in windows])
    _, plain = outlier_model("llama", seed=3)
    quantize(plain, QuantizeConfig(format="int8-w8a8"))
    plain_err = (torch.stack([plain.score(w) for w in windows]) - ref).pow(2).mean()
    smoothquant_model(model, windows)
    quantize(model, QuantizeConfig(format="int8-w8a8"))
    smooth_err = (torch.stack([model.score(w) for w in windows]) - ref).pow(2).mean()
    assert smooth_err < 0.5 * plain_err
