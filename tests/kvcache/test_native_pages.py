"""Which caches the native attention reads in place (``LayerKVCache.native_pages``), and that reading them there
(``attend_natively``) equals the codec's own read of the same pages: llama.cpp's block types, split K/V specs
whose halves differ (k=q8_0,v=q4_0), and the layers of an ``auto:`` budget plan."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch

from bytediet.kernels.cpu import build
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.base import LayerKVCache
from tests.kvcache.test_codec_matrix import random_batch_plan, step_metadata

NATIVE = pytest.mark.skipif(
    build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels on this machine"
)

PAGES = {  # spec: (key page type, value page type), or None where the codec's own read runs
    "q8_0": ("q8_0", "q8_0"),
    "q5_0": ("q5_0", "q5_0"),
    "q4_1": ("q4_1", "q4_1"),
    "q4_0": ("q4_0", "q4_0"),
    "k=q8_0,v=q4_0": ("q8_0", "q4_0"),
    "k=int8,v=q5_0": ("int8", "q5_0"),
    "k=bf16,v=q4_1": ("bf16", "q4_1"),
    "k=q4_0,v=fp16": ("q4_0", "fp16"),
    "k=fp8,v=q8_0": ("fp8", "q8_0"),
    "int8": ("int8", "int8"),
    "k=turboquant3,v=q4_0": None,
    "k=q8_0,v=kivi2": ("q8_0", "int2-token-g32-asym"),
    "kivi2g16": ("kivi2-keys", "int2-token-g32-asym"),
    "kivi4g16": ("kivi4-keys", "int4-token-g32-asym"),
    "k=kivi4g16,v=bf16": ("kivi4-keys", "bf16"),
    "k=turboquant3,v=kivi4": None,
    "qjl": ("qjl2-keys", "int4-token-g32-asym"),
    "qjl1": ("qjl1-keys", "int4-token-g32-asym"),
    "k=qjl3,v=q8_0": ("qjl3-keys", "q8_0"),
    "polarquant": ("polarquant", "polarquant"),
    "k=polarquant,v=kivi4": ("polarquant", "int4-token-g32-asym"),
    "hf4": ("kivi4-keys", "int4-token-g64-asym"),
    "hf2r64": ("kivi2-keys", "int2-token-g64-asym"),
    "k=hf4,v=fp16": ("kivi4-keys", "fp16"),
    "turboquant_prod2.5": ("turboquant", "turboquant"),
    "turboquant3.25": ("turboquant", "turboquant"),
    "turboquant4": None,  # two parts, uncalibrated: not before the first write chooses their outlier channels
    "rot-int8": None,
    "k=rot-q8_0,v=q4_0": None,  # rotated: only their own attend reads them natively (test_rotated)
}


@pytest.mark.parametrize("spec", sorted(PAGES))
def test_which_pages_the_native_attention_reads(spec):
    block = max(16, get_kv_codec(spec).min_block_size())  # HF's windows: 64 or 128 tokens
    cache = get_kv_codec(spec).create_cache(0, max(1, 64 // block), block, 2, 64, torch.float32, "cpu")
    pages = cache.native_pages()
    if PAGES[spec] is None:
        assert pages is None
        return
    assert (pages["k_dtype"], pages["v_dtype"]) == PAGES[spec]
    if pages["k_dtype"] == "turboquant":  # the codes of both halves, described by their TurboQuantPageSpec
        assert pages["k_cache"] is None and len(pages["k_side"].parts) == len(cache.keys.parts)
        assert (pages["k_side"].parts[0].signs is not None) == spec.startswith("turboquant_prod")
        return
    for role in ("k", "v"):
        assert pages[f"{role}_cache"].shape[:2] == (cache.num_blocks * block, 2)
        assert (pages[f"{role}_scale"] is not None) == (PAGES[spec][role == "v"] in ("int8", "fp8"))


def test_an_auto_plan_reads_its_layers_natively_where_both_halves_allow():
    codec = get_kv_codec("auto:7")
    plan = [
        {"k": "q8_0", "v": "q4_0"},
        {"k": "turboquant4", "v": "q4_1"},
        {"k": "bf16", "v": "q5_0"},
        {"k": "q4_0", "v": "q4_0"},
    ]
    codec.load_calibration_state({"budget": 7.0, "plan": plan})
    caches = [codec.create_cache(i, 4, 16, 2, 64, torch.float32, "cpu") for i in range(len(plan))]
    kinds = [None if p is None else (p["k_dtype"], p["v_dtype"]) for p in (c.native_pages() for c in caches)]
    assert kinds == [("q8_0", "q4_0"), None, ("bf16", "q5_0"), ("q4_0", "q4_0")]  # turboquant keys: codec's read


def attend_both_ways(spec, *, hq, hkv, d, window, seed, num_blocks=48, block_size=16):
    """Ragged steps (a prefill chunk, mixed prefill + decode steps, pure decodes) over one cache: each step's
    attention natively and by the codec's own read (attend_natively off) on the same pages."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    cache = get_kv_codec(spec).create_cache(0, num_blocks, block_size, hkv, d, torch.float32, "cpu")  # spec or codec
    plan = random_batch_plan(rng, num_blocks, block_size, 3, 130)
    done = [0] * len(plan)
    pairs = []
    for step in range(6):
        if step == 0:  # prefill chunks
            new = [min(n, rng.randint(1, 40)) for _, n in plan]
        else:  # prefill chunks beside decodes, then decodes only
            new = [min(n - dn, rng.randint(0, 9) if step < 3 else 1) for dn, (_, n) in zip(done, plan)]
        if sum(new) == 0:
            break
        meta = step_metadata(plan, done, new, block_size)
        t = sum(new)
        cache.write(torch.randn(t, hkv, d, generator=gen) * 2, torch.randn(t, hkv, d, generator=gen), meta.slot_mapping)
        # (TurboQuant's outlier channels: chosen by the first write; rotated pages: the attention's, not the step's)
        assert cache.attention_pages() is not None
        q = torch.randn(t, hq, d, generator=gen)
        native = cache.attend(q, meta, d**-0.5, window)
        with mock.patch.object(LayerKVCache, "attend_natively", return_value=None):
            own = cache.attend(q, meta, d**-0.5, window)
        pairs.append((native, own))
        done = [dn + m for dn, m in zip(done, new)]
    return pairs


def assert_native_equals_own_read(spec, *, tol, **kwargs):
    """attend_both_ways(spec, **kwargs) with the reference twin forbidden: ≥ 3 steps, native == the codec's own read
    to ``tol`` of the largest output."""
    with mock.patch(
        "bytediet.kernels.reference.attention_over_pages",
        side_effect=AssertionError("the reference twin ran, not the native kernel"),
    ):
        pairs = attend_both_ways(spec, **kwargs)
    assert len(pairs) >= 3
    for native, own in pairs:
        assert (native - own).abs().max().item() <= tol * max(1.0, own.abs().max().item())


def assert_staged_native_equals_own_read(spec, block, slots, hq, hkv, d, window):
    """assert_native_equals_own_read for pages with staged windows (KIVI, HF): ``slots`` tokens in blocks of
    ``block``, to 1e-5."""
    seed = hq * d + hkv + block
    assert_native_equals_own_read(
        spec, hq=hq, hkv=hkv, d=d, window=window, seed=seed, num_blocks=slots // block, block_size=block, tol=1e-5
    )


@NATIVE
@pytest.mark.parametrize(
    "spec",
    [
        "q8_0",
        "q5_0",
        "q4_1",
        "q4_0",
        "q5_1",
        "k=q5_1,v=q4_0",
        "k=q8_0,v=q4_0",
        "k=int8,v=q4_1",
        "k=bf16,v=q5_0",
        "rot-int8",
        "rot-q8_0",
        "k=rot-q8_0,v=int8",
        "k=q8_0,v=rot-int8",
    ],
)
@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (4, 4, 32, None), (6, 2, 96, 7)])
def test_native_attention_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    assert_native_equals_own_read(spec, hq=hq, hkv=hkv, d=d, window=window, seed=hq * d + hkv, tol=1e-5)


# KIVI (arXiv 2402.02750): keys per channel over block-aligned groups of G tokens, the open group's tokens from the
# staging pages; values per token in groups of 32 channels. Odd lengths leave groups partly filled (open) at every
# step; prefill chunks fill whole groups at once or end inside one; the halves mix with other page types.
KIVI_SPECS = {  # spec: block size (a multiple of the key group)
    "kivi2": 32,
    "kivi4": 32,
    "kivi2g16": 16,
    "kivi4g16": 32,
    "k=q8_0,v=kivi2": 16,
    "k=kivi2,v=fp16": 32,
}


@NATIVE
@pytest.mark.parametrize("spec", sorted(KIVI_SPECS))
@pytest.mark.parametrize("hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (4, 4, 32, None), (6, 2, 96, 7)])
def test_native_attention_on_kivi_pages_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    assert_staged_native_equals_own_read(spec, KIVI_SPECS[spec], 4096, hq, hkv, d, window)  # 8 staging pages: 3 open


def test_kivi_pages_the_native_attention_cannot_read_keep_the_codecs_read():
    # head_dim 24: the values' channel groups are 24 wide, not 32 (the native value pages' groups)
    cache = get_kv_codec("kivi2g16").create_cache(0, 128, 16, 2, 24, torch.float32, "cpu")
    assert cache.native_pages() is None


def test_the_native_decode_step_says_it_does_not_write_kivi_pages():
    from bytediet.models.native_decode import _pages_or_objection

    cache = get_kv_codec("kivi2").create_cache(0, 64, 32, 2, 64, torch.float32, "cpu")
    pages, why = _pages_or_objection(cache)
    assert pages is None and "kivi2-keys" in why and "\n" not in why
    pages, why = _pages_or_objection(get_kv_codec("q8_0").create_cache(0, 4, 16, 2, 64, torch.float32, "cpu"))
    assert why == "" and "k_side" not in pages and pages["k_dtype"] == "q8_0"


# QJL (arXiv 2406.03482): keys scored on their sign bits against the query sketched once per call, values per token
# (int4, groups of 32 channels); calibrated: the key mean's q·μ, the same for every key of a query, left to the softmax.
@NATIVE
@pytest.mark.parametrize("spec", ["qjl", "qjl1", "qjl4", "k=qjl3,v=q8_0", "qjl-calibrated"])
@pytest.mark.parametrize(
    "hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (4, 4, 32, None), (6, 2, 96, 7), (7, 1, 64, None)]
)
def test_native_attention_on_qjl_pages_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    codec = get_kv_codec(spec.removesuffix("-calibrated"))
    if spec.endswith("-calibrated"):
        gen = torch.Generator().manual_seed(d)
        codec.key_half.calibrate(torch.randn(64, hkv, d, generator=gen) + 3 * torch.randn(1, hkv, d, generator=gen), 0)
    assert_native_equals_own_read(codec, hq=hq, hkv=hkv, d=d, window=window, seed=hq * d + hkv, tol=1e-4)


# PolarQuant (arXiv 2502.02617): keys scored against the query rotated once, rows widened down the polar tree in the
# rotated basis; values summed there and rotated back once per head (head_dim a multiple of 64: its packed levels).
@NATIVE
@pytest.mark.parametrize("spec", ["polarquant", "k=polarquant,v=q4_0", "k=fp16,v=polarquant"])
@pytest.mark.parametrize(
    "hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (6, 2, 128, 7), (7, 1, 64, None), (4, 4, 64, 33)]
)
def test_native_attention_on_polarquant_pages_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    assert_native_equals_own_read(spec, hq=hq, hkv=hkv, d=d, window=window, seed=hq * d + hkv, tol=1e-4)


# HF QuantizedCache (hf2/hf4): keys per channel over 64-token groups (KIVI's layout) and values per token in groups of
# 64 channels, both behind a full-precision window of R tokens staged in fp16 until it fills: odd lengths leave
# windows open at every step, prefill chunks fill whole windows or end inside one.
HF_SPECS = {"hf4": 128, "hf2": 128, "hf4r64": 64, "k=hf2r64,v=bf16": 64, "k=q8_0,v=hf4r64": 64}  # spec: block size


@NATIVE
@pytest.mark.parametrize("spec", sorted(HF_SPECS))
@pytest.mark.parametrize(
    "hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (6, 2, 128, 7), (7, 1, 64, None), (4, 4, 64, 100)]
)
def test_native_attention_on_hf_pages_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    assert_staged_native_equals_own_read(spec, HF_SPECS[spec], 8192, hq, hkv, d, window)  # 4 staging windows: 3 open


# TurboQuant on the module path (arXiv 2504.19874): turboquant_prod's keys — MSE codes plus the residual's 1-bit QJL
# sketch, scored against the query rotated and sketched once — and the MSE variant's prefill chunks; values MSE.
# Uncalibrated two-part layouts pick their outlier channels at the first write; calibrated: a mean and a channel order.
@NATIVE
@pytest.mark.parametrize(
    "spec",
    [
        "turboquant_prod3",
        "turboquant_prod2.5",
        "turboquant_prod3.5-calibrated",
        "turboquant3.5",
        "turboquant2.5:qr-calibrated",
    ],
)
@pytest.mark.parametrize(
    "hq,hkv,d,window", [(9, 3, 64, None), (4, 1, 256, 20), (4, 4, 32, None), (6, 2, 96, 7), (7, 1, 64, None)]
)
def test_native_attention_on_turboquant_pages_equals_the_codecs_own_read(spec, hq, hkv, d, window):
    codec = get_kv_codec(spec.removesuffix("-calibrated"))
    if any(bits == 1 for _, bits in codec.key_half.layout(d)) and codec.key_half.variant == "prod":
        pytest.skip(f"{spec} at head_dim {d}: 1-bit prod parts have no MSE codes (the codec's own read runs)")
    if spec.endswith("-calibrated"):
        gen = torch.Generator().manual_seed(d)
        offset = 3 * torch.randn(1, hkv, d, generator=gen)
        codec.calibrate(torch.randn(64, hkv, d, generator=gen) * 2 + offset, torch.randn(64, hkv, d, generator=gen), 0)
    assert_native_equals_own_read(codec, hq=hq, hkv=hkv, d=d, window=window, seed=hq * d + hkv, tol=1e-4)


def test_the_native_decode_step_says_it_does_not_write_turboquant_prod_keys():
    from bytediet.models.native_decode import _pages_or_objection

    pages, why = _pages_or_objection(
        get_kv_codec("turboquant_prod3").create_cache(0, 4, 16, 2, 64, torch.float32, "cpu")
    )
    assert pages is None and "turboquant_prod" in why and "attention native" in why and "\n" not in why
    pages, why = _pages_or_objection(get_kv_codec("turboquant3").create_cache(0, 4, 16, 2, 64, torch.float32, "cpu"))
    assert why == "" and pages["k_dtype"] == "turboquant" and pages["k_tq"] is not None
