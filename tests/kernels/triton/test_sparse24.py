"""2:4 sparse weights on sparse tensor cores (PyTorch semi-structured) against their twin, reference.sparse24_matmul:
on a GPU (sm_80+) only; on the CPU, the clear error."""

import pytest
import torch

from bytediet.kernels import reference
from bytediet.kernels.triton import sparse24
from bytediet.quant import get_weight_format


def test_cpu_gets_a_one_line_reason():
    reason = sparse24.semi_structured_unsupported_reason(torch.device("cpu"))
    assert reason and "\n" not in reason and "CUDA" in reason
    with pytest.raises(RuntimeError, match="sm_80"):
        sparse24.to_semi_structured(torch.zeros(64, 128, dtype=torch.float16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sparse24_linear_equals_twin_on_the_gpu():
    device = torch.device("cuda")
    if sparse24.semi_structured_unsupported_reason(device):
        pytest.skip(sparse24.semi_structured_unsupported_reason(device))
    gen = torch.Generator().manual_seed(4)
    fmt = get_weight_format("sparse24")
    packed = fmt.quantize(torch.randn(128, 256, generator=gen))
    _, rows = fmt.native_layout(packed)
    for dtype in (torch.float16, torch.bfloat16):
        weight = sparse24.sparse24_weight_from_rows(rows.to(device), dtype)
        for m in (1, 8, 70):
            x = torch.randn(m, 256, generator=gen).to(dtype)
            y = sparse24.sparse24_linear(x.to(device), weight).cpu()
            ref = reference.sparse24_matmul(x.float(), packed["values"].to(dtype), packed["index"])
            terms = x.double().abs() @ fmt.dequantize(packed).to(dtype).double().abs().T
            # fp32 accumulation of 128 kept products (γ_K), then one rounding to dtype (2⁻⁷ bf16, 2⁻¹⁰ fp16)
            ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
            assert ((y.double() - ref.double()).abs() <= ulp * ref.double().abs() + 130 * 2.0**-24 * terms + 1e-6).all()
