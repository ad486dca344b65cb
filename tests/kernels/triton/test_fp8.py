"""W8A8 FP8 through torch._scaled_mm against its twin (reference.fp8_w8a8_linear), on torch's CPU kernel here
and on the GPU where one is present."""

import pytest
import torch

from bytediet.kernels import reference
from bytediet.kernels.triton import fp8
from bytediet.quant import get_weight_format

U = 2.0**-24


def fp8_weight(n: int, k: int, gen: torch.Generator, device: str = "cpu"):
    fmt = get_weight_format("fp8")
    _, rows = fmt.native_layout(fmt.quantize(torch.randn(n, k, generator=gen)))
    return fp8.fp8_weight_from_rows(rows.to(device))


def check(y, x, qweight, scale, bias, out_ulp):
    """|y − twin| ≤ one rounding of y + (K + 2)·u·Σ|x_q s_x||w|: any float32 accumulation order (Higham's γ_K)."""
    ref = reference.fp8_w8a8_linear(x.cpu(), qweight.cpu(), scale.cpu(), None if bias is None else bias.cpu())
    xq, sx = reference.quantize_rows_fp8(x.cpu().reshape(-1, x.shape[-1]))
    terms = (xq.double() * sx.double()).abs() @ (qweight.cpu().double() * scale.cpu().double()[:, None]).abs().T
    err = (y.cpu().double().reshape(terms.shape) - ref.double().reshape(terms.shape)).abs()
    bound = out_ulp * ref.double().abs().reshape(terms.shape) + (x.shape[-1] + 2) * U * terms + 1e-30
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


def cpu_scaled_mm_works() -> bool:
    try:
        one = torch.ones(())
        a = torch.zeros(16, 16).to(torch.float8_e4m3fn)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@pytest.mark.skipif(not cpu_scaled_mm_works(), reason="this torch has no CPU torch._scaled_mm for float8_e4m3fn")
@pytest.mark.parametrize("rowwise", [True, False])
@pytest.mark.parametrize("m", [1, 5, 33])
def test_fp8_linear_equals_twin_on_cpu(rowwise, m):
    gen = torch.Generator().manual_seed(m + rowwise)
    qweight, scale = fp8_weight(48, 64, gen)
    x = torch.randn(m, 64, generator=gen)
    x[0] *= 100.0  # per-token scales: one loud row leaves the others' precision alone
    bias = torch.randn(48, generator=gen) if m != 5 else None
    dtype = torch.bfloat16 if rowwise else torch.float32
    y = fp8.fp8_linear(x.to(dtype), qweight, scale, None if bias is None else bias.to(dtype), rowwise=rowwise)
    assert y.shape == (m, 48) and y.dtype == dtype
    bias_r = None if bias is None else bias.to(dtype)
    check(y, x.to(dtype), qweight, scale, bias_r, 2.0**-7 if rowwise else 2 * U)


def test_fp8_weight_round_trips_the_format():
    gen = torch.Generator().manual_seed(1)
    fmt = get_weight_format("fp8")
    packed = fmt.quantize(torch.randn(16, 32, generator=gen))
    q, s = fp8.fp8_weight_from_rows(fmt.native_layout(packed)[1])
    assert torch.equal(q.view(torch.uint8), packed["qweight"].view(torch.uint8)) and torch.equal(s, packed["scale"])


def test_fp8_rejects_shapes_scaled_mm_cannot_take():
    gen = torch.Generator().manual_seed(2)
    qweight, scale = fp8_weight(24, 32, gen)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8.fp8_linear(torch.randn(1, 32), qweight, scale)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp8_linear_on_the_gpu():
    device = torch.device("cuda")
    reason = fp8.fp8_unsupported_reason(device)
    if reason:
        with pytest.raises(RuntimeError, match="sm_89"):
            fp8.fp8_linear(torch.randn(1, 64, device=device), *fp8_weight(32, 64, torch.Generator()))
        return
    gen = torch.Generator().manual_seed(3)
    qweight, scale = fp8_weight(256, 512, gen, "cuda")
    for m in (1, 16, 100):
        x = torch.randn(m, 512, generator=gen).to(device, torch.bfloat16)
        check(fp8.fp8_linear(x, qweight, scale), x, qweight, scale, None, 2.0**-7)
