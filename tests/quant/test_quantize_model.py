"""quantize(model, config): per-layer formats, overrides, skips, atomic failure, summary."""

from __future__ import annotations

import pytest
import torch

from bytediet.errors import ConfigError
from bytediet.models.layers import Linear
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.quant import get_weight_format


class Tree(torch.nn.Module):
    """A plain module tree of Linear layers (no linear_layers() method)."""

    def __init__(self, in_features: int = 64) -> None:
        super().__init__()
        self.up = Linear(in_features, 32)
        self.blocks = torch.nn.ModuleList([Linear(32, 32, bias=True) for _ in range(2)])
        fp32 = get_weight_format("fp32")
        for m in (self.up, *self.blocks):
            m.set_weight(torch.randn(m.out_features, m.in_features), fp32)


def test_quantizes_every_layer_from_its_float_weight():
    tree = Tree()
    before = {n: m.dequantized_weight().clone() for n, m in tree.named_modules() if isinstance(m, Linear)}
    summary = quantize(tree, QuantizeConfig(format="int8"))
    assert {layer.name for layer in summary.layers} == set(before)
    fmt = get_weight_format("int8")
    for name, w in before.items():
        layer = tree.get_submodule(name)
        assert layer.format.spec() == "int8"
        assert torch.equal(layer.dequantized_weight(), fmt.dequantize(fmt.quantize(w)))
    assert summary.bytes_after < summary.bytes_before
    assert summary.layers[0].bits_per_weight == pytest.approx(8 + 32 / 64)


def test_overrides_first_match_and_skip(tiny_model):
    cfg = QuantizeConfig(
        format="int4-g32", overrides={"lm_head": "int8", "*.layers.0.*": "fp8"}, skip=("*.mlp.down_proj",)
    )
    summary = quantize(tiny_model, cfg)
    formats = {name: layer.format.spec() for name, layer in tiny_model.linear_layers()}
    assert formats["lm_head"] == "int8"
    assert formats["model.layers.0.self_attn.q_proj"] == "fp8"
    assert formats["model.layers.1.self_attn.q_proj"] == "int4-g32"
    assert formats["model.layers.1.mlp.down_proj"] == "fp32"  # skipped
    assert sorted(summary.skipped) == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]


def test_bad_group_size_names_the_layer_and_leaves_model_untouched():
    tree = Tree(in_features=96)  # 96 = 3·32: g32 works, g64 / g128 do not
    with pytest.raises(ConfigError, match=r"layer up .*valid group sizes for it: 32"):
        quantize(tree, QuantizeConfig(format="int4-g64"))
    assert all(m.format.spec() == "fp32" for m in tree.modules() if isinstance(m, Linear))


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown weight format 'int3'"):
        QuantizeConfig(format="int3")
    with pytest.raises(ConfigError, match="int4"):
        QuantizeConfig(format="int8", overrides={"lm_head": "int4-g48"})


def test_quantized_model_still_scores(tiny_model):
    ids = torch.arange(20) % 96
    ref = tiny_model.score(ids)
    quantize(tiny_model, "int8")
    out = tiny_model.score(ids)
    assert out.shape == ref.shape
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
