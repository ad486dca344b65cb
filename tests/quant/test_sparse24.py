"""2:4 sparsity: the pattern, the packed layout, Wanda's metric, and Wanda against magnitude pruning."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.calibrate.base import BlockRunner, block_linears, capture
from bytediet.calibrate.wanda import wanda_model
from bytediet.errors import ConfigError
from bytediet.kernels.reference import sparse24_matmul
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.quant import get_weight_format
from bytediet.quant.sparse24 import densify, keep_mask, pack_positions, unpack_positions
from tests.conftest import model_from_state, random_state, tiny_config


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 9), groups8=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_two_of_every_four_survive_and_they_are_the_largest(rows, groups8, seed):
    w = torch.randn(rows, 8 * groups8, generator=torch.Generator().manual_seed(seed))
    for spec in ("sparse24", "sparse24-int8"):
        fmt = get_weight_format(spec)
        d = fmt.dequantize(fmt.quantize(w)).reshape(rows, -1, 4)
        g = w.reshape(rows, -1, 4)
        assert ((d != 0).sum(-1) <= 2).all()
        kept = g.abs().topk(2, dim=-1).values.min(-1).values  # the smaller kept magnitude per group
        dropped = torch.where(d == 0, g.abs(), torch.zeros_like(g)).amax(-1)
        assert (dropped <= kept).all()
        if spec == "sparse24":  # the kept values are the weights, in float16
            assert torch.allclose(d[d != 0], g[d != 0].half().float())


def test_positions_round_trip_every_pattern():
    pairs = [(a, b) for a in range(4) for b in range(a + 1, 4)]  # the six 2-of-4 patterns
    mask = torch.zeros(len(pairs), len(pairs), 4, dtype=torch.bool)
    for i in range(len(pairs)):  # row i, group j: pattern (i + j) mod 6, so every pattern meets every slot
        for j in range(len(pairs)):
            mask[i, j, list(pairs[(i + j) % len(pairs)])] = True
    mask = mask.reshape(len(pairs), -1)
    index = pack_positions(mask)
    assert index.shape == (6, 3) and index.dtype == torch.uint8  # 4 bits per group, 2 groups per byte
    positions = unpack_positions(index)
    rebuilt = torch.zeros(6, 6, 4, dtype=torch.bool).scatter_(-1, positions, True).reshape(6, -1)
    assert torch.equal(rebuilt, mask)
    values = torch.arange(1, 6 * 12 + 1, dtype=torch.float32).reshape(6, 12)
    dense = densify(values, index)
    assert torch.equal(dense[mask].reshape(6, 12), values)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 7), groups=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_compressed_layout_round_trip_is_exact_and_every_group_has_two_zeros(rows, groups, seed):
    """Any k = 4·groups (odd group counts leave half a byte of padding): values + index give back the weight."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, 4 * groups, generator=gen).half().float()  # fp16-exact values
    for spec in ("sparse24", "sparse24-int8"):
        fmt = get_weight_format(spec)
        packed = fmt.quantize(w)
        assert packed["values"].shape == (rows, 2 * groups) and packed["index"].shape == (rows, (groups + 1) // 2)
        mask = fmt.mask(packed)
        assert (mask.reshape(rows, groups, 4).sum(-1) == 2).all()  # exactly 2 kept, 2 zeros, in every group
        again = fmt.pack(fmt.dequantize(packed), mask)  # repacking the decoded weight is the identity
        assert all(torch.equal(packed[key], again[key]) for key in packed)
        if spec == "sparse24":
            assert torch.equal(fmt.dequantize(packed), torch.where(mask, w, torch.zeros_like(w)))


@pytest.mark.parametrize("spec", ["sparse24", "sparse24-int8"])
@pytest.mark.parametrize("k", [8, 12, 576])
def test_reference_matmul_from_the_compressed_layout_equals_the_dense_masked_matmul(spec, k):
    gen = torch.Generator().manual_seed(k)
    w, x = torch.randn(24, k, generator=gen), torch.randn(5, k, generator=gen)
    fmt = get_weight_format(spec)
    packed = fmt.quantize(w)
    dense = fmt.dequantize(packed)  # the masked weight: zeros outside the kept positions
    got = sparse24_matmul(x, packed["values"], packed["index"], packed.get("scale"))
    assert torch.allclose(got, x @ dense.t(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(fmt.apply(x, packed), got, rtol=1e-5, atol=1e-5)


def test_unstructured_half_keeps_the_larger_half_of_each_row_in_9_bits():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 20, generator=gen)
    fmt = get_weight_format("sparse50")
    packed = fmt.quantize(w)
    mask = fmt.mask(packed)
    assert (mask.sum(1) == 10).all()
    kept_min = torch.where(mask, w.abs(), torch.full_like(w, 1e9)).amin(1)
    dropped_max = torch.where(mask, torch.zeros_like(w), w.abs()).amax(1)
    assert (dropped_max <= kept_min).all()
    assert torch.equal(fmt.dequantize(packed), torch.where(mask, w.half().float(), torch.zeros_like(w)))
    assert fmt.bits_per_weight(6, 20) == 9.0


def test_wanda_metric_weighs_by_the_input_norm():
    w = torch.tensor([[1.0, 0.9, 0.2, 0.1, 1.0, 0.9, 0.2, 0.1]])
    norms = torch.tensor([1.0, 1.0, 10.0, 10.0, 1.0, 1.0, 1.0, 1.0])
    assert keep_mask(w).tolist() == [[True, True, False, False, True, True, False, False]]
    assert keep_mask(w, norms).tolist() == [[False, False, True, True, True, True, False, False]]


def test_bad_shapes_and_settings():
    for spec in ("sparse24", "sparse24-int8"):
        with pytest.raises(ConfigError, match=f"{spec} needs in_features divisible by 4, got 10.*--skip"):
            get_weight_format(spec).quantize(torch.randn(4, 10))
    with pytest.raises(ConfigError, match="sparse50 needs in_features divisible by 2, got 7"):
        get_weight_format("sparse50").quantize(torch.randn(4, 7))
    with pytest.raises(ConfigError, match="no parameters"):
        get_weight_format("sparse24-g8")


def _outputs_error(model, ref_model, windows):
    return sum(float((model.score(w) - ref_model.score(w)).pow(2).mean()) for w in windows)


def outlier_model(cfg, state):
    """A tiny model whose blocks see a few input channels carrying most of the activation energy, as in LLMs."""
    model = model_from_state(cfg, state)
    for block in model.model.layers:
        block.input_layernorm.weight.data[[3, 17, 30]] *= 8
        block.post_attention_layernorm.weight.data[[5, 11]] *= 8
    return model


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_wanda_beats_magnitude_on_outlier_inputs(arch):
    cfg = tiny_config(arch)
    state = random_state(cfg, 0)
    ref = outlier_model(cfg, state)
    gen = torch.Generator().manual_seed(1)
    calib = torch.randint(0, cfg.vocab_size, (4, 48), generator=gen)
    test = torch.randint(0, cfg.vocab_size, (3, 48), generator=gen)
    config = QuantizeConfig(format="sparse24", output_policy="same", skip=("lm_head",))
    errors = {}
    for method in ("magnitude", "wanda"):
        model = outlier_model(cfg, state)
        prepacked = wanda_model(model, config, calib)[0] if method == "wanda" else None
        if prepacked is not None:  # the model is untouched until the result is installed
            assert all(layer.format.spec() == "fp32" for _, layer in model.linear_layers())
        quantize(model, config, prepacked=prepacked)
        assert {layer.format.spec() for n, layer in model.linear_layers() if n != "lm_head"} == {"sparse24"}
        errors[method] = _outputs_error(model, ref, test)
    assert errors["wanda"] < 0.8 * errors["magnitude"], errors


def test_wanda_needs_a_sparse_format():
    cfg = tiny_config("llama")
    model = model_from_state(cfg, random_state(cfg, 0))
    with pytest.raises(ConfigError, match="sparse24"):
        wanda_model(model, QuantizeConfig(format="int8"), torch.zeros(1, 8, dtype=torch.long))


def test_calibration_stats_give_channel_norms():
    cfg = tiny_config("llama")
    model = model_from_state(cfg, random_state(cfg, 0))
    windows = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    runner = BlockRunner(model, windows)
    block = model.model.layers[0]
    captured = []
    hook = block.mlp.down_proj.register_forward_pre_hook(lambda m, a: captured.append(a[0].reshape(-1, m.in_features)))
    with capture(block_linears(block, "model.layers.0"), hessian=True) as stats:
        runner.run_block(0, runner.embed())
    hook.remove()
    x = torch.cat(captured)
    from bytediet.quant.pruning import channel_norms

    assert torch.allclose(channel_norms(stats["model.layers.0.mlp.down_proj"]), x.norm(dim=0), rtol=1e-4)


def test_sparse24_int8_spec_carries_its_activation_precision():
    """A run config names the activation precision in the spec (optimize recommends sparse24-int8-a8)."""
    from bytediet.errors import ConfigError

    for spec, mode in (("sparse24-int8", "q16"), ("sparse24-int8-a8", "q8"), ("sparse24-int8-af32", "f32")):
        fmt = get_weight_format(spec)
        assert fmt.activations == mode and fmt.spec() == spec
    with pytest.raises(ConfigError, match="activation precision"):
        get_weight_format("sparse24-int8-g64")
