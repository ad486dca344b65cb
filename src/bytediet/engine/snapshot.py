"""What the API server reads from an engine, as plain picklable values (the same in-thread or out of process).

:class:`EngineInfo` is fixed once the engine is built (tokenizer, limits, what is served);
:class:`EngineCounters` is the state the server's ``/metrics`` and ``/health`` show, read after each step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..errors import ConfigError
from .params import SamplingParams


@dataclass(frozen=True)
class EngineInfo:
    """The engine's fixed facts: the tokenizer, the vocabulary, the context and KV capacity, what is served."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    source_path: Optional[str]
    kv_codec: str  # the codec that runs, described (e.g. "fp32", "int8 K / int4 V")
    kv_compression: float  # KV bytes at fp16 / bytes as stored
    weight_format: str  # the weight formats in the model, comma-separated

    @property
    def capacity(self) -> int:
        """Tokens the KV cache holds."""
        return self.num_blocks * self.block_size

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """``LLMEngine.validate``'s checks from these facts alone (the API process has no engine)."""
        if not isinstance(params, SamplingParams):
            raise ConfigError("sampling params must be a bytediet SamplingParams")
        if params.n != 1:
            raise ConfigError("n: the engine core takes one sequence per request; use LLM.generate for n > 1")
        params.validate(self.vocab_size)
        ids = [int(t) for t in prompt_token_ids]
        if not ids:
            raise ConfigError("prompt: must not be empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size - 1}]")
        if len(ids) >= self.max_model_len:
            raise ConfigError(
                f"prompt: {len(ids)} tokens do not fit the context window of {self.max_model_len} "
                "tokens (at least one token must be generated); shorten the prompt"
            )
        if len(ids) >= self.capacity:
            raise ConfigError(
                f"prompt: {len(ids)} tokens exceed the KV cache ({self.capacity} tokens); raise --kv-cache-memory"
            )
        return ids


@dataclass(frozen=True)
class EngineCounters:
    """The engine's state after its last step (``/metrics``, ``/health``)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0  # in blocks
    prefix_hits: int = 0  # in blocks
    prefix_partial_query_tokens: int = 0  # tokens looked up at the head of a cached block (token-granular reuse)
    prefix_partial_hit_tokens: int = 0  # tokens found at the head of a cached block (token-granular reuse)
    num_preemptions: int = 0
    spec_verifications: int = 0  # request-steps that verified speculative drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    failure: Optional[str] = None  # why the engine can no longer step (a tensor-parallel worker died)


def engine_info(engine) -> EngineInfo:
    """The fixed facts of an :class:`~bytediet.engine.engine.LLMEngine`."""
    config = engine.model.config
    codec = engine.runner.codec  # the codec that runs (with its calibration state)
    bm = engine.block_manager
    return EngineInfo(
        tokenizer=engine.tokenizer,
        vocab_size=config.vocab_size,
        max_model_len=engine.max_model_len,
        num_blocks=bm.num_blocks,
        block_size=bm.block_size,
        source_path=getattr(engine.model, "source_path", None),
        kv_codec=codec.describe(config.head_dim),
        kv_compression=16.0 / codec.bits_per_coordinate(config.num_kv_heads, config.head_dim),
        weight_format=",".join(engine.model.weight_formats()),
    )


def engine_counters(engine) -> EngineCounters:
    """The state of an :class:`~bytediet.engine.engine.LLMEngine` now (plain reads)."""
    bm, sched = engine.block_manager, engine.scheduler
    return EngineCounters(
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        num_free_blocks=bm.num_free_blocks,
        prefix_queries=bm.prefix_queries,
        prefix_hits=bm.prefix_hits,
        prefix_partial_query_tokens=bm.partial_query_tokens,
        prefix_partial_hit_tokens=bm.partial_hit_tokens,
        num_preemptions=sched.num_preemptions,
        spec_verifications=engine.stats.spec_verifications,
        spec_draft_tokens=engine.stats.spec_draft_tokens,
        spec_accepted_tokens=engine.stats.spec_accepted_tokens,
        failure=engine.failure,
    )
