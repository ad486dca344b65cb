"""``quantize(model, config)``: re-quantize every linear layer of a model (torchao's ``quantize_`` shape).

The config names one weight format, per-layer overrides by ``fnmatch`` pattern on the layer's
qualified name (``{"lm_head": "int8", "*.layers.0.*": "int8"}``; the first matching pattern wins) and
skip patterns (layers left as they are). Every layer is quantized from its dequantized float weight
*before* any layer is replaced, so a bad spec or shape raises and leaves the model untouched.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterator, Mapping, Optional

import torch.nn as nn

from ..errors import ConfigError
from .base import Packed, WeightFormat, get_weight_format


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how. ``calibration`` records calibration settings (saved with the checkpoint)."""

    format: str
    overrides: Mapping[str, str] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    calibration: Optional[Mapping[str, Any]] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", dict(self.overrides))
        object.__setattr__(self, "skip", tuple([self.skip] if isinstance(self.skip, str) else self.skip))
        for spec in [self.format, *self.overrides.values()]:
            build_format(spec)  # fail on a bad name now, not halfway through a model

    def spec_for(self, layer_name: str) -> Optional[str]:
        """The format spec for a layer, or None when a skip pattern matches it."""
        if any(fnmatchcase(layer_name, p) for p in self.skip):
            return None
        for pattern, spec in self.overrides.items():
            if fnmatchcase(layer_name, pattern):
                return spec
        return self.format

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantizeConfig":
        return cls(format=d["format"], overrides=d.get("overrides", {}), skip=tuple(d.get("skip", ())),
                   calibration=d.get("calibration"))


@dataclass
class LayerSummary:
    name: str
    format: str
    shape: tuple[int, int]
    bytes_before: int
    bytes_after: int
    bits_per_weight: float


@dataclass
class QuantizeSummary:
    """What ``quantize`` did: per-layer formats and sizes (bytes of the packed buffers)."""

    layers: list[LayerSummary]
    skipped: list[str]

    @property
    def bytes_before(self) -> int:
        return sum(layer.bytes_before for layer in self.layers)

    @property
    def bytes_after(self) -> int:
        return sum(layer.bytes_after for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return {"bytes_before": self.bytes_before, "bytes_after": self.bytes_after, "skipped": self.skipped,
                "layers": [asdict(layer) for layer in self.layers]}


def build_format(spec: str) -> WeightFormat:
    """``get_weight_format`` with an unknown name reported as a :class:`ConfigError`."""
    try:
        return get_weight_format(spec)
    except KeyError as exc:
        raise ConfigError(exc.args[0]) from None


def linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.linear_layers()`` when the model has it, else every :class:`Linear` submodule."""
    if hasattr(model, "linear_layers"):
        yield from model.linear_layers()
        return
    from ..models.layers import Linear

    for name, module in model.named_modules():
        if isinstance(module, Linear):
            yield name, module


def packed_nbytes(packed: Packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.values())


def quantize(model: nn.Module, config: QuantizeConfig | str,
             stats: Optional[Mapping[str, Any]] = None) -> QuantizeSummary:
    """Re-quantize the linear layers of ``model`` in place; ``stats[layer_name]`` goes to formats that calibrate."""
    if isinstance(config, str):
        config = QuantizeConfig(format=config)
    stats = stats or {}
    planned: list[tuple[str, nn.Module, WeightFormat, Packed]] = []
    skipped: list[str] = []
    for name, layer in linear_layers(model):
        spec = config.spec_for(name)
        if spec is None:
            skipped.append(name)
            continue
        fmt = build_format(spec)
        try:
            packed = fmt.quantize(layer.dequantized_weight(), stats.get(name))
        except ConfigError as exc:
            raise ConfigError(f"layer {name} ({layer.out_features}×{layer.in_features}): {exc}") from None
        planned.append((name, layer, fmt, packed))
    summary = []
    for name, layer, fmt, packed in planned:  # nothing is replaced until every layer quantized cleanly
        before = packed_nbytes(layer.packed)
        layer.set_packed(fmt, packed)
        summary.append(LayerSummary(name, fmt.spec(), (layer.out_features, layer.in_features), before,
                                    packed_nbytes(packed), fmt.bits_per_weight(layer.out_features, layer.in_features)))
    model.quantize_config = config
    return QuantizeSummary(summary, skipped)
