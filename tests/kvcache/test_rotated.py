"""Rotated 8-bit KV codecs (``rot-int8``, ``rot-q8_0``): pages hold x Rᵀ for a fixed orthogonal R, and attention over
them — the query rotated before, the output after — equals attention over the decoded, un-rotated K and V."""

from __future__ import annotations

import pytest
import torch

from bytediet.errors import ConfigError
from bytediet.kernels.cpu import build
from bytediet.kernels.reference import attention_over_context
from bytediet.kvcache import AttentionMetadata, get_kv_codec
from bytediet.kvcache.rotated import RotatedHalf
from bytediet.kvcache.turboquant import TurboQuantHalf


def _outlier_keys(n: int, h: int, d: int, seed: int = 0) -> torch.Tensor:
    """Keys like real ones: most channels small, a few channels ~30× larger (the case a rotation is for)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, h, d, generator=g)
    k[..., torch.randperm(d, generator=g)[:4]] *= 30
    return k


@pytest.mark.parametrize("spec,inner", [("rot-int8", "int8"), ("rot-q8_0", "q8_0")])
@pytest.mark.parametrize("d", [64, 96, 256])  # 96: not a power of two, the QR rotation
def test_pages_hold_rotated_vectors_and_decode_rotates_back(spec, inner, d):
    cache = get_kv_codec(spec).create_cache(3, 4, 16, 2, d, torch.float32, "cpu")
    ref = get_kv_codec(inner).create_cache(3, 4, 16, 2, d, torch.float32, "cpu")
    r_k, r_v = cache.keys.rotation, cache.values.rotation
    for r in (r_k, r_v):
        torch.testing.assert_close(r @ r.T, torch.eye(d), atol=1e-5, rtol=0)
    assert not torch.allclose(r_k, r_v)  # seeded by side (and layer)
    k, v = _outlier_keys(40, 2, d), torch.randn(40, 2, d)
    slots = torch.arange(40)
    cache.write(k, v, slots)
    ref.write(k @ r_k.T, v @ r_v.T, slots)
    for mine, theirs in zip(cache.keys.tensors() + cache.values.tensors(), ref.keys.tensors() + ref.values.tensors()):
        assert torch.equal(mine, theirs)  # the inner codec's pages of x Rᵀ, bit for bit
    kd, vd = cache.decode(slots)
    rk, rv = ref.decode(slots)
    torch.testing.assert_close(kd, rk @ r_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(vd, rv @ r_v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", ["rot-int8", "rot-q8_0", "k=rot-q8_0,v=int8", "k=q8_0,v=rot-int8"])
@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("d,window", [(64, None), (256, 9), (96, None)])
def test_attention_on_rotated_pages_equals_attention_on_the_decoded_vectors(spec, native, d, window):
    """q·k = (q Rᵀ)·(k Rᵀ) and Σ p v = (Σ p v Rᵀ) R: the cache's attention (native kernel, or the codec's own
    blockwise read) equals plain attention over what decode() returns in the model's basis."""
    from unittest import mock

    from bytediet.kvcache.base import LayerKVCache

    n, hq, hkv = 50, 4, 2
    cache = get_kv_codec(spec).create_cache(0, 4, 16, hkv, d, torch.float32, "cpu")
    g = torch.Generator().manual_seed(d)
    k, v, q = _outlier_keys(n, hkv, d), torch.randn(n, hkv, d, generator=g), torch.randn(n, hq, d, generator=g)
    meta = AttentionMetadata.for_single_sequence(n, 16)
    cache.write(k, v, meta.slot_mapping)
    if native:  # the native kernel must run, not its reference twin
        if build.find_compiler() is None or not build.runnable_variants():
            pytest.skip("no native kernels on this machine")
        read = mock.patch(
            "bytediet.kernels.reference.attention_over_pages",
            side_effect=AssertionError("the reference twin ran, not the native kernel"),
        )
    else:
        read = mock.patch.object(LayerKVCache, "attend_natively", return_value=None)
    with read:
        out = cache.attend(q, meta, d**-0.5, window)
    kd, vd = cache.decode(meta.slot_mapping)
    torch.testing.assert_close(out, attention_over_context(q, kd, vd, d**-0.5, window), atol=2e-5, rtol=1e-4)


def test_a_rotation_makes_per_token_int8_more_accurate_on_outlier_channels():
    k = _outlier_keys(256, 1, 256)
    slots = torch.arange(256)
    err = {}
    for spec in ("int8", "rot-int8", "q8_0", "rot-q8_0"):
        cache = get_kv_codec(spec).create_cache(0, 16, 16, 1, 256, torch.float32, "cpu")
        cache.write(k, k, slots)
        err[spec] = float((cache.decode(slots)[0] - k).pow(2).mean())
    assert err["rot-int8"] < err["int8"] / 10 and err["rot-q8_0"] < err["q8_0"]


def test_bytes_are_the_inner_codecs_and_the_decode_step_reads_the_pages_with_their_rotations():
    from bytediet.models.native_decode import _pages_or_objection

    for spec, inner in (("rot-int8", "int8"), ("rot-q8_0", "q8_0")):
        for h, d in ((3, 64), (1, 256)):
            assert get_kv_codec(spec).bytes_per_token(h, d) == get_kv_codec(inner).bytes_per_token(h, d)
    assert get_kv_codec("rot-int8").bits_per_coordinate(1, 256) == 8 + 16 / 256
    cache = get_kv_codec("k=rot-q8_0,v=q8_0").create_cache(0, 4, 16, 2, 64, torch.float32, "cpu")
    assert cache.native_pages() is None and cache.attention_pages()["k_dtype"] == "q8_0"
    pages, why = _pages_or_objection(cache)
    assert why == "" and pages["k_dtype"] == "q8_0" and pages["v_rot"] is None
    assert torch.equal(pages["k_rot"], cache.keys.rotation)


def test_only_stateless_per_token_halves_are_rotated():
    with pytest.raises(ConfigError, match="cannot rotate"):
        RotatedHalf(TurboQuantHalf(4, "mse", "hadamard"))
    assert "hadamard rotation of 64" in get_kv_codec("rot-int8").describe(64)
    assert "qr rotation of 96" in get_kv_codec("rot-q8_0").describe(96)
