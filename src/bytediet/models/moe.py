"""Mixture-of-experts feed-forward block: a router, top-k gating, token-grouped experts, a shared expert.

Shazeer et al. 2017 (arXiv 1701.06538) for the sparsely-gated layer; Mixtral (Jiang et al. 2024,
arXiv 2401.04088), Qwen2-MoE (Qwen2 technical report, arXiv 2407.10671) and OLMoE (Muennighoff et al.
2024, arXiv 2409.02060) for the three families' gating rules.

Each expert is an ordinary gated :class:`~bytediet.models.layers.MLP` whose three linears are
:class:`~bytediet.models.layers.Linear` layers, so every weight format (``--weights int8``, packed GGUF
blocks, ...) applies to experts as to any other layer. The router and the shared-expert gate stay in
float: they are tiny, and a rounding error there changes *which* expert runs, not just a value.

The experts run token-grouped: the (token, expert) assignments of a step are sorted by expert, and each
expert that received tokens multiplies all of them at once (``index_select`` in, ``index_add_`` out), so
its weights are read once per step however many tokens it serves. The Python loop runs over the experts
hit in this step, never over tokens.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..config import ModelConfig
from ..errors import ConfigError
from ..registry import Registry
from .layers import MLP

# name → gating(logits (T, E) float32, k, normalize) → (weights (T, k) float32, expert ids (T, k) int64)
GATINGS: Registry[Callable[[torch.Tensor, int, bool], tuple[torch.Tensor, torch.Tensor]]] = Registry("MoE gating rule")


@GATINGS.register("topk-softmax")
def topk_softmax(logits: torch.Tensor, k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral: the k largest logits, then a softmax over those k only (always sums to 1)."""
    top, ids = logits.topk(k, dim=-1)
    return top.softmax(dim=-1), ids


@GATINGS.register("softmax-topk")
def softmax_topk(logits: torch.Tensor, k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2-MoE, OLMoE: a softmax over all experts, then the k largest probabilities; ``normalize``
    (``norm_topk_prob``) rescales them to sum 1 (Qwen1.5-MoE and OLMoE ship with it off)."""
    probs, ids = logits.softmax(dim=-1).topk(k, dim=-1)
    if normalize:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs, ids


class Router(nn.Module):
    """A float linear map without bias, (T, hidden) → (T, n) float32 scores (n experts, or 1 for a gate)."""

    def __init__(self, hidden: int, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.float().T


class SparseMoE(nn.Module):
    """``Σ_j w_j · expert_{e_j}(x)`` over a token's top-k experts, plus ``σ(g·x) · shared(x)`` (qwen2_moe).

    Module names follow the Qwen2-MoE / OLMoE checkpoints (``mlp.gate``, ``mlp.experts.3.up_proj``,
    ``mlp.shared_expert.down_proj``, ``mlp.shared_expert_gate``); the Mixtral adapter renames its own.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.top_k, self.normalize = config.num_experts_per_tok, config.norm_topk_prob
        try:
            self.gating = GATINGS.get(config.moe_gating)
        except KeyError as exc:
            raise ConfigError(f"{config.architecture} MoE: {exc.args[0]}") from None
        self.gate = Router(h, config.num_experts)
        self.experts = nn.ModuleList(
            MLP(h, config.moe_intermediate_size, config.hidden_act) for _ in range(config.num_experts)
        )
        shared = config.shared_expert_intermediate_size
        self.shared_expert = MLP(h, shared, config.hidden_act) if shared else None
        self.shared_expert_gate = Router(h, 1) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) → routing weights (T, k) float32 and expert ids (T, k)."""
        return self.gating(self.gate(x), self.top_k, self.normalize)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)  # (T, k), (T, k)
        out = grouped_experts(self.experts, x, weights, ids)
        if self.shared_expert is not None:
            out = out + (torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x).float()).to(out.dtype)
        return out


def grouped_experts(experts: nn.ModuleList, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Run each expert once on all the tokens routed to it and scatter-add the weighted results.

    x (T, hidden); weights, ids (T, k) → (T, hidden). The T·k assignments are sorted by expert id; an
    expert with n assignments multiplies an (n, hidden) gather of its tokens in one call.
    """
    k = ids.shape[1]
    flat = ids.reshape(-1)  # (T·k,), assignment a belongs to token a // k
    order = torch.argsort(flat, stable=True)
    tokens = order // k
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    scale = weights.reshape(-1)[order].unsqueeze(1)  # (T·k, 1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for expert, n in zip(experts, counts):
        if n:
            rows = tokens[start : start + n]
            y = expert(x.index_select(0, rows)).float() * scale[start : start + n]
            out.index_add_(0, rows, y)
            start += n
    return out.to(x.dtype)
