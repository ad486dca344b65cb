"""Qwen2-MoE / Qwen1.5-MoE (Qwen2 technical report, arXiv 2407.10671).

Qwen2 attention (q/k/v biases); each sparse layer has ``num_experts`` fine-grained experts of width
``moe_intermediate_size`` picked by a softmax-then-top-k router (renormalized only when
``norm_topk_prob``), plus one always-on shared expert of width ``shared_expert_intermediate_size``
scaled by ``sigmoid(shared_expert_gate · x)``. Layers listed in ``mlp_only_layers``, or off the
``decoder_sparse_step`` grid, keep a dense MLP of width ``intermediate_size``. GGUF: ``qwen2moe``.
"""

from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from .arch import ARCHITECTURES, check_hf_gating, moe_from_gguf
from .llama import Qwen2


@ARCHITECTURES.register("qwen2moe")
@ARCHITECTURES.register("qwen2_moe")
class Qwen2Moe(Qwen2):
    name = "qwen2_moe"

    def moe_from_gguf(self, meta) -> dict:
        return moe_from_gguf(meta, self.name, "softmax-topk", False)  # llama.cpp: no renormalization

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        check_hf_gating(cfg, self.name)
        base = super().config_from_hf({**cfg, "attention_bias": cfg.get("qkv_bias", True)})
        n, experts, step = base.num_layers, cfg["num_experts"], cfg.get("decoder_sparse_step", 1)
        only_mlp = set(cfg.get("mlp_only_layers") or ())
        dense = tuple(i for i in range(n) if i in only_mlp or not (experts > 0 and (i + 1) % step == 0))
        types = cfg.get("layer_types") or ["full_attention"] * n
        sliding = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
        return dataclasses.replace(
            base,
            num_experts=experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_intermediate_size=cfg["moe_intermediate_size"],
            shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0),
            moe_gating="softmax-topk",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=dense,
            layer_types=sliding,
            sliding_window=cfg.get("sliding_window") if "sliding" in sliding else None,
        )
