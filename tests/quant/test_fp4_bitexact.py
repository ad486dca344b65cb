"""Bit-exact E2M1 / MXFP4 / NVFP4 encode and decode against independent references: a float64
brute-force nearest-value search written here, and the ``gguf`` package's MXFP4/NVFP4 block decoders."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.quant.fp4 import decode_e2m1, encode_e2m1, pack_nibbles, unpack_nibbles
from bytediet.quant.mxfp4 import MXFP4
from bytediet.quant.nvfp4 import NVFP4


# E2M1 from its bit fields (OCP MX v1.0 §5.3.3): bias 1; exponent 0 is subnormal (0.5 · mantissa)
def e2m1_from_bits(code: int) -> float:
    sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
    mag = 0.5 * man if exp == 0 else 2.0 ** (exp - 1) * (1 + 0.5 * man)
    return -mag if sign else mag


def e4m3_values() -> np.ndarray:
    """All finite non-negative E4M3 (fn) values from the bit fields: bias 7, S.1111.111 is NaN."""
    vals = []
    for exp, man in itertools.product(range(16), range(8)):
        if exp == 15 and man == 7:
            continue
        vals.append(man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))
    return np.array(vals)


def nearest_even(x: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index into the sorted non-negative ``grid`` nearest to |x|, ties to the even index (= even mantissa),
    saturating at the top."""
    a = np.minimum(np.abs(x)[..., None], grid[-1])
    dist = np.abs(a - grid)
    best = dist.min(-1, keepdims=True)
    candidates = np.where(dist == best, np.arange(len(grid)), len(grid) + 1)
    idx = np.where((candidates % 2 == 0) & (candidates <= len(grid)), candidates, len(grid) + 1).min(-1)
    return np.where(idx > len(grid), candidates.min(-1), idx)


E2M1_GRID = np.array([e2m1_from_bits(c) for c in range(8)])


def reference_e2m1_codes(x: np.ndarray) -> np.ndarray:
    return nearest_even(x, E2M1_GRID) | (np.where(x < 0, 8, 0))


def test_all_16_codes_decode_to_their_bit_fields():
    codes = torch.arange(16, dtype=torch.uint8)
    assert decode_e2m1(codes).tolist() == [e2m1_from_bits(c) for c in range(16)]
    assert torch.signbit(decode_e2m1(torch.tensor([8], dtype=torch.uint8))).item()  # code 8 is -0


def test_every_code_encodes_back_to_itself():
    codes = torch.tensor([c for c in range(16) if c != 8], dtype=torch.uint8)  # -0 encodes as +0
    assert torch.equal(encode_e2m1(decode_e2m1(codes)), codes)
    assert encode_e2m1(torch.tensor([-0.0])).item() == 0


@pytest.mark.parametrize(
    "value,code",
    [
        (0.25, 0),
        (0.75, 2),
        (1.25, 2),
        (1.75, 4),
        (2.5, 4),
        (3.5, 6),
        (5.0, 6),  # ties go to the even mantissa
        (0.2500001, 1),
        (5.0001, 7),
        (6.0, 7),
        (7.9, 7),
        (1e30, 7),  # above a tie, and saturation
        (-0.75, 10),
        (-5.0, 14),
        (-1e30, 15),
    ],
)
def test_e2m1_rounding_ties_to_even_and_saturates(value, code):
    assert encode_e2m1(torch.tensor([value])).item() == code


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-8, 8, width=32), min_size=1, max_size=64))
def test_e2m1_encode_matches_brute_force(values):
    x = np.array(values, dtype=np.float32)
    assert encode_e2m1(torch.from_numpy(x)).numpy().tolist() == reference_e2m1_codes(x.astype(np.float64)).tolist()


def test_nibble_pack_round_trip_and_order():
    codes = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(unpack_nibbles(packed), codes)


# --- MXFP4 ---------------------------------------------------------------------------------------


def mx_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MX v1.0 §6.3 in float64: shared_exp = floor(log2 amax) − 2, element = RNE-saturate(v / 2^shared_exp)."""
    blocks = w.reshape(w.shape[0], -1, 32).astype(np.float64)
    amax = np.abs(blocks).max(-1)
    with np.errstate(divide="ignore"):
        shared = np.where(amax > 0, np.floor(np.log2(amax)) - 2, -127).clip(-127, 127)
    codes = reference_e2m1_codes(blocks / 2.0 ** shared[..., None])
    return codes.reshape(w.shape), (shared + 127).astype(np.uint8)


@settings(max_examples=20, deadline=None)
@given(out=st.integers(1, 8), blocks=st.integers(1, 4), log_scale=st.floats(-30, 30), seed=st.integers(0, 2**31))
def test_mxfp4_encode_matches_spec(out, blocks, log_scale, seed):
    w = torch.randn(out, 32 * blocks, generator=torch.Generator().manual_seed(seed)) * 2.0**log_scale
    packed = MXFP4().quantize(w)
    codes, scale = mx_reference(w.numpy())
    assert packed["scale"].numpy().tolist() == scale.tolist()
    assert unpack_nibbles(packed["qweight"]).numpy().tolist() == codes.tolist()


@pytest.mark.parametrize(
    "amax,scale_byte,top_value",
    [
        (4.0, 127, 4.0),  # log2 = 2 exactly → X = 1, 4 → 4
        (3.999, 126, 3.0),  # floor(log2) = 1 → X = 0.5; 7.998 saturates to 6 → 3.0
        (6.0, 127, 6.0),
        (7.99, 127, 6.0),
        (8.0, 128, 8.0),
        (2.0**-130, 0, 0.0),  # below the E8M0 range: X clamps to 2^-127, the value rounds to 0
    ],
)
def test_mxfp4_scale_rounding(amax, scale_byte, top_value):
    w = torch.zeros(1, 32)
    w[0, 5] = amax
    packed = MXFP4().quantize(w)
    assert packed["scale"].item() == scale_byte
    assert MXFP4().dequantize(packed)[0, 5].item() == top_value


def test_mxfp4_decode_matches_gguf():
    """Re-lay our packed bytes into GGUF's MXFP4 block (E8M0 byte, 16 bytes: element j low, j+16 high)."""
    w = torch.randn(16, 128) * 0.1
    packed = MXFP4().quantize(w)
    codes = unpack_nibbles(packed["qweight"]).reshape(-1, 32)
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    blocks = torch.cat((packed["scale"].reshape(-1, 1), qs), dim=1).numpy()
    ref = gguf.quants.dequantize(blocks, T.MXFP4).reshape(16, 128)
    assert np.array_equal(MXFP4().dequantize(packed).numpy(), ref)


def test_mxfp4_all_codes_in_one_block():
    w = torch.tensor([[e2m1_from_bits(c) for c in range(16)] * 2])  # amax 6 → X = 1
    packed = MXFP4().quantize(w)
    assert torch.equal(MXFP4().dequantize(packed), w)


# --- NVFP4 ---------------------------------------------------------------------------------------

E4M3_GRID = e4m3_values()


def nv_reference(w: np.ndarray):
    """NVFP4 in float64: s_t = amax/(6·448); s_b = E4M3_RNE(amax_b / (6 s_t)); q = E2M1_RNE(w / (s_b s_t))."""
    w = w.astype(np.float32)
    s_t = np.float32(np.abs(w).max() / np.float32(6 * 448)) or np.float32(1)
    blocks = w.reshape(w.shape[0], -1, 16)
    target = (np.abs(blocks).max(-1) / (np.float32(6) * s_t)).astype(np.float32)  # float32, as the formula is evaluated
    s_b = E4M3_GRID[nearest_even(target.astype(np.float64), E4M3_GRID)]
    step = (s_b.astype(np.float32) * s_t)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        scaled = np.where(step > 0, blocks / step, 0).astype(np.float32)
    return reference_e2m1_codes(scaled.astype(np.float64)).reshape(w.shape), s_b, s_t


@settings(max_examples=20, deadline=None)
@given(out=st.integers(1, 8), blocks=st.integers(1, 4), log_scale=st.floats(-6, 6), seed=st.integers(0, 2**31))
def test_nvfp4_encode_matches_definition(out, blocks, log_scale, seed):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, 16 * blocks, generator=gen) * torch.rand(out, 1, generator=gen) * 2.0**log_scale
    packed = NVFP4().quantize(w)
    codes, s_b, s_t = nv_reference(w.numpy())
    assert packed["tensor_scale"].item() == s_t
    assert packed["scale"].float().numpy().tolist() == s_b.tolist()
    assert unpack_nibbles(packed["qweight"]).numpy().tolist() == codes.tolist()


def test_nvfp4_decode_matches_gguf():
    """GGUF NVFP4 super-block of 64: four UE4M3 bytes, then per 16: element j low nibble, j+8 high."""
    w = torch.randn(8, 128) * 0.1
    packed = NVFP4().quantize(w)
    packed["tensor_scale"] = torch.ones(1)  # GGUF keeps the tensor scale outside the blocks
    codes = unpack_nibbles(packed["qweight"]).reshape(-1, 4, 16)
    qs = (codes[..., :8] | (codes[..., 8:] << 4)).reshape(-1, 32)
    scales = packed["scale"].view(torch.uint8).reshape(-1, 4)
    ref = gguf.quants.dequantize(torch.cat((scales, qs), 1).numpy(), T.NVFP4).reshape(8, 128)
    assert np.array_equal(NVFP4().dequantize(packed).numpy(), ref)


def test_nvfp4_tiny_block_scale_underflow_decodes_to_zero():
    w = torch.zeros(1, 32)
    w[0, 0] = 1.0
    w[0, 17] = 1e-9  # block 2's scale underflows E4M3
    deq = NVFP4().dequantize(NVFP4().quantize(w))
    assert deq[0, 0].item() == 1.0 and deq[0, 17].item() == 0.0
