"""Frozen, validated configuration dataclasses of the bottom layer: names and numbers, no objects.

The model's shape (:class:`ModelConfig`) and the scheduler's budget (:class:`SchedulerConfig`) live here.
A config that names a registered implementation lives next to that registry, which validates the name:
:class:`bytediet.kvcache.config.CacheConfig` (KV codec) and :class:`bytediet.engine.config.EngineConfig`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

from .errors import ConfigError


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a decoder-only transformer (llama, qwen2, gemma3 and the MoE families).

    ``layer_types[i]`` is ``"full"`` or ``"sliding"``; sliding layers attend to the last
    ``sliding_window`` tokens and use ``rope_local_theta`` (gemma3).

    Mixture of experts (mixtral, qwen2_moe, olmoe; ``num_experts > 0``): every layer not in
    ``dense_layers`` replaces its MLP by ``num_experts`` experts of width ``moe_intermediate_size``, of
    which a router picks ``num_experts_per_tok`` per token with the gating rule named by ``moe_gating``
    (``norm_topk_prob``: renormalize the picked weights to sum 1); ``shared_expert_intermediate_size > 0``
    adds an always-on expert scaled by a sigmoid gate (qwen2_moe). ``qk_norm_per_head`` False normalizes
    q and k over the whole projection instead of per head (olmoe); ``clip_qkv`` clamps q, k and v (olmoe).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_local_theta: Optional[float] = None
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: Optional[int] = None
    layer_types: tuple[str, ...] = ()
    query_pre_attn_scalar: Optional[float] = None
    qk_norm: bool = False
    sandwich_norm: bool = False  # gemma3: post-attention and post-feed-forward norms
    embedding_scale: float = 1.0
    qk_norm_per_head: bool = True
    clip_qkv: Optional[float] = None
    attention_out_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    moe_gating: str = ""
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    name: str = ""

    def __post_init__(self) -> None:
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model config: {key} must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ConfigError(f"model config: unsupported hidden_act {self.hidden_act!r} (silu or gelu_tanh)")
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if len(self.layer_types) != self.num_layers:
            raise ConfigError("model config: layer_types must name one type per layer")
        if any(t == "sliding" for t in self.layer_types) and not self.sliding_window:
            raise ConfigError("model config: sliding layers need sliding_window")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))  # JSON gives lists
        if self.num_experts:
            self._check_moe()

    def _check_moe(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"model config: num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and "
                f"num_experts ({self.num_experts})"
            )
        if not self.moe_gating:
            raise ConfigError("model config: a mixture-of-experts model must name its moe_gating rule")
        if self.moe_intermediate_size <= 0:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer``'s feed-forward block is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_for(self, layer: int) -> Optional[int]:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    def rope_theta_for(self, layer: int) -> float:
        if self.layer_types[layer] == "sliding" and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied); every expert of a MoE model counts."""
        return self._parameters(self.num_experts)

    @property
    def num_active_parameters(self) -> int:
        """Parameters one token reads: attention, router, its ``num_experts_per_tok`` experts, the shared expert.

        Equal to :attr:`num_parameters` for a dense model (Mixtral-8x7B: 46.7 B total, 12.9 B active).
        """
        return self._parameters(self.num_experts_per_tok)

    def _parameters(self, experts: int) -> int:
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.attention_out_bias:
            attn += h
        qk = (self.num_heads + self.num_kv_heads) * d if not self.qk_norm_per_head else 2 * d
        norms = h * (4 if self.sandwich_norm else 2) + (qk if self.qk_norm else 0)
        moe = self.num_moe_layers
        moe_mlp = (
            experts * 3 * h * self.moe_intermediate_size
            + self.num_experts * h
            + (3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0)
        )
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + norms) + (self.num_layers - moe) * 3 * h * i + moe * moe_mlp + emb + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 2**10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 2**20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 2**30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"`` → 2147483648; an int is returned unchanged."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


SCHEDULING_POLICIES = ("fcfs", "priority")
# Tokens one engine step computes: 1024 beat 256, 512 and 2048 on both dev models at 64 concurrent long prompts
# (throughput +5-8 %, TTFT p50 -7-15 %, the same TPOT p99: bench/RESULTS.md "Recording 15", bench/scheduling_sweep.py).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step and concurrency limit (vLLM v1 semantics)."""

    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True
    #: most prompt tokens one request computes in a step (0: no cap, the budget is the cap)
    long_prefill_token_threshold: int = 0
    #: "fcfs" (arrival order) or "priority" (lowest ``priority`` value first, then arrival; vLLM's meaning)
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
        if not 0 <= self.long_prefill_token_threshold <= self.max_num_batched_tokens:
            raise ConfigError(
                f"--long-prefill-token-threshold {self.long_prefill_token_threshold} must be between 0 "
                f"(no cap) and --max-num-batched-tokens ({self.max_num_batched_tokens})"
            )
        if self.policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy {self.policy!r}: choose one of {', '.join(SCHEDULING_POLICIES)}")

    @property
    def prefill_chunk(self) -> int:
        """Most prompt tokens one request computes in a step."""
        return self.long_prefill_token_threshold or self.max_num_batched_tokens
