"""The one-call native decode step against its twin ``reference.decode_step`` on random decoders: every GQA
ratio of the three families, sliding windows, gemma3's sandwich and q/k norms, qwen2's biases, odd context
lengths across page boundaries, several sequences at once, both activation modes and weight layouts."""

import zlib

import pytest
import torch
from gguf import GGMLQuantizationType as T

from bytediet.kernels import ops, reference
from bytediet.kernels.cpu import build
from bytediet.kernels.decoder_spec import BLOCK_PAGE_TYPES, DecoderSpec, LayerSpec, LinearSpec
from bytediet.kernels.ggml_codecs import ENCODERS
from tests.kernels.step_checks import (
    BLOCK,
    assert_written_as_reference,
    native_kv,
    restore,
    snapshot,
    twin_on_pages,
)

VARIANTS = [v.name for v in build.runnable_variants()] if build.find_compiler() else []
pytestmark = pytest.mark.skipif(not VARIANTS, reason="no native kernels on this machine")


def linear(n, k, gen, gtype=T.Q4_1, bias=False, interleave=False):
    blocks = ENCODERS[gtype]((torch.randn(n * k // 32, 32, generator=gen) * 0.2)).reshape(n, -1)
    if interleave and ops.can_interleave(int(gtype), n, k):
        return LinearSpec(
            ops.repack_x4(int(gtype), blocks),
            int(gtype),
            n,
            k,
            torch.randn(n, generator=gen) if bias else None,
            interleaved=True,
            source=blocks,
        )
    return LinearSpec(blocks, int(gtype), n, k, torch.randn(n, generator=gen) if bias else None)


def random_pages(gen, slots, kv_heads, head_dim, page_type):
    """(pages, scales): random earlier keys or values stored as ``page_type`` pages."""
    return reference.write_kv_rows(page_type, torch.randn(slots, kv_heads, head_dim, generator=gen))


def random_spec(
    gen,
    *,
    heads,
    kv_heads,
    head_dim=32,
    hidden=64,
    inter=96,
    layers=2,
    gemma=False,
    bias=False,
    window=0,
    activations="q8",
    interleave=False,
    slots=512,
    k_dtype="fp32",
    v_dtype=None,
):
    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=gen)

    specs = []
    for i in range(layers):
        lin = lambda n, k, b=False: linear(n, k, gen, T.Q8_0 if i == 1 else T.Q4_1, b, interleave)
        (k_cache, k_scale), (v_cache, v_scale) = (
            random_pages(gen, slots, kv_heads, head_dim, t) for t in (k_dtype, v_dtype or k_dtype)
        )
        specs.append(
            LayerSpec(
                attn_norm=norm(hidden),
                post_attn_norm=norm(hidden),
                inv_freq=1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)),
                k_cache=k_cache,
                v_cache=v_cache,
                k_dtype=k_dtype,
                v_dtype=v_dtype,
                k_scale=k_scale,
                v_scale=v_scale,
                q=lin(heads * head_dim, hidden, bias),
                k=lin(kv_heads * head_dim, hidden, bias),
                v=lin(kv_heads * head_dim, hidden, bias),
                o=lin(hidden, heads * head_dim),
                gate=lin(inter, hidden),
                up=lin(inter, hidden),
                down=lin(hidden, inter),
                window=window if i == 0 else 0,
                pre_ffn_norm=norm(hidden) if gemma else None,
                post_ffn_norm=norm(hidden) if gemma else None,
                q_norm=norm(head_dim) if gemma else None,
                k_norm=norm(head_dim) if gemma else None,
            )
        )
    return DecoderSpec(
        layers=specs,
        hidden=hidden,
        intermediate=inter,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        eps=1e-6,
        attention_scale=head_dim**-0.5,
        gelu=gemma,
        sandwich=gemma,
        activations=activations,
    )


def batch(gen, contexts, slots=512):
    """One new token per sequence at position ctx-1; each sequence owns shuffled pages."""
    perm = torch.randperm(slots // BLOCK, generator=gen)
    tables, used = [], 0
    width = max(-(-c // BLOCK) for c in contexts)
    for c in contexts:
        n = -(-c // BLOCK)
        tables.append(torch.cat([perm[used : used + n], torch.full((width - n,), -1)]))
        used += n
    bt = torch.stack(tables).long()
    positions = torch.tensor([c - 1 for c in contexts])
    slots_ = bt[torch.arange(len(contexts)), positions // BLOCK] * BLOCK + positions % BLOCK
    return positions, slots_, bt


CASES = {  # name: (spec kwargs, contexts)
    "mha": (dict(heads=4, kv_heads=4), [1, 17]),
    "smollm2-gqa-3": (dict(heads=6, kv_heads=2), [33, 150, 5]),
    "gemma3-gqa-4-window": (dict(heads=4, kv_heads=1, gemma=True, window=20, head_dim=64), [16, 47, 130]),
    "qwen2-bias-gqa-7": (dict(heads=7, kv_heads=1, bias=True), [64, 3]),
    # ≥ 8 sequences: q16 steps run the panel GEMM (gemm_panel.cpp) where the build has AVX-512 VNNI
    "batch-10-gqa-3": (dict(heads=6, kv_heads=2, bias=True), [5, 9, 1, 33, 17, 2, 40, 11, 8, 3]),
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "activations,interleave", [("q8", False), ("q8", True), ("q16", False), ("q16", True), ("f32", False)]
)
def test_decode_step_equals_reference(variant, case, activations, interleave):
    kwargs, contexts = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    spec = random_spec(gen, activations=activations, interleave=interleave, **kwargs)
    check_step(spec, *batch(gen, contexts), torch.randn(len(contexts), spec.hidden, generator=gen), variant)


def check_step(spec, positions, slots, bt, x, variant, token_rows=None):
    """The native step against its twin, the write and the rest apart, each on identical inputs (step_checks);
    ``token_rows``: token t reads table row token_rows[t] (the twin, and the probe of the write, get the rows
    copied out per token)."""
    before = snapshot(spec)
    got = ops.decode_step(spec, x, positions, slots, bt, BLOCK, token_rows=token_rows, variant=variant)
    after = snapshot(spec)
    if token_rows is not None:
        bt = bt[token_rows]
    restore(spec, before)
    kv = native_kv(spec, x, positions, slots, bt, variant)
    restore(spec, after)
    assert_written_as_reference(spec, before, kv, positions, slots)
    want, twin_kv = twin_on_pages(spec, x, positions, slots, bt)
    # identical pages; q16 holds each activation within amax/64516 whichever way a code rounds (a flip re-draws
    # only that: ~1e-4 of the largest value), f32 has no codes; measured ≤ 1.7e-4 (out), 8.6e-5 (k, v)
    tol, kv_tol = 1e-3 * want.abs().max().item(), [1e-3 * max(k.abs().max(), v.abs().max()).item() for k, v in kv]
    if spec.activations == "q8":
        # a float rounding apart an int8 code on a .5 boundary flips, and the flip re-draws the q8 rounding of all
        # that follows: kernel and twin then differ by at most their two q8 rounding errors (triangle inequality),
        # each the size of the twin's own (q8 against q16); measured ≤ 0.5× that (1.2× in a TurboQuant step) over
        # 100 seeds with the twin's GEMM and attention outputs moved by one ulp at random
        near, near_kv = twin_on_pages(spec, x, positions, slots, bt, activations="q16")
        tol += 2 * (want - near).abs().max().item()
        kv_tol = [
            t + 2 * max((k - k16).abs().max(), (v - v16).abs().max()).item()
            for t, (k, v), (k16, v16) in zip(kv_tol, twin_kv, near_kv)
        ]
    assert (got - want).abs().max().item() <= tol
    for (k, v), (tk, tv), t in zip(kv, twin_kv, kv_tol):  # the new keys (after RoPE) and values the step computed
        assert (k - tk).abs().max().item() <= t and (v - tv).abs().max().item() <= t


def verifying_batch(gen, contexts, rows):
    """Sequence i computes ``rows[i]`` tokens (its last token and its drafts) ending at position contexts[i] − 1:
    (positions, slots, block tables (one row per sequence), token_rows (T,))."""
    _, _, bt = batch(gen, contexts)
    token_rows = torch.repeat_interleave(torch.arange(len(contexts)), torch.tensor(rows))
    positions = torch.cat([torch.arange(c - r, c) for c, r in zip(contexts, rows)])
    slots = bt[token_rows, positions // BLOCK] * BLOCK + positions % BLOCK
    return positions, slots, bt, token_rows


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k_dtype", ["fp32", "bf16", "int8", "q8_0", "q4_0"])
@pytest.mark.parametrize("activations", ["q8", "q16"])
def test_verifying_rows_of_one_sequence_share_its_table_row(variant, k_dtype, activations):
    """A verifying step (speculative decoding): several sequences, each with its last token and up to 7 drafts at
    consecutive positions, every token naming its sequence's block table row — the rows of one sequence attend as
    one query tile (each sees the drafts before it, written by the same step); the same as the twin over per-token
    copies of the tables, and as the native step given those copies."""
    gen = torch.Generator().manual_seed(zlib.crc32((k_dtype + activations).encode()))
    spec = random_spec(gen, heads=6, kv_heads=2, bias=True, activations=activations, interleave=True, k_dtype=k_dtype)
    positions, slots, bt, token_rows = verifying_batch(gen, [40, 9, 150, 23], [5, 1, 8, 3])
    x = torch.randn(len(positions), spec.hidden, generator=gen)
    before = snapshot(spec)
    copied = ops.decode_step(spec, x, positions, slots, bt[token_rows], BLOCK, variant=variant)
    restore(spec, before)
    check_step(spec, positions, slots, bt, x, variant, token_rows=token_rows)
    restore(spec, before)
    shared = ops.decode_step(spec, x, positions, slots, bt, BLOCK, token_rows=token_rows, variant=variant)
    assert (shared - copied).abs().max().item() <= 1e-3 * copied.abs().max().item()


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k_dtype", ["fp32", "int8", "q8_0"])
@pytest.mark.parametrize("activations", ["q8", "q16"])
def test_prefill_chunks_step_natively_beside_decodes(variant, k_dtype, activations):
    """Prefill chunks as the engine hands them to the native step (runner.native_step_takes): a decode, a chunk of
    40 tokens after 110 cached ones (more rows than a query tile and than the panel GEMM's least), a cold prompt of
    33 tokens from position 0 and a chunk of 2 — the same as the twin over per-token copies of the tables."""
    gen = torch.Generator().manual_seed(zlib.crc32(("chunks" + k_dtype + activations).encode()))
    spec = random_spec(gen, heads=6, kv_heads=2, bias=True, activations=activations, interleave=True, k_dtype=k_dtype)
    positions, slots, bt, token_rows = verifying_batch(gen, [40, 150, 33, 23], [1, 40, 33, 2])
    check_step(spec, positions, slots, bt, torch.randn(len(positions), spec.hidden, generator=gen), variant, token_rows)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(
    "k_dtype,v_dtype",
    [(t, None) for t in ("bf16", "fp16", "int8", "fp8", *BLOCK_PAGE_TYPES)]
    + [("q8_0", "q4_0"), ("int8", "q5_0"), ("q4_1", "bf16")],
)
def test_decode_step_over_stored_page_types_equals_reference(variant, case, k_dtype, v_dtype):
    """Pages read in place in their stored type and the new token's k, v written the way the torch codec
    rounds them (bf16/fp16: round to nearest even; int8: the int8 codec's per-token scale and codes; q8_0 … q4_0:
    llama.cpp's block quantizers); keys and values of different types (k=q8_0,v=q4_0)."""
    kwargs, contexts = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32((case + k_dtype + (v_dtype or "")).encode()))
    spec = random_spec(gen, activations="q16", k_dtype=k_dtype, v_dtype=v_dtype, **kwargs)
    check_step(spec, *batch(gen, contexts), torch.randn(len(contexts), spec.hidden, generator=gen), variant)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("k_dtype,v_dtype,rotate", [("q8_0", None, "kv"), ("int8", None, "k"), ("int8", "q8_0", "v")])
def test_decode_step_over_rotated_pages_equals_reference(variant, case, k_dtype, v_dtype, rotate):
    """``k_rot``/``v_rot`` (kvcache/rotated.py): q and k rotated after RoPE, v before its write, the output back."""
    from bytediet.kvcache.rotation import random_rotation

    kwargs, contexts = CASES[case]
    gen = torch.Generator().manual_seed(zlib.crc32((case + k_dtype + rotate).encode()))
    spec = random_spec(gen, activations="f32", k_dtype=k_dtype, v_dtype=v_dtype, **kwargs)
    for i, layer in enumerate(spec.layers):
        d = spec.head_dim
        layer.k_rot = random_rotation(d, "hadamard", 2 * i) if "k" in rotate else None
        layer.v_rot = random_rotation(d, "hadamard", 2 * i + 1) if "v" in rotate else None
    check_step(spec, *batch(gen, contexts), torch.randn(len(contexts), spec.hidden, generator=gen), variant)


def test_the_reference_twin_runs_without_native_kernels():
    gen = torch.Generator().manual_seed(3)
    spec = random_spec(gen, heads=4, kv_heads=2)
    positions, slots, bt = batch(gen, [9])
    out = reference.decode_step(spec, torch.randn(1, spec.hidden, generator=gen), positions, slots, bt, BLOCK)
    assert out.shape == (1, spec.hidden) and torch.isfinite(out).all()


def k_quant_linear(gtype, n, k, gen, interleave):
    """Random Q4_K / Q6_K blocks with small f16 super-block scales (d, dmin), x4-interleaved or not."""
    size, scale_at = {T.Q4_K: (144, (0, 2)), T.Q6_K: (210, (208,))}[gtype]
    b = torch.randint(0, 256, (n * k // 256, size), generator=gen, dtype=torch.uint8)
    for at in scale_at:
        b[:, at : at + 2] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8)
    blocks = b.reshape(n, -1)
    if interleave:
        return LinearSpec(ops.repack_x4(int(gtype), blocks), int(gtype), n, k, None, interleaved=True)
    return LinearSpec(blocks, int(gtype), n, k, None)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("activations,interleave", [("q8", True), ("q16", True), ("q16", False)])
def test_decode_step_with_k_quant_layers_equals_reference(variant, activations, interleave):
    """Gemma-3's Q4_K_M mix: o_proj and down_proj in Q4_K / Q6_K (interleaved when the step runs x4)."""
    gen = torch.Generator().manual_seed(12)
    spec = random_spec(
        gen,
        heads=4,
        kv_heads=1,
        head_dim=64,
        hidden=256,
        inter=512,
        gemma=True,
        window=20,
        activations=activations,
        interleave=interleave,
    )
    for i, layer in enumerate(spec.layers):
        o_type, down_type = (T.Q4_K, T.Q6_K) if i == 0 else (T.Q6_K, T.Q4_K)
        layer.o = k_quant_linear(o_type, 256, 256, gen, interleave)
        layer.down = k_quant_linear(down_type, 256, 512, gen, interleave)
    check_step(spec, *batch(gen, [16, 47, 130]), torch.randn(3, spec.hidden, generator=gen), variant)
