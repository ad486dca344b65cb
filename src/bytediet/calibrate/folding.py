"""Per-channel scale folding shared by AWQ and SmoothQuant: x → x / s, W → W · diag(s).

A :class:`ScaleGroup` is a set of linear layers that read the same input, together with the module
that produces that input: an RMSNorm (q/k/v after the input norm, gate/up after the MLP norm) or a
linear layer (down after up: the MLP's gate ⊙ up product is linear in up's output rows; o after v:
attention output is a convex mix of V rows). Dividing the producer's output channel j by s_j and
multiplying column j of every consumer by s_j leaves the float model's function unchanged
(Xiao et al. 2022, arXiv 2211.10438, eq. 3; Lin et al. 2023, arXiv 2306.00978, §3.2).

Grouped-query attention: o's input channel (head h, dim d) comes from V head h // (H / KV), so the
o-group's scales are tied across the query heads sharing a KV head: one scale per V output channel,
repeated ``repeat`` times along o's input.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import ConfigError

FLOAT_FORMATS = ("fp32", "bf16", "fp16")


@dataclass
class ScaleGroup:
    """Linears sharing one input; ``prev`` (RMSNorm or Linear) produces it. Scales live on prev's channels."""

    name: str
    prev_name: str
    prev: nn.Module
    linears: list[tuple[str, nn.Module]]
    repeat: int = 1  # GQA: consumer input channels per producer channel (in groups of head_dim)
    head_dim: int = 1

    @property
    def channels(self) -> int:
        """Number of producer channels (= independent scales)."""
        return self.linears[0][1].in_features // self.repeat

    def expand(self, s: torch.Tensor) -> torch.Tensor:
        """(channels,) producer scales → (in_features,) consumer input scales."""
        if self.repeat == 1:
            return s
        kv = s.view(-1, 1, self.head_dim)  # (KV, 1, D) → (KV, repeat, D) → (H·D,)
        return kv.expand(-1, self.repeat, -1).reshape(-1)

    def reduce(self, v: torch.Tensor, how: str = "mean") -> torch.Tensor:
        """(in_features,) per-input-channel statistic → (channels,): "mean" or "max" over tied channels."""
        if self.repeat == 1:
            return v
        t = v.view(-1, self.repeat, self.head_dim)  # (KV, repeat, D)
        return (t.mean(1) if how == "mean" else t.amax(1)).reshape(-1)


def float_weight(layer: nn.Module, what: str) -> torch.Tensor:
    """The layer's float weight (out, in); folding needs unquantized weights."""
    if layer.format is None or layer.format.spec() not in FLOAT_FORMATS:
        raise ConfigError(
            f"{what}: calibration needs float weights, this layer is {layer.format}; load the model "
            f"without --weights / --keep-packed"
        )
    return layer.dequantized_weight()


def _set_float(layer: nn.Module, w: torch.Tensor) -> None:
    layer.set_weight(w, layer.format)  # same float format: a plain copy


def scale_groups(
    block: nn.Module, prefix: str, which: tuple[str, ...] = ("o", "qkv", "down", "gate_up")
) -> list[ScaleGroup]:
    """The foldable groups of one decoder block, in ``which`` order (o before qkv and down before gate_up:
    a group whose scales touch another group's weights is searched first)."""
    attn, mlp = block.self_attn, block.mlp
    if not hasattr(mlp, "up_proj") and {"down", "gate_up"} & set(which):
        raise ConfigError(
            f"{prefix}: scale folding (AWQ, SmoothQuant) covers a dense MLP and this layer is a mixture "
            f"of experts; quantize it without --calibrate (round to nearest)"
        )
    mlp_norm, mlp_norm_name = (
        (block.pre_feedforward_layernorm, "pre_feedforward_layernorm")
        if block.sandwich
        else (block.post_attention_layernorm, "post_attention_layernorm")
    )
    a, m = f"{prefix}.self_attn", f"{prefix}.mlp"
    groups = {
        "o": ScaleGroup(
            f"{prefix}.o",
            f"{a}.v_proj",
            attn.v_proj,
            [(f"{a}.o_proj", attn.o_proj)],
            attn.num_heads // attn.num_kv_heads,
            attn.head_dim,
        ),
        "qkv": ScaleGroup(
            f"{prefix}.qkv",
            f"{prefix}.input_layernorm",
            block.input_layernorm,
            [(f"{a}.q_proj", attn.q_proj), (f"{a}.k_proj", attn.k_proj), (f"{a}.v_proj", attn.v_proj)],
        ),
    }
    if hasattr(mlp, "up_proj"):  # a dense MLP (a mixture of experts has none to fold into)
        groups["down"] = ScaleGroup(f"{prefix}.down", f"{m}.up_proj", mlp.up_proj, [(f"{m}.down_proj", mlp.down_proj)])
        groups["gate_up"] = ScaleGroup(
            f"{prefix}.gate_up",
            f"{prefix}.{mlp_norm_name}",
            mlp_norm,
            [(f"{m}.gate_proj", mlp.gate_proj), (f"{m}.up_proj", mlp.up_proj)],
        )
    unknown = set(which) - set(groups)
    if unknown:
        raise ConfigError(f"unknown scale groups {sorted(unknown)}; choose from {', '.join(groups)}")
    return [groups[w] for w in which]


@torch.no_grad()
def fold_scales(group: ScaleGroup, s: torch.Tensor) -> None:
    """Divide the producer's output channels by ``s`` (channels,) and multiply the consumers' columns by it."""
    s = s.double()
    if not torch.isfinite(s).all() or (s <= 0).any():
        raise ValueError(f"{group.name}: scales must be finite and positive")
    prev = group.prev
    if hasattr(prev, "format"):  # a Linear: scale its output rows (and bias)
        w = float_weight(prev, group.prev_name).double()
        _set_float(prev, (w / s[:, None]).float())
        if prev.bias is not None:
            prev.bias.data = (prev.bias.double() / s).to(prev.bias.dtype)
    else:  # RMSNorm: y = x̂ · weight
        prev.weight.data = (prev.weight.double() / s).to(prev.weight.dtype)
    s_in = group.expand(s)
    for name, layer in group.linears:
        w = float_weight(layer, name).double()
        _set_float(layer, (w * s_in[None, :]).float())


def group_weight(group: ScaleGroup) -> torch.Tensor:
    """(Σ out_i, in) the consumers' float weights stacked."""
    return torch.cat([float_weight(layer, name) for name, layer in group.linears])
