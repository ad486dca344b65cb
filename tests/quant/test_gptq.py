"""GPTQ against a naive, un-blocked implementation written here, and against round-to-nearest."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.gptq import GPTQConfig, gptq_model, gptq_quantize, inverse_hessian_factor
from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config


def int4_params(g: torch.Tensor, sym: bool):
    """The int4 format's group grid, from its definition: fp16 absmax/7 (sym) or (max−min)/15 and min (asym)."""
    if sym:
        return (g.abs().amax(1) / 7).half().double(), torch.zeros(g.shape[0], dtype=torch.float64)
    return ((g.amax(1) - g.amin(1)) / 15).half().double(), g.amin(1).half().double()


def int4_round(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, sym: bool) -> torch.Tensor:
    inv = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    if sym:
        return torch.round(w * inv).clamp(-7, 7) * scale
    return torch.round((w - zero) * inv).clamp(0, 15) * scale + zero


def naive_gptq(w, h, gs, sym, act_order, damp=0.01):
    """Column by column, every remaining column updated at once with the full inverse Hessian (no blocks)."""
    w, h = w.double().clone(), h.double().clone()
    k = w.shape[1]
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = torch.argsort(torch.diag(h), descending=True, stable=True) if act_order else torch.arange(k)
    static = [int4_params(w[:, g * gs : (g + 1) * gs], sym) for g in range(k // gs)]
    w, h = w[:, perm], h[perm][:, perm]
    h = h + damp * torch.diag(h).mean() * torch.eye(k, dtype=torch.float64)
    hinv = torch.linalg.inv(h)
    q = torch.zeros_like(w)
    params = {}
    for i in range(k):
        g = int(perm[i]) // gs
        if act_order:
            params[g] = static[g]
        elif i % gs == 0:
            params[g] = int4_params(w[:, i : i + gs], sym)
        q[:, i] = int4_round(w[:, i], *params[g], sym)
        err = (w[:, i] - q[:, i]) / hinv[i, i]
        w[:, i:] -= err[:, None] * hinv[i, i:][None, :]  # OBS update of the remaining weights ...
        rest = hinv[i + 1 :, i + 1 :] - hinv[i + 1 :, i : i + 1] @ hinv[i : i + 1, i + 1 :] / hinv[i, i]
        hinv = torch.zeros_like(hinv)
        hinv[i + 1 :, i + 1 :] = rest  # ... and the inverse Hessian with column i eliminated
    return q[:, torch.argsort(perm)]


def layer_problem(seed, out=24, k=128, tokens=400):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5 + torch.eye(k)
    x = torch.randn(tokens, k, generator=g) @ mix * (1 + 4 * torch.rand(k, generator=g))  # correlated, uneven
    w = torch.randn(out, k, generator=g) * 0.1
    return w, x, 2 * x.double().t() @ x.double() / tokens


def out_err(x, w, q):
    return (x.double() @ (w.double() - q.double()).t()).pow(2).mean().item()


@pytest.mark.parametrize("spec", ["int4-g32", "int4-g64-sym", "int4-g128"])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_blocked_equals_naive_and_beats_rtn(spec, act_order, seed):
    fmt = get_weight_format(spec)
    w, x, h = layer_problem(seed)
    packed = gptq_quantize(w, h, fmt, GPTQConfig(block_size=64 if fmt.group_size <= 64 else 128, act_order=act_order))
    q = fmt.dequantize(packed)
    ref = naive_gptq(w, h, fmt.group_size, fmt.symmetric, act_order)
    assert torch.allclose(q.double(), ref, atol=1e-6)
    assert set(packed) == set(fmt.quantize(w))  # the format's own tensors: apply/save/load just work
    rtn = fmt.dequantize(fmt.quantize(w))
    assert out_err(x, w, q) < 0.8 * out_err(x, w, rtn)


def test_inverse_hessian_factor_in_place_equals_the_three_factorisations():
    torch.manual_seed(3)
    x = torch.randn(80, 48, dtype=torch.float64) * torch.linspace(0.1, 4, 48, dtype=torch.float64)
    h = 2 * x.t() @ x / 80
    damped = h + 0.01 * h.diagonal().mean() * torch.eye(48, dtype=torch.float64)
    expected = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(damped)), upper=True)
    kept = h.clone()
    assert torch.equal(inverse_hessian_factor(h, 0.01), expected) and torch.equal(h, kept)  # h untouched
    u = inverse_hessian_factor(h, 0.01, overwrite=True)
    assert torch.equal(u, expected) and u.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    with pytest.raises(ConfigError, match="not positive definite"):
        inverse_hessian_factor(-kept, 0.01, "SparseGPT", overwrite=True)


def test_dead_inputs_and_bad_settings():
    fmt = get_weight_format("int4-g32")
    w, x, h = layer_problem(3, k=64)
    x[:, 5] = 0
    h = 2 * x.double().t() @ x.double() / x.shape[0]
    q = fmt.dequantize(gptq_quantize(w, h, fmt))
    assert torch.isfinite(q).all() and torch.all(q[:, 5].abs() <= fmt.dequantize(fmt.quantize(w)).abs().amax())
    with pytest.raises(ConfigError, match="multiple of the group size"):
        gptq_quantize(w, h, fmt, GPTQConfig(block_size=48))
    with pytest.raises(ConfigError, match="int4"):
        gptq_quantize(w, h, get_weight_format("int8"))


def test_gptq_model_installs_packed_int4_closer_than_rtn():
    cfg = tiny_config("llama", hidden_size=64, intermediate_size=128, head_dim=16)
    state = random_state(cfg, seed=4)
    windows = torch.randint(0, cfg.vocab_size, (4, 48), generator=torch.Generator().manual_seed(1))
    model = model_from_state(cfg, state)
    ref = torch.stack([model.score(w) for w in windows])
    qcfg = QuantizeConfig(format="int4-g32", overrides={"*.down_proj": "int8"})
    packed, record = gptq_model(model, qcfg, windows)
    assert all(layer.format.spec() == "fp32" for _, layer in model.linear_layers())  # restored
    assert record["method"] == "gptq" and "lm_head" not in packed
    quantize(model, qcfg, prepacked=packed)
    formats = {n: layer.format.spec() for n, layer in model.linear_layers()}
    assert (
        formats["model.layers.1.self_attn.q_proj"] == "int4-g32" and formats["model.layers.0.mlp.down_proj"] == "int8"
    )
    gptq_err = (torch.stack([model.score(w) for w in windows]) - ref).pow(2).mean()
    rtn = model_from_state(cfg, state)
    quantize(rtn, qcfg)
    rtn_err = (torch.stack([rtn.score(w) for w in windows]) - ref).pow(2).mean()
    assert gptq_err < rtn_err


@pytest.mark.parametrize("act_order", [False, True])
def test_every_buffer_follows_the_weight_device(act_order):
    """``quantize --device cuda`` runs GPTQ on the GPU: no buffer may land on the default device. With the default
    device set to ``meta``, a buffer made without the weight's device would break the CPU run."""
    fmt = get_weight_format("int4-g32")
    w, _, h = layer_problem(4, k=64)
    want = fmt.dequantize(gptq_quantize(w, h, fmt, GPTQConfig(block_size=64, act_order=act_order)))
    with torch.device("meta"):
        packed = gptq_quantize(w, h, fmt, GPTQConfig(block_size=64, act_order=act_order))
    assert all(t.device.type == "cpu" for t in packed.values())
    assert torch.equal(fmt.dequantize(packed), want)
