"""The engine's KV sizing: concurrent sequences in a fixed memory, from the block pool and the per-sequence staging."""

from __future__ import annotations

import pytest

from bytediet.engine.runner import ModelRunner, sequence_capacity
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.config import CacheConfig
from tests.conftest import model_from_state, random_state, tiny_config

MEMORY = 8 << 20


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64)  # 2 layers
    return model_from_state(cfg, random_state(cfg))


def test_hf4_window_staging_caps_sequences_longer_than_their_share(model):
    """hf4 per layer and token (2 KV heads × 64): K = 64 B codes + 8 B per-channel fp16 scale/zero (per 64 tokens)
    + 16 B fp16 window staging (128 × 2 × 64 × 2 B per 2048 tokens) + 8 B / 128 bookkeeping = 88.0625 B; V the same
    with per-token scales → 176.125 B. A 128-token block of both layers: 45 088 B; 8 MiB holds 186 blocks =
    23 808 slots, whose staging pool has 23 808 // 2048 = 11 windows. 1024-token sequences: 186 // 8 = 23 by
    blocks, 11 by staging; 4096-token ones: 186 // 32 = 5 by blocks."""
    codec = get_kv_codec("hf4")
    assert codec.bytes_per_token(2, 64) == 176.125
    cache = CacheConfig(kv_cache_memory=MEMORY, kv_cache_dtype="hf4")
    assert sequence_capacity(codec, model, cache, 1024) == {
        "sequences": 11,
        "num_blocks": 186,
        "by_blocks": 23,
        "by_staging": 11,
    }
    assert sequence_capacity(codec, model, cache, 4096)["sequences"] == 5
    runner = ModelRunner(model, cache)  # what the engine allocates and enforces
    assert (runner.num_blocks, runner.max_sequences) == (186, 11)


def test_codecs_without_staging_are_limited_by_blocks_only(model):
    """q8_0: 8.5 bits × 2 × 2 × 64 / 8 = 272 B per layer and token; 16-token blocks of 2 layers = 8704 B;
    8 MiB // 8704 = 963 blocks; 4096 tokens take 256 blocks → 3 sequences."""
    cache = CacheConfig(kv_cache_memory=MEMORY, kv_cache_dtype="q8_0")
    assert sequence_capacity(get_kv_codec("q8_0"), model, cache, 4096) == {
        "sequences": 3,
        "num_blocks": 963,
        "by_blocks": 3,
        "by_staging": None,
    }
