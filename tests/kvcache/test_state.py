"""A calibrated codec travels as name + plain-data state, and is rebuilt identical (issue 15)."""

from __future__ import annotations

import json

import pytest
import torch

from bytediet.calibrate.kv import calibrate_codec
from bytediet.errors import ConfigError
from bytediet.kvcache import AttentionMetadata
from bytediet.kvcache.base import build_kv_codec, codec_config, get_kv_codec
from bytediet.kvcache.config import CacheConfig
from bytediet.kvcache.state import to_plain
from tests.conftest import model_from_state, random_state, tiny_config


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("llama", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=64)
    return model_from_state(cfg, random_state(cfg, seed=3))


def _decoded(codec, model, layer: int):
    torch.manual_seed(layer)
    k, v = torch.randn(40, 2, 64) + 1.0, torch.randn(40, 2, 64)
    cache = codec.create_cache(layer, 4, 16, 2, 64, torch.float32, "cpu")
    meta = AttentionMetadata.for_single_sequence(40, 16)
    cache.write(k, v, meta.slot_mapping, meta.positions)
    return cache.decode(meta.slot_mapping, meta.positions)


@pytest.mark.parametrize("spec", ["turboquant3.5", "fp8", "fp8_vllm", "qjl4", "k=fp8,v=turboquant3"])
def test_state_round_trips_through_json(spec, model):
    windows = [torch.randint(0, model.config.vocab_size, (48,))]
    codec = calibrate_codec(get_kv_codec(spec), model, windows)
    name, state = codec_config(codec)
    assert name == spec and state is not None
    plain = json.loads(json.dumps(to_plain(state)))  # what a run config file holds
    rebuilt = build_kv_codec(name, plain, rope=model.rope)
    assert codec_config(rebuilt)[0] == spec
    for layer in range(model.config.num_layers):
        for a, b in zip(_decoded(codec, model, layer), _decoded(rebuilt, model, layer)):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # an uncalibrated rebuild differs: the state is what carries the calibration
    plain_codec = get_kv_codec(spec)
    assert any(not torch.equal(a, b) for a, b in zip(_decoded(codec, model, 0), _decoded(plain_codec, model, 0)))


def test_configs_hold_names_not_objects(tmp_path, model):
    codec = calibrate_codec(get_kv_codec("fp8"), model, [torch.randint(0, model.config.vocab_size, (32,))])
    with pytest.raises(ConfigError, match="kv_calibration_state"):
        CacheConfig(kv_cache_dtype=codec)
    torch.save(codec.calibration_state(), tmp_path / "fp8.pt")  # a state file works as well
    built = CacheConfig(kv_cache_dtype="fp8", kv_calibration_state=str(tmp_path / "fp8.pt")).build_codec()
    assert torch.equal(built.key_half.scales[1], codec.key_half.scales[1])
    with pytest.raises(ConfigError, match="takes no calibration state"):
        build_kv_codec("int8", {"k": {"scales": {}}, "v": None})
    with pytest.raises(ConfigError, match="pre-RoPE"):
        tq = calibrate_codec(get_kv_codec("turboquant3"), model, [torch.randint(0, model.config.vocab_size, (32,))])
        build_kv_codec("turboquant3", tq.calibration_state())  # no rope given
