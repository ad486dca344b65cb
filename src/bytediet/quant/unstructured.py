"""Unstructured 50 % sparsity: each row keeps any half of its weights (the comparison row for 2:4).

Without calibration the kept half is the half of largest |w| in each row (magnitude pruning); with
calibration statistics it is the half of largest |w_ij| · ‖X_j‖₂ — Wanda's unstructured rule, which
compares weights within an output row (Sun et al. 2023, arXiv 2306.11695, §3). SparseGPT
(:mod:`bytediet.calibrate.sparsegpt`) keeps half of each row in every block of columns it visits
(its "adaptive mask selection", Frantar & Alistarh 2023, arXiv 2301.00774, §3.2), so a row still keeps
exactly half.

Packed tensors (out = out_features, k = in_features, even):

* ``values``: (out, k/2) float16, the kept weights in column order;
* ``bitmap``: (out, ⌈k/8⌉) uint8, bit j % 8 of byte j // 8 set when column j is kept.

16/2 + 1 = **9 bits/weight**, the same as 2:4 with fp16 values: the two layouts cost the same bytes, so
the comparison isolates what the 2:4 constraint costs in accuracy. No CPU or GPU kernel reads this
layout; :meth:`apply` multiplies the re-densified weight.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .base import WEIGHT_FORMATS, Packed
from .common import no_parameters, shard_columns_in_units
from .pruning import PrunedFormat, kept_values

_BITS = 2 ** torch.arange(8, dtype=torch.int32)


def pack_bitmap(mask: torch.Tensor) -> torch.Tensor:
    """(out, k) bool → (out, ⌈k/8⌉) uint8, column j in bit j % 8 of byte j // 8."""
    out, k = mask.shape
    padded = torch.zeros(out, -(-k // 8) * 8, dtype=torch.int32, device=mask.device)
    padded[:, :k] = mask.to(torch.int32)
    return (padded.reshape(out, -1, 8) * _BITS.to(mask.device)).sum(-1).to(torch.uint8)


def unpack_bitmap(bitmap: torch.Tensor, k: int) -> torch.Tensor:
    """(out, ⌈k/8⌉) uint8 → (out, k) bool."""
    bits = (bitmap.to(torch.int32)[..., None] & _BITS.to(bitmap.device)) != 0
    return bits.reshape(bitmap.shape[0], -1)[:, :k]


@WEIGHT_FORMATS.register("sparse50")
class Sparse50(PrunedFormat):
    """Unstructured 50 % sparse weight (half of every row kept), the kept values in float16 (9 bits/weight)."""

    name = "sparse50"
    span = None  # the whole row (or SparseGPT's column block) is one selection

    from_spec = classmethod(no_parameters)

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 16 * 0.5 + 1

    def pack(self, weight: torch.Tensor, mask: torch.Tensor) -> Packed:
        return {"values": kept_values(weight.float(), mask).half(), "bitmap": pack_bitmap(mask)}

    def mask(self, packed: Packed) -> torch.Tensor:
        return unpack_bitmap(packed["bitmap"], 2 * packed["values"].shape[1])

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows only: a row keeps half of its weights anywhere along it, so a column slice holds a different count
        per row and cannot be stored as this layout."""
        if dim == 1:
            raise ConfigError(
                f"{self.spec()}: unstructured sparsity keeps a different number of weights per row in a column "
                "slice, so a row-parallel layer (o_proj, down_proj) cannot be split; use sparse24 (2:4), "
                "or --tensor-parallel-size 1"
            )
        return shard_columns_in_units(packed, 0, start, stop, self.spec())

    def dequantize(self, packed: Packed) -> torch.Tensor:
        mask = self.mask(packed)
        dense = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
        dense[mask] = packed["values"].float().reshape(-1)
        return dense
