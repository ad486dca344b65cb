"""Token-granular prefix reuse end to end: a block's head served from the cache gives the tokens a cold run gives,
for codecs whose pages are all per slot; codecs with per-block or per-sequence state keep block granularity."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.block_copy import block_copier
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from tests.conftest import model_from_state, random_state, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")
    return model_from_state(config, random_state(config, seed=5))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make(model, **kw) -> LLM:
    return LLM(loaded=(model, None), block_size=4, num_blocks=64, **kw)


def out(llm: LLM, prompt):
    r = llm.generate([prompt], GREEDY)[0]
    return r, r.outputs[0].token_ids, [lp for x in r.outputs[0].logprobs for _, lp in x.top]


@pytest.mark.parametrize("codec", ["auto", "bf16", "int8"])
def test_a_reused_head_gives_the_cold_runs_tokens(model, codec):
    prompt = ids(10, 1)  # two full blocks and a tail of two tokens
    longer = prompt + ids(3, 2)  # starts with the whole prompt: its third block's head is prompt's tail
    shorter = prompt[:7]  # ends inside the second (full, cached) block: its head is copied
    cold = make(model, kv_cache_dtype=codec, enable_prefix_caching=False)
    warm = make(model, kv_cache_dtype=codec)
    assert warm.engine.block_manager.token_reuse
    out(warm, prompt)
    for p, served in ((longer, 10), (shorter, 6)):
        r, tokens, logprobs = out(warm, p)
        _, want_tokens, want_logprobs = out(cold, p)
        assert r.num_cached_tokens == served
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_codecs_with_per_sequence_state_keep_block_granularity(model):
    kivi = make(model, kv_cache_dtype="kivi2g4")
    assert not kivi.engine.block_manager.token_reuse
    assert block_copier(kivi.engine.runner.caches, 4) is None


def test_the_copier_copies_one_block_of_every_page(model):
    llm = make(model, kv_cache_dtype="int8")
    caches = llm.engine.runner.caches
    for c in caches:
        for t in c.tensors():
            t.copy_(torch.arange(t.numel()).reshape(t.shape).to(t.dtype))
    before = [[t.clone() for t in c.tensors()] for c in caches]
    block_copier(caches, 4)(3, 7)
    for c, old in zip(caches, before):
        for t, o in zip(c.tensors(), old):
            assert torch.equal(t[28:32], o[12:16])
            t[28:32] = o[28:32]
            assert torch.equal(t, o)  # nothing else moved
