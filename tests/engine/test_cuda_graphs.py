"""CUDA graphs for decode: the buckets and the padding run on the CPU; the capture itself needs a GPU."""
from __future__ import annotations

import pytest
import torch

from bytediet.engine.cuda_graphs import bucket_for, graph_batch_sizes, pad_decode_batch


@pytest.mark.parametrize("max_seqs,sizes", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 32]),
    (64, [1, 2, 4, 8, 16, 32, 48, 64]),
])
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
        torch.tensor([11, 12]), torch.tensor([5, 2]), torch.tensor([21, 30]), torch.tensor([6, 3]), tables,
        size=4, width=3, pad_block=pad_block, block_size=block_size)
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
        llm = LLM("tiny", loaded=(model, None), num_blocks=16, device="cuda", dtype="float32", enforce_eager=eager,
                  max_num_seqs=4)
        assert (llm.engine.runner.graphs is None) == eager, llm.engine.runner.decode_path
        runs.append([o.outputs[0].token_ids for o in llm.generate([[1, 2, 3], [4, 5], [6]], params)])
    assert runs[0] == runs[1]
