"""2:4 semi-structured sparsity: in every group of 4 consecutive input weights of a row, 2 are zero.

The compressed layout NVIDIA's sparse tensor cores read (Mishra et al. 2021, "Accelerating Sparse Deep
Neural Networks", arXiv 2104.08378): each group of four keeps its two values plus two 2-bit positions,
so a dense fp16 weight of 16 bits/weight becomes 2·16 + 2·2 = 36 bits per 4 weights (**9 bits/weight**),
and with int8 values 2·8 + 2·2 = 20 bits per 4 (**5 bits/weight**, plus the per-row scale).

Which two survive (:class:`~bytediet.quant.pruning.PrunedFormat`): the two of largest |w| (magnitude),
of largest |w_ij| · ‖X_j‖₂ with calibration statistics (Wanda, :mod:`bytediet.calibrate.wanda`), or the
mask SparseGPT chooses while it updates the kept weights (:mod:`bytediet.calibrate.sparsegpt`).

Packed tensors (out = out_features, k = in_features, a multiple of 4):

* ``values``: (out, k/2) float16 (``sparse24``) or int8 (``sparse24-int8``), the kept weights in order;
* ``index``: (out, ⌈k/8⌉) uint8, one 4-bit code per group, two groups per byte (even group in the low
  nibble; an odd last group leaves the high nibble 0): position of the first kept weight in bits 0–1,
  of the second in bits 2–3 (first < second) — :func:`bytediet.kernels.reference.sparse24_positions`;
* ``scale``: (out,) float32 per-row absmax / 127 (``sparse24-int8`` only).

:func:`bytediet.kernels.reference.sparse24_matmul` multiplies straight from ``values`` + ``index``.
:meth:`apply` multiplies the re-densified weight with BLAS (the reference path); where the native kernels
exist both formats are repacked once into block layouts of the same bytes and read in place.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import native_layouts
from ..kernels.reference import sparse24_positions
from .base import WEIGHT_FORMATS, Packed
from .common import NativeActivations, activations_only, no_parameters, shard_columns_in_units
from .int8 import quantize_rows_int8
from .pruning import PrunedFormat, kept_values, top_half

GROUP = 4
KEEP = 2


def keep_mask(weight: torch.Tensor, norms: Optional[torch.Tensor] = None) -> torch.Tensor:
    """(out, k) bool: True for the 2 weights of each group of 4 with the largest |w| (· ‖X_j‖₂ when given)."""
    score = weight.abs() if norms is None else weight.abs() * norms.to(weight)[None, :]
    return top_half(score, GROUP)


def pack_positions(mask: torch.Tensor) -> torch.Tensor:
    """(out, k) bool with exactly 2 True per group of 4 → (out, ⌈k/8⌉) uint8, two 4-bit group codes per byte."""
    out, k = mask.shape
    pos = torch.arange(GROUP, dtype=torch.uint8, device=mask.device).expand(out, k // GROUP, GROUP)
    kept = pos[mask.reshape(out, k // GROUP, GROUP)].reshape(out, k // GROUP, KEEP)  # ascending
    codes = kept[..., 0] | (kept[..., 1] << 2)  # (out, k/4), 4 bits each
    if codes.shape[1] % 2:  # an odd number of groups: the last byte's high nibble is padding
        codes = torch.cat([codes, torch.zeros(out, 1, dtype=torch.uint8, device=codes.device)], dim=1)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_positions(index: torch.Tensor, groups: Optional[int] = None) -> torch.Tensor:
    """(out, ⌈k/8⌉) uint8 → (out, k/4, 2) int64 positions inside each group (``groups`` = k/4, default 2·bytes)."""
    return sparse24_positions(index, 2 * index.shape[1] if groups is None else groups)


def densify(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values (out, k/2) float, index (out, ⌈k/8⌉) uint8 → dense (out, k) float32 with zeros elsewhere."""
    out, groups = values.shape[0], values.shape[1] // KEEP
    dense = torch.zeros(out, groups, GROUP, dtype=torch.float32, device=values.device)
    dense.scatter_(-1, unpack_positions(index, groups), values.float().reshape(out, groups, KEEP))
    return dense.reshape(out, groups * GROUP)


@WEIGHT_FORMATS.register("sparse24")
class Sparse24(PrunedFormat):
    """2:4 sparse weight, the kept values in float16 (9 bits/weight).

    Where the native kernels exist, a layer multiplies through :meth:`native_layout` (kernels/native_layouts.py
    ``SPARSE24_F16``: the same 9 bits per weight, the kept values placed in registers); fp16 values are not
    integers, so the activations stay float (``activations = "f32"``).
    """

    name = "sparse24"
    value_bits = 16
    span = GROUP
    activations = "f32"  # how the native kernel multiplies (sparse24-int8 takes the activation option)

    from_spec = classmethod(no_parameters)

    def native_layout(self, packed: Packed):
        if packed["values"].shape[1] % 16:  # whole blocks of 32 weights per row only
            return None
        return native_layouts.SPARSE24_F16, native_layouts.pack_sparse24_f16(packed["values"], packed["index"])

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return (KEEP * self.value_bits + KEEP * 2) / GROUP

    def pack(self, weight: torch.Tensor, mask: torch.Tensor) -> Packed:
        return {"values": kept_values(weight.float(), mask).half(), "index": pack_positions(mask)}

    def mask(self, packed: Packed) -> torch.Tensor:
        return densify(torch.ones_like(packed["values"], dtype=torch.float32), packed["index"]) != 0

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return densify(packed["values"], packed["index"])

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows keep their groups; columns are cut on whole groups of 4 (two kept values each), and the slice's
        group codes are packed again two per byte (a cut between the two groups of a byte moves every code)."""
        if dim == 0:
            return shard_columns_in_units(packed, 0, start, stop, self.spec())
        rest = {k: v for k, v in packed.items() if k != "index"}
        out = shard_columns_in_units(rest, 1, start, stop, self.spec(), block=GROUP, columns={"values": KEEP})
        out["index"] = pack_positions(self.mask(packed)[:, start:stop])
        return out


@WEIGHT_FORMATS.register("sparse24-int8")
class Sparse24Int8(NativeActivations, Sparse24):
    """2:4 sparse weight, the kept values int8 with one float32 scale per row (5 bits/weight + scale).

    Where the native kernels exist, a layer multiplies through :meth:`native_layout`: the same 5 bits per weight
    (kernels/native_layouts.py ``SPARSE24_INT8``), the kept values expanded into their positions in registers.
    """

    name = "sparse24-int8"
    value_bits = 8

    # the only option is the native kernel's activation precision: sparse24-int8-a8, sparse24-int8-af32
    from_spec = classmethod(activations_only)

    def spec(self) -> str:
        return self.name + self.activation_suffix()

    def native_layout(self, packed: Packed):
        if packed["values"].shape[1] % 16:  # whole blocks of 32 weights per row only
            return None
        return native_layouts.SPARSE24_INT8, native_layouts.pack_sparse24_int8(
            packed["values"], packed["index"], packed["scale"]
        )

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return super().bits_per_weight(out_features, in_features) + 32.0 / in_features

    def pack(self, weight: torch.Tensor, mask: torch.Tensor) -> Packed:
        q, scale = quantize_rows_int8(kept_values(weight.float(), mask))
        return {"values": q, "index": pack_positions(mask), "scale": scale}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        return densify(packed["values"].float() * packed["scale"][:, None], packed["index"])
