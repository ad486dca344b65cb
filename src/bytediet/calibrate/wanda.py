"""Wanda: prune by |weight| × input-activation norm, calibrated block by block (Sun et al. 2023, arXiv 2306.11695).

For every pruned layer (2:4, :mod:`bytediet.quant.sparse24`; 50 %, :mod:`bytediet.quant.unstructured`) inside the
decoder blocks, the calibration windows give ‖X_j‖₂ per input channel, and each group of four keeps the two weights
of largest |w_ij| · ‖X_j‖₂ (the paper's metric, compared per output row — here per group of 4 along the row, the
2:4 constraint). As in the paper's code, blocks are pruned in order: block i's statistics come from the
outputs of the already-pruned blocks 0..i−1. No weight is updated (unlike SparseGPT), so the method is
one forward pass per block plus a top-2 per group.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..models.quantize import QuantizeConfig, build_format
from ..quant import Packed
from ..quant.pruning import PrunedFormat
from .base import CALIBRATION_METHODS, Progress, no_progress, pack_blocks_in_order, require_windows


def wanda_model(
    model, config: QuantizeConfig, windows: torch.Tensor, progress: Progress = no_progress
) -> tuple[dict[str, Packed], dict]:
    """Wanda-pruned packed weights for every 2:4 layer in the decoder blocks → ({layer: packed}, record).

    Layers of other formats inside the blocks are rounded to nearest so that later blocks see the
    model as it will run. The model's weights are restored afterwards: install the result with
    ``quantize(model, config, prepacked=result)``.
    """
    require_windows(windows, "wanda")
    specs = {config.spec_for(name) for name, _ in model.linear_layers()} - {None}
    if not any(isinstance(build_format(s), PrunedFormat) for s in specs):
        raise ConfigError(
            "wanda prunes sparse layers: use --format sparse24, sparse24-int8 or sparse50 "
            f"(this config has {', '.join(sorted(specs))})"
        )
    result = pack_blocks_in_order(
        model,
        config,
        windows,
        progress,
        "Wanda: pruning blocks",
        lambda fmt: isinstance(fmt, PrunedFormat),
        lambda w, fmt, stats: fmt.quantize(w, stats),
    )
    return result, {"method": "wanda"}


@CALIBRATION_METHODS.register("wanda")
def run_wanda(model, config: QuantizeConfig, windows: torch.Tensor, progress: Progress = no_progress, **settings):
    """The registered method: Wanda-pruned 2:4 layers for ``quantize(..., prepacked=)``; takes no settings."""
    if settings:
        raise ConfigError(f"wanda takes no settings, got {sorted(settings)}")
    return wanda_model(model, config, windows, progress)


run_wanda.candidate_formats = ("sparse24", "sparse24-int8")  # the families `bytediet optimize` calibrates with it
