"""A fixed KV-cache memory admits more concurrent sequences with a smaller codec (measured on the engine).

The engine sizes its block pool from the codec's ``bytes_per_token``; here the scheduler runs many long
4096-token requests on a tiny random model (head_dim 64, so every codec applies) and the largest number of requests
running at once is counted. Also: the all-in size ratios against bf16 that issue 5 asks for.
"""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.kvcache import get_kv_codec
from tests.conftest import model_from_state, random_state, tiny_config

PROMPT, NEW, BLOCK = 4032, 64, 32  # 4096-token sequences, as issue 5 asks; 64 decode steps keep them running
BF16_SEQS = 3  # the memory below holds this many whole bf16 sequences


@pytest.fixture(scope="module")
def tiny64():
    cfg = tiny_config("llama", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=8192)
    return model_from_state(cfg, random_state(cfg, seed=3))


def max_running(model, spec: str, memory: int, n_requests: int) -> tuple[int, int]:
    """Run ``n_requests`` long greedy requests to completion → (most running at once, requests finished)."""
    llm = LLM(
        kv_cache_dtype=spec,
        kv_cache_memory=memory,
        block_size=BLOCK,
        max_num_batched_tokens=4096,
        max_num_seqs=256,
        enable_prefix_caching=False,
        loaded=(model, None),
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    for _ in range(n_requests):
        llm.engine.add_request(torch.randint(0, model.config.vocab_size, (PROMPT,), generator=gen).tolist(), params)
    most, finished = 0, 0
    while llm.engine.has_unfinished_requests():
        finished += sum(o.finished for o in llm.engine.step())
        most = max(most, len(llm.engine.scheduler.running))
    return most, finished


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["turboquant3.5", "turboquant2.5", "kivi2"])
def test_compressed_codecs_admit_more_sequences(tiny64, spec):
    cfg = tiny64.config
    bf16 = get_kv_codec("bf16").bytes_per_token(cfg.num_kv_heads, cfg.head_dim) * cfg.num_layers
    blocks_per_seq = -(-(PROMPT + NEW) // BLOCK)
    memory = int(BF16_SEQS * blocks_per_seq * BLOCK * bf16)
    base, done = max_running(tiny64, "bf16", memory, BF16_SEQS + 2)
    assert done == BF16_SEQS + 2 and base == BF16_SEQS
    codec = get_kv_codec(spec)
    ratio = bf16 / (codec.bytes_per_token(cfg.num_kv_heads, cfg.head_dim) * cfg.num_layers)
    expected = int(int(memory // (bf16 / ratio * BLOCK)) // blocks_per_seq)  # whole sequences in the pool
    n_requests = expected + 3
    most, done = max_running(tiny64, spec, memory, n_requests)
    assert done == n_requests, spec
    print(f"\n{spec}: {most} 4096-token sequences running at once vs {base} with bf16 ({ratio:.2f}x smaller)")
    assert most >= expected - 1, f"{spec}: {most} running at once, the pool holds {expected} sequences"
    assert most >= 0.8 * ratio * base, f"{spec}: {most} vs {base} bf16 sequences, {ratio:.2f}x smaller"


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("spec,x_smaller", [("turboquant3.5", 4.5), ("turboquant2.5", 6.0)])
def test_all_in_size_against_bf16(spec, x_smaller, d):
    bf16 = get_kv_codec("bf16").bytes_per_token(2, d)
    codec = get_kv_codec(spec)
    assert bf16 / codec.bytes_per_token(2, d) >= x_smaller
    assert codec.bits_per_coordinate(2, d) <= float(spec[len("turboquant") :])


def test_kivi_staging_pool_limits_running_sequences_instead_of_failing(tiny64):
    # a small pool has few staging pages (one open key group per running sequence): with many short requests
    # the engine runs only that many at a time, the others wait, and every request finishes
    llm = LLM(
        kv_cache_dtype="kivi2", num_blocks=64, max_num_seqs=32, enable_prefix_caching=False, loaded=(tiny64, None)
    )
    pages = llm.engine.runner.max_sequences
    assert pages == 64 * 32 // 512 and llm.engine.scheduler.config.max_num_seqs == pages
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        llm.engine.add_request(torch.randint(0, tiny64.config.vocab_size, (45,), generator=gen).tolist(), params)
    most, finished = 0, 0
    while llm.engine.has_unfinished_requests():
        finished += sum(o.finished for o in llm.engine.step())
        most = max(most, len(llm.engine.scheduler.running))
    assert finished == 12 and most == pages
    # a codec without per-sequence state leaves max_num_seqs alone
    assert (
        LLM(kv_cache_dtype="int8", num_blocks=64, max_num_seqs=32, loaded=(tiny64, None)).engine.runner.max_sequences
        is None
    )
