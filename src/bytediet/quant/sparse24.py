"""2:4 semi-structured sparsity: in every group of 4 consecutive input weights of a row, 2 are zero.

The layout NVIDIA's sparse tensor cores read (Mishra et al. 2021, "Accelerating Sparse Deep Neural
Networks", arXiv 2104.08378): each group of four keeps its two values plus two 2-bit positions, so a
dense fp16 weight of 16 bits/weight becomes 2·16 + 2·2 = 36 bits per 4 weights (9 bits/weight), and
with int8 values 2·8 + 2·2 = 20 bits per 4 (5 bits/weight, plus the per-row scale).

Which two survive:

* without calibration, the two of largest |w| (magnitude pruning);
* with calibration statistics, the two of largest |w_ij| · ‖X_j‖₂ — **Wanda** (Sun et al. 2023,
  "A Simple and Effective Pruning Approach for Large Language Models", arXiv 2306.11695, eq. 1),
  where ‖X_j‖₂ is the L2 norm of input channel j over the calibration tokens. The calibration method
  ``wanda`` (:mod:`bytediet.calibrate.wanda`) collects those norms block by block.

Packed tensors (out = out_features, k = in_features, a multiple of 8):

* ``values``: (out, k/2) float16 (``sparse24``) or int8 (``sparse24-int8``), the kept weights in order;
* ``index``: (out, k/8) uint8, one 4-bit code per group, two groups per byte (even group in the low
  nibble): position of the first kept weight in bits 0–1, of the second in bits 2–3 (first < second);
* ``scale``: (out,) float32 per-row absmax / 127 (``sparse24-int8`` only).

This CPU has no sparse matrix unit, so :meth:`apply` multiplies the re-densified weight: the format
saves bytes here, not time (the roofline analyzer's what-if shows the GPU side).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..errors import ConfigError
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import check_weight, no_parameters
from .int8 import quantize_rows_int8

GROUP = 4
KEEP = 2


def channel_norms(stats: Any) -> Optional[torch.Tensor]:
    """(in,) ‖X_j‖₂ from calibration ``stats``: a tensor of norms, or a :class:`LinearStats` with a Gram matrix."""
    if stats is None:
        return None
    if isinstance(stats, torch.Tensor):
        return stats.float()
    gram = getattr(stats, "gram", None)
    if gram is None:
        raise ConfigError("2:4 sparsity with calibration needs per-channel input norms (capture with hessian=True)")
    return gram.diagonal().clamp(min=0).sqrt().float()


def keep_mask(weight: torch.Tensor, norms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(out, k) bool: True for the 2 weights of each group of 4 with the largest |w| (· ‖X_j‖₂ when given)."""
    score = weight.abs() if norms is None else weight.abs() * norms.to(weight)[None, :]
    out, k = weight.shape
    groups = score.reshape(out, k // GROUP, GROUP)
    top = groups.topk(KEEP, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return mask.reshape(out, k)


def pack_positions(mask: torch.Tensor) -> torch.Tensor:
    """(out, k) bool with exactly 2 True per group of 4 → (out, k/8) uint8, two 4-bit group codes per byte."""
    out, k = mask.shape
    pos = torch.arange(GROUP, dtype=torch.uint8).expand(out, k // GROUP, GROUP)
    kept = pos[mask.reshape(out, k // GROUP, GROUP)].reshape(out, k // GROUP, KEEP)  # ascending
    codes = kept[..., 0] | (kept[..., 1] << 2)  # (out, k/4), 4 bits each
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_positions(index: torch.Tensor) -> torch.Tensor:
    """(out, k/8) uint8 → (out, k/4, 2) int64 positions inside each group."""
    codes = torch.stack([index & 15, index >> 4], dim=-1).reshape(index.shape[0], -1)  # (out, k/4)
    return torch.stack([codes & 3, (codes >> 2) & 3], dim=-1).long()


def densify(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (out, k/2) float, index (out, k/8) uint8 → dense (out, k) float32 with zeros elsewhere."""
    out, groups = index.shape[0], index.shape[1] * 2
    dense = torch.zeros(out, groups, GROUP, dtype=torch.float32)
    dense.scatter_(-1, unpack_positions(index), values.float().reshape(out, groups, KEEP))
    return dense.reshape(out, groups * GROUP)


@WEIGHT_FORMATS.register("sparse24")
class Sparse24(WeightFormat):
    """2:4 sparse weight, the kept values in float16 (9 bits/weight)."""

    name = "sparse24"
    value_bits = 16
    dropped_fraction = 0.5  # tells callers (and the test matrix) that half the weights become exact zeros

    from_spec = classmethod(no_parameters)

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return (KEEP * self.value_bits + KEEP * 2) / GROUP

    def _kept(self, weight: torch.Tensor, stats) -> tuple[torch.Tensor, torch.Tensor]:
        w = check_weight(weight, self.name, multiple_of=2 * GROUP)
        mask = keep_mask(w, channel_norms(stats))
        return w[mask].reshape(w.shape[0], -1), pack_positions(mask)

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        values, index = self._kept(weight, stats)
        return {"values": values.half(), "index": index}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return densify(packed["values"], packed["index"])


@WEIGHT_FORMATS.register("sparse24-int8")
class Sparse24Int8(Sparse24):
    """2:4 sparse weight, the kept values int8 with one float32 scale per row (5 bits/weight + scale)."""

    name = "sparse24-int8"
    value_bits = 8

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return super().bits_per_weight(out_features, in_features) + 32.0 / in_features

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        values, index = self._kept(weight, stats)
        q, scale = quantize_rows_int8(values)
        return {"values": q, "index": index, "scale": scale}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return densify(packed["values"].float() * packed["scale"][:, None], packed["index"])
