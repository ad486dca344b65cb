"""The prefix-cache part of ``bytediet bench``: what the KV tiers (docs/kv-tiers.md) save on repeated prefixes.

Two workloads, both on bytediet alone (``--parts prefix-cache``):

* repeated prompt: a long prompt (``prefix_prompt_len`` tokens), cold; again after another prompt evicted its blocks
  from a pool that holds one sequence (RAM-tier hit); again after a restart (a new engine on the same directory:
  disk-tier hit). TTFT of each, their ratios to the cold one, and whether the tokens equal the cold run's (greedy).
* multi-turn chat: ``chat_conversations`` conversations over ``chat_system_prompts`` system prompts of
  ``chat_system_len`` tokens, each turn adding ``chat_turn_len`` tokens, in a pool 4x smaller than the shared prefixes;
  requests arrive one after another. Mean / p50 TTFT and throughput with the tiers on (RAM) and off.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence

from .bench import percentile

Progress = Callable[[str], None]


def _engine(ours, num_blocks: int, **tiers):
    from ..engine.llm import LLM

    return LLM(
        loaded=(ours.model, ours.tokenizer),
        kv_cache_dtype=ours.kv_cache_dtype,
        kv_calibration_state=ours.kv_state,
        block_size=ours.block_size,
        num_blocks=num_blocks,
        max_num_batched_tokens=ours.max_num_batched_tokens,
        num_threads=ours.threads,
        **tiers,
    )


def _timed(llm, prompt: Sequence[int], new_tokens: int) -> dict:
    from ..engine.params import SamplingParams

    out = llm.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True))[0]
    return {"ttft_s": out.ttft, "tokens": out.outputs[0].token_ids, "cached_tokens": out.cached_tokens_by_tier}


def _slice(ids: Sequence[int], start: int, n: int) -> list[int]:
    return [ids[(start + i) % len(ids)] for i in range(n)]


def repeated_prompt(ours, config, ids: Sequence[int], progress: Progress) -> dict:
    new, bs = config.prefix_new_tokens, ours.block_size
    n = min(config.prefix_prompt_len, ours.model.config.max_position_embeddings - new - 1)  # within the context
    prompt, filler = _slice(ids, 0, n), _slice(ids, n, n)
    blocks = -(-(n + new) // bs) + 2  # one sequence: the filler evicts the prompt's blocks
    with tempfile.TemporaryDirectory(prefix="bytediet-kv-tiers-") as d:
        llm = _engine(ours, blocks, kv_offload_size=config.prefix_offload_size, kv_offload_dir=d)
        progress(f"prefix-cache: {n}-token prompt cold")
        cold = _timed(llm, prompt, new)
        _timed(llm, filler, new)
        progress("prefix-cache: again from the RAM tier")
        ram = _timed(llm, prompt, new)
        llm.shutdown()
        del llm
        restarted = _engine(ours, blocks, kv_offload_size=config.prefix_offload_size, kv_offload_dir=d)
        progress("prefix-cache: again after a restart (disk tier)")
        disk = _timed(restarted, prompt, new)
        restarted.shutdown()
    out = {"prompt_tokens": n, "new_tokens": new, "pool_blocks": blocks}
    for name, r in (("cold", cold), ("ram_hit", ram), ("disk_hit", disk)):
        out[name] = {
            "ttft_s": r["ttft_s"],
            "cached_tokens": r["cached_tokens"],
            "tokens_equal_cold": r["tokens"] == cold["tokens"],
        }
    out["ram_ttft_ratio"] = ram["ttft_s"] / cold["ttft_s"]
    out["disk_ttft_ratio"] = disk["ttft_s"] / cold["ttft_s"]
    return out


def multi_turn_chat(ours, config, ids: Sequence[int], progress: Progress) -> dict:
    k, s, convs, turn, new = (
        config.chat_system_prompts,
        config.chat_system_len,
        config.chat_conversations,
        config.chat_turn_len,
        config.chat_new_tokens,
    )
    systems = [_slice(ids, i * s, s) for i in range(k)]
    requests = []
    for t in range(config.chat_turns):
        for c in range(convs):
            user = [_slice(ids, k * s + (c * config.chat_turns + j) * turn, turn) for j in range(t + 1)]
            requests.append(systems[c % k] + [tok for u in user for tok in u])
    longest = max(len(r) for r in requests) + new
    blocks = max(-(-k * s // (4 * ours.block_size)), -(-longest // ours.block_size) + 1)  # prefixes 4x the pool
    out = {
        "system_prompts": k,
        "system_tokens": s,
        "conversations": convs,
        "turns": config.chat_turns,
        "requests": len(requests),
        "pool_blocks": blocks,
    }
    for name, tiers in (("tiers_off", {}), ("tiers_on", {"kv_offload_size": config.prefix_offload_size})):
        progress(f"prefix-cache: multi-turn chat, {name}")
        llm = _engine(ours, blocks, **tiers)
        t0, ttfts, generated = time.perf_counter(), [], 0
        for r in requests:
            res = _timed(llm, r, new)
            ttfts.append(res["ttft_s"])
            generated += len(res["tokens"])
        wall = time.perf_counter() - t0
        llm.shutdown()
        out[name] = {
            "ttft_mean_s": sum(ttfts) / len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50),
            "output_tokens_per_s": generated / wall,
            "wall_s": wall,
        }
    out["ttft_p50_ratio"] = out["tiers_on"]["ttft_p50_s"] / out["tiers_off"]["ttft_p50_s"]
    return out


def measure_prefix_cache(ours, config, ids: Sequence[int], progress: Progress = lambda msg: None) -> dict:
    if getattr(ours, "tensor_parallel_size", 1) > 1:
        return {"skipped": "KV tiers do not support tensor parallelism yet"}
    return {
        "repeated_prompt": repeated_prompt(ours, config, ids, progress),
        "multi_turn_chat": multi_turn_chat(ours, config, ids, progress),
    }
