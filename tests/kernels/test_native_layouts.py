"""bytediet's int8/int4 layouts: the repack is exact (the reference decoder gives the format's own dequantized
weight, bit for bit), and the native kernels multiply them as the reference does, for every runnable variant."""

import pytest
import torch

from bytediet.kernels import native_layouts as nl
from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.quant import get_weight_format
from bytediet.quant.int4 import Int4
from bytediet.quant.int8 import Int8
from bytediet.quant.mxfp4 import MXFP4
from bytediet.quant.nvfp4 import NVFP4

from .test_ops_gemm_blocks import check_close

VARIANTS = [v.name for v in build.runnable_variants()]
needs_native = pytest.mark.skipif(
    not VARIANTS or build.find_compiler() is None,
    reason="no runnable native variant (CPU without AVX2, or no compiler)",
)
INT4_CASES = [(g, sym) for g in (32, 64, 128) for sym in (False, True)]


def int4_rows(n: int, k: int, group: int, symmetric: bool, gen: torch.Generator, scale: float = 1.0):
    fmt = Int4(group, symmetric)
    packed = fmt.quantize(torch.randn(n, k, generator=gen) * scale)
    rows = nl.pack_int4_groups(packed["qweight"], packed["scale"], packed.get("offset"), group)
    return fmt, packed, rows, nl.INT4_GROUPS[(group, symmetric)]


def int8_rows(n: int, k: int, gen: torch.Generator, scale: float = 1.0):
    fmt = Int8()
    packed = fmt.quantize(torch.randn(n, k, generator=gen) * scale)
    return fmt, packed, nl.pack_int8_rows(packed["qweight"], packed["scale"]), nl.INT8_ROW


def fp4_rows(fmt, n: int, k: int, gen: torch.Generator, scale: float = 1.0):
    packed = fmt.quantize(torch.randn(n, k, generator=gen) * scale)
    t, rows = fmt.native_layout(packed)
    return fmt, packed, rows, t


@pytest.mark.parametrize("fmt", [MXFP4(), NVFP4()], ids=["mxfp4", "nvfp4"])
def test_fp4_repack_is_bit_identical(fmt):
    gen = torch.Generator().manual_seed(9)
    _, packed, rows, t = fp4_rows(fmt, 6, 256, gen)
    assert torch.equal(reference.dequantize_blocks(t, rows), fmt.dequantize(packed))
    body = rows.numel() - 6 * nl.row_header_bytes(t)  # nvfp4: 4 bytes per row hold the tensor scale
    assert body * 8 / (6 * 256) == pytest.approx(4.0 + 8 * (1 if fmt.name == "mxfp4" else 2) / 32)  # as the format
    assert nl.row_weights(t, rows.shape[1]) == 256


def sparse24_rows(n: int, k: int, gen: torch.Generator, scale: float = 1.0):
    fmt = get_weight_format("sparse24-int8")
    packed = fmt.quantize(torch.randn(n, k, generator=gen) * scale)
    return fmt, packed, nl.pack_sparse24_int8(packed["values"], packed["index"], packed["scale"]), nl.SPARSE24_INT8


def test_sparse24_repack_is_bit_identical_and_moves_5_bits_per_weight():
    gen = torch.Generator().manual_seed(12)
    fmt, packed, rows, t = sparse24_rows(6, 256, gen)
    assert torch.equal(reference.dequantize_blocks(t, rows), fmt.dequantize(packed))
    assert rows.numel() * 8 / (6 * 256) == pytest.approx(fmt.bits_per_weight(6, 256))
    assert nl.row_weights(t, rows.shape[1]) == 256


@pytest.mark.parametrize("group,symmetric", INT4_CASES)
def test_int4_repack_is_bit_identical(group, symmetric):
    gen = torch.Generator().manual_seed(group + symmetric)
    fmt, packed, rows, t = int4_rows(5, 384, group, symmetric, gen)
    assert rows.shape == (5, 384 // group * nl.block_bytes(t))
    assert rows.numel() * 8 / (5 * 384) == fmt.bits_per_weight(5, 384)  # exactly the format's bytes
    assert torch.equal(reference.dequantize_blocks(t, rows), fmt.dequantize(packed))
    assert nl.row_weights(t, rows.shape[1]) == 384


def test_int8_repack_is_bit_identical():
    gen = torch.Generator().manual_seed(3)
    fmt, packed, rows, t = int8_rows(7, 96, gen)
    assert rows.shape == (7, 4 + 96)
    assert torch.equal(reference.dequantize_blocks(t, rows), fmt.dequantize(packed))
    assert nl.row_weights(t, rows.shape[1]) == 96


def check_products(t, rows, activations, variant, gen, own=None):
    """The native product of layout ``t`` rows with 1, 2 (with a bias), 5 and 17 activation rows against
    ``reference.gemm_blocks`` (and, given ``own(x, bias)``, against the format's own product)."""
    n, k = rows.shape[0], nl.row_weights(t, rows.shape[1])
    w = reference.dequantize_blocks(t, rows)
    for m in (1, 2, 5, 17):
        x = torch.randn(m, k, generator=gen)
        bias = torch.randn(n, generator=gen) if m == 2 else None
        y = ops.gemm_blocks(t, rows, x, bias, activations, variant=variant)
        assert y.shape == (m, n)
        check_close(y, reference.gemm_blocks(t, rows, x, bias, activations), x, w)
        if own is not None:
            check_close(y, own(x, bias), x, w)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "case", ["int8", "mxfp4", "nvfp4", "sparse24-int8"] + [f"int4-g{g}{'-sym' if s else ''}" for g, s in INT4_CASES]
)
@pytest.mark.parametrize("activations", ["q8", "q16", "f32"])
def test_native_layout_gemm_equals_reference(variant, case, activations):
    gen = torch.Generator().manual_seed(len(case) * 31 + len(activations))
    k = 384
    for n in (1, 3, 37):  # rows not a multiple of the 4-row tile
        if case == "int8":
            _, _, rows, t = int8_rows(n, k, gen)
        elif case == "sparse24-int8":
            _, _, rows, t = sparse24_rows(n, k, gen)
        elif case in ("mxfp4", "nvfp4"):
            _, _, rows, t = fp4_rows(MXFP4() if case == "mxfp4" else NVFP4(), n, k, gen)
        else:
            g = int(case.split("-g")[1].split("-")[0])
            _, _, rows, t = int4_rows(n, k, g, case.endswith("sym"), gen)
        check_products(t, rows, activations, variant, gen)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_layout_extreme_inputs(variant):
    gen = torch.Generator().manual_seed(11)
    k = 256
    for make in (
        lambda s: int8_rows(5, k, gen, s),
        lambda s: int4_rows(5, k, 64, False, gen, s),
        lambda s: int4_rows(5, k, 128, True, gen, s),
        lambda s: fp4_rows(MXFP4(), 5, k, gen, s),
        lambda s: fp4_rows(NVFP4(), 5, k, gen, s),
        lambda s: sparse24_rows(5, k, gen, s),
    ):
        _, _, zero_rows, t = make(0.0)  # all-zero weights: zero scales
        x = torch.randn(2, k, generator=gen)
        for activations in ("q8", "q16", "f32"):
            assert torch.equal(ops.gemm_blocks(t, zero_rows, x, None, activations, variant=variant), torch.zeros(2, 5))
        _, _, rows, t = make(100.0)
        for x in (torch.zeros(2, k), torch.randn(2, k, generator=gen) * 1e4):
            for activations in ("q8", "q16", "f32"):
                y = ops.gemm_blocks(t, rows, x, None, activations, variant=variant)
                check_close(
                    y, reference.gemm_blocks(t, rows, x, None, activations), x, reference.dequantize_blocks(t, rows)
                )


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_native_dequantize_equals_the_reference_decoders(variant):
    """The float decode behind the compute-bound path (ops.dequantize_blocks), for GGML and bytediet layouts."""
    from .test_ops_gemm_blocks import K_TYPES, SMALL_BLOCK_TYPES, random_blocks

    gen = torch.Generator().manual_seed(4)
    cases = [(int(t), random_blocks(t, 5, 512, gen)) for t in SMALL_BLOCK_TYPES + list(K_TYPES)]
    cases += [
        (t, rows)
        for *_, rows, t in (
            int8_rows(5, 512, gen),
            int4_rows(5, 512, 128, False, gen),
            int4_rows(5, 512, 32, True, gen),
            fp4_rows(MXFP4(), 5, 512, gen),
            fp4_rows(NVFP4(), 5, 512, gen),
            sparse24_rows(5, 512, gen),
        )
    ]
    for t, rows in cases:
        got = ops.dequantize_blocks(t, rows, variant=variant)
        want = reference.dequantize_blocks(t, rows)
        assert got.shape == want.shape == (5, 512)
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), t  # one rounding (fma) against two
        # bf16 (the prefill GEMM on CPUs that multiply bf16 fast): the same values rounded to nearest even
        got16 = ops.dequantize_blocks(t, rows, dtype=torch.bfloat16, variant=variant)
        assert got16.dtype == torch.bfloat16 and torch.equal(got16, got.to(torch.bfloat16)), t
        want16 = reference.dequantize_blocks(t, rows, torch.bfloat16)
        assert torch.allclose(got16.float(), want16.float(), rtol=2**-7, atol=0), t  # at most one bf16 step


# --- fp8, 2:4 sparse fp16, int8-w8a8: the formats whose activations are fixed by the format ------------------

FIXED_ACTIVATION_FORMATS = {"fp8": "f32", "sparse24": "f32", "int8-w8a8": "q8-token"}


def fixed_rows(spec: str, n: int, k: int, gen: torch.Generator, scale: float = 1.0):
    fmt = get_weight_format(spec)
    packed = fmt.quantize(torch.randn(n, k, generator=gen) * scale)
    t, rows = fmt.native_layout(packed)
    return fmt, packed, rows, t


@pytest.mark.parametrize(
    "spec,layout,bits",
    [("fp8", nl.FP8_ROW, None), ("sparse24", nl.SPARSE24_F16, 9.0), ("int8-w8a8", nl.INT8_ROW, None)],
)
def test_fixed_activation_repacks_are_bit_identical_and_keep_the_bytes(spec, layout, bits):
    gen = torch.Generator().manual_seed(21)
    fmt, packed, rows, t = fixed_rows(spec, 6, 320, gen)
    assert t == layout and fmt.activations == FIXED_ACTIVATION_FORMATS[spec]
    assert torch.equal(reference.dequantize_blocks(t, rows), fmt.dequantize(packed))
    assert rows.numel() * 8 / (6 * 320) == pytest.approx(bits or fmt.bits_per_weight(6, 320))
    assert nl.row_weights(t, rows.shape[1]) == 320


def test_fp8_layout_decodes_every_finite_e4m3_code():
    """All 254 finite E4M3 codes (subnormals, ±0, ±448) through the native decoder, against torch's cast."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].reshape(2, 127)  # drop the two NaN codes (the quantizer never writes them)
    codes = torch.cat((codes, codes[:, :1]), dim=1)  # 128 per row: whole blocks of 32
    rows = nl.pack_fp8_rows(codes.view(torch.float8_e4m3fn), torch.tensor([1.0, 3.5]))
    want = codes.view(torch.float8_e4m3fn).float() * torch.tensor([[1.0], [3.5]])
    assert torch.equal(reference.dequantize_blocks(nl.FP8_ROW, rows), want)
    for variant in VARIANTS:
        assert torch.equal(ops.dequantize_blocks(nl.FP8_ROW, rows, variant=variant), want)


def test_float_layouts_refuse_integer_activations():
    gen = torch.Generator().manual_seed(2)
    for spec in ("fp8", "sparse24"):
        _, _, rows, t = fixed_rows(spec, 4, 64, gen)
        with pytest.raises(ValueError, match="f32 activations"):
            reference.gemm_blocks(t, rows, torch.randn(1, 64), None, "q8")
        if VARIANTS:
            with pytest.raises(ValueError, match="f32 activations"):
                ops.gemm_blocks(t, rows, torch.randn(1, 64), None, "q16", variant=VARIANTS[0])


def test_per_token_activations_are_smoothquants_rounding():
    """reference.quantize_rows_per_token is the rounding int8-w8a8's apply() defines (quant/int8.py)."""
    from bytediet.quant.int8 import quantize_rows_int8

    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(8)) * torch.logspace(-3, 3, 5)[:, None]
    x[2] = 0.0
    q, d = reference.quantize_rows_per_token(x)
    q_ref, d_ref = quantize_rows_int8(x)
    assert torch.equal(q, q_ref) and torch.equal(d, d_ref)
    for variant in VARIANTS:
        qn, dn = ops.quantize_rows_per_token(x, variant=variant)
        assert torch.equal(qn, q) and torch.equal(dn, d)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", list(FIXED_ACTIVATION_FORMATS))
def test_fixed_activation_gemm_equals_reference(variant, spec):
    gen = torch.Generator().manual_seed(len(spec) * 13)
    activations = FIXED_ACTIVATION_FORMATS[spec]
    for k in (64, 416):  # 416: an odd number (13) of 32-weight blocks
        for n in (1, 3, 37):  # rows not a multiple of the 4-row tile
            fmt, packed, rows, t = fixed_rows(spec, n, k, gen)
            # and the format's own (reference-path) product
            check_products(t, rows, activations, variant, gen, own=lambda x, bias: fmt.apply(x, packed, bias))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", list(FIXED_ACTIVATION_FORMATS))
def test_fixed_activation_extreme_inputs(variant, spec):
    gen = torch.Generator().manual_seed(5)
    k, activations = 256, FIXED_ACTIVATION_FORMATS[spec]
    _, _, zero_rows, t = fixed_rows(spec, 5, k, gen, 0.0)  # all-zero weights (fp8, int8: scale 1 or 0)
    assert torch.equal(
        ops.gemm_blocks(t, zero_rows, torch.randn(2, k, generator=gen), None, activations, variant=variant),
        torch.zeros(2, 5),
    )
    for scale in (1e-30, 1e4):  # fp8: tiny per-row scales; large weights
        _, _, rows, t = fixed_rows(spec, 5, k, gen, scale)
        w = reference.dequantize_blocks(t, rows)
        for x in (torch.zeros(2, k), torch.randn(2, k, generator=gen) * 1e4, torch.randn(2, k, generator=gen) * 1e-6):
            y = ops.gemm_blocks(t, rows, x, None, activations, variant=variant)
            check_close(y, reference.gemm_blocks(t, rows, x, None, activations), x, w)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("spec", ["fp8", "sparse24"])
def test_float_layouts_dense_decode_equals_the_reference(variant, spec):
    """The decode behind the compute-bound path (values(): the 2:4 placement by lane permutes, E4M3 widening)."""
    _, packed, rows, t = fixed_rows(spec, 7, 416, torch.Generator().manual_seed(17))
    assert torch.equal(ops.dequantize_blocks(t, rows, variant=variant), reference.dequantize_blocks(t, rows))
