"""Architecture adapters: checkpoint metadata → :class:`ModelConfig`, checkpoint tensor names → module names.

One adapter per family, registered in :data:`ARCHITECTURES` by the checkpoint's architecture name
(GGUF ``general.architecture`` or HF ``model_type``).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from ..config import ModelConfig
from ..registry import Registry

ARCHITECTURES: Registry = Registry("model architecture")

# GGUF per-layer tensor names → HF module names (shared by the families; absent ones are skipped)
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class Architecture:
    """Base adapter; subclasses set ``name`` and implement the two config readers."""

    name = "abstract"
    gguf_layer_names = GGUF_LAYER_NAMES

    def config_from_gguf(self, meta: Callable[[str, Any], Any]) -> ModelConfig:
        """``meta(key, default)`` reads a GGUF metadata field (the ``<arch>.`` prefix is added by the caller)."""
        raise NotImplementedError

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        raise NotImplementedError

    def gguf_name_to_module(self, gguf_name: str) -> Optional[str]:
        """``blk.3.attn_q.weight`` → ``model.layers.3.self_attn.q_proj.weight`` (None: not used)."""
        stem, _, kind = gguf_name.rpartition(".")
        if stem.startswith("blk."):
            _, idx, part = stem.split(".", 2)
            target = self.gguf_layer_names.get(part)
            return f"model.layers.{idx}.{target}.{kind}" if target else None
        target = GGUF_GLOBAL_NAMES.get(stem)
        return f"{target}.{kind}" if target else None

    def fix_gguf_tensor(self, module_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
        """Undo converter-specific layouts (llama's q/k permutation). Default: unchanged."""
        return array


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs → rotate-half halves).

    The converter did ``w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2)``; this is its inverse.
    w: (n_heads * head_dim, in).
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
