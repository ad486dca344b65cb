"""Triton paged attention (``kernels/triton/paged_attention``) against its twin ``reference.attention_over_pages`` in
the interpreter: every page type it reads (float rows, int8/fp8 with scales, llama.cpp's blocks, TurboQuant codes),
keys and values of different types, decodes (one token per row, ragged contexts, several sequences, GQA and MHA,
sliding windows, the context split over programs and merged) and prefill chunks over pages (query tiles, causal,
tiles spanning two sequences). Tiny grids: the interpreter runs each program one after the other.

Tolerance 2e-5 · max(1, max|out|): kernel and twin both compute in float32 from the same decoded values and differ
only in summation order (blockwise online softmax against one softmax) — a few ulp over ≤ 100 terms; a bfloat16
dot (8-bit mantissa, relative error 4e-3 on q) would miss it by far, which test_bf16_pages_at_fp32_tolerance checks.
"""

import dataclasses
import functools
import zlib

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from bytediet.kernels import reference
from bytediet.kernels.triton import paged_attention as pa
from tests.kernels import paged_batches
from tests.kernels.paged_batches import BLOCK, row_pages, turboquant_pages

ragged_batch = functools.partial(paged_batches.ragged_batch, spare=2)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter on the CPU


def to_device(x):
    """Tensors, TurboQuant page specs (and their parts) on DEVICE; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if dataclasses.is_dataclass(x):
        return dataclasses.replace(x, **{f.name: to_device(getattr(x, f.name)) for f in dataclasses.fields(x)})
    if isinstance(x, list):
        return [to_device(y) for y in x]
    return x


def kernel(*args, **kwargs):
    """The Triton attention on DEVICE in float32 dots (the twin's precision) → the CPU."""
    return pa.attention_over_pages(
        *to_device(list(args)), **{k: to_device(v) for k, v in kwargs.items()}, precision="ieee"
    ).cpu()


ROW_TYPES = ["fp32", "bf16", "fp16", "int8", "fp8", "q8_0", "q5_0", "q4_1", "q4_0"]


def side(gen, slots, hkv, d, dtype, tq):
    """dict of one side's pages: row/block pages with scales, or TurboQuant pages built by ``tq``."""
    if dtype == "turboquant":
        return dict(cache=None, scale=None, side=tq(gen, slots, hkv, d))
    pages, scales = row_pages(gen, slots, hkv, d, dtype)
    return dict(cache=pages, scale=scales, side=None)


def check(name, k_dtype, v_dtype, hq, hkv, d, window, seqs, tq=None, tol=2e-5, **tiling):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{k_dtype}{v_dtype}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    k, v = (side(gen, slots, hkv, d, t, tq) for t in (k_dtype, v_dtype))
    q = torch.randn(len(positions), hq, d, generator=gen)
    args = (
        q,
        positions,
        rows,
        bt,
        BLOCK,
        d**-0.5,
        window,
        k_dtype,
        k["cache"],
        v["cache"],
        k["scale"],
        v["scale"],
        v_dtype,
    )
    want = reference.attention_over_pages(*args, k_side=k["side"], v_side=v["side"])
    got = kernel(*args, k_side=k["side"], v_side=v["side"], **tiling)
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= tol * max(1.0, want.abs().max().item()), f"max error {err}"


# decodes: one token per row, ragged contexts across page boundaries, GQA 2 (and 3: padded head groups), MHA
@pytest.mark.parametrize("dtype", ROW_TYPES)
def test_decode_over_row_and_block_pages(dtype):
    check("decode", dtype, dtype, 6, 2, 64, None, [(1, 1), (1, 17), (1, 40)])


def test_decode_split_k_gqa3_window():  # the context cut into 4 slices, merged (stage 2); a window of 20 keys
    check("split", "q8_0", "int8", 6, 2, 32, 20, [(1, 70), (1, 5)], num_splits=4)


def test_decode_split_k_mha():
    check("split-mha", "fp16", "q4_1", 4, 4, 32, None, [(1, 33), (1, 2)], num_splits=2)


def test_head_dim_96_gqa3_window():  # three GGML blocks a row, head_dim padded to 128 in registers
    check("d96", "q5_0", "q4_1", 6, 2, 96, 11, [(1, 31), (1, 50)])


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_every_code_of_int8_and_fp8_values(dtype):
    """One key in context: the output is the value row itself, so every one of the 256 codes (fp8's subnormals and
    extremes; its two NaN codes, which the codecs never write, left out) must come back exactly as the twin reads it."""
    codes = torch.arange(256, dtype=torch.uint8)
    if dtype == "fp8":
        codes[[0x7F, 0xFF]] = 0
    v = codes.reshape(1, 1, 256).repeat(BLOCK, 1, 1)
    scales = torch.full((BLOCK, 1, 1), 0.75, dtype=torch.float16)
    k = torch.randn(BLOCK, 1, 256).half()
    args = (
        torch.randn(1, 1, 256),
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([[0]]),
        BLOCK,
        0.1,
        None,
        "fp16",
        k,
        v,
        None,
        scales,
        dtype,
    )
    assert torch.equal(kernel(*args), reference.attention_over_pages(*args))


# keys and values of different types, as llama.cpp's k=q8_0,v=q4_0 and the auto: plans mix them
MIXED = [("q8_0", "q4_0"), ("int8", "q5_0"), ("bf16", "q4_1"), ("fp8", "fp16"), ("q4_0", "fp32"), ("q5_0", "fp8")]


@pytest.mark.parametrize("k_dtype,v_dtype", MIXED)
def test_prefill_chunk_beside_decode_over_mixed_pages(k_dtype, v_dtype):
    # a prefill chunk of 9 tokens after a 23-token prefix hit, then a decode: tiles of 4 tokens, one spanning both
    check("prefill", k_dtype, v_dtype, 4, 2, 32, None, [(9, 32), (1, 20)], block_m=4)


def test_prefill_causal_window_tiles():  # a whole prompt in tiles of 8, causal and within a window of 7 keys
    check("prefill-window", "q8_0", "bf16", 2, 1, 64, 7, [(12, 12)], block_m=8)


def test_default_tiling_prefill():  # more tokens than rows: the prefill tiles chosen by the wrapper
    check("default-prefill", "fp16", "q5_0", 4, 2, 32, None, [(6, 18), (1, 9)])


def test_tokens_in_any_order_int64_tables():
    """The kernel reads each token's row and position, not their order: a shuffled mixed batch (a prefill chunk's
    tokens apart, decodes between them) in tiles of 4, int64 block tables; no tokens at all gives an empty output."""
    gen = torch.Generator().manual_seed(11)
    bt, positions, rows, slots = ragged_batch([(5, 21), (1, 17), (3, 9), (1, 4)], gen)
    order = torch.randperm(len(positions), generator=gen)
    (k, _), (v, vs) = row_pages(gen, slots, 2, 32, "q4_0"), row_pages(gen, slots, 2, 32, "int8")
    q = torch.randn(len(positions), 4, 32, generator=gen)
    args = (q[order], positions[order], rows[order], bt.long(), BLOCK, 0.2, 6, "q4_0", k, v, None, vs, "int8")
    want = reference.attention_over_pages(*args)
    got = kernel(*args, block_m=4)
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    assert kernel(q[:0], positions[:0], rows[:0], *args[3:]).shape == (0, 4, 32)


@pytest.mark.parametrize("splits", [1, 2])
def test_padded_decode_reads_no_page(splits):
    """A padded batch's dummy token (its block-table row all −1, as a CUDA-graph bucket pads) reads nothing and
    gives zeros; the real decodes beside it equal the twin."""
    gen = torch.Generator().manual_seed(12)
    bt, positions, rows, slots = ragged_batch([(1, 21), (1, 7)], gen)
    bt = torch.cat([bt, torch.full((1, bt.shape[1]), -1, dtype=bt.dtype)])
    (k, _), (v, _) = row_pages(gen, slots, 1, 32, "fp16"), row_pages(gen, slots, 1, 32, "q8_0")
    q = torch.randn(3, 2, 32, generator=gen)
    args = (
        q,
        torch.cat([positions, torch.tensor([0])]),
        torch.cat([rows, torch.tensor([2])]),
        bt,
        BLOCK,
        0.2,
        None,
        "fp16",
        k,
        v,
        None,
        None,
        "q8_0",
    )
    want = reference.attention_over_pages(q[:2], positions, rows, *args[3:])
    got = kernel(*args, num_splits=splits)
    assert (got[:2] - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
    assert torch.equal(got[2], torch.zeros(2, 32))


def test_bf16_pages_at_fp32_tolerance():
    """bf16 pages, float32 queries: the kernel must dot in float32 (the interpreter's bf16 tl.dot is wrong). The
    tolerance catches a bf16 dot: rounding q to bf16 moves the twin's output by far more than it."""
    check("bf16", "bf16", "bf16", 4, 2, 64, None, [(1, 30), (3, 20)], block_m=2)
    gen = torch.Generator().manual_seed(7)
    bt, positions, rows, slots = ragged_batch([(1, 30)], gen)
    (k, _), (v, _) = row_pages(gen, slots, 2, 64, "bf16"), row_pages(gen, slots, 2, 64, "bf16")
    q = torch.randn(1, 4, 64, generator=gen)
    want = reference.attention_over_pages(q, positions, rows, bt, BLOCK, 0.125, None, "bf16", k, v)
    rounded = reference.attention_over_pages(
        q.bfloat16().float(), positions, rows, bt, BLOCK, 0.125, None, "bf16", k, v
    )
    assert (rounded - want).abs().max().item() > 50 * 2e-5 * max(1.0, want.abs().max().item())


# TuroboQuant pages: keys MSE or inner-product (a QJL sketch of the residual), values MSE; one or two parts of any
# width (padded in registers), calibrated channel order with a constant or pre-RoPE mean
TQ = {
    "mse-4+3": ("mse", [(8, 4), (56, 3)], [(64, 2)]),
    "prod-2": ("prod", [(64, 2)], [(64, 3)]),
    "prod-4+2": ("prod", [(16, 4), (48, 2)], [(8, 4), (56, 3)]),
}


@pytest.mark.parametrize("layout", sorted(TQ))
@pytest.mark.parametrize("calibrated", [None, "mean", "rope"])
def test_turboquant_pages(layout, calibrated):
    variant, k_layout, v_layout = TQ[layout]
    pages = {
        "k": lambda g, s, h, d: turboquant_pages(g, s, h, d, k_layout, variant, calibrated),
        "v": lambda g, s, h, d: turboquant_pages(g, s, h, d, v_layout, "mse", calibrated and "mean"),
    }
    seqs = [(1, 19), (4, 24)] if calibrated else [(1, 19), (1, 40)]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{layout}{calibrated}".encode()))
    bt, positions, rows, slots = ragged_batch(seqs, gen)
    k, v = pages["k"](gen, slots, 2, 64), pages["v"](gen, slots, 2, 64)
    q = torch.randn(len(positions), 4, 64, generator=gen)
    args = (q, positions, rows, bt, BLOCK, 0.125, 9 if calibrated == "rope" else None, "turboquant", None, None)
    want = reference.attention_over_pages(*args, k_side=k, v_side=v)
    got = kernel(*args, k_side=k, v_side=v, block_m=2 if calibrated else None)
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("k_dtype,v_dtype", [("q5_0", "turboquant"), ("turboquant", "fp8"), ("int8", "turboquant")])
def test_turboquant_beside_row_pages(k_dtype, v_dtype):  # an auto:<bits> plan's k=q5_0,v=turboquant4
    check(
        "tq-mixed",
        k_dtype,
        v_dtype,
        4,
        2,
        64,
        None,
        [(1, 25), (1, 8)],
        tq=lambda g, s, h, d: turboquant_pages(g, s, h, d, [(8, 4), (56, 3)], "mse", "mean"),
    )


def test_code_pages_raise_one_line():
    batch = (torch.randn(1, 2, 32), torch.tensor([0]), torch.tensor([0]), torch.tensor([[0]]), BLOCK, 0.1, None)
    with pytest.raises(NotImplementedError, match="'kivi2-keys' pages"):
        pa.attention_over_pages(*batch, "kivi2-keys", torch.zeros(16, 1, 8, dtype=torch.uint8), torch.zeros(16, 1, 32))
    with pytest.raises(ValueError, match="unknown KV page type 'fp4'"):
        pa.attention_over_pages(*batch, "fp4", torch.zeros(16, 1, 32), torch.zeros(16, 1, 32))


def test_check_pages_before_the_first_step():
    pa.check_pages("q8_0", "q4_0")
    pa.check_pages(
        "turboquant", "bf16", k_side=turboquant_pages(torch.Generator(), 16, 1, 64, [(16, 4), (48, 2)], "prod")
    )
    with pytest.raises(NotImplementedError, match="'qjl2-keys' pages"):
        pa.check_pages("qjl2-keys", "int8")
    with pytest.raises(NotImplementedError, match="1 or 2 parts, not 3"):
        pa.check_pages(
            "int8", "turboquant", v_side=turboquant_pages(torch.Generator(), 16, 1, 64, [(16, 4), (16, 3), (32, 2)])
        )
    with pytest.raises(NotImplementedError, match="TurboQuant values of the MSE variant"):
        pa.check_pages("fp16", "turboquant", v_side=turboquant_pages(torch.Generator(), 16, 1, 64, [(64, 2)], "prod"))


def test_check_runs_small_shapes():  # the device check's function, on tiny shapes in the interpreter
    from bytediet.kernels.triton import paged_attention_check as pc

    assert {s["name"] for s in pc.check_shapes()} >= {"llama3-8b-decode-b16", "llama3-8b-prefill-after-hit"}
    tiny = [
        {
            "name": "tiny",
            "hq": 4,
            "hkv": 2,
            "d": 32,
            "window": None,
            "seqs": [(3, 20), (1, 9)],
            "mixes": [("q8_0", "turboquant"), ("turboquant", "int8")],
        }
    ]
    rows = pc.check(DEVICE, tiny)
    assert len(rows) == 2 and all(r["ok"] for r in rows), rows
