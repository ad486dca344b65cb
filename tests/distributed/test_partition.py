"""Which heads, channels and tokens each rank holds (pure arithmetic, no processes)."""

from __future__ import annotations

import pytest

from bytediet.distributed.partition import even_range, partition
from bytediet.errors import ConfigError
from tests.conftest import tiny_config


def test_even_range_covers_everything_once_with_sizes_differing_by_at_most_one():
    for n in range(1, 30):
        for parts in range(1, 7):
            ranges = [even_range(n, parts, i) for i in range(parts)]
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            sizes = [hi - lo for lo, hi in ranges]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_smollm2_shape_splits_kv_groups_unevenly():
    """9 query heads over 3 KV heads at TP=2: rank 0 takes KV heads 0-1 and their 6 query heads."""
    config = tiny_config("llama", num_heads=9, num_kv_heads=3, intermediate_size=1536, vocab_size=49152)
    p0, p1 = partition(config, 0, 2), partition(config, 1, 2)
    assert (p0.kv_heads, p0.q_heads) == ((0, 2), (0, 6))
    assert (p1.kv_heads, p1.q_heads) == ((2, 3), (6, 9))
    assert (p0.intermediate, p1.intermediate) == ((0, 768), (768, 1536))
    assert (p0.vocab, p1.vocab) == ((0, 24576), (24576, 49152))


def test_gemma3_shape_replicates_its_single_kv_head():
    config = tiny_config("gemma3", num_heads=4, num_kv_heads=1)
    parts = [partition(config, r, 2) for r in range(2)]
    assert [p.kv_heads for p in parts] == [(0, 1), (0, 1)]
    assert [p.q_heads for p in parts] == [(0, 2), (2, 4)]
    four = [partition(config, r, 4) for r in range(4)]
    assert [p.q_heads for p in four] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_replicated_kv_heads_keep_each_rank_in_its_own_group():
    config = tiny_config("llama", num_heads=8, num_kv_heads=2)  # groups of 4 query heads
    parts = [partition(config, r, 4) for r in range(4)]
    assert [p.kv_heads for p in parts] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [p.q_heads for p in parts] == [(0, 2), (2, 4), (4, 6), (6, 8)]


@pytest.mark.parametrize("world, match", [(3, "multiple of 2"), (16, "at most 8")])
def test_impossible_splits_say_what_would_work(world, match):
    config = tiny_config("llama", num_heads=8, num_kv_heads=2)
    with pytest.raises(ConfigError, match=match):
        partition(config, 0, world)
