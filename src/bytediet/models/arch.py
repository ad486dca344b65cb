"""Architecture adapters: checkpoint metadata → :class:`ModelConfig`, checkpoint tensor names → module names.

One adapter per family, registered in :data:`ARCHITECTURES` by the checkpoint's architecture name
(GGUF ``general.architecture`` or HF ``model_type``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError
from ..registry import Registry
from .moe import GATINGS

ARCHITECTURES: Registry = Registry("model architecture")

# GGUF per-layer tensor names → HF module names (shared by the families; absent ones are skipped)
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp's mixture-of-experts tensors (the same in every family). ``{e}``: the tensor stacks all experts
# as (n_expert, out, in) and is split into one tensor per expert; older Mixtral files store
# ``ffn_gate.{e}`` / ``ffn_up.{e}`` / ``ffn_down.{e}`` one per expert.
GGUF_MOE_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_GGUF_SINGLE_EXPERT = re.compile(r"^(ffn_gate|ffn_up|ffn_down)\.(\d+)$")


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
            target = self.gguf_layer_names.get(part) or GGUF_MOE_NAMES.get(part)
            single = _GGUF_SINGLE_EXPERT.match(part)
            if single:
                target = GGUF_MOE_NAMES[single.group(1) + "_exps"].format(e=single.group(2))
            return f"model.layers.{idx}.{target}.{kind}" if target else None
        target = GGUF_GLOBAL_NAMES.get(stem)
        return f"{target}.{kind}" if target else None

    def hf_name_to_module(self, hf_name: str) -> str:
        """A Hugging Face tensor name → the model's module name (Mixtral renames its experts). Default: unchanged."""
        return hf_name

    def fix_gguf_tensor(self, module_name: str, array: np.ndarray, config: ModelConfig) -> np.ndarray:
        """Undo converter-specific layouts (llama's q/k permutation). Default: unchanged."""
        return array


def hf_rope_theta(cfg: dict, default: float) -> float:
    """RoPE base of an HF config: ``rope_theta``, or ``rope_parameters.rope_theta`` (transformers ≥ 5)."""
    return float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or default)


def hf_rope_scaling(cfg: dict) -> Optional[dict]:
    """``rope_scaling``, or transformers ≥ 5's ``rope_parameters`` when its type is not the default."""
    if cfg.get("rope_scaling"):
        return cfg["rope_scaling"]
    params = cfg.get("rope_parameters") or {}
    return params if params.get("rope_type", "default") != "default" else None


# ------------------------------------------------------------------------------------ mixture of experts
GGUF_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}  # gguf.ExpertGatingFuncType


def moe_from_gguf(meta: Callable[[str, Any], Any], family: str, gating: str, norm_topk_prob: bool) -> dict:
    """The :class:`ModelConfig` MoE fields of a GGUF file (empty for a dense model).

    ``gating``/``norm_topk_prob``: the family's rule and llama.cpp's default for it; a file that asks for
    another scoring function (``expert_gating_func``) is refused, naming it.
    """
    experts = int(meta("expert_count", 0) or 0)
    if not experts:
        return {}
    func = meta("expert_gating_func", None)
    if func is not None and GGUF_GATING_FUNCS.get(int(func)) != "softmax":
        raise CheckpointError(
            f"{family} MoE: expert_gating_func {GGUF_GATING_FUNCS.get(int(func), func)!r} is not a gating variant "
            f"bytediet loads (softmax only; rules: {', '.join(GATINGS.names())})"
        )
    return dict(
        num_experts=experts,
        num_experts_per_tok=int(meta("expert_used_count")),
        moe_intermediate_size=int(meta("expert_feed_forward_length", 0) or 0),
        shared_expert_intermediate_size=int(meta("expert_shared_feed_forward_length", 0) or 0),
        moe_gating=gating,
        norm_topk_prob=bool(meta("expert_weights_norm", norm_topk_prob)),
    )


def check_hf_gating(cfg: dict, family: str) -> None:
    """Refuse HF MoE configs whose router scores are not a softmax (e.g. DeepSeek-V3's ``sigmoid``)."""
    scoring = cfg.get("scoring_func", "softmax")
    if scoring != "softmax":
        raise CheckpointError(
            f"{family} MoE: scoring_func {scoring!r} is not a gating variant bytediet loads "
            f"(softmax only; rules: {', '.join(GATINGS.names())})"
        )


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation (interleaved RoPE pairs → rotate-half halves).

    The converter did ``w.reshape(n_heads, 2, d/2, in).swapaxes(1, 2)``; this is its inverse.
    w: (n_heads * head_dim, in).
    """
    out_dim = w.shape[0]
    half = out_dim // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
