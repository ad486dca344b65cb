"""``auto:<bits>``: the budget allocator (never over budget, bits to sensitive layers) and the plan end to end."""

from __future__ import annotations

import random

import pytest
import torch

from bytediet.calibrate.kv_budget import DEFAULT_CANDIDATES, allocate, candidate_bytes, candidate_roles, plan_kv_budget
from bytediet.errors import ConfigError
from bytediet.kvcache import get_kv_codec
from tests.conftest import model_from_state, random_state, tiny_config

H, D = 2, 64
NBYTES = candidate_bytes(DEFAULT_CANDIDATES, H, D)  # {"k": {spec: bytes}, "v": {...}}; k=<spec> entries keys only


def _bits(plan) -> float:
    return sum(NBYTES["k"][p["k"]] + NBYTES["v"][p["v"]] for p in plan) * 8 / (2 * H * D * len(plan))


def _errors(sensitivity: list[float], rng: random.Random) -> list[dict]:
    """Error tables shaped like measured ones: ~4^-bits (a bit quarters the MSE), times each layer's sensitivity."""
    out = []
    for s in sensitivity:
        out.append(
            {
                role: {
                    spec: s * 4.0 ** -(NBYTES[role][spec] * 8 / (H * D)) * rng.uniform(0.8, 1.2)
                    for spec in NBYTES[role]
                }
                for role in ("k", "v")
            }
        )
    return out


@pytest.mark.parametrize("seed", range(5))
def test_the_allocator_never_exceeds_the_budget(seed):
    rng = random.Random(seed)
    errors = _errors([rng.uniform(0.1, 10) for _ in range(12)], rng)
    previous = None
    for budget in (2.25, 2.6, 3.0, 3.5, 4.5, 5.0, 6.0, 8.5, 12.0, 16.0, 20.0):
        plan = allocate(errors, NBYTES, budget, H, D)
        assert _bits(plan) <= budget + 1e-9
        total = sum(errors[i]["k"][p["k"]] + errors[i]["v"][p["v"]] for i, p in enumerate(plan))
        assert previous is None or total <= previous + 1e-12  # more bytes never cost accuracy
        previous = total


def test_sensitive_layers_get_more_bits():
    rng = random.Random(0)
    sens = [1.0, 100.0, 1.0, 100.0, 1.0, 1.0]  # layers 1 and 3 are 100× as sensitive
    errors = _errors(sens, rng)
    errors[2]["k"] = {s: 50 * e for s, e in errors[2]["k"].items()}  # and layer 2's keys alone (outlier channels)
    plan = allocate(errors, NBYTES, 4.5, H, D)
    bits = lambda i, role: NBYTES[role][plan[i][role]] * 8 / (H * D)
    calm = max(bits(i, r) for i in (0, 4, 5) for r in ("k", "v"))
    assert min(bits(i, r) for i in (1, 3) for r in ("k", "v")) > calm
    assert bits(2, "k") > bits(2, "v")


def test_the_exchange_pass_buys_bf16_for_the_one_layer_that_needs_it():
    """q8_0 everywhere fills 8.5 bits exactly, and the greedy stops there; int8 (8 + 16/D bits) in the calm
    layers frees enough for bf16 keys in the sensitive one, which lowers the summed error."""
    n = 31
    errors = [{role: {"int8": 0.02, "q8_0": 0.01, "bf16": 0.0} for role in ("k", "v")} for _ in range(n)]
    errors[0]["k"] = {"int8": 2.0, "q8_0": 1.0, "bf16": 0.0}
    nbytes = {role: {s: NBYTES[role][s] for s in ("int8", "q8_0", "bf16")} for role in ("k", "v")}
    plan = allocate(errors, nbytes, 8.5, H, D)
    assert plan[0]["k"] == "bf16" and sum(p[r] == "int8" for p in plan for r in ("k", "v")) > 0
    used = sum(nbytes["k"][p["k"]] + nbytes["v"][p["v"]] for p in plan) * 8 / (2 * H * D * n)
    assert used <= 8.5 + 1e-9
    total = sum(errors[i]["k"][p["k"]] + errors[i]["v"][p["v"]] for i, p in enumerate(plan))
    assert total < 1.0 + (2 * n - 1) * 0.01  # below q8_0 everywhere


def test_a_budget_below_every_codec_is_an_error_naming_it():
    errors = _errors([1.0, 1.0], random.Random(0))
    with pytest.raises(ConfigError, match=r"auto:1\.5 is below what any codec reaches"):
        allocate(errors, NBYTES, 1.5, H, D)
    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    with pytest.raises(ConfigError, match=r"auto:1 is below"):
        plan_kv_budget(model_from_state(cfg, random_state(cfg, seed=0)), [torch.arange(8)], 1.0)


def test_the_plan_runs_in_the_engine_and_travels_as_data():
    from bytediet import LLM
    from bytediet.calibrate.kv import calibrate_codec

    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=4))
    windows = [torch.randint(0, cfg.vocab_size, (64,)) for _ in range(2)]
    plan = plan_kv_budget(model, windows, 5.0)
    assert plan.bits <= 5.0 and len(plan.plan) == cfg.num_layers
    roles = candidate_roles(DEFAULT_CANDIDATES)
    for role in ("k", "v"):
        assert all(set(e[role]) == {s for s, r in roles.items() if role in r} for e in plan.errors)
    assert all(e["k"]["bf16"] < e["k"]["turboquant2"] for e in plan.errors)  # errors measured, not guessed
    codec = calibrate_codec(get_kv_codec("auto:5"), model, windows)
    assert codec.calibration_state() == plan.state()
    llm = LLM(
        "tiny",
        loaded=(model, None),
        kv_cache_dtype="auto:5",
        kv_calibration_state=plan.state(),
        num_blocks=8,
        block_size=16,
    )
    runner = llm.engine.runner
    assert runner.codec.plan == plan.plan and "KV plan for auto:5" in runner.codec.plan_table(2, 64)
    assert runner.kv_cache_bytes() == pytest.approx(8 * 16 * runner.bytes_per_token)
    assert len(llm.generate([[1, 2, 3, 4]])[0].outputs[0].token_ids) > 0
    with pytest.raises(ConfigError, match="auto:5 is a byte budget"):
        LLM("tiny", loaded=(model, None), kv_cache_dtype="auto:5", num_blocks=8)


def test_a_plan_of_rotated_halves_runs_in_the_engine_at_its_inner_codecs_bytes():
    """``rot-q8_0`` and ``rot-int8`` are candidates (same bytes as q8_0 / int8: the rotation is a per-layer constant);
    a plan mixing them with plain halves sizes the pool all-in and generates (decode on the module path)."""
    from bytediet import LLM

    assert {"rot-q8_0", "rot-int8"} <= set(DEFAULT_CANDIDATES)
    assert NBYTES["k"]["rot-q8_0"] == NBYTES["k"]["q8_0"] and NBYTES["v"]["rot-int8"] == NBYTES["v"]["int8"]
    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=4))
    plan = [{"k": "rot-q8_0", "v": "rot-int8"}, {"k": "bf16", "v": "int8"}][: cfg.num_layers]
    plan += [{"k": "q8_0", "v": "rot-q8_0"}] * (cfg.num_layers - len(plan))
    state = {"budget": 16.0, "plan": plan}
    llm = LLM(
        "tiny", loaded=(model, None), kv_cache_dtype="auto:16", kv_calibration_state=state, num_blocks=8, block_size=16
    )
    expected = sum(NBYTES["k"][p["k"]] + NBYTES["v"][p["v"]] for p in plan)  # every layer's, all-in
    assert llm.engine.runner.bytes_per_token == pytest.approx(expected)
    assert len(llm.generate([[1, 2, 3, 4]])[0].outputs[0].token_ids) > 0


def test_validation_rejects_a_plan_worse_than_a_uniform_candidate():
    """Error tables that lie (TurboQuant-2 keys and q4_0 values 'free') make the allocator propose that mix; end to
    end on the validation half a uniform candidate of the budget is better, and it is chosen instead."""
    from bytediet.calibrate.kv_budget import measure_errors, plan_from_errors

    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=4))
    windows = [torch.randint(0, cfg.vocab_size, (96,), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    sens = measure_errors(model, windows)
    lie = {"k": "turboquant2", "v": "q4_0"}
    for layer in sens.errors:
        for role in ("k", "v"):
            layer[role] = {spec: (0.0 if spec == lie[role] else 1.0) for spec in layer[role]}
    plan = plan_from_errors(sens, 4.5, cfg.num_kv_heads, cfg.head_dim, model)
    assert plan.chosen != "plan" and plan.chosen.startswith("uniform ")
    assert plan.validation[plan.chosen] < plan.validation["plan"]
    assert all(p == {"k": plan.chosen.split()[1], "v": plan.chosen.split()[1]} for p in plan.plan)
    assert "beat" in plan.verdict() and "plan" in plan.verdict()
    unvalidated = plan_from_errors(sens, 4.5, cfg.num_kv_heads, cfg.head_dim)
    assert unvalidated.plan == [lie] * cfg.num_layers and not unvalidated.validation


def test_a_plan_carries_its_calibrated_codecs_states_into_the_engine():
    from bytediet import LLM
    from bytediet.calibrate.kv_budget import measure_errors

    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=4))
    sens = measure_errors(model, [torch.randint(0, cfg.vocab_size, (96,))], candidates=("q4_0", "turboquant3"))
    assert sens.codecs["turboquant3"].calibration_state() is not None
    state = {
        "budget": 4.5,
        "plan": [{"k": "turboquant3", "v": "q4_0"}] * cfg.num_layers,
        "states": sens.states(["turboquant3", "q4_0"]),
    }
    assert set(state["states"]) == {"turboquant3"}
    llm = LLM(
        "tiny", loaded=(model, None), kv_cache_dtype="auto:4.5", kv_calibration_state=state, num_blocks=8, block_size=16
    )
    key_half = llm.engine.runner.codec.layers[0].key_half
    assert "calibrated" in key_half.describe(64) and "uncalibrated" not in key_half.describe(64)
    assert llm.engine.runner.codec.calibration_state()["states"] == state["states"]


def test_calibration_windows_too_short_to_split_name_the_flags():
    from bytediet.calibrate.kv_budget import split_windows

    with pytest.raises(ConfigError, match=r"--kv-calib-len of at least 32"):
        split_windows([torch.arange(20)])


def test_rank_correlation_is_spearmans_rho():
    from bytediet.calibrate.kv_budget import rank_correlation

    assert rank_correlation([1, 2, 3, 4], [10, 20, 30, 400]) == pytest.approx(1.0)
    assert rank_correlation([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert rank_correlation([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(0.9486832980505138)  # scipy.stats.spearmanr
    assert rank_correlation([1, 2], [2, 1]) is None


def test_a_validation_window_scored_a_chunk_of_rows_at_a_time_gives_the_whole_window_s_kl(monkeypatch):
    """_window_kl compares both runs a few rows at a time (a 262k vocabulary never holds a window's logits): the
    KL of scoring each whole window at once."""
    import bytediet.calibrate.kv_budget as kb

    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=6))
    window = torch.randint(0, cfg.vocab_size, (77,), generator=torch.Generator().manual_seed(3))
    codec = get_kv_codec("q4_0")
    ref = model.score(window).float().log_softmax(dim=-1)
    test = model.score(window, kv_codec=codec, block_size=16).float().log_softmax(dim=-1)
    whole = float((ref.exp() * (ref - test)).sum())
    monkeypatch.setattr(kb, "VALIDATION_ROW_ELEMENTS", 10 * cfg.vocab_size)  # 10 rows a chunk, uneven last
    kl, rows = kb._window_kl(model, window, codec)
    assert rows == 77 and whole > 0
    assert kl == pytest.approx(whole, rel=1e-4)
