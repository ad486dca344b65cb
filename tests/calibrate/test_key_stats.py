"""Per-channel key statistics: a planted outlier channel is found, before and after RoPE, and flat keys look flat."""

from __future__ import annotations

import pytest
import torch

from bytediet.calibrate.key_stats import channel_stats, key_stats
from bytediet.errors import ConfigError
from tests.conftest import model_from_state, random_state, tiny_config


def test_flat_gaussian_keys_have_no_outliers():
    g = torch.Generator().manual_seed(0)
    s = channel_stats(torch.randn(4096, 2, 64, generator=g))
    assert s["outliers"] == 0 and s["max_median_ratio"] < 1.2
    assert s["kurtosis"] == pytest.approx(3.0, abs=0.15) and s["top_share"] == pytest.approx(4 / 64, rel=0.15)
    assert s["mean_share"] < 0.01


def test_a_planted_channel_and_a_constant_offset_are_measured():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2048, 2, 64, generator=g)
    x[:, 1, 37] *= 30.0  # one channel 30× the others: most of head 1's energy
    s = channel_stats(x)
    assert s["top_channel"] == [1, 37] and s["outliers"] == 1
    assert s["max_median_ratio"] == pytest.approx(30.0, rel=0.1)
    assert s["top_share"] == pytest.approx((900 + 3) / (900 + 63), rel=0.02)  # the channel and 3 more of 64
    assert s["kurtosis"] > 20
    offset = channel_stats(x[:, :1] + 3.0)  # a bias on every channel of head 0: 9 of 10 parts of the energy
    assert offset["mean_share"] == pytest.approx(0.9, abs=0.01) and offset["outliers"] == 0


def test_a_planted_outlier_channel_of_a_model_is_found_before_and_after_rope():
    cfg = tiny_config("qwen2", head_dim=16, num_kv_heads=2, num_heads=4, hidden_size=32)
    state = random_state(cfg, seed=3)
    state["model.layers.0.self_attn.k_proj.weight"][16 + 7] *= 25.0  # layer 0, KV head 1, channel 7 (low frequency)
    model = model_from_state(cfg, state)
    g = torch.Generator().manual_seed(0)
    out = key_stats(model, [torch.randint(0, cfg.vocab_size, (96,), generator=g) for _ in range(2)])
    assert out["tokens"] == 192 and len(out["layers"]) == cfg.num_layers
    planted, other = out["layers"]
    for side in ("pre", "post"):
        assert planted[side]["top_channel"] == [1, 7] and planted[side]["outliers"] >= 1, side
        assert planted[side]["max_median_ratio"] > 3 * other[side]["max_median_ratio"], side
        assert out["summary"][side]["max_median_ratio"]["max_layer"] == 0
    assert other["pre"]["outliers"] == 0


def test_too_few_keys_are_refused():
    with pytest.raises(ConfigError, match="tokens >= 2"):
        channel_stats(torch.randn(1, 2, 8))
