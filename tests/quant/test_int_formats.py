"""INT8 / INT4 specifics: elementwise rounding bounds, spec parsing, the exact int8 matmul."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bytediet.errors import ConfigError
from bytediet.quant import get_weight_format
from bytediet.quant.int8 import int8_matmul


@settings(max_examples=15, deadline=None)
@given(out=st.integers(1, 16), k=st.sampled_from([32, 96, 256]), log_scale=st.floats(-2, 2), seed=st.integers(0, 2**31))
def test_int8_error_is_at_most_half_a_step(out, k, log_scale, seed):
    w = torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 10.0**log_scale
    fmt = get_weight_format("int8")
    packed = fmt.quantize(w)
    step = w.abs().amax(1, keepdim=True) / 127
    assert ((fmt.dequantize(packed) - w).abs() <= step / 2 * (1 + 1e-5)).all()
    assert packed["qweight"].abs().amax(1).eq(127).all()  # each row's absmax lands on ±127


@pytest.mark.parametrize("spec", ["int4-g32", "int4-g64-sym", "int4-g128"])
@settings(max_examples=10, deadline=None)
@given(out=st.integers(1, 8), log_scale=st.floats(-1, 2), seed=st.integers(0, 2**31))
def test_int4_error_is_at_most_half_a_step(spec, out, log_scale, seed):
    fmt = get_weight_format(spec)
    w = torch.randn(out, 256, generator=torch.Generator().manual_seed(seed)) * 10.0**log_scale
    g = w.view(out, -1, fmt.group_size)
    packed = fmt.quantize(w)
    step = packed["scale"].float()[..., None]  # (out, groups, 1), the stored float16 scale
    amax = g.abs().amax(-1, keepdim=True)
    err = (fmt.dequantize(packed).view_as(g) - g).abs()
    assert (err <= step / 2 + amax * 2.0**-9).all()  # + float16 rounding of the scale / offset


@pytest.mark.parametrize(
    "spec,group,sym",
    [
        ("int4", 128, False),
        ("int4-sym", 128, True),
        ("int4-g32", 32, False),
        ("int4-g64-asym", 64, False),
        ("INT4-G32-SYM", 32, True),
    ],
)
def test_int4_spec_parsing(spec, group, sym):
    fmt = get_weight_format(spec)
    assert (fmt.group_size, fmt.symmetric) == (group, sym)


@pytest.mark.parametrize("spec", ["int4-g48", "int4-x", "int4-", "int4--sym", "int8-g32", "fp8-e5m2"])
def test_bad_specs_are_config_errors(spec):
    with pytest.raises(ConfigError):
        get_weight_format(spec)


@settings(max_examples=15, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_int8_matmul_is_exact(m, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-127, 128, (m, k), generator=gen, dtype=torch.int8)
    b = torch.randint(-127, 128, (k, n), generator=gen, dtype=torch.int8)
    out = int8_matmul(a, b)
    assert out.dtype == torch.int32
    assert torch.equal(out.long(), a.long() @ b.long())
