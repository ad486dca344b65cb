"""``WeightFormat.shard``: a slice of the packed weight decodes to the same slice of the decoded weight, for every
registered format (a new one is picked up here), on both axes tensor parallelism cuts."""

from __future__ import annotations

import pytest
import torch

from bytediet.errors import ConfigError
from bytediet.quant import get_weight_format
from bytediet.quant.base import WeightFormat
from tests.quant.test_format_matrix import SPECS, random_packed

ROWS_ONLY = {"sparse50"}  # unstructured: a column slice keeps a different count per row


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dim, lo, hi", [(0, 8, 20), (0, 0, 1), (1, 256, 512), (1, 0, 256)])
def test_a_shard_decodes_to_the_same_slice(spec, dim, lo, hi):
    if dim == 1 and spec in ROWS_ONLY:
        pytest.skip("refused: see test_unstructured_sparsity_refuses_a_column_cut")
    fmt = get_weight_format(spec)
    packed = random_packed(fmt, 24, 512, torch.Generator().manual_seed(hash(spec) % 1000))
    whole = fmt.dequantize(packed)
    part = fmt.shard(packed, dim, lo, hi)
    assert torch.equal(fmt.dequantize(part), whole.narrow(dim, lo, hi - lo))
    for name, t in part.items():
        assert t.is_contiguous(), name


@pytest.mark.parametrize("spec", ["sparse24", "sparse24-int8"])
def test_a_2_4_cut_between_the_two_groups_of_a_byte_repacks_the_codes(spec):
    fmt = get_weight_format(spec)
    packed = fmt.quantize(torch.randn(6, 64, generator=torch.Generator().manual_seed(2)))
    part = fmt.shard(packed, 1, 4, 36)  # starts at group 1: the high nibble of byte 0
    assert part["index"].shape == (6, 4) and part["values"].shape == (6, 16)
    assert torch.equal(fmt.dequantize(part), fmt.dequantize(packed)[:, 4:36])


@pytest.mark.parametrize(
    "spec, cut, block",
    [("gguf-q8_0", 48, 32), ("int4-g64", 32, 64), ("mxfp4", 16, 32), ("nvfp4", 8, 16), ("sparse24", 2, 4)],
)
def test_block_formats_cut_columns_only_on_block_boundaries(spec, cut, block):
    fmt = get_weight_format(spec)
    packed = fmt.quantize(torch.randn(4, 512))
    with pytest.raises(ConfigError, match=f"do not fall on its blocks of {block}"):
        fmt.shard(packed, 1, 0, cut)


def test_unstructured_sparsity_refuses_a_column_cut():
    fmt = get_weight_format("sparse50")
    with pytest.raises(ConfigError, match="cannot be split.*sparse24"):
        fmt.shard(fmt.quantize(torch.randn(4, 64)), 1, 0, 32)


def test_a_format_without_a_shard_says_which_can():
    class Opaque(WeightFormat):
        name = "opaque"

        def bits_per_weight(self, out_features, in_features):
            return 32.0

        def quantize(self, weight, stats=None):
            return {"w": weight}

        def dequantize(self, packed):
            return packed["w"]

    with pytest.raises(ConfigError, match="opaque cannot be split.*int8"):
        Opaque().shard({"w": torch.zeros(4, 4)}, 0, 0, 2)
