"""Llama family (Llama 2/3, SmolLM2) and Qwen2 (q/k/v biases, untied ``lm_head``).

Touvron et al. 2023, arXiv 2302.13971; Qwen2 technical report, arXiv 2407.10671.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig
from .arch import ARCHITECTURES, Architecture, hf_rope_scaling, hf_rope_theta, moe_from_gguf, unpermute_rope


def _rope_scaling_from_gguf(meta) -> dict | None:
    kind = meta("rope.scaling.type", None)
    if kind in (None, "none"):
        return None
    return {
        "type": kind,
        "factor": float(meta("rope.scaling.factor", 1.0)),
        "original_max_position_embeddings": int(meta("rope.scaling.original_context_length", 8192)),
    }


@ARCHITECTURES.register("llama")
class Llama(Architecture):
    name = "llama"
    permuted_qk = True  # llama.cpp's converter permutes attn_q / attn_k of llama models

    def config_from_gguf(self, meta) -> ModelConfig:
        hidden = int(meta("embedding_length"))
        heads = int(meta("attention.head_count"))
        moe = self.moe_from_gguf(meta)
        return ModelConfig(
            architecture="mixtral" if moe and self.name == "llama" else self.name,
            vocab_size=int(meta("vocab_size", 0)) or int(meta("__vocab_from_tokens", 0)),
            hidden_size=hidden,
            intermediate_size=int(meta("feed_forward_length")),
            num_layers=int(meta("block_count")),
            num_heads=heads,
            num_kv_heads=int(meta("attention.head_count_kv", heads)),
            head_dim=int(meta("attention.key_length", 0)) or hidden // heads,
            rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta("rope.freq_base", 10000.0)),
            rope_scaling=_rope_scaling_from_gguf(meta),
            max_position_embeddings=int(meta("context_length", 2048)),
            tie_word_embeddings=not meta("__has_output", False),
            attention_bias=bool(meta("__has_qkv_bias", False)),
            name=str(meta("__name", "")),
            **moe,
        )

    def moe_from_gguf(self, meta) -> dict:
        """llama.cpp writes Mixtral as ``llama`` with ``expert_count``: softmax over the top-k logits."""
        return moe_from_gguf(meta, "mixtral", "topk-softmax", True)

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        return ModelConfig(
            architecture=self.name,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=hf_rope_theta(cfg, 10000.0),
            rope_scaling=hf_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", self.name == "qwen2"),
            name=cfg.get("_name_or_path", ""),
        )

    def fix_gguf_tensor(self, module_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
        if not self.permuted_qk:
            return array
        if module_name.endswith("self_attn.q_proj.weight"):
            return unpermute_rope(array, config.num_heads)
        if module_name.endswith("self_attn.k_proj.weight"):
            return unpermute_rope(array, config.num_kv_heads)
        return array


@ARCHITECTURES.register("qwen2")
class Qwen2(Llama):
    name = "qwen2"
    permuted_qk = False  # qwen2 uses NEOX (rotate-half) RoPE in llama.cpp: stored as in HF

    def moe_from_gguf(self, meta) -> dict:
        return {}  # qwen2 is dense; its MoE sibling is the qwen2moe architecture
