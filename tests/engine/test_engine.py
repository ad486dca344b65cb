"""Continuous batching, chunked prefill, preemption, prefix caching, aborts and bad input on tiny models."""

from __future__ import annotations

import pytest
import torch

from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from bytediet.kernels.cpu import build
from bytediet.quant import get_weight_format
from tests.conftest import model_from_state, random_state, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)


def make_llm(model, **kw) -> LLM:
    kw.setdefault("num_blocks", 64)
    kw.setdefault("block_size", 4)
    return LLM(loaded=(model, None), **kw)


def prompts(vocab: int, lengths, seed=0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def assert_same_or_tie(got: list[int], solo_out) -> None:
    """Token-for-token equal, except after a position where the solo run's top-2 logits tie (< 1e-3)."""
    want = solo_out.token_ids
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top = solo_out.logprobs[i].top
            gap = top[0][1] - top[1][1]
            assert gap < 1e-3, f"diverged at token {i} ({a} vs {b}) with a top-2 gap of {gap:.2e}"
            return
    assert len(got) == len(want)


def test_continuous_batching_equals_solo_runs_with_preemption(tiny_model):
    vocab = tiny_model.config.vocab_size
    ps = prompts(vocab, [3, 17, 9, 30, 1, 22, 5, 14, 40, 7, 11, 2, 26, 8, 19, 33], seed=1)
    solo = [make_llm(tiny_model).generate([p], GREEDY)[0].outputs[0] for p in ps]
    # tiny pool (24 blocks × 4 tokens) and budget: chunked prefill and preemption both happen
    llm = make_llm(tiny_model, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=8)
    engine, reqs = llm.engine, []
    for i, p in enumerate(ps):  # staggered arrival: a new request every other step
        reqs.append(engine.add_request(p, GREEDY))
        engine.step()
        if i % 2:
            engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.scheduler.num_preemptions > 0, "the test is meant to exercise preemption"
    for req, s in zip(reqs, solo):
        assert req.finish_reason.value == "length"
        assert_same_or_tie(req.output_token_ids, s)
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_prefix_caching_reuses_blocks_and_keeps_outputs(tiny_model):
    vocab = tiny_model.config.vocab_size
    system = prompts(vocab, [24], seed=2)[0]
    ps = [system + tail for tail in prompts(vocab, [3, 7, 5], seed=3)]
    cached = make_llm(tiny_model, enable_prefix_caching=True)
    plain = make_llm(tiny_model, enable_prefix_caching=False)
    a = [cached.generate([p], GREEDY)[0] for p in ps]
    b = plain.generate(ps, GREEDY)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
    assert cached.engine.block_manager.prefix_hits > 0
    assert a[1].num_cached_tokens == 24 and a[0].num_cached_tokens == 0
    assert plain.engine.block_manager.prefix_hits == 0
    for llm in (cached, plain):
        assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_logprobs_match_log_softmax_of_the_model(tiny_model):
    p = prompts(tiny_model.config.vocab_size, [10], seed=4)[0]
    out = (
        make_llm(tiny_model)
        .generate([p], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
        .outputs[0]
    )
    ids = torch.tensor(p + out.token_ids)
    logp = torch.log_softmax(tiny_model.score(ids).double(), -1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = logp[len(p) - 1 + i]
        assert lp.token_id == tok
        assert abs(lp.logprob - row[tok].item()) < 1e-4
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()


def test_seeded_request_gives_the_same_text_alone_or_in_a_batch(tiny_model):
    vocab = tiny_model.config.vocab_size
    ps = prompts(vocab, [6, 9, 12], seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=0.8, max_tokens=7, seed=None, ignore_eos=True)
    alone = make_llm(tiny_model).generate([ps[0]], seeded)[0].outputs[0].token_ids
    mixed = make_llm(tiny_model).generate(ps, [seeded, other, other])[0].outputs[0].token_ids
    assert alone == mixed


def test_n_completions_share_the_prompt_and_differ_by_seed(tiny_model):
    p = prompts(tiny_model.config.vocab_size, [8], seed=6)[0]
    out = make_llm(tiny_model).generate(
        [p], SamplingParams(n=3, temperature=5.0, seed=7, max_tokens=8, ignore_eos=True)
    )[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_abort_frees_blocks_at_once_and_others_continue(tiny_model):
    vocab = tiny_model.config.vocab_size
    llm = make_llm(tiny_model)
    engine = llm.engine
    a = engine.add_request(prompts(vocab, [20], 7)[0], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    b = engine.add_request(prompts(vocab, [5], 8)[0], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert a.block_ids
    engine.abort_request(a.request_id)
    assert a.finish_reason.value == "abort" and not a.block_ids
    while engine.has_unfinished_requests():
        engine.step()
    assert len(b.output_token_ids) == 6
    assert engine.num_free_blocks == engine.block_manager.num_blocks


def test_stop_token_ids_and_max_tokens_finish_requests(tiny_model):
    p = prompts(tiny_model.config.vocab_size, [6], seed=9)[0]
    llm = make_llm(tiny_model)
    free = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    stop_tok = free.token_ids[3]
    first = free.token_ids.index(stop_tok)
    stopped = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_tok]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: first + 1]
    assert free.finish_reason == "length" and len(free.token_ids) == 10


def test_context_window_ends_generation_with_length():
    config = tiny_config("llama", max_position_embeddings=24)
    model = model_from_state(config, random_state(config))
    out = (
        make_llm(model)
        .generate([list(range(20))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
        .outputs[0]
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 4


def test_single_request_larger_than_the_cache_stops_instead_of_hanging(tiny_model):
    llm = make_llm(tiny_model, num_blocks=4)  # 16 tokens in all
    out = llm.generate([list(range(10))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    # 16 slots hold the prompt and 6 outputs; the 7th output is sampled from the last slot, never stored
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 7
    assert llm.engine.num_free_blocks == 4


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ([], SamplingParams(), "prompt"),
        (list(range(300)), SamplingParams(), "prompt"),
        ([1, 2, 500], SamplingParams(), "prompt"),
        ([1, 2], SamplingParams(stop_token_ids=[10_000]), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected_before_queueing(tiny_model, prompt, params, field):
    llm = make_llm(tiny_model)
    with pytest.raises(ConfigError, match=field):
        llm.generate([prompt], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].token_ids


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kwargs)


def test_a_batch_with_one_bad_prompt_queues_nothing(tiny_model):
    llm = make_llm(tiny_model)
    with pytest.raises(ConfigError):
        llm.generate([[1, 2, 3], []], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks


def test_stream_yields_deltas_and_aborting_the_stream_frees_blocks(tiny_model):
    llm = make_llm(tiny_model)
    stream = llm.stream([1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    first = next(stream)
    assert first.new_token_ids and not first.finished
    stream.close()  # a client that went away
    assert llm.engine.num_free_blocks == llm.engine.block_manager.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_engine_accepts_a_codec_as_name_plus_state(tiny_model):
    """Configs hold names (issue 15): a calibrated codec travels as its name and calibration state; the engine
    builds the object once and owns it. A codec object is refused with the way to pass it."""
    from bytediet.kvcache import get_kv_codec

    codec = get_kv_codec("fp8")
    for layer in range(tiny_model.config.num_layers):
        codec.calibrate(
            torch.randn(8, tiny_model.config.num_kv_heads, tiny_model.config.head_dim),
            torch.randn(8, tiny_model.config.num_kv_heads, tiny_model.config.head_dim),
            layer,
        )
    with pytest.raises(ConfigError, match="kv_calibration_state"):
        make_llm(tiny_model, kv_cache_dtype=codec)
    llm = make_llm(tiny_model, kv_cache_dtype=codec.name, kv_calibration_state=codec.calibration_state())
    built = llm.engine.runner.codec
    assert built is not codec and built.calibrated
    assert all(torch.equal(built.key_half.scales[i], codec.key_half.scales[i]) for i in codec.key_half.scales)
    assert llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=3))[0].outputs[0].token_ids


@pytest.mark.skipif(build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels here")
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_llama_cpp_kv_blocks_generate_natively_the_reference_paths_tokens(arch, monkeypatch):
    """``--kv-cache-dtype k=q8_0,v=q4_0`` on a packed model (head dim 64: two GGML blocks a row): decode steps run
    natively (prefill chunks attend natively over the same pages) and the greedy tokens are the reference path's
    (BYTEDIET_KERNELS=reference: module path, PyTorch kernels, the codec's own read of its pages)."""
    model = packed_model_for(arch)
    ps = prompts(model.config.vocab_size, [3, 17, 9, 30, 1, 22], seed=1)
    native = make_llm(model, kv_cache_dtype="k=q8_0,v=q4_0", block_size=16)
    assert native.engine.runner.decode_path == "native"
    got = native.generate(ps, GREEDY)
    monkeypatch.setenv("BYTEDIET_KERNELS", "reference")
    reference = make_llm(model, kv_cache_dtype="k=q8_0,v=q4_0", block_size=16)
    assert reference.engine.runner.decode_path.startswith("modules (no native kernels")
    for g, w in zip(got, reference.generate(ps, GREEDY)):
        assert_same_or_tie(g.outputs[0].token_ids, w.outputs[0])


@pytest.mark.skipif(build.find_compiler() is None or not build.runnable_variants(), reason="no native kernels here")
@pytest.mark.parametrize("arch,kv", [("llama", "int8"), ("gemma3", "rot-int8"), ("qwen2", "q8_0")])
def test_short_prefill_steps_run_natively_and_generate_the_module_paths_tokens(arch, kv, monkeypatch):
    """Steps with prefill chunks of at most NATIVE_PREFILL_MAX_TOKENS tokens (cold prompts, suffixes after a cached
    prefix, chunks of a long prompt, beside decodes) run on the one-call native step; longer ones, and every step
    with the limit at 0, on the module path — and the greedy tokens are the same either way."""
    from bytediet.engine import runner

    model = packed_model_for(arch)
    shared = prompts(model.config.vocab_size, [24], seed=3)[0]
    tails = prompts(model.config.vocab_size, [3, 9, 1, 30, 5], seed=4)
    ps = [shared + t for t in tails] + prompts(model.config.vocab_size, [7, 70], seed=5)

    def run(limit):
        monkeypatch.setattr(runner, "NATIVE_PREFILL_MAX_TOKENS", limit)
        llm = make_llm(model, kv_cache_dtype=kv, block_size=16, max_num_batched_tokens=48)
        steps = {"native": 0, "module": 0}
        r = llm.engine.runner
        r.decoder.logits = counted(r.decoder.logits, steps, "native")
        r.model.forward = counted(r.model.forward, steps, "module")
        llm.generate(ps[:1], GREEDY)  # the shared prefix cached
        return llm.generate(ps, GREEDY), steps

    want, module_steps = run(0)
    got, steps = run(32)
    assert steps["native"] > module_steps["native"] and steps["module"] < module_steps["module"]
    assert steps["module"] > 0  # the 70-token prompt's 48-token chunk is over the limit
    for g, w in zip(got, want):
        assert_same_or_tie(g.outputs[0].token_ids, w.outputs[0])


def counted(fn, counts: dict, key: str):
    """``fn``, adding one to ``counts[key]`` at each call."""

    def wrapper(*args, **kwargs):
        counts[key] += 1
        return fn(*args, **kwargs)

    return wrapper


def packed_model_for(arch: str):
    """A tiny model of ``arch`` on GGUF blocks (Q4_1 layers, a Q8_0 head), as the native step runs them."""
    config = tiny_config(arch, head_dim=64)
    model = model_from_state(config, random_state(config))
    for name, lin in model.linear_layers():
        lin.set_weight(lin.dequantized_weight(), get_weight_format("gguf-q8_0" if name == "lm_head" else "gguf-q4_1"))
    return model


def test_warm_up_steps_the_engine_and_leaves_no_cached_prefix(tiny_model):
    llm = make_llm(tiny_model)
    llm.warm_up()
    bm = llm.engine.block_manager
    assert llm.engine.stats.steps >= 2 and not llm.engine.has_unfinished_requests()
    assert not bm.hash_to_block and not bm.by_head and bm.num_free_blocks == bm.num_blocks
    first = llm.generate([[1, 2, 3, 4, 5, 6, 7, 1]], GREEDY)[0]
    assert first.num_cached_tokens == 0
