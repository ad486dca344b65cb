"""ops.linear, the one place a linear layer's kernel is chosen: each branch (block kernels, x4, the prefill-sized
float GEMM, the format's own product) against the reference product of the same weight."""

import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import ops, reference
from bytediet.kernels.ggml_codecs import ENCODERS

N, K = 64, 128


def weight(activations, gen, interleave=False, native=True):
    blocks = ENCODERS[T.Q4_0](torch.randn(N * K // 32, 32, generator=gen) * 0.2).reshape(N, -1)
    calls = []

    def apply(x, bias):
        calls.append(x.shape)
        return reference.gemm_blocks(T.Q4_0, blocks, x, bias, "f32")

    x4 = ops.repack_x4(int(T.Q4_0), blocks) if interleave and ops.can_interleave(int(T.Q4_0), N, K) else None
    w = ops.LinearWeight(K, N, activations, apply, (int(T.Q4_0), blocks) if native else None, x4, int(T.Q4_0))
    return w, blocks, calls


@pytest.mark.parametrize(
    "activations,rows,interleave",
    [
        ("q8", 3, False),
        ("q8", 3, True),
        ("q16", 2, True),
        ("q16", 20, True),
        ("f32", 5, False),
        ("q16", 80, False),
        ("f32", 80, False),
    ],
)
def test_each_branch_equals_the_reference_product(activations, rows, interleave):
    gen = torch.Generator().manual_seed(rows)
    w, blocks, calls = weight(activations, gen, interleave)
    x, bias = torch.randn(rows, K, generator=gen), torch.randn(N, generator=gen)
    want = reference.gemm_blocks(T.Q4_0, blocks, x, bias, "f32")
    got = ops.linear(w, x, bias)
    assert got.shape == (rows, N) and not calls  # a kernel ran, not the format's own product
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()  # q8/q16 activation rounding


@pytest.mark.parametrize("rows", [ops.PANEL_MIN_ROWS - 1, ops.PANEL_MIN_ROWS, ops.DENSE_GEMM_MIN_ROWS - 1])
def test_a_batched_decode_takes_the_panel_from_panel_min_rows(monkeypatch, rows):
    """q16 rows from PANEL_MIN_ROWS on run the panel GEMM (where this build has it), fewer the x4 kernels."""
    taken = []
    for name in ("gemm_panel", "gemm_x4"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _k=kernel, _n=name, **kw: taken.append(_n) or _k(*a, **kw))
    gen = torch.Generator().manual_seed(rows)
    w, blocks, _ = weight("q16", gen, interleave=True)
    x = torch.randn(rows, K, generator=gen)
    want = reference.gemm_blocks(T.Q4_0, blocks, x, None, "f32")
    got = ops.linear(w, x)
    assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()
    panel = rows >= ops.PANEL_MIN_ROWS and ops.has_gemm_panel(int(T.Q4_0))
    expected = "gemm_panel" if panel else "gemm_x4" if w.interleaved is not None else None
    assert taken == ([expected] if expected else [])


@pytest.mark.parametrize("rows", [ops.DENSE_GEMM_MIN_ROWS, ops.DECODED_LARGE_WEIGHT_MIN_ROWS])
def test_a_weight_too_large_to_decode_for_a_few_rows_runs_its_x4_kernels(monkeypatch, rows):
    """A q16 product of prefill size on a weight whose float copy is over DECODE_CHUNK_BYTES (an lm_head) runs the
    x4 kernels below DECODED_LARGE_WEIGHT_MIN_ROWS rows and the decoded float GEMM from there (where no panel GEMM
    takes it); a weight under the limit is decoded from DENSE_GEMM_MIN_ROWS."""
    taken = []
    for name in ("gemm_panel", "gemm_x4", "decoded_linear"):
        kernel = getattr(ops, name)
        monkeypatch.setattr(ops, name, lambda *a, _k=kernel, _n=name, **kw: taken.append(_n) or _k(*a, **kw))
    monkeypatch.setattr(ops, "has_gemm_panel", lambda *a, **kw: False)
    gen = torch.Generator().manual_seed(rows)
    w, blocks, _ = weight("q16", gen, interleave=True)
    if w.interleaved is None:
        pytest.skip("no native x4 kernels here")
    x = torch.randn(rows, K, generator=gen)
    want = reference.gemm_blocks(T.Q4_0, blocks, x, None, "f32")
    for limit, large in ((N * K * 4, False), (N * K * 4 - 1, True)):  # the float copy: N × K × 4 bytes
        monkeypatch.setattr(ops, "DECODE_CHUNK_BYTES", limit)
        taken.clear()
        got = ops.linear(w, x)
        assert (got - want).abs().max().item() <= 3e-2 * want.abs().max().item()
        x4 = large and rows < ops.DECODED_LARGE_WEIGHT_MIN_ROWS
        assert taken == (["gemm_x4"] if x4 else ["decoded_linear"])


def test_a_weight_without_native_rows_runs_the_format_s_product():
    w, blocks, calls = weight("q8", torch.Generator().manual_seed(0), native=False)
    x = torch.randn(2, K)
    assert torch.equal(ops.linear(w, x), reference.gemm_blocks(T.Q4_0, blocks, x, None, "f32")) and calls == [(2, K)]


@pytest.mark.parametrize("gemm", [torch.float32, torch.bfloat16])
def test_a_large_weight_is_decoded_a_run_of_rows_at_a_time(monkeypatch, gemm):
    """decoded_linear: a weight over DECODE_CHUNK_BYTES multiplied in runs of rows (uneven last run) gives the
    whole-weight product."""
    gen = torch.Generator().manual_seed(7)
    blocks = ENCODERS[T.Q4_0](torch.randn(N * K // 32, 32, generator=gen) * 0.2).reshape(N, -1)
    x = torch.randn(2, 70, K, generator=gen)
    whole = ops.decoded_linear(int(T.Q4_0), blocks, x, gemm)
    monkeypatch.setattr(ops, "DECODE_CHUNK_BYTES", 11 * K * torch.finfo(gemm).bits // 8)  # 11 rows a run
    chunked = ops.decoded_linear(int(T.Q4_0), blocks, x, gemm)
    assert chunked.shape == (2, 70, N) and chunked.dtype == x.dtype
    w = reference.dequantize_blocks(T.Q4_0, blocks, gemm)
    want = torch.nn.functional.linear(x.to(gemm), w).to(x.dtype)
    torch.testing.assert_close(chunked, whole, rtol=1e-5 if gemm == torch.float32 else 1e-2, atol=1e-5)
    torch.testing.assert_close(chunked, want, rtol=1e-5 if gemm == torch.float32 else 1e-2, atol=1e-5)
