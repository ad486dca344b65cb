"""Acceptance: the real models at tensor-parallel size 2 (two CPU processes, gloo) generate token for token what
size 1 generates — fp32 and int8 weights, a batch with preemption, and an int8 KV cache.

Every case loads the checkpoint in three processes (size 1, then both ranks); all four run in every test run
(the issue's acceptance is a CI test)."""

from __future__ import annotations

import pytest

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.eval.corpus import load_corpus
from tests.distributed.conftest import run_batch

# 12 blocks × 16 tokens hold fewer tokens than the six sequences need: preemption; 64 tokens a step: chunked prefill
ENGINE = dict(num_blocks=12, block_size=16, max_num_batched_tokens=64, max_num_seqs=6)


def prompts(tokenizer, bos: bool) -> list[list[int]]:
    text = load_corpus("prideprejudice")
    out = []
    for i in range(6):
        ids = tokenizer.encode(text[30000 + 2500 * i : 33000 + 2500 * i], add_special_tokens=False)[: 12 + 9 * i]
        out.append(([tokenizer.bos_token_id] if bos else []) + ids)
    return out


# int8 weights with float activations (-af32): the q16/q8 activation rounding of the default int8 kernels turns the
# ranks' different summation order (≈ 1e-7 after o_proj's all-reduce) into code flips of ≈ 1e-5 per layer, 5e-3 in
# the logits after 30 layers (measured, SmolLM2), enough to flip a near-tie of greedy decoding; TP = 2 is as exact
# as fp32 there, but not bit-identical. Perplexity at TP = 2 with q16 activations: tests/eval/test_parallel.py.
@pytest.mark.parametrize(
    "model, weights, kv",
    [  # ≈ 20–70 s each on two loaded cores
        ("default", "fp32", "auto"),
        ("default", "int8-af32", "int8"),
        ("gemma3-270m", "fp32", "auto"),
        ("gemma3-270m", "int8-af32", "auto"),
    ],
)
def test_tp2_generates_what_tp1_generates(model, weights, kv):
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * (i % 3), ignore_eos=True) for i in range(6)]
    one = LLM(model, weights=weights, kv_cache_dtype=kv, **ENGINE)
    batch = prompts(one.tokenizer, bos=model.startswith("gemma"))
    want, _ = run_batch(one, batch, params)
    del one
    two = LLM(model, weights=weights, kv_cache_dtype=kv, tensor_parallel_size=2, **ENGINE)
    try:
        got, preemptions = run_batch(two, batch, params)
    finally:
        two.shutdown()
    assert preemptions > 0, "the test is meant to exercise preemption"
    assert got == want
