"""SparseGPT: the mask equals a brute-force OBS reference, it beats magnitude/Wanda on the layer loss, bad input."""

from __future__ import annotations

import itertools

import pytest
import torch

from bytediet.calibrate import calibrate_and_quantize, get_calibration_method
from bytediet.calibrate.sparsegpt import SparseGPTConfig, sparsegpt_model, sparsegpt_prune
from bytediet.calibrate.wanda import wanda_model
from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config

PATTERNS = list(itertools.combinations(range(4), 2))  # the six ways to keep 2 of 4


def correlated_inputs(tokens: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=gen) / k**0.5 + torch.eye(k)
    return (torch.randn(tokens, k, generator=gen) * torch.linspace(0.2, 3.0, k)) @ mix


def brute_force_sparsegpt(w: torch.Tensor, h: torch.Tensor, damp: float, span: int | None, block: int):
    """Column-by-column OBS with explicit inverses of the remaining columns' Hessian (no Cholesky, no lazy
    batches); at each span start every allowed keep-pattern of every row is enumerated and the one with
    the largest kept saliency w² / [H_F⁻¹]_jj (F = columns from j on) wins."""
    w, h = w.double().clone(), h.double().clone()
    h.diagonal().add_(damp * h.diagonal().mean())
    out, k = w.shape
    keep = torch.ones(out, k, dtype=torch.bool)

    def diag_inv(j):  # [H_F⁻¹]_jj with F = j..k-1
        return torch.linalg.inv(h[j:, j:])[0, 0]

    for c in range(k):
        starts_span = (c % span == 0) if span else (c % block == 0)
        if starts_span:
            width = span or min(block, k - c)
            sal = w[:, c : c + width] ** 2 / torch.stack([diag_inv(c + j) for j in range(width)])[None, :]
            for r in range(out):
                choices = PATTERNS if span == 4 else itertools.combinations(range(width), width // 2)
                best = max(choices, key=lambda p: float(sal[r, list(p)].sum()))
                keep[r, c : c + width] = False
                keep[r, [c + j for j in best]] = True
        hinv = torch.linalg.inv(h[c:, c:])
        pruned = ~keep[:, c]
        delta = w[pruned, c] / hinv[0, 0]
        w[pruned, c:] -= delta[:, None] * hinv[0][None, :]  # the OBS update: w_c → 0, the rest compensates
    return w.masked_fill(~keep, 0.0), keep


@pytest.mark.parametrize(
    "spec,k,block",
    [("sparse24", 16, 8), ("sparse24", 12, 4), ("sparse24-int8", 16, 16), ("sparse50", 12, 4), ("sparse50", 8, 8)],
)
def test_mask_and_weights_equal_the_brute_force_obs_reference(spec, k, block):
    fmt = get_weight_format(spec)
    x = correlated_inputs(64, k, seed=k)
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    w = torch.randn(5, k, generator=torch.Generator().manual_seed(block))
    got_w, got_keep = sparsegpt_prune(w, h, fmt, SparseGPTConfig(block_size=block, damp=0.01))
    ref_w, ref_keep = brute_force_sparsegpt(w, h, 0.01, fmt.span, block)
    assert torch.equal(got_keep, ref_keep)
    assert torch.allclose(got_w, ref_w, atol=1e-9)
    if fmt.span == 4:  # every group of 4 has exactly 2 zeros, in the packed result too
        deq = fmt.dequantize(fmt.pack(got_w.float(), got_keep)).reshape(5, -1, 4)
        assert ((deq == 0).sum(-1) == 2).all() or spec == "sparse24-int8"
        assert (got_keep.reshape(5, -1, 4).sum(-1) == 2).all()
    else:
        assert (got_keep.sum(1) == k // 2).all()


def layer_loss(w_hat, w, x):
    return float((x.double() @ (w.double() - w_hat.double()).t()).pow(2).mean())


@pytest.mark.parametrize("spec", ["sparse24", "sparse50"])
def test_sparsegpt_beats_wanda_and_magnitude_on_the_layer_objective(spec):
    fmt = get_weight_format(spec)
    k = 64
    x = correlated_inputs(512, k, seed=0)
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    w = torch.randn(32, k, generator=torch.Generator().manual_seed(0))
    sgpt = sparsegpt_prune(w, h, fmt)[0]
    wanda = fmt.dequantize(fmt.quantize(w, x.norm(dim=0)))
    magnitude = fmt.dequantize(fmt.quantize(w))
    losses = {n: layer_loss(v, w, x) for n, v in [("sparsegpt", sgpt), ("wanda", wanda), ("magnitude", magnitude)]}
    assert losses["sparsegpt"] < 0.8 * min(losses["wanda"], losses["magnitude"]), losses


def test_dead_inputs_get_zero_weights():
    x = correlated_inputs(64, 8, seed=1)
    x[:, 2] = 0
    h = 2 * x.double().t() @ x.double() / 64
    w, keep = sparsegpt_prune(torch.randn(3, 8), h, get_weight_format("sparse24"))
    assert (w[:, 2] == 0).all() and (keep.reshape(3, 2, 4).sum(-1) == 2).all()


def test_model_pass_prunes_every_block_layer_and_leaves_the_model_untouched():
    cfg = tiny_config("llama")
    model = model_from_state(cfg, random_state(cfg, 0))
    calib = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    config = QuantizeConfig(format="sparse24", output_policy="same", skip=("lm_head",))
    prepacked, record = sparsegpt_model(model, config, calib)
    assert record == {"method": "sparsegpt", "block_size": 128, "damp": 0.01}
    assert all(layer.format.spec() == "fp32" for _, layer in model.linear_layers())
    calibrate_and_quantize(model, config, "sparsegpt", calib)
    for name, layer in model.linear_layers():
        if name != "lm_head":
            d = layer.dequantized_weight().reshape(layer.out_features, -1, 4)
            assert ((d == 0).sum(-1) >= 2).all(), name
    assert model.quantize_config.calibration["method"] == "sparsegpt"


def test_bad_input_is_a_clear_error():
    cfg = tiny_config("llama")
    model = model_from_state(cfg, random_state(cfg, 0))
    config = QuantizeConfig(format="sparse24")
    for method in (sparsegpt_model, wanda_model):
        with pytest.raises(ConfigError, match="needs calibration data.*--calib-samples"):
            method(model, config, torch.zeros(0, 8, dtype=torch.long))
        with pytest.raises(ConfigError, match="needs calibration data"):
            method(model, config, None)
    with pytest.raises(ConfigError, match="sparse24"):
        sparsegpt_model(model, QuantizeConfig(format="int8"), torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ConfigError, match="unknown calibration method 'sparsegtp'|sparsegtp"):
        get_calibration_method("sparsegtp")
    with pytest.raises(ConfigError, match="divisible by 4, got 10"):
        sparsegpt_prune(torch.randn(2, 10), torch.eye(10), get_weight_format("sparse24"))
    with pytest.raises(ConfigError, match="multiple of 4"):
        SparseGPTConfig(block_size=6)


def test_layer_name_in_the_error_for_a_bad_input_dimension():
    cfg = tiny_config("llama", intermediate_size=62)  # down_proj's input dimension is not a multiple of 4
    model = model_from_state(cfg, random_state(cfg, 0))
    calib = torch.randint(0, cfg.vocab_size, (1, 8))
    config = QuantizeConfig(format="sparse24", skip=("lm_head",))
    with pytest.raises(ConfigError, match=r"layer model\.layers\.0\.mlp\.down_proj .*divisible by 4, got 62"):
        quantize(model, config)
    for method in (sparsegpt_model, wanda_model):  # the calibrated paths name the layer too
        with pytest.raises(ConfigError, match=r"layer model\.layers\.0\.mlp\.down_proj .*divisible by 4, got 62"):
            method(model, config, calib)


@pytest.mark.parametrize("spec", ["sparse24", "sparse50"])
def test_every_buffer_follows_the_weight_device(spec):
    """``quantize --device cuda`` prunes on the GPU: with the default device set to ``meta``, a buffer made without
    the weight's device would break this CPU run."""
    fmt = get_weight_format(spec)
    x = correlated_inputs(64, 16, seed=2)
    w, h = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)), 2 * x.double().t() @ x.double() / 64
    want = sparsegpt_prune(w, h, fmt, SparseGPTConfig(block_size=8))
    with torch.device("meta"):
        pruned, keep = sparsegpt_prune(w, h, fmt, SparseGPTConfig(block_size=8))
    assert pruned.device.type == keep.device.type == "cpu"
    assert torch.equal(pruned, want[0]) and torch.equal(keep, want[1])
