"""What every pruned weight format shares: a keep-mask chosen from a score, packing under a given mask.

A pruned format stores only the weights its mask keeps. Three kinds of caller choose the mask:

* the format itself, rounding to nearest: score |w| (magnitude pruning), or |w_ij| · ‖X_j‖₂ when
  calibration statistics are given — **Wanda** (Sun et al. 2023, arXiv 2306.11695, eq. 1);
* **SparseGPT** (:mod:`bytediet.calibrate.sparsegpt`), which selects the mask span by span while it
  updates the surviving weights, and then calls :meth:`PrunedFormat.pack` with its mask;
* recovery fine-tuning (:mod:`bytediet.calibrate.recover`), which reads the mask back with
  :meth:`PrunedFormat.mask`, trains the kept weights and packs them again under the same mask.

``span``: the columns inside which a selection is made — 4 for 2:4 (each group of 4 keeps 2), ``None``
for a per-row choice (each row keeps half of the columns it is given).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ConfigError
from .base import Packed, WeightFormat
from .common import check_weight


def channel_norms(stats: Any) -> Optional[torch.Tensor]:
    """(in,) ‖X_j‖₂ from calibration ``stats``: a tensor of norms, or a ``LinearStats`` with a Gram matrix."""
    if stats is None:
        return None
    if isinstance(stats, torch.Tensor):
        return stats.float()
    gram = getattr(stats, "gram", None)
    if gram is None:
        raise ConfigError("pruning with calibration needs per-channel input norms (capture with hessian=True)")
    return gram.diagonal().clamp(min=0).sqrt().float()


def top_half(score: torch.Tensor, span: int) -> torch.Tensor:
    """(out, k) score → bool mask keeping the larger half of every ``span`` consecutive columns of a row."""
    out, k = score.shape
    groups = score.reshape(out, k // span, span)
    top = groups.topk(span // 2, dim=-1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True).reshape(out, k)


class PrunedFormat(WeightFormat):
    """A weight format that keeps half of the weights (under a mask) and stores only those."""

    span: Optional[int] = None  # selection granularity along a row; None: the whole row (or block) given
    dropped_fraction = 0.5  # tells callers (and the test matrix) that half the weights become exact zeros

    def check(self, weight: torch.Tensor) -> torch.Tensor:
        """Validate a (out, in) weight for this format → contiguous float32 (raise with what to do)."""
        need = self.span or 2
        if weight.dim() == 2 and weight.shape[1] % need:
            raise ConfigError(
                f"{self.spec()} needs in_features divisible by {need}, got {weight.shape[1]}; "
                "leave this layer dense (--skip LAYER) or override it with another format"
            )
        return check_weight(weight, self.spec())

    def select(self, score: torch.Tensor) -> torch.Tensor:
        """(out, k) saliency (larger = more important) → (out, k) bool keep-mask, half of each span kept."""
        return top_half(score, self.span or score.shape[1])

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        w = self.check(weight)
        norms = channel_norms(stats)
        score = w.abs() if norms is None else w.abs() * norms.to(w)[None, :]
        return self.pack(w, self.select(score))

    def pack(self, weight: torch.Tensor, mask: torch.Tensor) -> Packed:
        """weight (out, k) float, mask (out, k) bool with half of each span True → packed tensors."""
        raise NotImplementedError

    def mask(self, packed: Packed) -> torch.Tensor:
        """Packed tensors → (out, k) bool, True where a weight is stored (even if its value is 0)."""
        raise NotImplementedError


def kept_values(weight: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(out, k) weight, (out, k) mask with the same count per row → (out, count) kept weights in column order."""
    counts = mask.sum(1)
    if counts.numel() and not bool((counts == counts[0]).all()):
        raise ConfigError("a pruning mask must keep the same number of weights in every row")
    return weight[mask].reshape(weight.shape[0], -1)
