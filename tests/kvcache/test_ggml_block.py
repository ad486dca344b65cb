"""llama.cpp's KV block types: bit-identical to gguf's reference quantizer, all-in bits, head-dim errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants

from bytediet.errors import ConfigError
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.ggml_block import TYPES


@pytest.mark.parametrize("name", sorted(TYPES))
def test_blocks_are_llama_cpp_bytes_and_decode_like_gguf(name):
    torch.manual_seed(0)
    h, d, n = 2, 64, 40
    x = torch.randn(n, h, d) * torch.logspace(-2, 1, d)  # channels of very different ranges, as keys have
    x[3, 1, :32] = 0.0  # an all-zero block (scale 0)
    cache = get_kv_codec(name).create_cache(0, 4, 16, h, d, torch.float32, "cpu")
    slots = torch.randperm(64)[:n]
    cache.write(x, x.flip(0), slots)
    want = quants.quantize(x.reshape(-1, d).numpy(), TYPES[name])  # (n·h, d/32·bytes) uint8
    got = cache.keys.blocks[slots].reshape(n * h, -1).numpy()
    np.testing.assert_array_equal(got, want)
    k, _ = cache.decode(slots)
    np.testing.assert_array_equal(k.reshape(n * h, d).numpy(), quants.dequantize(want, TYPES[name]))


@pytest.mark.parametrize(
    "spec, bits", [("q8_0", 8.5), ("q5_0", 5.5), ("q4_1", 5.0), ("q4_0", 4.5), ("q5_1", 6.0), ("k=q8_0,v=q4_0", 6.5)]
)
def test_all_in_bits_per_coordinate(spec, bits):
    for hkv, d in ((3, 64), (1, 256)):
        assert get_kv_codec(spec).bits_per_coordinate(hkv, d) == bits


def test_a_head_dim_off_the_block_names_the_layer():
    with pytest.raises(ConfigError, match="layer 5 has head_dim 48.*multiple of 32"):
        get_kv_codec("q4_0").create_cache(5, 4, 16, 2, 48, torch.float32, "cpu")
