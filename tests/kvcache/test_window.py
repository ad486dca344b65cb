"""The full-precision recent window (KIVI / Hugging Face residual) and the HF QuantizedCache codec built on it."""

from __future__ import annotations

import pytest
import torch

from bytediet.errors import BytedietError, ConfigError
from bytediet.kvcache import AttentionMetadata, get_kv_codec


def _write_one_sequence(spec: str, n: int, block_size: int = 128):
    torch.manual_seed(1)
    k = torch.randn(n, 2, 64) * torch.linspace(0.1, 5, 64)  # outlier channels, per-channel keys handle them
    v = torch.randn(n, 2, 64)
    cache = get_kv_codec(spec).create_cache(0, 8, block_size, 2, 64, torch.float32, "cpu")
    meta = AttentionMetadata.for_single_sequence(n, block_size)
    for lo in range(0, n, 37):  # a prefill chunk, then ragged writes
        cache.write(k[lo : lo + 37], v[lo : lo + 37], meta.slot_mapping[lo : lo + 37])
    return cache, k, v, meta


def test_recent_tokens_are_exact_older_ones_are_quantized():
    cache, k, v, meta = _write_one_sequence("hf4", 300)  # windows of 128: 256 quantized, 44 staged
    kd, vd = cache.decode(meta.slot_mapping)
    torch.testing.assert_close(kd[256:], k[256:].half().float(), rtol=0, atol=0)
    torch.testing.assert_close(vd[256:], v[256:].half().float(), rtol=0, atol=0)
    assert not torch.equal(kd[:256], k[:256].half().float())
    rel = lambda a, b: float((a - b).norm() / b.norm())
    assert rel(kd[:256], k[:256]) < 0.1 and rel(vd[:256], v[:256]) < 0.15  # 4-bit, asymmetric
    # per-channel keys: the error of a channel follows its own range, not the largest channel's
    err = (kd[:256] - k[:256]).abs().amax(dim=(0, 1))
    assert err[:4].max() < 0.2 * err[-4:].min()


def test_window_is_counted_all_in():
    c = get_kv_codec("hf4")
    # 4-bit codes + fp16 scale/zero per 64 (keys: per channel over 64 tokens; values: per token over 64 channels)
    # + an fp16 window of 128 tokens per 2048 cache tokens + two int32 per window chunk
    per_side = 64 * 4 / 8 + 2 * 2 * 64 / 64 + 128 * 64 * 2 / 2048 + 8 / 128
    assert c.bytes_per_token(1, 64) == pytest.approx(2 * per_side)
    assert c.min_block_size() == 128 and get_kv_codec("hf2r64").min_block_size() == 64


def test_open_windows_are_limited_and_freed():
    codec = get_kv_codec("hf4")
    cache = codec.create_cache(0, 16, 128, 1, 64, torch.float32, "cpu")  # 2048 tokens: one staged window
    assert cache.max_sequences() == 1
    cache.write(torch.randn(5, 1, 64), torch.randn(5, 1, 64), torch.arange(5))
    with pytest.raises(BytedietError, match="windows are open at once"):
        cache.write(torch.randn(5, 1, 64), torch.randn(5, 1, 64), torch.arange(128, 133))
    meta = AttentionMetadata.for_single_sequence(5, 128)
    cache.attend(torch.randn(5, 1, 64), meta, 0.125)  # notes sequence 0's open window
    cache.free_sequence(0)
    cache.write(torch.randn(5, 1, 64), torch.randn(5, 1, 64), torch.arange(128, 133))


def test_bad_specs_and_block_sizes():
    with pytest.raises(ConfigError, match="hf4r64"):
        get_kv_codec("hf3")
    with pytest.raises(ConfigError, match="must divide the KV block size 64"):
        get_kv_codec("hf4").create_cache(0, 4, 64, 1, 64, torch.float32, "cpu")
