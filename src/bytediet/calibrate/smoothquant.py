"""SmoothQuant: migrate activation outliers into the weights before W8A8 (Xiao et al. 2022, arXiv 2211.10438).

Per-token int8 activations lose the small channels of a token whose other channels are outliers.
SmoothQuant divides input channel j by

    s_j = max|X_j|^α / max|W_j|^(1−α)            (paper eq. 4; α = migration strength, default 0.5)

(max|X_j| over calibration tokens, max|W_j| over column j of every linear reading X) and multiplies
the weights' column j by s_j; :func:`~.folding.fold_scales` puts 1/s into the preceding RMSNorm or
linear, so the float model is unchanged, and the layers are then quantized to ``int8-w8a8``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from .base import CALIBRATION_METHODS, BlockRunner, Progress, block_linears, capture, no_progress
from .folding import ScaleGroup, fold_scales, group_weight, scale_groups

DEFAULT_FORMAT = "int8-w8a8"


@dataclass(frozen=True)
class SmoothQuantConfig:
    """``alpha``: migration strength in [0, 1]; ``groups``: which producer→consumer groups to smooth."""

    alpha: float = 0.5
    groups: tuple[str, ...] = ("qkv", "gate_up", "o", "down")

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"SmoothQuant migration strength must be in [0, 1], got {self.alpha}")

    def to_dict(self) -> dict:
        return asdict(self)


def smooth_scales(x_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float, eps: float = 1e-5) -> torch.Tensor:
    """s = max|X|^α / max|W|^(1−α) per channel (C,); channels that never fire or have zero weights get s = 1."""
    x, w = x_absmax.double().clamp(min=eps), w_absmax.double().clamp(min=eps)
    s = x.pow(alpha) / w.pow(1.0 - alpha)
    dead = (x_absmax <= eps) | (w_absmax <= eps)
    return torch.where(dead, torch.ones_like(s), s)


def smooth_group(group: ScaleGroup, x_absmax_in: torch.Tensor, alpha: float) -> torch.Tensor:
    """Compute and fold the scales of one group from its inputs' per-channel max |x| (in,); returns s."""
    w_absmax = group.reduce(group_weight(group).abs().amax(0), "max")
    s = smooth_scales(group.reduce(x_absmax_in, "max"), w_absmax, alpha)
    fold_scales(group, s)
    return s


def smoothquant_model(
    model,
    windows: torch.Tensor,
    config: SmoothQuantConfig = SmoothQuantConfig(),
    progress: Progress = no_progress,
    runner: Optional[BlockRunner] = None,
) -> dict:
    """Fold SmoothQuant scales into every block of ``model``; windows: (N, L) calibration ids.

    Afterwards quantize with ``int8-w8a8`` (``prepacked=runner.packed``: a packed model's blocks are dequantized
    one at a time and quantized to the runner's config once smoothed). Returns the settings and per-group scale
    ranges.
    """
    runner = runner or BlockRunner(model, windows)
    hidden = runner.embed()
    record = {}
    for i in progress(range(len(runner.layers)), "SmoothQuant: smoothing blocks"):
        runner.begin(i)
        block, prefix = runner.layers[i], f"model.layers.{i}"
        with capture(block_linears(block, prefix)) as stats:
            hidden = runner.run_block(i, hidden)  # smoothing preserves the float function: reuse these
        for group in scale_groups(block, prefix, config.groups):
            s = smooth_group(group, stats[group.linears[0][0]].abs_max, config.alpha)
            record[group.name] = {"scale_min": float(s.min()), "scale_max": float(s.max())}
        runner.end(i)
    return {"method": "smoothquant", **config.to_dict(), "results": record}


@CALIBRATION_METHODS.register("smoothquant")
def run_smoothquant(model, config, windows: torch.Tensor, progress: Progress = no_progress, **settings):
    """The registered method: fold scales; the config's format should be ``int8-w8a8``. ``settings``: α, groups."""
    runner = BlockRunner(model, windows, config=config)
    record = smoothquant_model(model, windows, SmoothQuantConfig(**settings), progress, runner)
    return runner.packed or None, record


run_smoothquant.candidate_formats = ("int8-w8a8",)  # the families `bytediet optimize` calibrates with it
