"""Tier keys: the salted hash chain changes with the model, codec (and its calibration), block size and layout."""

from __future__ import annotations

import subprocess
import sys

import torch

from bytediet.engine.kv_tiers.keys import chain_key, model_fingerprint, tier_salt
from tests.conftest import model_from_state, random_state, tiny_config

BASE = {"model_fp": "m", "codec_name": "fp32", "codec_state": None, "block_size": 16, "layout": "[]", "stored_as": None}


def test_salt_changes_with_model_codec_state_block_size_layout_and_at_rest_codec():
    base = tier_salt(**BASE)
    assert tier_salt(**BASE) == base
    for field, other in [
        ("model_fp", "m2"),
        ("codec_name", "bf16"),
        ("codec_state", {"scale": [1.0]}),
        ("block_size", 32),
        ("layout", "[[3]]"),
        ("stored_as", "rot-q8_0"),
    ]:
        assert tier_salt(**{**BASE, field: other}) != base, field
    a = tier_salt(**{**BASE, "codec_state": {"s": torch.ones(4)}})
    b = tier_salt(**{**BASE, "codec_state": {"s": torch.ones(4) * 2}})
    assert a != b


def test_chain_key_depends_on_parent_and_tokens_and_is_stable_across_processes():
    root = tier_salt(**BASE)
    k1 = chain_key(root, [1, 2, 3, 4])
    assert chain_key(root, [1, 2, 3, 5]) != k1
    assert chain_key(tier_salt(**{**BASE, "block_size": 4}), [1, 2, 3, 4]) != k1
    assert chain_key(k1, [5, 6, 7, 8]) != chain_key(root, [5, 6, 7, 8])
    code = (
        "from bytediet.engine.kv_tiers.keys import chain_key, tier_salt;"
        f"print(chain_key(tier_salt(**{BASE!r}), [1, 2, 3, 4]).hex())"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert other == k1.hex()


def test_model_fingerprint_tells_models_apart():
    config = tiny_config("llama")
    a = model_from_state(config, random_state(config, seed=0))
    b = model_from_state(config, random_state(config, seed=1))
    assert model_fingerprint(a) == model_fingerprint(a)
    assert model_fingerprint(a) != model_fingerprint(b)
