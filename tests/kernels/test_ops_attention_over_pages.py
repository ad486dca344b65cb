"""Native paged attention (``ops.attention_over_pages``) against its twin ``reference.attention_over_pages``:
every page type (llama.cpp's GGML block types and the code pages included: KIVI's and HF QuantizedCache's
per-channel keys and per-token values with their staged windows, QJL's sign-bit keys, PolarQuant's rows), keys and
values of different types, the GQA ratios of the three families, odd context lengths across page boundaries,
sliding windows, a ragged batch mixing a prefill chunk (tokens sharing a block table row) with decodes, long
contexts split across threads."""

import functools
import zlib
from unittest import mock

import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import (
    ATTENTION_PAGE_TYPES,
    CODE_PAGE_BITS,
    CODE_PAGE_TYPES,
    PAGE_ALIGN,
    CodePageSide,
)
from tests.kernels import paged_batches
from tests.kernels.paged_batches import BLOCK, row_pages, turboquant_pages

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")
ragged_batch = functools.partial(paged_batches.ragged_batch, spare=3, dtype=torch.int64)


CASES = {  # name: (hq, hkv, d, window, [(tokens, context) per sequence])
    "llama-gqa-3": (9, 3, 64, None, [(1, 1), (1, 17), (1, 130)]),
    "gemma3-gqa-4-window": (4, 1, 256, 20, [(1, 47), (5, 33), (1, 16)]),
    "mha-prefill-chunk": (4, 4, 32, None, [(23, 40), (1, 9)]),
    "qwen2-gqa-7-long": (7, 1, 64, None, [(1, 1000)]),
    "window-prefill": (6, 2, 24, 7, [(12, 12), (1, 70)]),
    "gqa-3-d96-mixed": (9, 3, 96, 33, [(1, 31), (17, 49), (1, 1), (1, 97)]),  # 3 GGML blocks a row
    "batch-10-gqa-3-d32": (6, 2, 32, None, [(1, c) for c in (5, 9, 1, 33, 17, 2, 40, 11, 8, 3)]),
}


def fits(page_type, d):  # llama.cpp's block types, per-token codes, PolarQuant: head_dim a multiple of 32 or 64
    return d % PAGE_ALIGN.get(page_type, 8) == 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype", ATTENTION_PAGE_TYPES)
def test_native_attention_over_pages_equals_reference(variant, case, k_dtype):
    if not fits(k_dtype, CASES[case][2]):
        pytest.skip(f"{k_dtype} pages need head_dim % 32 == 0")
    check(variant, case, k_dtype, k_dtype)


# keys of one page type, values of another: llama.cpp's k=q8_0,v=q4_0, and the pairs the auto: budget plans mix
MIXED = [
    ("q8_0", "q4_0"),
    ("q4_0", "q8_0"),
    ("q8_0", "q5_0"),
    ("q5_0", "q4_1"),
    ("int8", "q4_0"),
    ("q4_1", "int8"),
    ("bf16", "q4_1"),
    ("q8_0", "bf16"),
    ("fp32", "q5_0"),
    ("fp8", "q8_0"),
    ("int8", "bf16"),
    ("fp16", "fp8"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][2] % 32 == 0))
@pytest.mark.parametrize("k_dtype,v_dtype", MIXED)
def test_native_attention_over_mixed_pages_equals_reference(variant, case, k_dtype, v_dtype):
    check(variant, case, k_dtype, v_dtype)


def check(variant, case, k_dtype, v_dtype):
    hq, hkv, d, window, seqs = CASES[case]
    mixed = v_dtype != k_dtype
    gen = torch.Generator().manual_seed(zlib.crc32((case + k_dtype + (v_dtype if mixed else "")).encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    (k, ks), (v, vs) = row_pages(gen, slots, hkv, d, k_dtype), row_pages(gen, slots, hkv, d, v_dtype)
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d**-0.5, window, k_dtype, k, v, ks, vs, v_dtype if mixed else None)
    want = reference.attention_over_pages(*args)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, variant=variant)  # natively: no fallback to the twin
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


# --- code pages: packed codes read with side data (scales, zero points, staged windows, sketches, rotations) ---


def staged(gen, slots, hkv, d, window):
    """(stage_of, stage): about a third of the ``window``-token windows open, their rows in fp16 staging pages."""
    windows = -(-slots // window)
    open_ = torch.rand(windows, generator=gen) < 0.35
    stage_of = torch.full((windows,), -1, dtype=torch.int32)
    stage_of[open_] = torch.randperm(int(open_.sum()), generator=gen).int()
    return stage_of, (torch.randn(max(1, int(open_.sum())), window, hkv, d, generator=gen) * 2).half()


def polar_table(gen):
    """cos then sin of random centroid angles: 16 at the first level, 4 at each of the three above."""
    return torch.cat(
        [torch.cat([a.cos(), a.sin()]) for a in (torch.rand(n, generator=gen) * 6.3 for n in (16, 4, 4, 4))]
    )


def code_pages(gen, slots, hkv, d, page_type, group, window=0):
    """(codes, CodePageSide): random code pages of ``page_type`` (decoder_spec.CODE_PAGE_TYPES). Per-channel keys have
    about a third of their windows open (a window of ``window`` tokens, 0: their group, KIVI's), per-token codes too
    when ``window`` (HF QuantizedCache's values); QJL keys a Gaussian sketch, PolarQuant a random rotation."""
    if page_type == "polarquant":
        codes = torch.randint(0, 256, (slots, hkv, 23 * d // 64), generator=gen, dtype=torch.uint8)
        rotation = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]
        return codes, CodePageSide(
            (torch.rand(slots, hkv, d // 16, generator=gen) + 0.2).half(), transform=rotation, table=polar_table(gen)
        )
    bits = CODE_PAGE_BITS[page_type]
    if page_type.startswith("qjl"):
        m = int(page_type[3]) * d
        codes = torch.randint(0, 256, (slots, hkv, m // 8), generator=gen, dtype=torch.uint8)
        return codes, CodePageSide(
            (torch.rand(slots, hkv, generator=gen) * 4 + 0.1).half(), transform=torch.randn(m, d, generator=gen)
        )
    codes = torch.randint(0, 256, (slots, hkv, d * bits // 8), generator=gen, dtype=torch.uint8)
    if not page_type.startswith("kivi"):
        shape = (slots, hkv, d // PAGE_ALIGN[page_type])
        stage_of, stage = staged(gen, slots, hkv, d, window) if window else (None, None)
        return codes, CodePageSide(
            (torch.rand(shape, generator=gen) * 0.5 + 0.01).half(),
            (torch.randn(shape, generator=gen)).half(),
            stage_of,
            stage,
            window=window,
        )
    groups = slots // group
    scale = (torch.rand(groups, hkv, d, generator=gen) * 0.5 + 0.01).half()
    zero = torch.randn(groups, hkv, d, generator=gen).half()
    return codes, CodePageSide(scale, zero, *staged(gen, slots, hkv, d, window or group), group, window)


CODE_PAIRS = [
    ("kivi2-keys", "int2-token-g32-asym"),
    ("kivi4-keys", "int4-token-g32-asym"),
    ("kivi2-keys", "q8_0"),
    ("fp16", "int4-token-g32-asym"),
    ("kivi4-keys", "int2-token-g32-asym"),
    ("kivi4-keys", "int4-token-g64-asym"),
    ("kivi2-keys", "int2-token-g64-asym"),  # HF QuantizedCache's
    ("qjl1-keys", "int4-token-g32-asym"),
    ("qjl2-keys", "int4-token-g32-asym"),
    ("qjl3-keys", "bf16"),
    ("qjl4-keys", "q4_0"),
    ("polarquant", "polarquant"),
    ("qjl2-keys", "polarquant"),
    ("polarquant", "int4-token-g64-asym"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype,v_dtype", CODE_PAIRS)
@pytest.mark.parametrize("group,window", [(8, 0), (16, 0), (8, 32)])  # window: HF's residual, beyond the key group
def test_native_attention_over_code_pages_equals_reference(variant, case, k_dtype, v_dtype, group, window):
    hq, hkv, d, win, seqs = CASES[case]
    k_dtype, v_dtype = (t if fits(t, d) else "fp32" for t in (k_dtype, v_dtype))  # 32/64-channel groups, polar trees
    if k_dtype not in CODE_PAGE_TYPES and v_dtype not in CODE_PAGE_TYPES:
        pytest.skip(f"head_dim {d} fits neither {k_dtype} nor {v_dtype}")
    if window and not any(t.startswith(("kivi", "int")) for t in (k_dtype, v_dtype)):
        pytest.skip("no staged windows in these pages")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{k_dtype}{v_dtype}{group}{window}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)

    def make(dtype):
        if dtype in CODE_PAGE_TYPES:
            return code_pages(gen, slots, hkv, d, dtype, group, window)
        p, s = row_pages(gen, slots, hkv, d, dtype)
        return (p, s, None)

    (k, *k_rest), (v, *v_rest) = make(k_dtype), make(v_dtype)
    ks, kside = (None, k_rest[0]) if k_dtype in CODE_PAGE_TYPES else k_rest[:2]
    vs, vside = (None, v_rest[0]) if v_dtype in CODE_PAGE_TYPES else v_rest[:2]
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d**-0.5, win, k_dtype, k, v, ks, vs, v_dtype)
    want = reference.attention_over_pages(*args, k_side=kside, v_side=vside)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, k_side=kside, v_side=vside, variant=variant)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def test_code_pages_refuse_missing_side_data():
    gen = torch.Generator().manual_seed(3)
    codes, side = code_pages(gen, 32, 1, 64, "qjl2-keys", 8)
    side.transform = None
    with pytest.raises(ValueError, match="sketch or rotation"):
        ops.attention_over_pages(
            torch.randn(1, 1, 64),
            torch.tensor([3]),
            torch.tensor([0]),
            torch.tensor([[0, 1]]),
            BLOCK,
            0.1,
            None,
            "qjl2-keys",
            codes,
            torch.randn(32, 1, 64),
            k_side=side,
            v_dtype="fp32",
            variant=VARIANTS[0],
        )


# --- TurboQuant pages on the module path: keys of the MSE or inner-product variant (turboquant_prod: a 1-bit QJL
# sketch of the residual, scored against the query sketched once), values MSE; prefill chunks beside decodes ---


TQ_LAYOUTS = {  # keys' variant and layout, values' layout, at head dim d: (channels, MSE bits) (prod: + a sign bit)
    "prod-3": lambda d: ("prod", [(d, 2)], [(d, 3)]),
    "prod-4+2": lambda d: ("prod", [(16, 3), (d - 16, 1)], [(8, 4), (d - 8, 3)]),
    "mse-4+3": lambda d: ("mse", [(8, 4), (d - 8, 3)], [(d, 2)]),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("layout", sorted(TQ_LAYOUTS))
@pytest.mark.parametrize("calibrated", [False, True, "rope"])
def test_native_attention_over_turboquant_pages_equals_reference(variant, case, layout, calibrated):
    hq, hkv, d, window, seqs = CASES[case]
    if not calibrated and layout == "prod-3" and case != "mha-prefill-chunk":
        pytest.skip("one part, no calibration: the mha case is enough")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{layout}{calibrated}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    kv, k_layout, v_layout = TQ_LAYOUTS[layout](d)
    k = turboquant_pages(gen, slots, hkv, d, k_layout, kv, calibrated, seed=31)
    v = turboquant_pages(gen, slots, hkv, d, v_layout, "mse", calibrated and True, seed=31)
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d**-0.5, window, "turboquant", None, None)
    want = reference.attention_over_pages(*args, k_side=k, v_side=v)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, k_side=k, v_side=v, variant=variant)
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())


# --- TurboQuant pages on one side, row or block pages on the other (an auto:<bits> plan's k=q5_0,v=turboquant4):
# the same kernel scores row keys against q itself, or sums row values unrotated ---

MIXED_TQ = [
    ("q5_0", "turboquant"),
    ("int8", "turboquant"),
    ("bf16", "turboquant"),
    ("turboquant", "q4_0"),
    ("turboquant", "fp32"),
    ("turboquant", "fp8"),
]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype,v_dtype", MIXED_TQ)
def test_native_attention_over_turboquant_beside_row_pages_equals_reference(variant, case, k_dtype, v_dtype):
    hq, hkv, d, window, seqs = CASES[case]
    rows_dtype = v_dtype if k_dtype == "turboquant" else k_dtype
    if not fits(rows_dtype, d):
        pytest.skip(f"{rows_dtype} pages need head_dim % {PAGE_ALIGN[rows_dtype]} == 0")
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{k_dtype}{v_dtype}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    tq = turboquant_pages(gen, slots, hkv, d, [(8, 4), (d - 8, 3)], "mse", True, seed=31)
    pages, scales = row_pages(gen, slots, hkv, d, rows_dtype)
    if k_dtype == "turboquant":
        sides, caches = dict(k_side=tq), dict(k_cache=None, v_cache=pages, k_scale=None, v_scale=scales)
    else:
        sides, caches = dict(v_side=tq), dict(k_cache=pages, v_cache=None, k_scale=scales, v_scale=None)
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d**-0.5, window, k_dtype)
    want = reference.attention_over_pages(*args, v_dtype=v_dtype, **caches, **sides)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, v_dtype=v_dtype, **caches, **sides, variant=variant)
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
