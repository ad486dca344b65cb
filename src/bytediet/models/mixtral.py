"""Mixtral (Jiang et al. 2024, arXiv 2401.04088): llama attention, every MLP a mixture of 8 experts, top-2.

Gating: a softmax over the k largest router logits. Hugging Face checkpoints name the block
``block_sparse_moe`` and an expert's linears ``w1`` (gate), ``w3`` (up), ``w2`` (down); they are renamed
to the model's ``mlp.experts.N.{gate,up,down}_proj``. llama.cpp writes Mixtral GGUFs with the ``llama``
architecture and ``llama.expert_count`` (read by :class:`~bytediet.models.llama.Llama`).
"""

from __future__ import annotations

import dataclasses
import re

from ..config import ModelConfig
from .arch import ARCHITECTURES, check_hf_gating
from .llama import Llama

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.w([123])\.")
_LINEARS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}


@ARCHITECTURES.register("mixtral")
class Mixtral(Llama):
    name = "mixtral"

    def config_from_hf(self, cfg: dict) -> ModelConfig:
        check_hf_gating(cfg, self.name)
        base = super().config_from_hf(cfg)
        window = cfg.get("sliding_window")  # Mixtral's HF attention slides on every layer when it is set
        return dataclasses.replace(
            base,
            num_experts=cfg["num_local_experts"],
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_gating="topk-softmax",
            norm_topk_prob=True,
            sliding_window=window or None,
            layer_types=("sliding" if window else "full",) * base.num_layers,
        )

    def hf_name_to_module(self, hf_name: str) -> str:
        name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_LINEARS[m.group(2)]}.", hf_name)
        return name.replace(".block_sparse_moe.", ".mlp.")
