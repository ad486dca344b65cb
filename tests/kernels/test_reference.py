"""The batched decode path of the reference paged attention equals per-sequence attention."""

from __future__ import annotations

import pytest
import torch

from bytediet.kernels.reference import attention_over_context, batch_slots, decode_attention, sequence_slots


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (4, 1)])
def test_batched_decode_equals_one_sequence_at_a_time(window, hq, hkv):
    g = torch.Generator().manual_seed(hq * 10 + hkv + (window or 0))
    bs, d, lens = 4, 8, [1, 7, 13, 4]
    pool_k = torch.randn(40 * bs, hkv, d, generator=g)
    pool_v = torch.randn(40 * bs, hkv, d, generator=g)
    perm = torch.randperm(40, generator=g)
    tables = torch.full((len(lens), 4), -1, dtype=torch.int64)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // bs)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    ctx = torch.tensor(lens)
    q = torch.randn(len(lens), hq, d, generator=g)
    slots = batch_slots(tables, ctx, bs)
    got = decode_attention(q, pool_k[slots], pool_v[slots], ctx, 0.3, window)
    for i, n in enumerate(lens):
        sl = sequence_slots(tables[i], n, bs)
        want = attention_over_context(q[i : i + 1], pool_k[sl], pool_v[sl], 0.3, window)
        torch.testing.assert_close(got[i : i + 1], want, atol=1e-5, rtol=1e-5)
