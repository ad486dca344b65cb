"""Sensitivity-driven mixed precision: greedy choice on a known table, and the end-to-end budget on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from bytediet.calibrate.mixed import MixedPrecisionConfig, Scorer, choose, mixed_precision, units_of
from bytediet.errors import ConfigError
from bytediet.models.quantize import quantize
from tests.conftest import model_from_state, random_state, tiny_config


def test_choose_upgrades_best_damage_per_byte_first():
    sens = {"a": {"q4": 0.5, "q8": 0.01, "f": 0.0}, "b": {"q4": 0.1, "q8": 0.0, "f": 0.0}}
    nbytes = {u: {"q4": 10, "q8": 20, "f": 40} for u in sens}
    assert choose(sens, nbytes, 1.0) == {"a": "q4", "b": "q4"}  # 0.6 fits
    assert choose(sens, nbytes, 0.2) == {"a": "q8", "b": "q4"}  # a's upgrade saves 0.049/byte, b's 0.01/byte
    assert choose(sens, nbytes, 0.05) == {"a": "q8", "b": "q8"}
    assert choose(sens, nbytes, 0.0) == {"a": "f", "b": "q8"}  # b's fp gains nothing: not bought
    assert choose({"a": {"q4": -0.1}}, {"a": {"q4": 1}}, 0.0) == {"a": "q4"}  # negative damage counts as none


def test_config_needs_exactly_one_budget():
    with pytest.raises(ConfigError, match="exactly one budget"):
        MixedPrecisionConfig()
    with pytest.raises(ConfigError, match="exactly one budget"):
        MixedPrecisionConfig(max_kl=0.1, max_ppl_increase=1.0)
    with pytest.raises(ConfigError, match="unknown weight format"):
        MixedPrecisionConfig(candidates=("int3",), max_kl=0.1)
    assert MixedPrecisionConfig(max_ppl_increase=5.0).budget == pytest.approx(math.log(1.05))


@pytest.fixture
def setup():
    cfg = tiny_config("llama", num_layers=3)
    state = random_state(cfg, seed=6)
    windows = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    return cfg, state, windows


def test_scorer_measures_kl_against_an_independent_computation(setup):
    cfg, state, windows = setup
    model = model_from_state(cfg, state)
    scorer = Scorer(model, windows)
    quantize(model, "int4-g32")
    ref = model_from_state(cfg, state)
    p = torch.cat([torch.softmax(ref.score(w), -1) for w in windows])
    q = torch.cat([torch.softmax(model.score(w), -1) for w in windows])
    kl = (p * (p.log() - q.log())).sum(-1).mean().item()
    got = scorer.measure(model)
    assert got["kl"] == pytest.approx(kl, rel=2e-2, abs=1e-4)  # the reference is stored in fp16
    assert got["kl"] > 0 and scorer.measure(ref)["kl"] == pytest.approx(0.0, abs=1e-3)


@pytest.mark.parametrize("budget", [0.002, 0.02])
def test_choice_meets_the_kl_budget_with_fewer_bytes_than_all_int8(setup, budget):
    cfg, state, windows = setup
    model = model_from_state(cfg, state)
    ref_logits = [model.score(w) for w in windows]
    res = mixed_precision(model, windows, MixedPrecisionConfig(candidates=("int8", "int4-g32", "fp32"), max_kl=budget))
    assert all(torch.equal(model.score(w), r) for w, r in zip(windows, ref_logits))  # model left unchanged
    assert (
        set(res.assignment)
        == set(units_of(model))
        == {"model.layers.0.*", "model.layers.1.*", "model.layers.2.*", "lm_head"}
    )
    assert res.config.format == "int4-g32" and res.measured["kl"] <= budget
    quantize(model, res.config)
    got = {n: layer.format.spec() for n, layer in model.linear_layers()}
    for unit, spec in res.assignment.items():
        assert got[unit.replace("*", "mlp.up_proj") if unit != "lm_head" else "lm_head"] == spec
    assert Scorer(model_from_state(cfg, state), windows).measure(model)["kl"] == pytest.approx(
        res.measured["kl"], rel=1e-3
    )
    int4_everywhere = mixed_precision(
        model_from_state(cfg, state), windows, MixedPrecisionConfig(candidates=("int4-g32",), max_kl=budget)
    )
    assert res.bytes >= int4_everywhere.bytes
