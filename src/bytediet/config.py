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
    """Architecture hyper-parameters of a decoder-only transformer (llama, qwen2 and gemma3 families).

    ``layer_types[i]`` is ``"full"`` or ``"sliding"``; sliding layers attend to the last
    ``sliding_window`` tokens and use ``rope_local_theta`` (gemma3).
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
    name: str = ""

    def __post_init__(self) -> None:
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
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
        """Parameter count (embeddings counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.attention_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * i
        norms = h * (4 if self.sandwich_norm else 2) + (2 * d if self.qk_norm else 0)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + emb + h

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_SIZE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 2**10, "m": 1e6, "mb": 1e6, "mib": 2**20,
          "g": 1e9, "gb": 1e9, "gib": 2**30, "t": 1e12, "tb": 1e12, "tib": 2**40}


def parse_bytes(text: str | int) -> int:
    """``"2GiB"`` → 2147483648; an int is returned unchanged."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ConfigError(f"cannot read {text!r} as a size; write e.g. 512MiB or 2GiB")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step and concurrency limit (vLLM v1 semantics)."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens must be at least 1")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs must be at least 1")
