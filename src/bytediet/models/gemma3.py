"""Gemma 3 (Gemma Team 2025, arXiv 2503.19786).

Embeddings scaled by √hidden; q/k RMSNorm; post-attention and post-feed-forward norms; GELU-tanh;
attention scale from ``query_pre_attn_scalar``; 5 sliding-window layers (window 512, RoPE base 10 000)
for every global layer (RoPE base 1 000 000). RMSNorm weights are applied as ``(1 + w)``: GGUF already
stores ``1 + w``; HF checkpoints store ``w`` and the loader adds 1.
"""

from __future__ import annotations

import math

from ..config import ModelConfig
from .arch import ARCHITECTURES, GGUF_LAYER_NAMES, Architecture


def gemma3_layer_types(num_layers: int, pattern: int = 6) -> tuple[str, ...]:
    return tuple("full" if (i + 1) % pattern == 0 else "sliding" for i in range(num_layers))


@ARCHITECTURES.register("gemma3")
class Gemma3(Architecture):
    name = "gemma3"
    norm_weight_offset_in_hf = 1.0
    # gemma3's "ffn_norm" is the norm *before* the MLP; "post_attention_norm" the one after attention
    gguf_layer_names = {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm"}

    def config_from_gguf(self, meta) -> ModelConfig:
        hidden = int(meta("embedding_length"))
        heads = int(meta("attention.head_count"))
        head_dim = int(meta("attention.key_length", 0)) or hidden // heads
        layers = int(meta("block_count"))
        factor = meta("rope.scaling.factor", None)
        return ModelConfig(
            architecture=self.name,
            vocab_size=int(meta("vocab_size", 0)) or int(meta("__vocab_from_tokens", 0)),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(meta("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(meta("rope.freq_base", 1_000_000.0)),
            rope_local_theta=10_000.0,
            rope_scaling={"type": "linear", "factor": float(factor)} if factor else None,
            max_position_embeddings=int(meta("context_length", 32768)),
            tie_word_embeddings=True,
            hidden_act="gelu_tanh",
            sliding_window=int(meta("attention.sliding_window", 512)),
            layer_types=gemma3_layer_types(layers),
            query_pre_attn_scalar=float(head_dim),
            qk_norm=True,
            sandwich_norm=True,
            embedding_scale=math.sqrt(hidden),
            name=str(meta("__name", "")),
        )

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        cfg = cfg.get("text_config", cfg)
        layers = cfg["num_hidden_layers"]
        layer_types = cfg.get("layer_types")
        if layer_types:
            layer_types = tuple("sliding" if t == "sliding_attention" else "full" for t in layer_types)
        else:
            layer_types = gemma3_layer_types(layers, cfg.get("sliding_window_pattern", 6))
        return ModelConfig(
            architecture=self.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=layers,
            num_heads=cfg["num_attention_heads"],
            num_kv_heads=cfg["num_key_value_heads"],
            head_dim=cfg["head_dim"],
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 1_000_000.0),
            rope_local_theta=cfg.get("rope_local_base_freq", 10_000.0),
            rope_scaling=cfg.get("rope_scaling"),
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            tie_word_embeddings=True,
            hidden_act="gelu_tanh",
            sliding_window=cfg.get("sliding_window", 512),
            layer_types=layer_types,
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar", cfg["head_dim"]),
            qk_norm=True,
            sandwich_norm=True,
            embedding_scale=math.sqrt(cfg["hidden_size"]),
        )
