"""Native paged attention (``ops.attention_over_pages``) against its twin ``reference.attention_over_pages``:
every page type (llama.cpp's GGML block types included), keys and values of different types, the GQA ratios of
the three families, odd context lengths across page boundaries, sliding windows, a ragged batch mixing a prefill
chunk (tokens sharing a block table row) with decodes, long contexts split across threads."""
import zlib
from unittest import mock

import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import (ATTENTION_PAGE_TYPES, BLOCK_PAGE_TYPES, CODE_PAGE_BITS, CODE_PAGE_TYPES,
                                         CodePageSide)

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")
BLOCK = 16


def pages(gen, slots, hkv, d, kv_dtype):
    """(pages, scales): random keys or values as the KV codecs store them in ``kv_dtype``."""
    return reference.write_kv_rows(kv_dtype, torch.randn(slots, hkv, d, generator=gen) * 2)


CASES = {  # name: (hq, hkv, d, window, [(tokens, context) per sequence])
    "llama-gqa-3": (9, 3, 64, None, [(1, 1), (1, 17), (1, 130)]),
    "gemma3-gqa-4-window": (4, 1, 256, 20, [(1, 47), (5, 33), (1, 16)]),
    "mha-prefill-chunk": (4, 4, 32, None, [(23, 40), (1, 9)]),
    "qwen2-gqa-7-long": (7, 1, 64, None, [(1, 1000)]),
    "window-prefill": (6, 2, 24, 7, [(12, 12), (1, 70)]),
    "gqa-3-d96-mixed": (9, 3, 96, 33, [(1, 31), (17, 49), (1, 1), (1, 97)]),  # 3 GGML blocks a row
}


def fits(kv_dtype, d):
    return kv_dtype not in BLOCK_PAGE_TYPES or d % 32 == 0  # llama.cpp's block types: head_dim a multiple of 32


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_dtype", ATTENTION_PAGE_TYPES)
def test_native_attention_over_pages_equals_reference(variant, case, kv_dtype):
    if not fits(kv_dtype, CASES[case][2]):
        pytest.skip(f"{kv_dtype} pages need head_dim % 32 == 0")
    check(variant, case, kv_dtype, kv_dtype)


# keys of one page type, values of another: llama.cpp's k=q8_0,v=q4_0, and the pairs the auto: budget plans mix
MIXED = [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("q8_0", "q5_0"), ("q5_0", "q4_1"), ("int8", "q4_0"),
         ("q4_1", "int8"), ("bf16", "q4_1"), ("q8_0", "bf16"), ("fp32", "q5_0"), ("fp8", "q8_0"), ("int8", "bf16"),
         ("fp16", "fp8")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(c for c in CASES if CASES[c][2] % 32 == 0))
@pytest.mark.parametrize("k_dtype,v_dtype", MIXED)
def test_native_attention_over_mixed_pages_equals_reference(variant, case, k_dtype, v_dtype):
    check(variant, case, k_dtype, v_dtype)


def ragged_batch(seqs, gen):
    """Block tables over shuffled pages (3 spare), each token's position and table row, and the slot count for
    sequences given as (new tokens, context) pairs."""
    width = max(-(-ctx // BLOCK) for _, ctx in seqs)
    perm = torch.randperm(sum(-(-ctx // BLOCK) for _, ctx in seqs) + 3, generator=gen)
    tables, positions, rows, used = [], [], [], 0
    for s, (n, ctx) in enumerate(seqs):
        nb = -(-ctx // BLOCK)
        tables.append(torch.cat([perm[used:used + nb], torch.full((width - nb,), -1)]))
        used += nb
        positions += list(range(ctx - n, ctx))
        rows += [s] * n
    return torch.stack(tables).long(), torch.tensor(positions), torch.tensor(rows), perm.numel() * BLOCK


def check(variant, case, kv_dtype, v_dtype):
    hq, hkv, d, window, seqs = CASES[case]
    mixed = v_dtype != kv_dtype
    gen = torch.Generator().manual_seed(zlib.crc32((case + kv_dtype + (v_dtype if mixed else "")).encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    (k, ks), (v, vs) = pages(gen, slots, hkv, d, kv_dtype), pages(gen, slots, hkv, d, v_dtype)
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d ** -0.5, window, kv_dtype, k, v, ks, vs, v_dtype if mixed else None)
    want = reference.attention_over_pages(*args)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, variant=variant)  # natively: no fallback to the twin
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


# --- code pages (KIVI): packed 2/4-bit codes widened with side data (scales, zero points, open key groups) ---

def code_pages(gen, slots, hkv, d, kv_dtype, group):
    """(codes, CodePageSide): random code pages of ``kv_dtype`` (decoder_spec.CODE_PAGE_TYPES); KIVI keys with
    about a third of their groups open (read from staging pages)."""
    bits = CODE_PAGE_BITS[kv_dtype]
    codes = torch.randint(0, 256, (slots, hkv, d * bits // 8), generator=gen, dtype=torch.uint8)
    if not kv_dtype.startswith("kivi"):
        shape = (slots, hkv, d // 32)
        return codes, CodePageSide((torch.rand(shape, generator=gen) * 0.5 + 0.01).half(),
                                   (torch.randn(shape, generator=gen)).half())
    groups = slots // group
    scale = (torch.rand(groups, hkv, d, generator=gen) * 0.5 + 0.01).half()
    zero = torch.randn(groups, hkv, d, generator=gen).half()
    open_ = torch.rand(groups, generator=gen) < 0.35
    stage_of = torch.full((groups,), -1, dtype=torch.int32)
    stage_of[open_] = torch.randperm(int(open_.sum()), generator=gen).int()
    stage = (torch.randn(max(1, int(open_.sum())), group, hkv, d, generator=gen) * 2).half()
    return codes, CodePageSide(scale, zero, stage_of, stage, group)


CODE_PAIRS = [("kivi2-keys", "int2-token-g32-asym"), ("kivi4-keys", "int4-token-g32-asym"),
              ("kivi2-keys", "q8_0"), ("fp16", "int4-token-g32-asym"), ("kivi4-keys", "int2-token-g32-asym")]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype,v_dtype", CODE_PAIRS)
@pytest.mark.parametrize("group", [8, 16])
def test_native_attention_over_code_pages_equals_reference(variant, case, k_dtype, v_dtype, group):
    hq, hkv, d, window, seqs = CASES[case]
    if d % 32 and (v_dtype in CODE_PAGE_TYPES or v_dtype in BLOCK_PAGE_TYPES):
        v_dtype = "fp32"  # per-token code pages (groups of 32 channels), like GGML blocks, need head_dim % 32 == 0
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case}{k_dtype}{v_dtype}{group}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)

    def make(dtype):
        if dtype in CODE_PAGE_TYPES:
            return code_pages(gen, slots, hkv, d, dtype, group)
        p, s = pages(gen, slots, hkv, d, dtype)
        return (p, s, None)

    (k, *k_rest), (v, *v_rest) = make(k_dtype), make(v_dtype)
    ks, kside = (None, k_rest[0]) if k_dtype in CODE_PAGE_TYPES else k_rest[:2]
    vs, vside = (None, v_rest[0]) if v_dtype in CODE_PAGE_TYPES else v_rest[:2]
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d ** -0.5, window, k_dtype, k, v, ks, vs, v_dtype)
    want = reference.attention_over_pages(*args, k_side=kside, v_side=vside)
    with mock.patch.object(reference, "attention_over_pages", side_effect=AssertionError("the reference ran")):
        got = ops.attention_over_pages(*args, k_side=kside, v_side=vside, variant=variant)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
