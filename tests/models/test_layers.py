"""Linear's three ways to multiply a packed weight: the float GEMM on the decoded weight for compute-bound
inputs (q16/f32 activations), the native integer kernels below that, and the format's own apply otherwise."""

import pytest
import torch
import torch.nn.functional as F

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.models.layers import Linear
from bytediet.quant import get_weight_format

pytestmark = pytest.mark.skipif(
    build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels on this machine"
)


@pytest.fixture
def prefill_gemm(monkeypatch):
    """Force the compute-bound GEMM's precision (else measured on this CPU: kernels/dense_gemm.py)."""
    from bytediet.kernels import dense_gemm

    def force(name: str) -> None:
        monkeypatch.setenv(dense_gemm.ENV, name)
        dense_gemm._choice.cache_clear()

    yield force  # monkeypatch restores the suite's setting (tests/conftest.py)
    dense_gemm._choice.cache_clear()


def packed_linear(spec: str, gen: torch.Generator) -> Linear:
    """A 256 → 48 layer with a random weight in format ``spec`` and a random bias."""
    lin = Linear(256, 48, bias=True)
    lin.set_weight(torch.randn(48, 256, generator=gen), get_weight_format(spec))
    lin.bias.copy_(torch.randn(48, generator=gen))
    return lin


@pytest.mark.parametrize("spec", ["gguf-q4_1", "int8", "int4-g64", "mxfp4", "sparse24-int8"])
def test_large_inputs_use_the_float_gemm_on_the_decoded_weight(spec, prefill_gemm):
    prefill_gemm("fp32")
    gen = torch.Generator().manual_seed(1)
    lin = packed_linear(spec, gen)
    w = lin.dequantized_weight()
    big = torch.randn(ops.DENSE_GEMM_MIN_ROWS, 256, generator=gen)
    assert torch.allclose(lin(big), F.linear(big, w, lin.bias), rtol=1e-5, atol=1e-4)  # exact activations
    small = big[:3]
    exact = F.linear(small, w, lin.bias)
    y = lin(small)  # the integer kernel with q16 activations: int16-like, not bit-exact
    assert torch.allclose(y, exact, rtol=1e-3, atol=1e-2) and not torch.equal(y, exact)


@pytest.mark.parametrize("spec", ["gguf-q4_1", "int8", "int4-g64", "mxfp4", "sparse24-int8"])
def test_large_q16_inputs_run_the_int8_panel_where_the_library_has_it(spec, prefill_gemm, monkeypatch):
    prefill_gemm("int8")
    gen = torch.Generator().manual_seed(5)
    lin = packed_linear(spec, gen)
    gtype, rows = lin.native_weight()
    big = torch.randn(ops.DENSE_GEMM_MIN_ROWS + 3, 256, generator=gen)
    want = reference.gemm_panel(gtype, rows, big, lin.bias)  # q16 activations, as the decode kernels
    y = lin(big)
    if ops.has_gemm_panel(gtype):
        assert torch.allclose(y, want, rtol=1e-4, atol=1e-4) and not torch.equal(
            y, F.linear(big, lin.dequantized_weight(), lin.bias)
        )
    monkeypatch.setattr(ops, "has_gemm_panel", lambda *a, **k: False)  # an avx2 build: the fp32 GEMM instead
    assert torch.allclose(lin(big), F.linear(big, lin.dequantized_weight(), lin.bias), rtol=1e-5, atol=1e-4)


def test_q8_keeps_its_integer_kernel_for_large_inputs():
    gen = torch.Generator().manual_seed(2)
    lin = Linear(256, 48)
    lin.set_weight(torch.randn(48, 256, generator=gen), get_weight_format("int8-a8"))
    x = torch.randn(ops.DENSE_GEMM_MIN_ROWS, 256, generator=gen)
    exact = F.linear(x, lin.dequantized_weight())
    assert (lin(x) - exact).abs().max() > 1e-3  # q8 rounding: the cost the user chose stays measurable


@pytest.mark.parametrize("spec", ["gguf-q4_1", "int4-g64"])
def test_a_bf16_prefill_gemm_rounds_to_bf16_and_f32_activations_stay_exact(spec, prefill_gemm):
    prefill_gemm("bf16")
    gen = torch.Generator().manual_seed(3)
    lin = packed_linear(spec, gen)
    w = lin.dequantized_weight()
    x = torch.randn(ops.DENSE_GEMM_MIN_ROWS, 256, generator=gen)
    y = lin(x)
    want = F.linear(x.bfloat16(), w.bfloat16()).float() + lin.bias  # bf16 operands, fp32 accumulation and bias
    assert y.dtype == torch.float32 and torch.allclose(y, want, rtol=1e-2, atol=1e-2)
    exact = F.linear(x, w, lin.bias)
    assert (y - exact).abs().max() > 1e-4  # the bf16 rounding is there (and measured in bench/RESULTS.md)
    exact_lin = packed_linear(spec + "-af32", gen)
    x = torch.randn(ops.DENSE_GEMM_MIN_ROWS, 256, generator=gen)
    assert torch.allclose(
        exact_lin(x), F.linear(x, exact_lin.dequantized_weight(), exact_lin.bias), rtol=1e-5, atol=1e-4
    )


def test_a_layer_switched_to_f32_activations_after_its_x4_repack_reads_its_blocks():
    """optimize copies a loaded model whose layers the native decode step already repacked (x4) and sets f32
    activations on the copy: the module path must not hand f32 to the interleaved kernel."""
    gen = torch.Generator().manual_seed(4)
    lin = packed_linear("gguf-q4_1", gen)
    gtype, blocks = lin.native_weight()
    if not ops.can_interleave(gtype, lin.out_features, lin.in_features):
        pytest.skip("no x4 layout for this shape here")
    lin.interleaved = ops.repack_x4(gtype, blocks)
    x = torch.randn(3, 256, generator=gen)
    lin.format.with_activations("f32")
    assert torch.allclose(lin(x), F.linear(x, lin.dequantized_weight(), lin.bias), rtol=1e-4, atol=1e-4)
