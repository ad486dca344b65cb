"""AWQ: activation-aware weight scaling before round-to-nearest (Lin et al. 2023, arXiv 2306.00978).

Weight channels that meet large activations matter most. For each :class:`~.folding.ScaleGroup`
(linears sharing one input x), AWQ scales input channel j by s_j = mean|x_j|^α (normalised so that
max(s)·min(s) = 1), quantizes W·diag(s) with the target format's plain rounding, and picks the α of a
grid over [0, 1] that minimises the group's output error on calibration inputs (paper eq. 4–5):

    err(α) = mean ‖ x Wᵀ − x (Q(W·diag(s)) · diag(s)⁻¹)ᵀ ‖²      (x: sampled calibration rows)

α = 0 gives s = 1, i.e. plain round-to-nearest, and is in the grid, so the search is never worse than
RTN on this objective. The chosen 1/s is then folded into the preceding RMSNorm / linear
(:func:`~.folding.fold_scales`), leaving the float model unchanged; the final weights are produced by
the ordinary ``quantize(model, config)``.

Blocks are processed one at a time on float activations (:class:`~.base.BlockRunner`);
because folding preserves the float function, block i + 1's inputs are block i's float outputs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from ..models.quantize import QuantizeConfig, build_format
from ..quant import WeightFormat
from .base import CALIBRATION_METHODS, BlockRunner, Progress, block_linears, capture, no_progress
from .folding import float_weight, fold_scales, scale_groups


@dataclass(frozen=True)
class AWQConfig:
    """Search settings: ``n_grid`` + 1 exponents α = 0, 1/n_grid, …, 1; ``search_tokens`` input rows per group."""

    n_grid: int = 20
    search_tokens: int = 2048
    groups: tuple[str, ...] = ("o", "qkv", "down", "gate_up")

    def __post_init__(self) -> None:
        if self.n_grid < 1 or self.search_tokens < 1:
            raise ConfigError(f"AWQ needs n_grid >= 1 and search_tokens >= 1, got {self.n_grid}, {self.search_tokens}")

    def to_dict(self) -> dict:
        return asdict(self)


def awq_scales(x_mean_abs: torch.Tensor, alpha: float) -> torch.Tensor:
    """s = mean|x|^α, normalised by √(max·min) (the paper's reference code does the same). (C,) → (C,)."""
    s = x_mean_abs.float().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def fake_quantize(w: torch.Tensor, fmt: Optional[WeightFormat]) -> torch.Tensor:
    """Q(w) as float (identity for a layer that stays in float)."""
    return w if fmt is None else fmt.dequantize(fmt.quantize(w))


@dataclass
class SearchResult:
    alpha: float
    scales: torch.Tensor  # (channels,)
    errors: list[tuple[float, float]]  # (α, err) for every grid point

    @property
    def rtn_error(self) -> float:
        return self.errors[0][1]

    @property
    def best_error(self) -> float:
        return min(e for _, e in self.errors)


@torch.no_grad()
def search_scale(
    weights: list[tuple[torch.Tensor, Optional[WeightFormat]]],
    x: torch.Tensor,
    x_mean_abs: torch.Tensor,
    n_grid: int = 20,
    expand=lambda s: s,
) -> SearchResult:
    """Grid-search α for one group.

    weights: the consumers' float weights (out_i, in) with their formats (None: not quantized);
    x: (T, in) calibration inputs; x_mean_abs: (channels,) mean |x| per producer channel;
    expand: producer scales (channels,) → input scales (in,) (GQA-tied groups repeat them).
    The first α reaching the minimum wins, so ties keep the smaller exponent (α = 0 is RTN).
    """
    x = x.float()
    w_all = torch.cat([w.float() for w, _ in weights])
    ref = x @ w_all.t()
    errors, best = [], None
    for i in range(n_grid + 1):
        alpha = i / n_grid
        s = awq_scales(x_mean_abs, alpha)
        s_in = expand(s)
        wq = torch.cat([fake_quantize(w.float() * s_in, fmt) / s_in for w, fmt in weights])
        err = (x @ wq.t() - ref).pow(2).mean().item()
        errors.append((alpha, err))
        if best is None or err < best[1]:
            best = (alpha, err, s)
    return SearchResult(best[0], best[2], errors)


def _format_for(config: QuantizeConfig, name: str) -> Optional[WeightFormat]:
    spec = config.spec_for(name)
    if spec is None:
        return None
    fmt = build_format(spec)
    return None if fmt.spec() in ("fp32", "bf16", "fp16") else fmt


def awq_block(
    block, prefix: str, hidden: torch.Tensor, runner: BlockRunner, index: int, config: QuantizeConfig, awq: AWQConfig
) -> tuple[torch.Tensor, dict]:
    """Search and fold the scales of one block; returns (block outputs, {group: (α, rtn_err, best_err)})."""
    rows = max(1, math.ceil(awq.search_tokens / hidden.shape[0]))
    with capture(block_linears(block, prefix), rows_per_call=rows, seed=index) as stats:
        out = runner.run_block(index, hidden)  # float outputs; folding below does not change them
    record = {}
    for group in scale_groups(block, prefix, awq.groups):
        fmts = [_format_for(config, name) for name, _ in group.linears]
        if all(f is None for f in fmts):
            continue
        first = stats[group.linears[0][0]]
        weights = [(float_weight(layer, name), f) for (name, layer), f in zip(group.linears, fmts)]
        result = search_scale(weights, first.sample(), group.reduce(first.mean_abs), awq.n_grid, group.expand)
        if result.alpha > 0:
            fold_scales(group, result.scales)
        record[group.name] = {"alpha": result.alpha, "rtn_error": result.rtn_error, "error": result.best_error}
    return out, record


def awq_model(
    model,
    config: QuantizeConfig,
    windows: torch.Tensor,
    awq: AWQConfig = AWQConfig(),
    progress: Progress = no_progress,
    runner: Optional[BlockRunner] = None,
) -> dict:
    """Fold AWQ scales into ``model`` (float weights) for ``config``'s formats; returns per-group results.

    windows: (N, L) calibration token ids. Afterwards call ``quantize(model, config, prepacked=runner.packed)``:
    a packed model's blocks are dequantized one at a time and quantized once folded (:class:`BlockRunner`).
    """
    runner = runner or BlockRunner(model, windows, config=config)
    hidden = runner.embed()
    groups = {}
    for i in progress(range(len(runner.layers)), "AWQ: searching scales per block"):
        runner.begin(i)
        hidden, record = awq_block(runner.layers[i], f"model.layers.{i}", hidden, runner, i, config, awq)
        runner.end(i)
        groups.update(record)
    return {"method": "awq", **awq.to_dict(), "results": groups}


@CALIBRATION_METHODS.register("awq")
def run_awq(model, config: QuantizeConfig, windows: torch.Tensor, progress: Progress = no_progress, **settings):
    """The registered method: fold scales, leave rounding to ``quantize``. ``settings``: :class:`AWQConfig` fields."""
    runner = BlockRunner(model, windows, config=config)
    record = awq_model(model, config, windows, AWQConfig(**settings), progress, runner)
    return runner.packed or None, record


run_awq.candidate_formats = ("int4",)  # the families `bytediet optimize` calibrates with it
