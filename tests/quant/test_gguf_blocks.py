"""Native GGUF block formats: bit-exact against the ``gguf`` package's reference (de)quantizers."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.errors import CheckpointError, ConfigError
from bytediet.quant import get_weight_format
from bytediet.quant.gguf_blocks import BLOCK_FORMATS, GGUFBlocks

TYPES = list(BLOCK_FORMATS)
ENCODABLE = [t for t in TYPES if BLOCK_FORMATS[t].can_quantize()]


@pytest.mark.parametrize("gtype", TYPES, ids=lambda t: t.name)
def test_decode_random_blocks_bit_exact(gtype):
    bs, ts = GGML_QUANT_SIZES[gtype]
    raw = np.random.randint(0, 256, (6, 3 * ts), dtype=np.uint8)
    with np.errstate(all="ignore"):  # random f16 fields include Inf/NaN: both sides must agree on them too
        ref = gguf.quants.dequantize(raw, gtype)
    mine = BLOCK_FORMATS[gtype]().dequantize({"blocks": torch.from_numpy(raw)}).numpy()
    assert mine.shape == (6, 3 * bs)
    assert np.array_equal(mine, ref.reshape(6, -1), equal_nan=True)


@pytest.mark.parametrize("gtype", ENCODABLE, ids=lambda t: t.name)
@settings(max_examples=10, deadline=None)
@given(rows=st.integers(1, 8), blocks=st.integers(1, 4), log_scale=st.floats(-4, 3), seed=st.integers(0, 2**31))
def test_encode_bit_exact(gtype, rows, blocks, log_scale, seed):
    bs = GGML_QUANT_SIZES[gtype][0]
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, bs * blocks, generator=gen) * 10.0**log_scale
    # a block on an integer grid: exact ties and repeated extremes (+0 only: gguf's min keeps whichever zero it sees)
    w[0, :bs] = torch.randint(-8, 8, (bs,), generator=gen).float() * 10.0**log_scale
    ref = gguf.quants.quantize(w.numpy(), gtype)
    packed = BLOCK_FORMATS[gtype]().quantize(w)
    assert np.array_equal(packed["blocks"].numpy(), ref)


def test_registered_names_and_bits():
    assert get_weight_format("gguf-q4_1").bits_per_weight(8, 64) == 5.0
    assert get_weight_format("gguf-q4_0").bits_per_weight(8, 64) == 4.5
    assert get_weight_format("gguf-q6_k").bits_per_weight(8, 256) == 6.5625


def test_from_gguf_tensor_checks_size_and_type():
    raw = np.zeros((4, 20), dtype=np.uint8)  # 4 rows of one Q4_1 block
    fmt, packed = GGUFBlocks.from_gguf_tensor(raw, T.Q4_1, (4, 32))
    assert fmt.spec() == "gguf-q4_1" and packed["blocks"].shape == (4, 20)
    with pytest.raises(CheckpointError, match="GGUF order"):
        GGUFBlocks.from_gguf_tensor(raw, T.Q4_1, (32, 4))
    with pytest.raises(CheckpointError, match="cannot be kept packed"):
        GGUFBlocks.from_gguf_tensor(raw, T.IQ2_XXS, (4, 32))


def test_file_only_types_refuse_float_weights():
    with pytest.raises(ConfigError, match="load it from a GGUF file"):
        get_weight_format("gguf-q6_k").quantize(torch.randn(2, 256))


def test_real_model_tensor_kept_packed():
    """A Q4_1 tensor of the default model, wrapped without decoding, decodes exactly as gguf does."""
    try:
        from bytediet.models.loader import default_model_path

        path = default_model_path()
    except Exception as exc:  # the model package is optional for this test
        pytest.skip(f"default model not available: {exc}")
    reader = gguf.GGUFReader(str(path))
    t = next(t for t in reader.tensors if t.name == "blk.0.attn_k.weight")
    shape = tuple(int(s) for s in reversed(t.shape))
    fmt, packed = GGUFBlocks.from_gguf_tensor(np.asarray(t.data), t.tensor_type, shape)
    ref = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
    assert fmt.spec() == "gguf-q4_1"
    assert np.array_equal(fmt.dequantize(packed).numpy(), ref)
    # re-quantizing to the same grid is lossless (the trap named in the issue)
    again = fmt.dequantize(fmt.quantize(torch.from_numpy(ref.copy())))
    assert torch.allclose(again, torch.from_numpy(ref), atol=1e-6)
