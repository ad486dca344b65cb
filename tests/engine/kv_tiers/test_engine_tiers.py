"""The engine with KV tiers: evicted prefixes come back from RAM and disk, equal to a recompute, across restarts."""

from __future__ import annotations

import errno
import logging
import time

import pytest
import torch

from bytediet.engine.block_manager import chain_hash
from bytediet.engine.kv_tiers.disk import DiskTier
from bytediet.engine.kv_tiers.pages import BlockPages
from bytediet.engine.llm import LLM
from bytediet.engine.params import SamplingParams
from bytediet.errors import ConfigError
from tests.conftest import model_from_state, random_state, tiny_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)


@pytest.fixture(scope="module")
def model():
    config = tiny_config("llama")
    return model_from_state(config, random_state(config, seed=3))


def ids(n: int, seed: int, vocab: int = 96) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = ids(41, 1)  # 10 full blocks of 4 tokens are cacheable, and nothing of an 11th (token-granular reuse)
OTHERS = [ids(40, 10 + i) for i in range(4)]  # enough to push PROMPT's blocks out of a 16-block pool


def llm(model, **kw) -> LLM:
    kw.setdefault("num_blocks", 16)
    return LLM(loaded=(model, None), block_size=4, **kw)


def run(engine_llm, prompts):
    return [engine_llm.generate([p], GREEDY)[0] for p in prompts]


def tokens_and_logprobs(out):
    o = out.outputs[0]
    return o.token_ids, [[(t, lp) for t, lp in x.top] for x in o.logprobs]


def reference(model):
    """The same prompt served from the pool's own prefix cache (a pool large enough to keep it)."""
    big = llm(model, num_blocks=128)
    cold, hit = run(big, [PROMPT, PROMPT])
    assert hit.num_cached_tokens == 40
    return big, cold, hit


def test_a_ram_tier_hit_equals_a_pool_hit_bit_for_bit(model):
    big, cold, pool_hit = reference(model)
    small = llm(model, kv_offload_size="1MiB")
    first, *_, again = run(small, [PROMPT, *OTHERS, PROMPT])
    assert tokens_and_logprobs(first) == tokens_and_logprobs(cold)
    assert tokens_and_logprobs(again) == tokens_and_logprobs(pool_hit)
    assert again.num_cached_tokens == 40
    assert small.engine.tiers.stats["ram"].hit_tokens == 40
    # the loaded blocks hold exactly the bytes the big pool computed for the same prefix
    bm_big, bm_small = big.engine.block_manager, small.engine.block_manager
    big_pages = BlockPages(big.engine.runner.caches, 4, "fp32")
    h = None
    for i in range(10):
        h = chain_hash(h, tuple(PROMPT[4 * i : 4 * i + 4]))
        want = big_pages.read(bm_big.hash_to_block[h], 0)
        assert torch.equal(small.engine.tiers.pages.read(bm_small.hash_to_block[h], 0), want)


def test_a_restart_finds_the_blocks_on_disk(model, tmp_path):
    _, _, pool_hit = reference(model)
    first = llm(model, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.shutdown()  # the pool's cached blocks go down to disk
    again = llm(model, kv_offload_dir=str(tmp_path))
    out = run(again, [PROMPT])[0]
    assert out.num_cached_tokens == 40 and again.engine.tiers.stats["disk"].hit_tokens == 40
    assert tokens_and_logprobs(out) == tokens_and_logprobs(pool_hit)
    req_tiers = again.engine.tiers.stats
    assert req_tiers["ram"].hit_tokens == 0
    again.shutdown()


def test_corrupt_files_are_recomputed_never_read_as_kv(model, tmp_path, caplog):
    _, cold, _ = reference(model)
    first = llm(model, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.shutdown()
    for f in tmp_path.rglob("*.kv"):
        raw = bytearray(f.read_bytes())
        raw[-1] ^= 0x55
        f.write_bytes(bytes(raw))
    again = llm(model, kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        out = run(again, [PROMPT])[0]
    assert "checksum mismatch" in caplog.text
    assert out.num_cached_tokens == 0
    assert tokens_and_logprobs(out) == tokens_and_logprobs(cold)
    again.shutdown()


def test_a_full_disk_mid_write_still_completes_the_requests(model, tmp_path, monkeypatch):
    _, cold, pool_hit = reference(model)

    def full(self, key, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    small = llm(model, kv_offload_dir=str(tmp_path), kv_offload_size="1MiB")
    monkeypatch.setattr(DiskTier, "write", full)
    outs = run(small, [PROMPT, *OTHERS, PROMPT])
    assert tokens_and_logprobs(outs[0]) == tokens_and_logprobs(cold)
    assert tokens_and_logprobs(outs[-1]) == tokens_and_logprobs(pool_hit)  # the RAM tier still had it
    small.shutdown()


def test_a_ram_hit_measured_quick_runs_in_the_step_that_finds_it(model):
    _, _, pool_hit = reference(model)
    small = llm(model, kv_offload_size="1MiB")
    run(small, [PROMPT, *OTHERS, PROMPT, *OTHERS])  # the first hit measures the RAM copy; PROMPT is down again
    engine = small.engine
    assert engine.tiers.seconds_per_byte["ram"] is not None  # 40 tokens of this tiny model: microseconds
    again = engine.add_request(PROMPT, GREEDY)
    engine.step()  # looked up, copied in line, and its one uncached token computed: no step spent waiting
    assert again.tier_load is None and again.num_output_tokens == 1
    assert again.cached_tokens_by_tier == {"pool": 0, "ram": 40}
    while engine.has_unfinished_requests():
        engine.step()
    top = [[(t, lp) for t, lp in x.top] for x in again.output_logprobs]
    assert (again.output_token_ids, top) == tokens_and_logprobs(pool_hit)
    small.shutdown()


def test_a_waiting_load_does_not_stall_the_others(model, tmp_path, monkeypatch):
    first = llm(model, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.shutdown()
    real_read = DiskTier.read
    monkeypatch.setattr(DiskTier, "read", lambda self, key: (time.sleep(0.05), real_read(self, key))[1])
    again = llm(model, kv_offload_dir=str(tmp_path), num_blocks=32)
    engine = again.engine
    other = engine.add_request(OTHERS[0], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    engine.step()
    loading = engine.add_request(PROMPT, GREEDY)
    progressed = 0
    while loading.tier_load is not None or loading.num_computed_tokens == 0:
        before = other.num_output_tokens
        engine.step()
        progressed += other.num_output_tokens - before
    assert progressed > 0, "the other request should decode while the disk read is in flight"
    while engine.has_unfinished_requests():
        engine.step()
    assert loading.cached_tokens_by_tier == {"pool": 0, "disk": 40}
    again.shutdown()


def test_policy_recomputes_when_loading_is_measured_slower(model, tmp_path):
    _, cold, _ = reference(model)
    first = llm(model, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.shutdown()
    again = llm(model, kv_offload_dir=str(tmp_path))
    tiers = again.engine.tiers
    tiers.seconds_per_byte["disk"] = 1.0  # a very slow disk, measured
    tiers.seconds_per_token = 1e-6
    out = run(again, [PROMPT])[0]
    assert out.num_cached_tokens == 0 and tiers.stats["disk"].skipped_tokens == 40
    assert tokens_and_logprobs(out) == tokens_and_logprobs(cold)
    again.shutdown()


def test_bad_settings_fail_at_start_in_one_line(model, tmp_path):
    with pytest.raises(ConfigError, match="below one block"):
        llm(model, kv_offload_size=10)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="cannot write there"):
        llm(model, kv_offload_dir=str(blocker / "sub"))
    held = llm(model, kv_offload_dir=str(tmp_path / "d"))
    with pytest.raises(ConfigError, match="in use by"):
        llm(model, kv_offload_dir=str(tmp_path / "d"))
    held.shutdown()
    with pytest.raises(ConfigError, match="prefix"):
        llm(model, kv_offload_size="1MiB", enable_prefix_caching=False)


def test_another_models_directory_is_ignored_and_said_once(model, tmp_path, caplog):
    config = tiny_config("llama")
    other_model = model_from_state(config, random_state(config, seed=99))
    first = llm(other_model, kv_offload_dir=str(tmp_path))
    run(first, [PROMPT])
    first.shutdown()
    with caplog.at_level(logging.WARNING, logger="bytediet.kv_tiers"):
        mine = llm(model, kv_offload_dir=str(tmp_path))
        out = run(mine, [PROMPT])[0]
    assert out.num_cached_tokens == 0 and caplog.text.count("another model") == 1
    mine.shutdown()


@pytest.mark.parametrize("name", ["smollm2", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_real_model_greedy_tokens_equal_a_cold_run_with_a_pool_that_forces_eviction(name, request):
    loaded = request.getfixturevalue(name)
    tokenizer = loaded[1]
    from bytediet.eval.corpus import load_corpus

    text = load_corpus("prideprejudice")
    prompt = tokenizer.encode(text[30000:32000], add_special_tokens=False)[:200]
    filler = tokenizer.encode(text[40000:44000], add_special_tokens=False)[:300]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cold = LLM(loaded=loaded, num_blocks=64).generate([prompt], params)[0].outputs[0].token_ids
    tiered = LLM(loaded=loaded, num_blocks=24, kv_offload_size="256MiB")  # 384 tokens: the filler evicts
    tiered.generate([prompt], params)
    tiered.generate([filler], params)
    out = tiered.generate([prompt], params)[0]
    assert tiered.engine.tiers.stats["ram"].hit_tokens >= 64 and out.num_cached_tokens == 192
    assert out.outputs[0].token_ids == cold


def test_re_encoded_at_rest_holds_more_blocks_and_comes_back_close():
    config = tiny_config("llama", head_dim=32)  # llama.cpp's q8_0 blocks are 32 wide
    model = model_from_state(config, random_state(config, seed=3))
    lossless = llm(model, kv_cache_dtype="bf16", kv_offload_size="1MiB")
    small = llm(model, kv_cache_dtype="bf16", kv_offload_size="1MiB", kv_offload_codec="rot-q8_0")
    assert lossless.engine.tiers.pages.block_bytes / small.engine.tiers.pages.block_bytes >= 1.8
    cold, *_, again = run(small, [PROMPT, *OTHERS, PROMPT])
    assert again.num_cached_tokens == 40 and small.engine.tiers.stats["ram"].hit_tokens == 40
    a, b = cold.outputs[0].logprobs[0].top, again.outputs[0].logprobs[0].top
    assert abs(a[0][1] - dict(b).get(a[0][0], -1e9)) < 0.1  # the greedy token's logprob, within a lossy codec's error
