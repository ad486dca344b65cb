"""Calibration set and activation capture: windows from the calibration split, hook statistics, block runner."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.base import BlockRunner, CalibrationConfig, capture
from bytediet.errors import ConfigError
from bytediet.eval.corpus import calibration_windows, make_windows
from bytediet.models.layers import Linear
from bytediet.models.loader import load_model
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config
from tests.eval.test_harness import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("calib-ckpt"), seed=3)


def test_windows_come_from_the_calibration_split_seeded(ckpt):
    _, tok = load_model(ckpt)
    cfg = CalibrationConfig(samples=3, seq_len=24, corpus=str(ckpt / "corpus.txt"), seed=7)
    w = calibration_windows(tok, cfg)
    bos = tok.encode("", add_special_tokens=True)
    assert w.shape == (3, len(bos) + 24) and w.dtype == torch.long
    ids = torch.tensor(tok.encode((ckpt / "corpus.txt").read_text(), add_special_tokens=False))
    expected = make_windows(ids, 24, 3, split="calibration", seed=7)
    assert torch.equal(w[:, len(bos) :], torch.stack([x.ids for x in expected]))
    eval_tokens = {s for win in make_windows(ids, 24, split="eval") for s in range(win.start, win.stop)}
    assert not eval_tokens & {s for win in expected for s in range(win.start, win.stop)}
    assert torch.equal(w, calibration_windows(tok, cfg))  # seeded
    assert not torch.equal(w, calibration_windows(tok, CalibrationConfig(3, 24, str(ckpt / "corpus.txt"), seed=8)))


def test_too_little_calibration_text_is_a_clear_error(ckpt):
    _, tok = load_model(ckpt)
    with pytest.raises(ConfigError, match=r"calibration data too short.*--calib-samples"):
        calibration_windows(tok, CalibrationConfig(samples=500, seq_len=512, corpus=str(ckpt / "corpus.txt")))
    with pytest.raises(ConfigError):
        CalibrationConfig(samples=0)


def test_capture_statistics_match_a_direct_computation():
    torch.manual_seed(0)
    a, b = Linear(12, 5), Linear(12, 3)
    fp32 = get_weight_format("fp32")
    a.set_weight(torch.randn(5, 12), fp32)
    b.set_weight(torch.randn(3, 12), fp32)
    xs = [torch.randn(9, 12) * torch.linspace(0.1, 5, 12) for _ in range(3)]
    with capture({"a": a, "b": b}, hessian=True, rows_per_call=4, seed=1) as stats:
        for x in xs:
            a(x), b(x)
    x = torch.cat(xs)
    sa = stats["a"]
    assert sa.tokens == 27
    assert torch.allclose(sa.mean_abs, x.abs().mean(0), atol=1e-6)
    assert torch.equal(sa.abs_max, x.abs().amax(0))
    assert torch.allclose(sa.hessian, 2 * x.double().t() @ x.double() / 27, atol=1e-9)
    sample = sa.sample()
    assert sample.shape == (12, 12)
    assert all(any(torch.equal(r, row) for row in x) for r in sample)  # real input rows ...
    assert torch.equal(sample, stats["b"].sample())  # ... the same ones for every module of a call
    assert len(a._forward_pre_hooks) == 0  # hooks removed
    hessian = sa.hessian
    assert torch.equal(sa.take_hessian(), hessian) and sa.gram is None  # in the Gram's storage, which is let go


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_block_runner_reproduces_the_model(arch):
    cfg = tiny_config(arch)
    model = model_from_state(cfg, random_state(cfg, seed=2))
    windows = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    runner = BlockRunner(model, windows)
    h = runner.embed()
    for i in range(cfg.num_layers):
        h = runner.run_block(i, h)
    logits = runner.logits(h)
    for w, got in zip(windows, logits):
        assert torch.allclose(got, model.score(w), atol=1e-5, rtol=1e-5)
