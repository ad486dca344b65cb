"""The weight-format extension point (modelled on vLLM's quantization methods and torchao's configs).

A :class:`WeightFormat` turns a float weight (out_features, in_features) into a dict of packed
tensors and runs a linear layer on them. "Unquantized" is one more format. Formats are chosen by
name from :data:`WEIGHT_FORMATS`; a name may carry parameters (``int4-g128-sym``), parsed by the
format's ``from_spec``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..errors import ConfigError
from ..registry import Registry

Packed = dict[str, torch.Tensor]


class WeightFormat(ABC):
    """How one linear layer's weight is stored and multiplied."""

    name: str = "abstract"
    # each output row packs from that row alone (no per-tensor state): quantizing a run of rows at a time
    # gives the same bytes as the whole weight (models/quantize.py quantizes large layers so)
    rows_independent: bool = False

    @abstractmethod
    def bits_per_weight(self, out_features: int, in_features: int) -> float:
        """All-in bits per weight (scales, zero points, metadata included)."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, stats: Optional[Any] = None) -> Packed:
        """(out_features, in_features) float weight → packed tensors; ``stats``: calibration data, if any."""

    @abstractmethod
    def dequantize(self, packed: Packed) -> torch.Tensor:
        """Packed tensors → float32 weight (out_features, in_features): the reference for ``apply``."""

    def apply(self, x: torch.Tensor, packed: Packed, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """y = x @ Wᵀ + b for x: (..., in_features) → (..., out_features). Fast formats override this."""
        return F.linear(x, self.dequantize(packed).to(x.dtype), bias)

    def native_layout(self, packed: Packed) -> Optional[tuple[int, torch.Tensor]]:
        """The weight as the native block kernels read it: (kernel type id, rows (out, bytes) uint8), or None
        when no native kernel multiplies this format. GGML blocks are read in place; bytediet's own formats
        return a copy repacked once (:mod:`bytediet.kernels.native_layouts`), cached by the layer."""
        return None

    def shard(self, packed: Packed, dim: int, start: int, stop: int) -> Packed:
        """The slice ``[start, stop)`` of the weight along ``dim`` (0: output rows, 1: input columns), packed.

        Tensor parallelism keeps only a rank's slice of each layer (Megatron-LM, Shoeybi et al. 2019,
        arXiv 1909.08053): column-parallel layers cut dim 0, row-parallel layers dim 1. A format whose
        packing cannot be cut there raises :class:`ConfigError` naming the formats that can.
        """
        raise ConfigError(
            f"weight format {self.spec()} cannot be split for tensor parallelism; load with --weights fp32, "
            "bf16, fp16 or int8 (or a GGUF block format), or use --tensor-parallel-size 1"
        )

    def spec(self) -> str:
        """The name that rebuilds this format through :func:`get_weight_format`."""
        return self.name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()})"


WEIGHT_FORMATS: Registry = Registry("weight format")


def get_weight_format(spec: str) -> WeightFormat:
    """Build a format from its spec, e.g. ``"fp32"``, ``"int8"``, ``"int4-g128"`` (:meth:`Registry.build`)."""
    return WEIGHT_FORMATS.build(spec)


def build_format(spec: str) -> WeightFormat:
    """``get_weight_format`` with an unknown name reported as a :class:`ConfigError`."""
    try:
        return get_weight_format(spec)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None
