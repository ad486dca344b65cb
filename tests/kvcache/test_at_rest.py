"""KV as the tiers bring it back re-encoded at rest: the same bits as a block's trip through the tiers' pages."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.kv_tiers.pages import BlockPages
from bytediet.kvcache import get_kv_codec
from bytediet.kvcache.at_rest import AtRestRoundTrip

H, D, BS, NB = 2, 64, 16, 4


def kv(n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g).to(torch.bfloat16) for _ in range(2)]


@pytest.mark.parametrize("at_rest", ["rot-q8_0", "q4_0"])
def test_full_blocks_equal_a_trip_through_the_tiers_and_the_tail_keeps_the_pool(at_rest):
    pool, rest = get_kv_codec("bf16", torch.bfloat16), get_kv_codec(at_rest)
    n = 2 * BS + 5  # two full blocks and a tail
    k, v = kv(n, seed=3)
    slots = torch.arange(n)
    trip = AtRestRoundTrip(pool, rest).create_cache(0, NB, BS, H, D, torch.bfloat16, "cpu")
    trip.write(k[:20], v[:20], slots[:20], slots[:20])  # the first block fills in this call, the second later
    trip.write(k[20:], v[20:], slots[20:], slots[20:])
    plain = pool.create_cache(0, NB, BS, H, D, torch.bfloat16, "cpu")
    plain.write(k, v, slots, slots)
    pages = BlockPages([plain], BS, "bf16", rest, torch.bfloat16)
    for b in range(2):  # what a block that went down a tier and came back holds
        pages.write(b, pages.read(b, b * BS), b * BS)
    got, want = trip.decode(slots, slots), plain.decode(slots, slots)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    untouched = pool.create_cache(0, NB, BS, H, D, torch.bfloat16, "cpu")
    untouched.write(k, v, slots, slots)
    tail = slots[2 * BS :]
    assert torch.equal(trip.decode(tail, tail)[0], untouched.decode(tail, tail)[0])
    full = slots[: 2 * BS]
    assert not torch.equal(trip.decode(full, full)[0], untouched.decode(full, full)[0])  # the trip changed them


def test_the_wrapper_attends_over_its_pool_pages():
    trip = AtRestRoundTrip(get_kv_codec("bf16", torch.bfloat16), get_kv_codec("rot-q8_0"))
    cache = trip.create_cache(0, NB, BS, H, D, torch.bfloat16, "cpu")
    assert cache.tensors() == cache._pool.tensors() and cache.block_size == BS
    assert trip.bytes_per_token(H, D) == get_kv_codec("bf16").bytes_per_token(H, D)
