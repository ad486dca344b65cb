"""CUDA graphs for decode: the buckets and the padding run on the CPU; the capture itself needs a GPU."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.cuda_graphs import bucket_for, graph_batch_sizes, pad_decode_batch


@pytest.mark.parametrize(
    "max_seqs,sizes",
    [
        (1, [1]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 32]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
    ],
)
def test_buckets_are_powers_of_two_to_eight_then_every_16_up_to_the_most_sequences(max_seqs, sizes):
    assert graph_batch_sizes(max_seqs) == sizes


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    sizes = graph_batch_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 9, 17, 33, 64)] == [1, 2, 4, 8, 16, 32, 48, 64]
    assert bucket_for(65, sizes) is None  # larger than every graph: the step runs eagerly


def test_padding_rows_touch_only_the_padding_block():
    block_size, pad_block = 4, 9
    tables = torch.tensor([[3, 5], [7, -1]])
    ids, pos, slots, ctx, out_tables = pad_decode_batch(
        torch.tensor([11, 12]),
        torch.tensor([5, 2]),
        torch.tensor([21, 30]),
        torch.tensor([6, 3]),
        tables,
        size=4,
        width=3,
        pad_block=pad_block,
        block_size=block_size,
    )
    assert ids.tolist() == [11, 12, 0, 0] and pos.tolist() == [5, 2, 0, 0]
    assert slots.tolist() == [21, 30, pad_block * block_size, pad_block * block_size]
    assert ctx.tolist() == [6, 3, 1, 1]
    assert out_tables.tolist() == [[3, 5, -1], [7, -1, -1], [pad_block, -1, -1], [pad_block, -1, -1]]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU (bench/device_check.py)")
def test_graph_replay_equals_eager_decode():
    from bytediet.engine.llm import LLM
    from bytediet.engine.params import SamplingParams
    from tests.conftest import model_from_state, random_state, tiny_config

    config = tiny_config("llama")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = []
    for eager in (True, False):
        model = model_from_state(config, random_state(config))
        llm = LLM(
            "tiny",
            loaded=(model, None),
            num_blocks=16,
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            max_num_seqs=4,
        )
        assert (llm.engine.runner.graphs is None) == eager, llm.engine.runner.decode_path
        runs.append([o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5], [6]], params)])
    assert runs[0] == runs[1]


def test_the_static_buffers_give_the_eager_decode_steps_logits():
    """What a graph captures — the forward over the padded static buffers — equals an eager decode step, and its
    padding rows touch only the padding block (run on the CPU: no capture, the same tensors)."""
    from bytediet.engine.cuda_graphs import DecodeGraphs
    from bytediet.kvcache.base import AttentionMetadata
    from tests.conftest import model_from_state, random_state, tiny_config

    config = tiny_config("llama")
    model = model_from_state(config, random_state(config))
    bs, num_blocks = 4, 12
    caches = model.new_caches(num_blocks + 1, bs, "fp32")
    lengths, tables = [7, 3, 10], [[0, 1], [2], [3, 4, 5]]
    for first, n in zip((0, 2, 3), lengths):  # prefill each sequence in its own blocks
        model(torch.arange(1, n + 1), AttentionMetadata.for_single_sequence(n, bs, first_block=first), caches)
    pos = torch.tensor(lengths)  # one new token each
    block_tables = torch.full((3, 3), -1)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t)
    slots = torch.stack([block_tables[i, p // bs] * bs + p % bs for i, p in enumerate(pos.tolist())])
    meta = AttentionMetadata(pos, slots, torch.arange(4), pos + 1, block_tables, bs, [1, 1, 1], (pos + 1).tolist())
    ids = torch.tensor([5, 6, 7])
    eager = model(ids, meta, caches, torch.arange(3))
    before = [c.k[: num_blocks * bs].clone() for c in caches]

    graphs = DecodeGraphs(model, caches, max_num_seqs=8, width=6, pad_block=num_blocks, block_size=bs)
    size = graphs.fill(ids, meta)
    assert size == 4
    static = graphs.forward(size)[:3]
    torch.testing.assert_close(static, eager, rtol=1e-5, atol=1e-5)
    others = torch.ones(num_blocks * bs, dtype=torch.bool)
    others[slots] = False  # the real rows rewrite their own slots (the same values, to rounding)
    for c, b in zip(caches, before):  # the padding row wrote into the padding block only
        assert torch.equal(c.k[: num_blocks * bs][others], b[others])
        torch.testing.assert_close(c.k[slots], b[slots])
        assert c.k[num_blocks * bs].abs().sum() > 0  # ... at its first slot
