"""Budget logic: pure functions of measured records, table-driven."""

from __future__ import annotations

import math

import pytest

from bytediet.errors import ConfigError
from bytediet.optimize.budget import Budget, best_of_step, choose, compounding, overshoot, within


def rec(label, ppl_pct, kl, tok_s=10.0, mem=100):
    return {"label": label, "ppl_increase_pct": ppl_pct, "kl_mean": kl, "decode_tok_s": tok_s, "memory_bytes": mem}


@pytest.mark.parametrize(
    "ppl_pct, kl, budget, expected",
    [
        (1.9, 0.5, Budget(2.0), True),
        (2.0, 0.5, Budget(2.0), True),  # the limit itself is inside
        (2.01, 0.0, Budget(2.0), False),
        (-3.0, 0.0, Budget(0.0), True),  # a perplexity decrease never breaks a budget
        (1.0, 0.02, Budget(2.0, 0.01), False),  # the KL limit binds
        (1.0, 0.01, Budget(2.0, 0.01), True),
    ],
)
def test_within(ppl_pct, kl, budget, expected):
    assert within(rec("x", ppl_pct, kl), budget) is expected


@pytest.mark.parametrize(
    "ppl_pct, kl, budget, expected",
    [
        (3.0, 0.0, Budget(2.0), 1.5),
        (1.0, 0.04, Budget(2.0, 0.01), 4.0),
        (-1.0, 0.0, Budget(2.0), 0.0),
        (0.5, 0.0, Budget(0.0), math.inf),
        (0.0, 0.0, Budget(0.0, 0.0), 0.0),
    ],
)
def test_overshoot_is_the_worst_limit_ratio(ppl_pct, kl, budget, expected):
    assert overshoot(rec("x", ppl_pct, kl), budget) == pytest.approx(expected)


RECORDS = [
    rec("int8", 0.2, 0.001, tok_s=12, mem=300),
    rec("int4", 3.0, 0.05, tok_s=15, mem=200),
    rec("nvfp4", 1.5, 0.03, tok_s=11, mem=190),
    rec("tq", 5.0, 0.2, tok_s=20, mem=150),
]


@pytest.mark.parametrize(
    "budget, objective, label, inside",
    [
        (Budget(2.0), "throughput", "int8", True),  # int4/tq are faster but miss the budget
        (Budget(2.0), "memory", "nvfp4", True),
        (Budget(10.0), "throughput", "tq", True),
        (Budget(2.0, 0.01), "memory", "int8", True),  # the KL limit rules out nvfp4
        (Budget(0.1), "throughput", "int8", False),  # impossible: int8 is closest (2x the limit)
        (Budget(0.1, 0.0001), "memory", "int8", False),
    ],
)
def test_choose(budget, objective, label, inside):
    choice = choose(RECORDS, budget, objective)
    assert (choice.record["label"], choice.within_budget) == (label, inside)
    if not inside:
        assert "no configuration meets the budget" in choice.reason and "the closest is int8" in choice.reason


def test_ties_go_to_the_smaller_kl_and_empty_input_is_reported():
    a, b = rec("a", 0.0, 0.02, tok_s=10), rec("b", 0.0, 0.01, tok_s=10)
    assert choose([a, b], Budget(), "throughput").record is b
    assert choose([], Budget(), "throughput").record is None
    assert best_of_step([rec("c", 9.0, 0.0)], Budget(), "memory") is None


@pytest.mark.parametrize("kw", [dict(max_ppl_increase=-1.0), dict(max_kl=-0.1), dict(max_ppl_increase=math.nan)])
def test_bad_budgets_are_refused(kw):
    with pytest.raises(ConfigError):
        Budget(**kw)


def test_unknown_objective_is_refused():
    with pytest.raises(ConfigError, match="throughput, memory"):
        choose(RECORDS, Budget(), "latency")


@pytest.mark.parametrize(
    "w, kv, both, compounds",
    [
        ((1.0, 0.010), (0.5, 0.005), (1.5, 0.015), False),  # exactly additive
        ((1.0, 0.010), (0.5, 0.005), (1.4, 0.012), False),  # less than the sum
        ((1.0, 0.010), (0.5, 0.005), (1.5, 0.030), True),  # KL super-additive
        ((1.0, 0.010), (0.5, 0.005), (3.0, 0.015), True),  # PPL super-additive
        ((-0.5, 0.0), (-0.2, 0.0), (0.1, 0.0), True),  # two "free" parts that cost together
        ((0.257, 0.0027), (-0.017, 0.0011), (0.302, 0.0037), False),  # 0.045 points more: below the noise floor
    ],
)
def test_compounding(w, kv, both, compounds):
    out = compounding(rec("w", *w), rec("kv", *kv), rec("both", *both))
    assert out["compounds"] is compounds
    assert out["kl_mean"]["sum_of_parts"] == pytest.approx(max(w[1], 0) + max(kv[1], 0))


@pytest.mark.parametrize(
    "drop, budget, inside, worst",
    [
        (None, Budget(2.0), True, 0.5),  # not measured: only the other limits apply
        (0.0, Budget(2.0), True, 0.5),
        (0.5, Budget(2.0), False, math.inf),  # the default: retrieve everything the unmodified model retrieves
        (0.5, Budget(2.0, max_passkey_drop=0.5), True, 1.0),
        (0.5, Budget(2.0, max_passkey_drop=0.25), False, 2.0),
        (1.0, Budget(2.0, max_passkey_drop=None), True, 0.5),  # no retrieval limit
    ],
)
def test_passkey_drop_limit(drop, budget, inside, worst):
    r = rec("x", 1.0, 0.0) | {"passkey_drop": drop}
    assert within(r, budget) is inside
    assert overshoot(r, budget) == pytest.approx(worst, rel=1e-6)
    with pytest.raises(ConfigError, match="passkey"):
        Budget(2.0, max_passkey_drop=1.5)


def act(label, parent, ppl_pct, top1, tok_s):
    """An activation-precision record of ``parent`` (the same weights at another activation precision)."""
    from bytediet.optimize.budget import activation_cost

    r = {**rec(label, ppl_pct, 0.01, tok_s=tok_s), "top1": top1}
    return {**r, **activation_cost(r, parent)}


PARENT = {**rec("int4-g64", 1.0, 0.01, tok_s=10.0), "top1": 0.95}


@pytest.mark.parametrize(
    "ppl_pct, top1, chosen",
    [
        (1.2, 0.945, "int4-g64-a8"),  # +0.2 points, −0.5 % top-1: the faster path is taken
        (1.3, 0.95, "int4-g64-a8"),  # exactly +0.3 points: the limit itself is inside
        (1.5, 0.95, "int4-g64"),  # +0.5 points: within the 2 % budget, but not the activation rule
        (1.1, 0.935, "int4-g64"),  # −1.5 % top-1 agreement
    ],
)
def test_activation_precision_is_taken_only_within_its_own_rule(ppl_pct, top1, chosen):
    a8 = act("int4-g64-a8", PARENT, ppl_pct, top1, tok_s=14.0)
    assert a8["activation_ppl_cost"] == pytest.approx(ppl_pct - 1.0)
    assert a8["activation_top1_drop"] == pytest.approx(0.95 - top1) and a8["activation_speedup"] == 1.4
    choice = choose([PARENT, a8], Budget(2.0), "throughput")
    assert choice.record["label"] == chosen and choice.within_budget
    assert within(a8, Budget(2.0)) is (chosen == "int4-g64-a8")
    # the rule as the default budget, and a looser one the user may set
    assert within(a8, Budget(2.0, max_activation_ppl_cost=1.0, max_activation_top1_drop=0.02))


def test_activation_overshoot_and_bad_limits():
    a8 = act("int4-g64-a8", PARENT, 1.6, 0.95, tok_s=14.0)  # +0.6 points: 2x the activation limit
    assert overshoot(a8, Budget(2.0)) == pytest.approx(2.0)
    assert overshoot(PARENT, Budget(2.0)) == pytest.approx(0.5)  # records of other steps: no activation limit
    with pytest.raises(ConfigError, match="activation-precision"):
        Budget(max_activation_top1_drop=2.0)
    assert "activation precision" in Budget().describe()
