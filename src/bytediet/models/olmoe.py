"""OLMoE (Muennighoff et al. 2024, arXiv 2409.02060): 64 experts, top-8, no shared expert.

Softmax-then-top-k gating without renormalization (``norm_topk_prob`` false); q and k RMS-normalized
over the whole projection (not per head) before RoPE; optional ``clip_qkv`` clamp; ``attention_bias``
covers q, k, v and o. llama.cpp: architecture ``olmoe``, NEOX (rotate-half) RoPE stored as in HF.
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from .arch import ARCHITECTURES, check_hf_gating, moe_from_gguf
from .llama import Llama


@ARCHITECTURES.register("olmoe")
class Olmoe(Llama):
    name = "olmoe"
    permuted_qk = False

    def moe_from_gguf(self, meta) -> dict:
        return moe_from_gguf(meta, self.name, "softmax-topk", False)

    def config_from_gguf(self, meta) -> ModelConfig:
        clip = meta("attention.clamp_kqv", None)
        return self._olmoe(super().config_from_gguf(meta), clip, bool(meta("__has_qkv_bias", False)))

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        check_hf_gating(cfg, self.name)
        base = super().config_from_hf(cfg)
        return self._olmoe(
            dataclasses.replace(
                base,
                num_experts=cfg["num_experts"],
                num_experts_per_tok=cfg["num_experts_per_tok"],
                moe_gating="softmax-topk",
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            ),
            cfg.get("clip_qkv"),
            bool(cfg.get("attention_bias", False)),
        )

    @staticmethod
    def _olmoe(config: ModelConfig, clip, bias: bool) -> ModelConfig:
        return dataclasses.replace(
            config,
            qk_norm=True,
            qk_norm_per_head=False,
            attention_bias=bias,
            attention_out_bias=bias,
            clip_qkv=None if clip is None else float(clip),
        )
