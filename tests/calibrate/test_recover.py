"""Recovery fine-tuning: a step lowers the KL, the mask stays frozen, state resumes exactly, bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from bytediet.calibrate.recover import Recovery, RecoveryConfig, distillation_kl
from bytediet.errors import ConfigError
from bytediet.models.quantize import QuantizeConfig, quantize
from tests.conftest import model_from_state, random_state, tiny_config


def pair(arch="llama", spec="sparse24"):
    cfg = tiny_config(arch)
    state = random_state(cfg, 0)
    teacher, student = model_from_state(cfg, state), model_from_state(cfg, state)
    quantize(student, QuantizeConfig(format=spec, skip=("lm_head",)))
    return teacher, student, cfg


def windows(cfg, n, seed=0, length=24):
    return torch.randint(0, cfg.vocab_size, (n, length), generator=torch.Generator().manual_seed(seed))


def kl_on(teacher, student, wins):
    return sum(float(distillation_kl(teacher.score(w), student.score(w))) for w in wins) / len(wins)


@pytest.mark.parametrize("arch,spec", [("llama", "sparse24"), ("gemma3", "sparse24-int8"), ("llama", "sparse50")])
def test_a_recovery_step_lowers_the_kl_and_keeps_the_mask(arch, spec):
    teacher, student, cfg = pair(arch, spec)
    train = windows(cfg, 1)
    masks = {n: lin.format.mask(lin.packed) for n, lin in student.linear_layers() if n != "lm_head"}
    before = kl_on(teacher, student, train)
    assert before > 1e-3
    run = Recovery(student, teacher, train, RecoveryConfig(steps=1, lr=1e-3, warmup=0))
    with torch.enable_grad(), run._training():
        loss = run.train_step()
    assert loss == pytest.approx(before, rel=1e-4)  # the step's loss is the KL of the untrained model
    after = kl_on(teacher, student, train)
    assert after < 0.9 * before, (before, after)
    for n, lin in student.linear_layers():  # the layers are back in their own format, mask unchanged
        if n != "lm_head":
            assert lin.format.spec() == spec and torch.equal(lin.format.mask(lin.packed), masks[n])


@pytest.mark.parametrize("spec", ["int4-g32", "int4-g32-sym"])
def test_int4_recovery_trains_the_scales_and_keeps_the_codes(spec):
    """PEQA: only the group scales (and offsets) move; the codes and the format's bytes stay as they were."""
    teacher, student, cfg = pair("llama", spec)
    train = windows(cfg, 1)
    before_packed = {
        n: {k: t.clone() for k, t in lin.packed.items()} for n, lin in student.linear_layers() if n != "lm_head"
    }
    before = kl_on(teacher, student, train)
    run = Recovery(student, teacher, train, RecoveryConfig(steps=3, lr=3e-3, warmup=0))
    trained = {"log_scale"} if spec.endswith("sym") else {"log_scale", "offset_shift"}
    assert set(k.split("::")[1] for k in run.params) == trained
    run.run()
    assert kl_on(teacher, student, train) < 0.9 * before
    for n, lin in student.linear_layers():
        if n == "lm_head":
            continue
        old = before_packed[n]
        assert lin.format.spec() == spec and set(lin.packed) == set(old)
        assert torch.equal(lin.packed["qweight"], old["qweight"])  # codes frozen
        assert lin.packed["scale"].dtype == torch.float16 and not torch.equal(lin.packed["scale"], old["scale"])


def test_int4_recovery_runs_the_native_kernels_on_the_trained_scales():
    """After training the layer's cached native layout is rebuilt: the model's own forward equals the twin's."""
    teacher, student, cfg = pair("llama", "int4-g32")
    Recovery(student, teacher, windows(cfg, 1), RecoveryConfig(steps=2, lr=3e-3, warmup=0)).run()
    x = torch.randn(3, cfg.hidden_size)
    lin = dict(student.linear_layers())["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(
        lin(x), torch.nn.functional.linear(x, lin.format.dequantize(lin.packed)), atol=2e-3, rtol=2e-3
    )


def test_training_lowers_held_out_kl_and_records_the_history():
    teacher, student, cfg = pair()
    held_out = windows(cfg, 2, seed=9)
    before = kl_on(teacher, student, held_out)
    run = Recovery(student, teacher, windows(cfg, 8), RecoveryConfig(steps=12, lr=3e-3, warmup=2, eval_every=6))
    result = run.run(evaluate=lambda m: {"held_out_kl": kl_on(teacher, m, held_out)})
    assert [h["step"] for h in result["history"]] == [0, 6, 12] and result["tokens"] == 12 * 24
    assert result["history"][0]["held_out_kl"] == pytest.approx(before)
    assert kl_on(teacher, student, held_out) < 0.9 * before
    assert student.quantize_config.calibration["recovery"]["steps_done"] == 12


def test_token_budget_stops_training():
    teacher, student, cfg = pair()
    result = Recovery(student, teacher, windows(cfg, 4), RecoveryConfig(steps=50, batch=2, max_tokens=100)).run()
    assert result["steps"] == 3 and result["tokens"] == 144  # 48 tokens a step; stops once ≥ 100


def test_resuming_from_the_state_file_equals_an_uninterrupted_run(tmp_path):
    cfg_run = RecoveryConfig(steps=6, lr=2e-3, warmup=1, save_every=2)
    teacher, whole, cfg = pair()
    Recovery(whole, teacher, windows(cfg, 3), cfg_run).run()
    _, part, _ = pair()
    state = tmp_path / "state.pt"
    Recovery(part, teacher, windows(cfg, 3), replace(cfg_run, max_tokens=4 * 24), state).run()  # stops at 4 of 6
    _, resumed, _ = pair()
    again = Recovery(resumed, teacher, windows(cfg, 3), cfg_run, state)
    assert again.step == 4 and again.tokens == 4 * 24
    again.run()
    for (n, a), (_, b) in zip(whole.linear_layers(), resumed.linear_layers()):
        assert torch.allclose(a.dequantized_weight(), b.dequantized_weight(), atol=1e-6), n


def test_bad_input():
    teacher, student, cfg = pair()
    with pytest.raises(ConfigError, match="calibration windows"):
        Recovery(student, teacher, None)
    dense = model_from_state(cfg, random_state(cfg, 0))
    with pytest.raises(ConfigError, match="pruned or INT4 layers.*prune or quantize it first"):
        Recovery(dense, teacher, windows(cfg, 1))
    with pytest.raises(ConfigError, match="recover-tokens"):
        RecoveryConfig(max_tokens=0)
