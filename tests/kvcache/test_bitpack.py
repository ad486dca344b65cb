"""Bit packing of KV codes: the word-wise pack/unpack against the bit-by-bit reference, on fresh random codes."""

from __future__ import annotations

import pytest
import torch

from bytediet.kvcache import bitpack


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("n", [8, 24, 64, 96, 256])
def test_pack_matches_the_bitwise_reference_and_round_trips(bits, n):
    gen = torch.Generator().manual_seed(1000 * bits + n)
    codes = torch.randint(0, 2**bits, (3, 5, n), generator=gen)
    packed = bitpack.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, bitpack.packed_size(n, bits))
    assert torch.equal(packed, bitpack.pack_bitwise(codes, bits))
    assert torch.equal(bitpack.unpack(packed, bits, n), codes)
    assert torch.equal(bitpack.unpack_bitwise(packed, bits, n), codes)


@pytest.mark.parametrize("bits,n", [(2, 4), (2, 12), (4, 2), (4, 6), (6, 4)])
def test_code_counts_that_are_not_whole_words(bits, n):
    codes = torch.randint(0, 2**bits, (7, n), generator=torch.Generator().manual_seed(n))
    packed = bitpack.pack(codes, bits)
    assert torch.equal(packed, bitpack.pack_bitwise(codes, bits))
    assert torch.equal(bitpack.unpack(packed, bits, n), codes)


def test_extreme_codes_and_a_count_that_does_not_fill_bytes():
    for bits in range(1, 9):
        top = torch.full((1, 16), 2**bits - 1)
        assert torch.equal(bitpack.unpack(bitpack.pack(top, bits), bits, 16), top)
        assert bitpack.pack(top, bits).eq(255).all()
    with pytest.raises(ValueError, match="whole bytes"):
        bitpack.pack(torch.zeros(1, 3, dtype=torch.long), 3)
