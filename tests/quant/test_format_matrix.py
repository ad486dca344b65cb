"""Every registered weight format through the same checks: error bounds, apply vs the dequantized
reference matmul, bits per weight against the bytes actually stored, spec round trip.

A new format registered in WEIGHT_FORMATS is picked up here without editing this file.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.quant import WEIGHT_FORMATS, get_weight_format
from bytediet.quant.gguf_blocks import GGUFBlocks

VARIANTS = ["int4-g32", "int4-g64", "int4-g32-sym", "int4-g64-sym", "int4-g128-sym"]
SPECS = WEIGHT_FORMATS.names() + VARIANTS

# Relative Frobenius error on Gaussian weights, with margin over the measured value. A format missing
# here is held to the generic bound below: a new format must still beat "all zeros" by a wide margin.
REL_ERROR = {
    "fp32": 1e-7,
    "bf16": 5e-3,
    "fp16": 6e-4,
    "int8": 0.012,
    "int8-w8a8": 0.012,
    "fp8": 0.04,
    "int4-g32": 0.10,
    "int4-g64": 0.11,
    "int4-g128": 0.12,
    "int4-g32-sym": 0.12,
    "int4-g64-sym": 0.13,
    "int4-g128-sym": 0.15,
    "mxfp4": 0.16,
    "nvfp4": 0.13,
    "sparse24": 0.45,
    "sparse24-int8": 0.45,  # half the weights dropped: ≈ 0.364 on Gaussian weights, more on 1 row
    "gguf-q8_0": 0.01,
    "gguf-q4_0": 0.14,
    "gguf-q4_1": 0.11,
    "gguf-q5_0": 0.07,
    "gguf-q5_1": 0.055,
}
GENERIC_REL_ERROR = 0.3
# f16 super-block scale fields of the K types (byte offsets), set to sane values in random blocks
_K_F16_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}


def random_packed(fmt, out: int, k: int, gen: torch.Generator):
    """A packed weight for ``fmt``: quantized from Gaussian weights, or random raw blocks for GGUF types
    that only come from files."""
    if isinstance(fmt, GGUFBlocks) and not fmt.can_quantize():
        bs, ts = fmt.block_size(), fmt.type_size()
        raw = torch.randint(0, 256, (out * k // bs, ts), generator=gen, dtype=torch.uint8)
        for off in _K_F16_FIELDS[fmt.ggml_type]:
            d = (torch.rand(raw.shape[0], 1, generator=gen) * 1e-3 + 1e-4).half()
            raw[:, off : off + 2] = d.view(torch.uint8)
        return {"blocks": raw.reshape(out, -1)}
    return fmt.quantize(torch.randn(out, k, generator=gen) * 0.05)


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trip(spec):
    fmt = get_weight_format(spec)
    assert get_weight_format(fmt.spec()).spec() == fmt.spec()


@pytest.mark.parametrize("spec", SPECS)
def test_bits_per_weight_matches_stored_bytes(spec):
    fmt = get_weight_format(spec)
    out, k = 48, 512
    packed = random_packed(fmt, out, k, torch.Generator().manual_seed(0))
    stored_bits = 8 * sum(t.numel() * t.element_size() for t in packed.values())
    assert stored_bits / (out * k) == pytest.approx(fmt.bits_per_weight(out, k), rel=1e-12)
    assert 1.0 < fmt.bits_per_weight(out, k) <= 32.0


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=8, deadline=None)
@given(out=st.integers(1, 24), blocks=st.integers(1, 3), log_scale=st.floats(-2, 2), seed=st.integers(0, 2**31))
def test_round_trip_error_bound(spec, out, blocks, log_scale, seed):
    fmt = get_weight_format(spec)
    if isinstance(fmt, GGUFBlocks) and not fmt.can_quantize():
        pytest.skip(f"{spec} has no float quantizer (it only comes from GGUF files)")
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, 256 * blocks, generator=gen) * 10.0**log_scale
    deq = fmt.dequantize(fmt.quantize(w))
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    rel = ((deq - w).norm() / w.norm()).item()
    assert rel <= REL_ERROR.get(spec, GENERIC_REL_ERROR), f"{spec}: relative error {rel:.4f}"
    row_range = w.abs().amax(dim=1, keepdim=True)
    if getattr(fmt, "dropped_fraction", 0.0):  # pruning: every weight is either dropped or (nearly) kept
        assert ((deq == 0) | ((deq - w).abs() <= row_range * 0.01)).all()
        assert (deq == 0).float().mean() >= fmt.dropped_fraction
    else:  # elementwise: no value moves by more than the row's range (catches swapped or misplaced codes)
        assert ((deq - w).abs() <= row_range * 0.51).all()


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("with_bias", [False, True])
def test_apply_equals_dequantized_matmul(spec, with_bias):
    fmt = get_weight_format(spec)
    gen = torch.Generator().manual_seed(hash(spec) % 2**31)
    out, k = 40, 256
    packed = random_packed(fmt, out, k, gen)
    x = torch.randn(3, 5, k, generator=gen)
    bias = torch.randn(out, generator=gen) if with_bias else None
    w = fmt.dequantize(packed)
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    y = fmt.apply(x, packed, bias)
    assert y.shape == (3, 5, out) and y.dtype == x.dtype
    err = (y.double() - ref).abs()
    if getattr(fmt, "activation_bits", None):
        # per-token activation rounding: |Δy_tj| ≤ Σ_k |W_jk| · s_t / 2 with s_t = absmax_t / (2^(b-1) - 1)
        qmax = 2 ** (fmt.activation_bits - 1) - 1
        s = x.abs().amax(-1, keepdim=True).double() / qmax  # (3, 5, 1)
        bound = s * w.abs().sum(1).double() / 2 + 1e-4
        assert (err <= bound).all()
        assert err.max() > 0  # activations really are rounded
    else:
        scale = x.abs().double().matmul(w.abs().double().t()).amax()
        assert err.max() <= 1e-5 * scale + 1e-6


@pytest.mark.parametrize("spec", SPECS)
def test_zero_weight_is_exact(spec):
    fmt = get_weight_format(spec)
    if isinstance(fmt, GGUFBlocks) and not fmt.can_quantize():
        pytest.skip(f"{spec} has no float quantizer")
    w = torch.zeros(4, 256)
    assert torch.equal(fmt.dequantize(fmt.quantize(w)), w)


@pytest.mark.parametrize("spec", SPECS)
def test_rejects_non_finite_and_wrong_rank(spec):
    fmt = get_weight_format(spec)
    if spec in ("fp32", "bf16", "fp16") or (isinstance(fmt, GGUFBlocks) and not fmt.can_quantize()):
        pytest.skip("unquantized formats store what they are given; file-only formats cannot quantize")
    from bytediet.errors import ConfigError

    w = torch.randn(4, 256)
    w[1, 3] = math.nan
    with pytest.raises(ConfigError, match="NaN"):
        fmt.quantize(w)
    with pytest.raises(ConfigError, match="2-D"):
        fmt.quantize(torch.randn(256))


@pytest.mark.parametrize("spec", SPECS)
def test_quantize_and_dequantize_stay_on_the_weights_device(spec):
    """``quantize --device cuda`` packs on the GPU: every tensor a format makes must follow its input's device. With
    the default device set to ``meta``, a tensor made without it would break this CPU run."""
    fmt = get_weight_format(spec)
    gen = torch.Generator().manual_seed(1)
    if isinstance(fmt, GGUFBlocks) and not fmt.can_quantize():  # decode-only K types: random raw blocks
        packed = random_packed(fmt, 8, 256, gen)
    else:
        w = torch.randn(8, 256, generator=gen) * 0.05
        want = fmt.quantize(w)
        with torch.device("meta"):
            packed = fmt.quantize(w)
        assert packed.keys() == want.keys() and all(torch.equal(packed[k], want[k]) for k in want)
    with torch.device("meta"):
        deq = fmt.dequantize(packed)
    assert deq.device.type == "cpu" and torch.equal(deq, fmt.dequantize(packed))
