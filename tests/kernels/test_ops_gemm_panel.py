"""The prefill panel GEMM (csrc/gemm_panel.cpp): every integer-code block format times q16 activations equals
its reference twin (kernels/reference.py gemm_panel) on fresh random inputs — odd activation rows (register
tile tails), weight rows not a multiple of the 32-row panel, all-zero and extreme scales, a bias; the avx2
variant (and a float-valued layout) has no panel kernel and says so, and ops.gemm_panel then runs the reference."""

import pytest
import torch

from bytediet.kernels import native_layouts as nl
from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.quant.mxfp4 import MXFP4
from bytediet.quant.nvfp4 import NVFP4

from .test_native_layouts import fp4_rows, int4_rows, int8_rows, needs_native, sparse24_rows
from .test_ops_gemm_blocks import K_TYPES, SMALL_BLOCK_TYPES, check_close, random_blocks

PANEL_VARIANTS = [v.name for v in build.runnable_variants() if "avx512_vnni" in v.cpu_flags]
needs_panel = pytest.mark.skipif(
    not PANEL_VARIANTS or build.find_compiler() is None, reason="no AVX-512 VNNI variant runs on this CPU"
)
GGML_TYPES = SMALL_BLOCK_TYPES + list(K_TYPES)


def own_layout(name: str, n: int, k: int, gen: torch.Generator, scale: float = 1.0):
    """(type id, rows) of one of bytediet's own layouts with a random weight."""
    if name == "int8":
        _, _, rows, t = int8_rows(n, k, gen, scale)
        return t, rows
    if name.startswith("int4"):
        group, sym = int(name.split("-")[1]), name.endswith("sym")
        _, _, rows, t = int4_rows(n, k, group, sym, gen, scale)
        return t, rows
    if name == "sparse24-int8":
        _, _, rows, t = sparse24_rows(n, k, gen, scale)
        return t, rows
    _, _, rows, t = fp4_rows(MXFP4() if name == "mxfp4" else NVFP4(), n, k, gen, scale)
    return t, rows


OWN = ["int8", "int4-32", "int4-64-sym", "int4-128", "mxfp4", "nvfp4", "sparse24-int8"]


def check(gtype: int, blocks: torch.Tensor, x: torch.Tensor, bias=None, variant=None) -> None:
    y = ops.gemm_panel(gtype, blocks, x, bias, variant=variant)
    ref = reference.gemm_panel(gtype, blocks, x, bias)
    w = reference.dequantize_blocks(gtype, blocks)
    check_close(y - (0 if bias is None else bias), ref - (0 if bias is None else bias), x, w)


@needs_panel
@pytest.mark.parametrize("variant", PANEL_VARIANTS)
@pytest.mark.parametrize("gtype", GGML_TYPES, ids=lambda t: getattr(t, "name", str(t)))
def test_ggml_blocks_equal_the_reference(variant, gtype):
    gen = torch.Generator().manual_seed(int(gtype) * 3 + 1)
    k = 512 if gtype in K_TYPES else 96
    for n in (1, 37, 70):  # one row, a partial panel, two panels and a tail
        blocks = random_blocks(gtype, n, k, gen)
        assert ops.has_gemm_panel(gtype, variant=variant)
        for m in (1, 3, 5, 67):  # register tiles of 4 rows and their tails
            x = torch.randn(m, k, generator=gen) * 3
            check(gtype, blocks, x, variant=variant)
    bias = torch.randn(37, generator=gen)
    check(gtype, random_blocks(gtype, 37, k, gen), torch.randn(9, k, generator=gen), bias, variant)


@needs_panel
@pytest.mark.parametrize("variant", PANEL_VARIANTS)
@pytest.mark.parametrize("name", OWN)
def test_bytediet_layouts_equal_the_reference(variant, name):
    gen = torch.Generator().manual_seed(len(name) * 11)
    for n, m in ((33, 5), (64, 66)):
        gtype, rows = own_layout(name, n, 256, gen)
        assert ops.has_gemm_panel(gtype, variant=variant)
        check(gtype, rows, torch.randn(m, 256, generator=gen), variant=variant)


@needs_panel
@pytest.mark.parametrize("variant", PANEL_VARIANTS)
def test_zero_weights_zero_activations_and_extreme_scales(variant):
    gen = torch.Generator().manual_seed(5)
    gtype = SMALL_BLOCK_TYPES[0]
    blocks = random_blocks(gtype, 40, 128, gen)
    zero = torch.zeros_like(blocks)  # d = 0: every weight 0
    x = torch.randn(7, 128, generator=gen)
    assert torch.equal(ops.gemm_panel(gtype, zero, x, variant=variant), torch.zeros(7, 40))
    assert torch.equal(ops.gemm_panel(gtype, blocks, torch.zeros(7, 128), variant=variant), torch.zeros(7, 40))
    for scale in (1e-6, 1e4):  # tiny and huge weight scales, huge and tiny activations
        big = random_blocks(gtype, 40, 128, gen, scale=scale)
        check(gtype, big, torch.randn(7, 128, generator=gen) / scale, variant=variant)
    x = torch.randn(6, 128, generator=gen)
    x[:, :32] = 0  # an all-zero activation block (d = 0) beside ordinary ones
    x[2] *= 1e5
    check(gtype, blocks, x, variant=variant)


@needs_native
def test_without_vnni_or_for_float_layouts_the_reference_runs():
    gen = torch.Generator().manual_seed(6)
    gtype = SMALL_BLOCK_TYPES[1]
    blocks, x = random_blocks(gtype, 8, 64, gen), torch.randn(3, 64, generator=gen)
    if "avx2" in [v.name for v in build.runnable_variants()]:
        assert not ops.has_gemm_panel(gtype, variant="avx2")
        assert torch.allclose(ops.gemm_panel(gtype, blocks, x, variant="avx2"), reference.gemm_panel(gtype, blocks, x))
    for float_layout in nl.FLOAT_TYPES:
        assert not ops.has_gemm_panel(float_layout)


@needs_panel
def test_rows_that_are_not_whole_blocks_are_refused():
    gen = torch.Generator().manual_seed(7)
    gtype = SMALL_BLOCK_TYPES[0]
    with pytest.raises(ValueError, match="do not hold"):
        ops.gemm_panel(
            gtype, random_blocks(gtype, 4, 64, gen), torch.randn(2, 96, generator=gen), variant=PANEL_VARIANTS[-1]
        )
