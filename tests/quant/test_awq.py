"""AWQ: the search is never worse than α = 0 (RTN) on its objective; folding leaves the float model unchanged."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.awq import AWQConfig, awq_model, awq_scales, search_scale
from bytediet.calibrate.folding import fold_scales, scale_groups
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config


def outlier_inputs(seed, tokens=256, k=128):
    g = torch.Generator().manual_seed(seed)
    mag = torch.ones(k)
    mag[torch.randperm(k, generator=g)[:6]] = 30.0  # a few salient channels, as in LLM activations
    return torch.randn(tokens, k, generator=g) * mag


@pytest.mark.parametrize("spec", ["int4-g32", "int4-g128-sym", "nvfp4"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_search_never_worse_than_rtn_and_helps_with_outliers(spec, seed):
    fmt = get_weight_format(spec)
    x = outlier_inputs(seed)
    g = torch.Generator().manual_seed(100 + seed)
    ws = [torch.randn(32, 128, generator=g) * 0.05, torch.randn(16, 128, generator=g) * 0.05]
    res = search_scale([(w, fmt) for w in ws], x, x.abs().mean(0), n_grid=10)
    w_all = torch.cat(ws)
    w_rtn = torch.cat([fmt.dequantize(fmt.quantize(w)) for w in ws])  # each layer its own (per-tensor) scales
    rtn = (x @ w_all.t() - x @ w_rtn.t()).pow(2).mean().item()
    assert res.errors[0][0] == 0.0 and res.rtn_error == pytest.approx(rtn, rel=1e-5)
    assert res.best_error <= res.rtn_error and len(res.errors) == 11
    assert res.alpha > 0 and res.best_error < 0.9 * rtn  # outlier channels: scaling pays off
    s = awq_scales(x.abs().mean(0), res.alpha)
    assert torch.allclose(res.scales, s) and (s.max() * s.min()).item() == pytest.approx(1.0, rel=1e-5)


def scaled_copy(arch, seed):
    cfg = tiny_config(arch)
    return cfg, model_from_state(cfg, random_state(cfg, seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_folding_random_scales_leaves_logits_identical(arch):
    cfg, model = scaled_copy(arch, 1)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))
    ref = model.score(ids)
    g = torch.Generator().manual_seed(5)
    for i, block in enumerate(model.model.layers):
        for group in scale_groups(block, f"model.layers.{i}"):
            fold_scales(group, torch.exp(torch.randn(group.channels, generator=g)))
    assert torch.allclose(model.score(ids), ref, atol=1e-4, rtol=1e-4)
    assert not torch.equal(
        model.model.layers[0].mlp.down_proj.dequantized_weight(),
        model_from_state(cfg, random_state(cfg, 1)).model.layers[0].mlp.down_proj.dequantized_weight(),
    )


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_awq_model_keeps_the_float_model_and_records_every_group(arch):
    cfg, model = scaled_copy(arch, 2)
    windows = torch.randint(0, cfg.vocab_size, (3, 32), generator=torch.Generator().manual_seed(2))
    ref = [model.score(w) for w in windows]
    qcfg = QuantizeConfig(format="int4-g32-sym")
    record = awq_model(model, qcfg, windows, AWQConfig(n_grid=8, search_tokens=64))
    assert len(record["results"]) == 4 * cfg.num_layers
    assert all(r["error"] <= r["rtn_error"] for r in record["results"].values())
    for w, r in zip(windows, ref):
        assert torch.allclose(model.score(w), r, atol=1e-4, rtol=1e-4)
    quantize(model, qcfg)
    assert model.model.layers[0].self_attn.q_proj.format.spec() == "int4-g32-sym"
