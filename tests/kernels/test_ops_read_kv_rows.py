"""The page decoding of the native attention (``ops.read_kv_rows``) against its twin ``reference.read_kv_rows``:
every page type, every fp8 code (normals, subnormals, signed zeros, the largest finite), extreme scales."""
import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import ROW_PAGE_TYPES

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")


def random_rows(kv_dtype, rows, d, gen):
    x = torch.randn(rows, d, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    if kv_dtype == "int8":
        return reference.quantize_int8_rows(x)
    if kv_dtype == "fp8":
        return reference.quantize_fp8_rows(x)
    return x.to({"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[kv_dtype]), None


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("kv_dtype", ROW_PAGE_TYPES)
def test_page_rows_read_as_the_reference(variant, kv_dtype):
    gen = torch.Generator().manual_seed(ROW_PAGE_TYPES.index(kv_dtype))
    pages, scales = random_rows(kv_dtype, 37, 72, gen)
    got = ops.read_kv_rows(kv_dtype, pages, scales, variant=variant)
    assert torch.equal(got, reference.read_kv_rows(kv_dtype, pages, scales))


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_fp8_code_decodes_exactly(variant):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F/0xFF are NaN in E4M3 (never written)
    codes = torch.cat([codes, torch.tensor([0, 0x80], dtype=torch.uint8)]).reshape(-1, 8)  # 256 codes, 8 a row
    for s in (1.0, 2.0 ** -14, 1e-6, 65504.0):
        scales = torch.full((codes.shape[0], 1), s, dtype=torch.float16)
        got = ops.read_kv_rows("fp8", codes, scales, variant=variant)
        assert torch.equal(got, reference.read_kv_rows("fp8", codes, scales)), s
