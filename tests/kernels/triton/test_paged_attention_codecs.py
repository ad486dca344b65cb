"""The Triton paged attention over the pages the real KV codecs write, through the codec's own native path
(``attend_natively``: its page description, the query and output rotations of ``rot-*`` halves), against the codec's
plain-PyTorch attention over the same pages: the page layouts the kernel assumes are the ones the codecs store."""

from unittest import mock

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from bytediet.kernels import ops
from bytediet.kernels.triton import paged_attention as pa
from bytediet.kvcache.base import AttentionMetadata, get_kv_codec

BLOCK, HKV, HQ, D = 16, 2, 4, 64
SPECS = [
    "bf16",
    "fp16",
    "fp8",
    "int8",
    "q8_0",
    "q5_0",
    "q4_1",
    "q4_0",
    "rot-int8",
    "rot-q8_0",
    "turboquant4",
    "turboquant_prod3",
    "turboquant3.5",
    "k=q5_0,v=turboquant3",
    "k=rot-q8_0,v=int8",
    "k=q8_0,v=q4_0",
]


def batch(gen):
    """A decode over 37 tokens and a 5-token prefill chunk over 21, on shuffled pages: the metadata, and every
    context token's slot and position."""
    seqs = [(1, 37), (5, 21)]
    width = max(-(-c // BLOCK) for _, c in seqs)
    perm = torch.randperm(sum(-(-c // BLOCK) for _, c in seqs) + 2, generator=gen)
    tables, used = [], 0
    for _, c in seqs:
        nb = -(-c // BLOCK)
        tables.append(torch.cat([perm[used : used + nb], torch.full((width - nb,), -1)]))
        used += nb
    bt = torch.stack(tables).long()
    slots = torch.cat(
        [bt[s][torch.arange(c) // BLOCK] * BLOCK + torch.arange(c) % BLOCK for s, (_, c) in enumerate(seqs)]
    )
    qlens, clens = [n for n, _ in seqs], [c for _, c in seqs]
    qpos = torch.cat([torch.arange(c - n, c) for n, c in seqs])
    meta = AttentionMetadata(
        qpos,
        torch.zeros_like(qpos),
        torch.tensor([0, qlens[0], sum(qlens)]),
        torch.tensor(clens),
        bt,
        BLOCK,
        qlens,
        clens,
        [0, 1],
    )
    return meta, slots, torch.cat([torch.arange(c) for _, c in seqs]), perm.numel()


@pytest.mark.parametrize("spec", SPECS)
def test_triton_attention_over_codec_pages(spec):
    gen = torch.Generator().manual_seed(sum(map(ord, spec)))
    meta, slots, positions, blocks = batch(gen)
    cache = get_kv_codec(spec).create_cache(0, blocks, BLOCK, HKV, D, torch.float32, "cpu")
    cache.write(
        torch.randn(len(slots), HKV, D, generator=gen), torch.randn(len(slots), HKV, D, generator=gen), slots, positions
    )
    q = torch.randn(meta.num_tokens, HQ, D, generator=gen)
    with mock.patch.object(ops, "native_library", lambda: None):
        want = cache.attend(q, meta, 0.125, 9)  # the codec's own read
    calls = []

    def triton(*args, variant=None, **kwargs):
        calls.append(kwargs["k_dtype"])
        return pa.attention_over_pages(*args, **kwargs, precision="ieee")

    with (
        mock.patch.object(ops, "native_library", lambda: object()),
        mock.patch.object(ops, "attention_over_pages", triton),
    ):
        got = cache.attend(q, meta, 0.125, 9)
    assert len(calls) == 1, "the codec did not hand its pages to the kernel"
    # both float32 over the same decoded values; they differ in summation order only
    assert (got - want).abs().max().item() <= 2e-5 * max(1.0, want.abs().max().item())
