"""The Triton dequantize-GEMV/GEMM against its twin (reference.gemm_blocks with float activations) for every
layout, on fresh random weights made by the repo's own quantizers and codecs, in the interpreter."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import native_layouts as nl
from bytediet.kernels import reference
from bytediet.kernels.triton import gemm_blocks as tg
from bytediet.quant import get_weight_format

from ..test_ops_gemm_blocks import random_blocks

GGML = {
    "q4_0": (T.Q4_0, 64),
    "q4_1": (T.Q4_1, 64),
    "q5_0": (T.Q5_0, 96),
    "q5_1": (T.Q5_1, 96),
    "q8_0": (T.Q8_0, 64),
    "q4_k": (T.Q4_K, 256),
    "q5_k": (T.Q5_K, 256),
    "q6_k": (T.Q6_K, 256),
}
NATIVE = {
    "int8": 96,
    "int4-g32": 64,
    "int4-g32-sym": 64,
    "int4-g64": 128,
    "int4-g64-sym": 128,
    "int4-g128": 256,
    "int4-g128-sym": 256,
    "mxfp4": 64,
    "nvfp4": 64,
    "fp8": 96,
    "sparse24": 64,
    "sparse24-int8": 64,
}
LAYOUTS = list(GGML) + list(NATIVE)
U = 2.0**-24  # float32 unit roundoff


def packed_rows(name: str, n: int, gen: torch.Generator, scale: float = 1.0, k: int = 0) -> tuple[int, torch.Tensor]:
    """(layout id, rows (n, row bytes) uint8) of a fresh random weight, K as in GGML/NATIVE unless given."""
    if name in GGML:
        gtype, k0 = GGML[name]
        return int(gtype), random_blocks(gtype, n, k or k0, gen, scale)
    fmt = get_weight_format(name)
    t, rows = fmt.native_layout(fmt.quantize(torch.randn(n, k or NATIVE[name], generator=gen) * scale))
    return t, rows


def assert_within_rounding(y, ref, x, w, out_ulp: float = U) -> None:
    """|y − ref| ≤ out_ulp·|ref| + 4(K + 2)·u·Σ|x||w|: any float32 summation order of K products (Higham's γ_K),
    4× for the block-structured GEMV's factored scales (d·Σq·x + m·Σx: its terms may exceed |w|·|x| where d·q and
    m cancel), plus the rounding of y to its dtype. No rounding tie can reach it, yet it is ~K/60 of one term."""
    xs = x.reshape(-1, x.shape[-1]).double()
    terms = xs.abs() @ w.abs().double().T
    err = (y.reshape(terms.shape).double() - ref.reshape(terms.shape).double()).abs()
    bound = out_ulp * ref.reshape(terms.shape).double().abs() + 4 * (x.shape[-1] + 2) * U * terms + 1e-30
    assert (err <= bound).all(), f"max error {err.max().item():.3g} (bound there {bound.flatten()[err.argmax()]:.3g})"


def test_runs_in_the_interpreter():
    assert tg.interpreting()  # so every tl.dot below is the float32 one


@pytest.mark.parametrize("name", LAYOUTS)
def test_dequantize_blocks_equals_reference(name):
    gen = torch.Generator().manual_seed(LAYOUTS.index(name))
    t, rows = packed_rows(name, 19, gen)  # 19 rows: a full and a partial tile of 16
    ref = reference.dequantize_blocks(t, rows)
    assert torch.equal(tg.dequantize_blocks(t, rows), ref)  # the same float32 operations, in the same order
    for dtype in (torch.bfloat16, torch.float16):  # rounded to nearest even, as torch rounds
        assert torch.equal(tg.dequantize_blocks(t, rows, dtype), ref.to(dtype))


@pytest.mark.parametrize("name", LAYOUTS)
def test_gemm_blocks_equals_reference(name):
    gen = torch.Generator().manual_seed(100 + LAYOUTS.index(name))
    t, rows = packed_rows(name, 19, gen)
    w = reference.dequantize_blocks(t, rows)
    k = w.shape[1]
    for m in (1, 3, 17):  # decode (GEMV), a few rows (GEMV), more than a 16-row tile (tl.dot)
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(19, generator=gen) if m != 3 else None
        y = tg.gemm_blocks(t, rows, x, bias)
        assert y.shape == (m, 19) and y.dtype == torch.float32
        assert_within_rounding(y, reference.gemm_blocks(t, rows, x, bias, "f32"), x, w)


@pytest.mark.parametrize("name", ["q4_k", "int4-g32", "nvfp4", "sparse24"])  # per-element and structured GEMVs
def test_split_k_gemv_equals_reference(name):
    gen = torch.Generator().manual_seed(7)
    t, rows = packed_rows(name, 5, gen, k=512)  # 8 K steps of 64 in the interpreter: 4 splits of 2
    w = reference.dequantize_blocks(t, rows)
    x = torch.randn(2, w.shape[1], generator=gen)
    bias = torch.randn(5, generator=gen)  # added once, not once per split
    y = tg.gemm_blocks(t, rows, x, bias, split_k=4)
    assert_within_rounding(y, reference.gemm_blocks(t, rows, x, bias, "f32"), x, w)


@pytest.mark.parametrize("name", ["q6_k", "int4-g128", "mxfp4", "fp8", "sparse24-int8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_activations_through_the_dot_and_the_gemv(name, dtype):
    """bf16/fp16 x: the interpreter's bf16 tl.dot is wrong, so the kernel must dot in float32: y equals the twin
    up to one rounding of y to x's dtype (2⁻⁷ relative for bf16's 8 significant bits, 2⁻¹⁰ for fp16's 11)."""
    gen = torch.Generator().manual_seed(3)
    t, rows = packed_rows(name, 19, gen)
    w = reference.dequantize_blocks(t, rows)
    for m in (2, 33):  # GEMV; tl.dot with a 64-row tile
        x = torch.randn(2, m, w.shape[1], generator=gen).to(dtype)[0]
        y = tg.gemm_blocks(t, rows, x)
        assert y.dtype == dtype
        assert_within_rounding(
            y, reference.gemm_blocks(t, rows, x, None, "f32"), x, w, 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
        )


def test_batched_shapes_large_scales_and_zero_rows():
    gen = torch.Generator().manual_seed(11)
    t, rows = packed_rows("int4-g64", 7, gen, scale=100.0)
    w = reference.dequantize_blocks(t, rows)
    x = torch.randn(2, 9, 128, generator=gen) * 1e3
    x[0, 4] = 0.0
    y = tg.gemm_blocks(t, rows, x)
    assert y.shape == (2, 9, 7)
    assert tg.gemm_blocks(t, rows, x[:, :0]).shape == (2, 0, 7)
    assert torch.equal(y[0, 4], torch.zeros(7))
    assert_within_rounding(y, reference.gemm_blocks(t, rows, x, None, "f32"), x, w)


def test_bad_input_gets_a_clear_error():
    rows = torch.zeros(4, 18, dtype=torch.uint8)
    with pytest.raises(NotImplementedError, match="GGML IQ2_XXS has no Triton kernel"):
        tg.gemm_blocks(16, rows, torch.randn(1, 32))  # IQ2_XXS: not a layout read here
    with pytest.raises(ValueError, match="hold 32 values, activations 64"):
        tg.gemm_blocks(int(T.Q4_0), rows, torch.randn(1, 64))
    with pytest.raises(ValueError, match="whole number of blocks"):
        tg.dequantize_blocks(nl.INT8_ROW, torch.zeros(4, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="uint8"):
        tg.gemm_blocks(int(T.Q4_0), rows.float(), torch.randn(1, 32))


def test_outside_the_interpreter_cpu_tensors_get_a_clear_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="run on CUDA tensors"):
        tg.gemm_blocks(int(T.Q4_0), torch.zeros(4, 18, dtype=torch.uint8), torch.randn(1, 32))
