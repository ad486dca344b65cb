"""KV calibration: K/V/Q capture from a real forward pass, and codecs calibrated from it."""

from __future__ import annotations

import torch

from bytediet.calibrate.kv import calibrate_codec, capture_kv
from bytediet.kvcache import get_kv_codec
from tests.conftest import model_from_state, random_state, tiny_config


def test_capture_records_post_rope_keys_values_and_queries():
    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=1))
    windows = [torch.randint(0, cfg.vocab_size, (40,)), torch.randint(0, cfg.vocab_size, (24,))]
    samples = capture_kv(model, windows)
    assert len(samples) == cfg.num_layers
    s = samples[0]
    assert s["k"].shape == (64, 2, 64) and s["v"].shape == (64, 2, 64) and s["q"].shape == (64, 4, 64)
    # layer 0's keys are k_proj(norm(embedding)) after RoPE: recompute them independently
    attn = model.model.layers[0].self_attn
    x = model.model.layers[0].input_layernorm(model.model.embed_tokens(windows[0]))
    k = attn.k_proj(x).view(40, 2, 64)
    torch.testing.assert_close(s["k"][:40], attn.rope(k, torch.arange(40)), atol=1e-5, rtol=1e-5)
    # each sample's position in its window, and the layer's rotary embedding (to see the keys before RoPE)
    assert torch.equal(s["pos"], torch.cat([torch.arange(40), torch.arange(24)])) and s["rope"] is attn.rope
    torch.testing.assert_close(attn.rope.inverse(s["k"][:40], s["pos"][:40]), k, atol=1e-5, rtol=1e-5)
    assert len(capture_kv(model, windows, max_samples=10)[1]["k"]) == 10


def test_calibrate_codec_sets_means_and_fp8_scales():
    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    model = model_from_state(cfg, random_state(cfg, seed=2))
    windows = [torch.randint(0, cfg.vocab_size, (48,))]
    tq = calibrate_codec(get_kv_codec("turboquant3.5"), model, windows)
    # keys: a pre-RoPE mean per layer (positions and RoPE come with the samples); values: a plain mean
    assert sorted(tq.key_half.rope_means) == list(range(cfg.num_layers)) and not tq.key_half.means
    assert sorted(tq.value_half.means) == list(range(cfg.num_layers)) and not tq.value_half.rope_means
    assert sorted(tq.value_half.ranking) == list(range(cfg.num_layers))
    fp8 = calibrate_codec(get_kv_codec("fp8"), model, windows)
    assert fp8.calibrated
    split = calibrate_codec(get_kv_codec("k=turboquant4,v=bf16"), model, windows)
    assert sorted(split.key_half.rope_means) == list(range(cfg.num_layers))
    logits = model.score(windows[0], kv_codec=tq)
    assert torch.isfinite(logits).all()
