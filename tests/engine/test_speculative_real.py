"""Greedy identity with speculative decoding on a real model: 100 prompts, with and without prompt lookup."""

from __future__ import annotations

import pytest

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.eval.corpus import load_corpus
from tests.engine.test_engine import assert_same_or_tie

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def hundred_prompts(tokenizer) -> list[list[int]]:
    """100 Austen passages of 24–120 tokens; every other one repeated twice, so prompt lookup finds drafts."""
    text = load_corpus("emma")
    out = []
    for i in range(100):
        n = 24 + (i * 29) % 97
        ids = tokenizer.encode(text[5000 + 1500 * i : 9000 + 1500 * i], add_special_tokens=False)[:n]
        out.append(ids + ids[: n // 2] if i % 2 else ids)
    return out


@pytest.mark.slow
def test_greedy_output_with_prompt_lookup_equals_plain_decoding_on_100_prompts(smollm2):
    model, tokenizer = smollm2
    prompts = hundred_prompts(tokenizer)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    plain_llm = LLM(loaded=(model, tokenizer), num_threads=2)
    spec = LLM(loaded=(model, tokenizer), num_threads=2, speculative_config=NGRAM)
    # 8 at a time: speculation stands aside in larger batches (disable_by_batch_size)
    chunks = [prompts[i : i + 8] for i in range(0, len(prompts), 8)]
    plain = [r for chunk in chunks for r in plain_llm.generate(chunk, params)]
    fast = [r for chunk in chunks for r in spec.generate(chunk, params)]
    stats = spec.engine.stats
    assert stats.spec_accepted_tokens > 100, "the prompts are meant to give drafts that are kept"
    for a, b in zip(fast, plain):
        assert_same_or_tie(a.outputs[0].token_ids, b.outputs[0])
    assert spec.engine.num_free_blocks == spec.engine.block_manager.num_blocks  # rollback leaked nothing
