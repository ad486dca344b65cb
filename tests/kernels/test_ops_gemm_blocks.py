"""Every native block-format kernel against its twin in kernels/reference.py, for every ISA variant this
CPU can run (the portable AVX2 variant always, forced), on fresh random inputs."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.ggml_codecs import ENCODERS

VARIANTS = [v.name for v in build.runnable_variants()]
needs_native = pytest.mark.skipif(
    not VARIANTS or build.find_compiler() is None,
    reason="no runnable native variant (CPU without AVX2, or no compiler)",
)
SMALL_BLOCK_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
K_TYPES = {T.Q4_K: (144, [0, 2]), T.Q5_K: (176, [0, 2]), T.Q6_K: (210, [208])}


def random_blocks(gtype, n: int, k: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """(n, bytes per row) uint8: encoded Gaussian weights, or random bytes with sane f16 scales (K-quants)."""
    if gtype in ENCODERS:
        w = torch.randn(n * k // 32, 32, generator=gen) * scale
        return ENCODERS[gtype](w).reshape(n, -1)
    size, scale_at = K_TYPES[gtype]
    b = torch.randint(0, 256, (n * k // 256, size), generator=gen, dtype=torch.uint8)
    d = torch.from_numpy(np.array([0.01 * scale], dtype=np.float16).view(np.uint8).copy())
    for at in scale_at:
        b[:, at : at + 2] = d
    return b.reshape(n, -1)


def check_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within float32 rounding of the sum of |terms| per output."""
    scale = x.abs().reshape(-1, x.shape[-1]).double() @ w.abs().double().T
    err = (y.reshape(scale.shape).double() - ref.reshape(scale.shape).double()).abs()
    assert (err <= 2e-6 * scale + 1e-6).all(), f"max error {err.max().item():.3g}"


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gtype", SMALL_BLOCK_TYPES + list(K_TYPES))
@pytest.mark.parametrize("activations", ["q8", "q16", "f32"])
def test_gemm_blocks_equals_reference(variant, gtype, activations):
    gen = torch.Generator().manual_seed(int(gtype) * 7 + len(activations))
    k = 512 if gtype in K_TYPES else 96
    for n in (1, 3, 37):  # rows not a multiple of the 4-row tile
        blocks = random_blocks(gtype, n, k, gen)
        w = reference.dequantize_blocks(int(gtype), blocks)
        for m in (1, 2, 3, 5, 17):  # activation rows: decode, small batches, tails of the 2-row tile
            x = torch.randn(m, k, generator=gen)
            bias = torch.randn(n, generator=gen) if m == 3 else None
            y = ops.gemm_blocks(int(gtype), blocks, x, bias, activations, variant=variant)
            ref = reference.gemm_blocks(int(gtype), blocks, x, bias, activations)
            assert y.shape == (m, n) and y.dtype == torch.float32
            check_close(y, ref, x, w)


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gtype", [T.Q4_1, T.Q8_0, T.Q6_K])
def test_gemm_blocks_extreme_inputs(variant, gtype):
    gen = torch.Generator().manual_seed(5)
    k = 512
    for activations in ("q8", "q16", "f32"):
        zero_w = torch.zeros_like(random_blocks(gtype, 5, k, gen))  # all-zero scales and codes
        x = torch.randn(2, k, generator=gen)
        assert torch.equal(
            ops.gemm_blocks(int(gtype), zero_w, x, None, activations, variant=variant), torch.zeros(2, 5)
        )
        blocks = random_blocks(gtype, 5, k, gen, scale=100.0)
        for x in (
            torch.zeros(2, k),
            torch.randn(2, k, generator=gen) * 1e4,
            torch.cat([torch.zeros(1, k), torch.randn(1, k, generator=gen)]),
        ):  # a zero row (scale 0) beside a normal one
            y = ops.gemm_blocks(int(gtype), blocks, x, None, activations, variant=variant)
            ref = reference.gemm_blocks(int(gtype), blocks, x, None, activations)
            check_close(y, ref, x, reference.dequantize_blocks(int(gtype), blocks))


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
def test_quantize_rows_q8_is_bit_identical(variant):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 160, generator=gen) * torch.logspace(-3, 3, 7)[:, None]
    x[3] = 0.0
    x[4, :32] = 0.5  # ties: round half to even, as torch.round
    q, d, s = ops.quantize_rows_q8(x, variant=variant)
    rq, rd, rs = reference.quantize_rows_q8(x)
    assert torch.equal(q, rq) and torch.equal(d, rd) and torch.equal(s, rs)
    for got, want in zip(ops.quantize_rows_q16(x, variant=variant), reference.quantize_rows_q16(x)):
        assert torch.equal(got, want)


def test_two_planes_are_as_precise_as_int16():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    q, d, q2, d2, _ = reference.quantize_rows_q16(x)
    approx = reference.dequantize_rows_q8(q, d) + reference.dequantize_rows_q8(q2, d2)
    amax = x.reshape(3, -1, 32).abs().amax(-1, keepdim=True)
    assert ((approx - x).reshape(3, -1, 32).abs() <= amax / 64516 * 1.01).all()


@needs_native
def test_batched_and_bf16_inputs_keep_their_shape_and_dtype():
    gen = torch.Generator().manual_seed(2)
    blocks = random_blocks(T.Q4_1, 9, 64, gen)
    x = torch.randn(2, 3, 64, generator=gen)
    y = ops.gemm_blocks(int(T.Q4_1), blocks, x.bfloat16())
    assert y.shape == (2, 3, 9) and y.dtype == torch.bfloat16
    ref = reference.gemm_blocks(int(T.Q4_1), blocks, x.bfloat16())
    assert torch.allclose(y.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_reference_rejects_bad_activation_mode():
    blocks = random_blocks(T.Q8_0, 2, 32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="activations"):
        reference.gemm_blocks(int(T.Q8_0), blocks, torch.randn(1, 32), None, "int4")


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K])
def test_interleaved_layout_and_product_equal_reference(variant, gtype):
    gen = torch.Generator().manual_seed(int(gtype))
    shapes = ((4, 256), (12, 512), (36, 768)) if gtype in K_TYPES else ((4, 32), (12, 96), (36, 160))
    for n, k in shapes:
        blocks = random_blocks(gtype, n, k, gen)
        packed = ops.repack_x4(int(gtype), blocks, variant=variant)
        assert torch.equal(packed, reference.repack_x4(int(gtype), blocks))
        assert torch.equal(reference.unpack_x4(int(gtype), packed), blocks)
        w = reference.dequantize_blocks(int(gtype), blocks)
        for m in (1, 2, 3, 4, 5, 7, 9):  # the 4-, 2- and 1-row activation tiles and their tails
            x = torch.randn(m, k, generator=gen) * (100.0 if m == 5 else 1.0)
            bias = torch.randn(n, generator=gen) if m == 3 else None
            for activations in ("q8", "q16"):
                y = ops.gemm_x4(int(gtype), packed, x, bias, activations, variant=variant)
                check_close(y, reference.gemm_x4(int(gtype), packed, x, bias, activations), x, w)


@pytest.mark.skipif(len(VARIANTS) < 2 or build.find_compiler() is None, reason="one runnable variant on this CPU")
@pytest.mark.parametrize("gtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K])
def test_interleaved_products_are_bit_identical_across_variants(gtype):
    """AVX2's maddubs sums and VNNI's dpbusd sums are the same integers, and the float steps are the same: every
    variant gives the same bits, at every row tile (the AVX-512 variant takes q16 rows four at a time)."""
    gen = torch.Generator().manual_seed(100 + int(gtype))
    n, k = (8, 512) if gtype in K_TYPES else (8, 160)
    blocks = random_blocks(gtype, n, k, gen)
    packed = ops.repack_x4(int(gtype), blocks, variant=VARIANTS[0])
    for m in (1, 2, 4, 6, 11):
        x = torch.randn(m, k, generator=gen)
        for activations in ("q8", "q16"):
            ys = [ops.gemm_x4(int(gtype), packed, x, None, activations, variant=v) for v in VARIANTS]
            for v, y in zip(VARIANTS[1:], ys[1:]):
                assert torch.equal(y, ys[0]), f"{v} differs from {VARIANTS[0]} at {m} rows, {activations}"


@needs_native
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("gtype", [T.Q4_K, T.Q6_K])
def test_interleaved_k_quants_extreme_inputs(variant, gtype):
    """All-zero weights, large scales, activation rows of zeros and of 1e4 (the int16 sums of the Q6_K kernel's
    unsigned 6-bit codes must not saturate: every code 63 against ±127 activations)."""
    gen = torch.Generator().manual_seed(11)
    k = 512
    zero = ops.repack_x4(int(gtype), torch.zeros_like(random_blocks(gtype, 8, k, gen)), variant=variant)
    for activations in ("q8", "q16"):
        assert torch.equal(
            ops.gemm_x4(int(gtype), zero, torch.randn(3, k, generator=gen), None, activations, variant=variant),
            torch.zeros(3, 8),
        )
    blocks = random_blocks(gtype, 8, k, gen, scale=100.0)
    if gtype == T.Q6_K:
        blocks.reshape(-1, 210)[:4, :192] = 0xFF  # codes 63 in the first rows' super-blocks
    packed = ops.repack_x4(int(gtype), blocks, variant=variant)
    w = reference.dequantize_blocks(int(gtype), blocks)
    sign = torch.where(torch.rand(1, k, generator=gen) > 0.5, 1.0, -1.0)
    for x in (
        torch.zeros(2, k),
        torch.randn(2, k, generator=gen) * 1e4,
        torch.ones(2, k) * sign * 3.0,
        torch.cat([torch.zeros(1, k), torch.randn(1, k, generator=gen)]),
    ):
        for activations in ("q8", "q16"):
            y = ops.gemm_x4(int(gtype), packed, x, None, activations, variant=variant)
            check_close(y, reference.gemm_x4(int(gtype), packed, x, None, activations), x, w)


def test_interleaving_rejects_rows_not_a_multiple_of_four():
    blocks = random_blocks(T.Q4_1, 6, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="does not interleave"):
        reference.repack_x4(int(T.Q4_1), blocks)
    assert not ops.can_interleave(int(T.Q4_1), 6, 64)


@needs_native
def test_concurrent_callers_share_the_pool_safely():
    """Two Python threads (tensor-parallel ranks run as threads do this) calling kernels at once: the pool runs
    one region at a time and the other caller computes alone, so both results stay exact."""
    from concurrent.futures import ThreadPoolExecutor

    gen = torch.Generator().manual_seed(21)
    blocks = random_blocks(T.Q4_1, 256, 512, gen)
    xs = [torch.randn(3, 512, generator=gen) for _ in range(2)]
    want = [ops.gemm_blocks(int(T.Q4_1), blocks, x, None, "q16") for x in xs]

    def work(i):
        return [ops.gemm_blocks(int(T.Q4_1), blocks, xs[i], None, "q16") for _ in range(200)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(work, range(2)))
    for i, outs in enumerate(results):
        assert all(torch.equal(y, want[i]) for y in outs)
