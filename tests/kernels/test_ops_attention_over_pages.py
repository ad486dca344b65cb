"""Native paged attention (``ops.attention_over_pages``) against its twin ``reference.attention_over_pages``:
every page type, the GQA ratios of the three families, odd context lengths across page boundaries, sliding
windows, a ragged batch mixing a prefill chunk (tokens sharing a block table row) with decodes, long contexts
split across threads."""
import zlib

import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import ROW_PAGE_TYPES

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")
BLOCK = 16


def pages(gen, slots, hkv, d, kv_dtype):
    x = torch.randn(slots, hkv, d, generator=gen) * 2
    if kv_dtype == "int8":
        return reference.quantize_int8_rows(x)
    if kv_dtype == "fp8":
        return reference.quantize_fp8_rows(x)
    return x.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]), None


CASES = {  # name: (hq, hkv, d, window, [(tokens, context) per sequence])
    "llama-gqa-3": (9, 3, 64, None, [(1, 1), (1, 17), (1, 130)]),
    "gemma3-gqa-4-window": (4, 1, 256, 20, [(1, 47), (5, 33), (1, 16)]),
    "mha-prefill-chunk": (4, 4, 32, None, [(23, 40), (1, 9)]),
    "qwen2-gqa-7-long": (7, 1, 64, None, [(1, 1000)]),
    "window-prefill": (6, 2, 24, 7, [(12, 12), (1, 70)]),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_dtype", ROW_PAGE_TYPES)
def test_native_attention_over_pages_equals_reference(variant, case, kv_dtype):
    hq, hkv, d, window, seqs = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32((case + kv_dtype).encode()))
    width = max(-(-ctx // BLOCK) for _, ctx in seqs)
    perm = torch.randperm(sum(-(-ctx // BLOCK) for _, ctx in seqs) + 3, generator=gen)
    tables, positions, rows, used = [], [], [], 0
    for s, (n, ctx) in enumerate(seqs):
        nb = -(-ctx // BLOCK)
        tables.append(torch.cat([perm[used:used + nb], torch.full((width - nb,), -1)]))
        used += nb
        positions += list(range(ctx - n, ctx))
        rows += [s] * n
    bt, positions, rows = torch.stack(tables).long(), torch.tensor(positions), torch.tensor(rows)
    slots = perm.numel() * BLOCK
    (k, ks), (v, vs) = pages(gen, slots, hkv, d, kv_dtype), pages(gen, slots, hkv, d, kv_dtype)
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (q, positions, rows, bt, BLOCK, d ** -0.5, window, kv_dtype, k, v, ks, vs)
    want = reference.attention_over_pages(*args)
    got = ops.attention_over_pages(*args, variant=variant)
    assert (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
