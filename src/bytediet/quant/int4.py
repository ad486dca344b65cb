"""INT4 group-wise weights (W4A16), packed two per byte: ``int4[-g32|-g64|-g128][-sym|-asym]``.

Each row is split into groups of ``group_size`` input channels with one float16 scale per group
(the layout of GPTQ / AWQ W4A16 checkpoints, Frantar et al. 2022 arXiv 2210.17323, Lin et al. 2023
arXiv 2306.00978):

* asymmetric (default): ``w ≈ q · scale + offset``, q ∈ 0..15, scale = (max − min) / 15, offset = min
  (both float16, the same grid as GGUF Q4_1 at group 32);
* symmetric (``-sym``): ``w ≈ q · scale``, q ∈ −7..7, scale = absmax / 7, stored as q + 8.

Codes are packed with :func:`bytediet.quant.fp4.pack_nibbles` (element 2i in the low nibble).
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kernels import native_layouts
from .base import WEIGHT_FORMATS, Packed, WeightFormat
from .common import ACTIVATION_SUFFIXES, NativeActivations, check_weight, shard_columns_in_units, split_spec
from .fp4 import pack_nibbles, unpack_nibbles

GROUP_SIZES = (32, 64, 128)
_SPEC_HELP = "int4[-g32|-g64|-g128][-sym|-asym][-a8|-af32], e.g. int4-g128-sym"


@WEIGHT_FORMATS.register("int4")
class Int4(NativeActivations, WeightFormat):
    """Group-wise 4-bit integer weights; packed = qweight (out, in/2) uint8, scale [, offset] (out, in/g) float16.

    ``apply`` multiplies in float; a model's layers multiply through :meth:`native_layout` where the native
    kernels exist, with the activation precision of the spec's ``-a8``/``-af32`` (default: q16, see
    :class:`~bytediet.quant.common.NativeActivations`).
    """

    name = "int4"
    rows_independent = True

    def __init__(self, group_size: int = 128, symmetric: bool = False) -> None:
        if group_size not in GROUP_SIZES:
            raise ConfigError(f"int4: group size {group_size} is not supported; choose one of {GROUP_SIZES}")
        self.group_size, self.symmetric = group_size, symmetric
        self.name = self.spec()

    @classmethod
    def from_spec(cls, suffix: str) -> "Int4":
        group, symmetric, activations = 128, False, "q16"
        for part in split_spec(suffix, "int4", _SPEC_HELP):
            if part in ACTIVATION_SUFFIXES:
                activations = ACTIVATION_SUFFIXES[part]
            elif part in ("sym", "asym"):
                symmetric = part == "sym"
            elif part.startswith("g") and part[1:].isdigit():
                group = int(part[1:])
            else:
                raise ConfigError(f"int4: unknown parameter {part!r} in {'int4' + suffix!r}; write {_SPEC_HELP}")
        return cls(group, symmetric).with_activations(activations)

    def spec(self) -> str:
        return f"int4-g{self.group_size}" + ("-sym" if self.symmetric else "") + self.activation_suffix()

    def native_layout(self, packed: Packed):
        t = native_layouts.INT4_GROUPS[(self.group_size, self.symmetric)]
        return t, native_layouts.pack_int4_groups(
            packed["qweight"], packed["scale"], packed.get("offset"), self.group_size
        )

    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        return 4.0 + (16.0 if self.symmetric else 32.0) / self.group_size

    def quantize(self, weight: torch.Tensor, stats=None) -> Packed:
        w = check_weight(weight, self.spec(), self.group_size, GROUP_SIZES)
        out, k = w.shape
        g = w.view(out, k // self.group_size, self.group_size)  # (out, groups, group_size)
        if self.symmetric:
            scale = (g.abs().amax(-1) / 7).half()  # stored precision is the one used to round
            q = torch.round(g * _safe_inv(scale)[..., None]).clamp_(-7, 7) + 8
            packed = {"scale": scale}
        else:
            lo, hi = g.amin(-1), g.amax(-1)
            scale, offset = ((hi - lo) / 15).half(), lo.half()
            q = torch.round((g - offset.float()[..., None]) * _safe_inv(scale)[..., None]).clamp_(0, 15)
            packed = {"scale": scale, "offset": offset}
        _check_finite_scale(scale, self.spec())
        return {"qweight": pack_nibbles(q.to(torch.uint8).view(out, k)), **packed}

    def dequantize(self, packed: Packed) -> torch.Tensor:
        scale = packed["scale"].float()  # (out, groups)
        out, groups = scale.shape
        q = unpack_nibbles(packed["qweight"]).float().view(out, groups, -1)
        if self.symmetric:
            w = (q - 8) * scale[..., None]
        else:
            w = q * scale[..., None] + packed["offset"].float()[..., None]
        return w.view(out, -1)

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """Rows keep their groups; columns are cut on whole groups (codes two per byte, one scale [+ offset] each)."""
        g = self.group_size
        return shard_columns_in_units(
            packed, dim, start, stop, self.spec(), block=g, columns={"qweight": 2, "scale": g, "offset": g}
        )


def _safe_inv(scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return torch.where(s > 0, 1.0 / s, torch.zeros_like(s))


def _check_finite_scale(scale: torch.Tensor, spec: str) -> None:
    if not torch.isfinite(scale).all():
        raise ConfigError(f"{spec}: a group's range exceeds float16 (|w| > 65504·7); use int8 or fp32 for this layer")
