"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal a plain forward pass over the prompt, however
the engine computes the prompt: whole, in chunks beside other requests, after a prefix-cache hit, or
recomputed after a preemption."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from tests.conftest import model_from_state, random_state, tiny_config
from tests.engine.test_engine import prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")
    return model_from_state(config, random_state(config, seed=3))


def reference(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward pass: (L-1,)."""
    lp = model.score(torch.tensor(ids)).log_softmax(dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def check(model, ids: list[int], got) -> None:
    assert len(got) == len(ids) and got[0] is None
    want = reference(model, ids)
    assert [lp.token_id for lp in got[1:]] == ids[1:]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in got[1:]]), want, atol=1e-4, rtol=0)
    for lp in got[1:]:
        assert len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] and lp.rank >= 1
        assert (lp.rank == 1) == (lp.logprob >= lp.top[0][1] - 1e-6)


def test_whole_prompts_in_one_batch(model):
    ps = prompts(model.config.vocab_size, [2, 9, 17, 30], seed=4)
    outs = LLM(loaded=(model, None), num_blocks=64, block_size=4).generate(ps, PARAMS)
    for ids, out in zip(ps, outs):
        check(model, ids, out.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3


def test_chunked_prefill_beside_other_requests(model):
    ps = prompts(model.config.vocab_size, [37, 21, 13], seed=5)
    llm = LLM(loaded=(model, None), num_blocks=64, block_size=4, max_num_batched_tokens=8)
    plain = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(ps, [PARAMS, plain, PARAMS])
    check(model, ps[0], outs[0].prompt_logprobs)
    check(model, ps[2], outs[2].prompt_logprobs)
    assert outs[1].prompt_logprobs is None


def test_a_cached_prefix_is_recomputed_to_be_scored(model):
    ids = prompts(model.config.vocab_size, [26], seed=6)[0]
    llm = LLM(loaded=(model, None), num_blocks=64, block_size=4)
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))  # fills the prefix cache
    out = llm.generate([ids], PARAMS)[0]
    assert out.num_cached_tokens == 0
    check(model, ids, out.prompt_logprobs)


def test_preempted_requests_score_each_prompt_token_once(model):
    ps = prompts(model.config.vocab_size, [30, 28, 25, 27], seed=7)
    llm = LLM(loaded=(model, None), num_blocks=20, block_size=4, max_num_batched_tokens=16)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=2))
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(ps, outs):
        check(model, ids, out.prompt_logprobs)


def test_a_one_token_prompt_has_only_the_empty_entry(model):
    out = LLM(loaded=(model, None), num_blocks=8, block_size=4).generate([[5]], PARAMS)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_prompt_logprobs_name_the_field(bad):
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_more_prompt_logprobs_than_the_vocabulary_is_refused(model):
    llm = LLM(loaded=(model, None), num_blocks=8, block_size=4)
    with pytest.raises(ConfigError, match="prompt_logprobs"):
        llm.engine.validate([1, 2], SamplingParams(prompt_logprobs=model.config.vocab_size + 1))
