"""``WeightFormat.shard``: a slice of the packed weight decodes to the same slice of the decoded weight."""
from __future__ import annotations

import pytest
import torch

from bytediet.errors import ConfigError
from bytediet.quant import get_weight_format

SPLITTABLE = ["fp32", "bf16", "fp16", "int8", "int8-w8a8", "gguf-q8_0", "gguf-q4_1"]


@pytest.mark.parametrize("spec", SPLITTABLE)
@pytest.mark.parametrize("dim", [0, 1])
def test_a_shard_decodes_to_the_same_slice(spec, dim):
    fmt = get_weight_format(spec)
    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(1))
    packed = fmt.quantize(w)
    whole = fmt.dequantize(packed)
    lo, hi = (8, 20) if dim == 0 else (256, 512)
    part = fmt.dequantize(fmt.shard(packed, dim, lo, hi))
    assert torch.equal(part, whole.narrow(dim, lo, hi - lo))


def test_block_formats_cut_columns_only_on_block_boundaries():
    fmt = get_weight_format("gguf-q8_0")  # blocks of 32
    packed = fmt.quantize(torch.randn(4, 512))
    with pytest.raises(ConfigError, match="do not fall on its blocks of 32"):
        fmt.shard(packed, 1, 0, 48)


def test_formats_without_a_shard_say_which_can():
    fmt = get_weight_format("fp8")
    with pytest.raises(ConfigError, match="cannot be split.*int8"):
        fmt.shard(fmt.quantize(torch.randn(4, 64)), 0, 0, 2)
