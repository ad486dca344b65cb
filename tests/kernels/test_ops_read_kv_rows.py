"""The page decoding of the native attention (``ops.read_kv_rows``) against its twin ``reference.read_kv_rows``:
every page type, every fp8 code (normals, subnormals, signed zeros, the largest finite), extreme scales; and the
page encoding of the native decode step (``ops.write_kv_rows``) against ``reference.write_kv_rows`` (the KV
codecs' own rounding), bit for bit: llama.cpp's block quantizers on ties, zeros, constants and extreme scales."""

from unittest import mock

import pytest
import torch

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import ATTENTION_PAGE_TYPES, BLOCK_PAGE_TYPES

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")


def random_rows(page_type, rows, d, gen):
    x = torch.randn(rows, d, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    return reference.write_kv_rows(page_type, x)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_type", ATTENTION_PAGE_TYPES)
def test_page_rows_read_as_the_reference(variant, page_type):
    gen = torch.Generator().manual_seed(ATTENTION_PAGE_TYPES.index(page_type))
    d = 96 if page_type in BLOCK_PAGE_TYPES else 72  # block pages: 3 blocks of 32 values a row
    pages, scales = random_rows(page_type, 37, d, gen)
    with mock.patch.object(reference, "read_kv_rows", side_effect=AssertionError("the reference ran")):
        got = ops.read_kv_rows(page_type, pages, scales, variant=variant)
    assert got.shape == (37, d)
    assert torch.equal(got, reference.read_kv_rows(page_type, pages, scales))


def hard_rows(gen):
    """(3, 5, 96) float32 rows that test a quantizer's rounding: random at 1e-4 … 1e4, all-zero and constant
    blocks, values on the half-steps (x·(1/d) + 8.5 exactly an integer), a block whose extremes tie in magnitude
    (the first wins, sign kept), negative-only blocks."""
    x = torch.randn(3, 5, 96, generator=gen) * torch.logspace(-4, 4, 5)[None, :, None]
    x[0, 0, :32] = 0.0
    x[0, 1, 32:64] = 1.5
    x[0, 2, :] = torch.arange(96) / 8.0 - 6.0
    x[1, 0, :32] = torch.linspace(-4.0, 4.0, 32)
    x[1, 1, 32:64] = -torch.rand(32, generator=gen) - 0.25
    x[2, 0, 64:] = torch.where(torch.arange(32) % 2 == 0, 3.0, -3.0)
    return x


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("page_type", ATTENTION_PAGE_TYPES)
def test_page_rows_written_as_the_reference(variant, page_type):
    x = hard_rows(torch.Generator().manual_seed(7 + ATTENTION_PAGE_TYPES.index(page_type)))
    with mock.patch.object(reference, "write_kv_rows", side_effect=AssertionError("the reference ran")):
        got, got_scales = ops.write_kv_rows(page_type, x, variant=variant)
    want, want_scales = reference.write_kv_rows(page_type, x)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # bit for bit (signed zeros included)
    assert (got_scales is None) == (want_scales is None)
    if want_scales is not None:
        assert torch.equal(got_scales, want_scales)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_fp8_code_decodes_exactly(variant):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # 0x7F/0xFF are NaN in E4M3 (never written)
    codes = torch.cat([codes, torch.tensor([0, 0x80], dtype=torch.uint8)]).reshape(-1, 8)  # 256 codes, 8 a row
    for s in (1.0, 2.0**-14, 1e-6, 65504.0):
        scales = torch.full((codes.shape[0], 1), s, dtype=torch.float16)
        got = ops.read_kv_rows("fp8", codes, scales, variant=variant)
        assert torch.equal(got, reference.read_kv_rows("fp8", codes, scales)), s
