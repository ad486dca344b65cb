"""``quantize(model, config)``: re-quantize every linear layer of a model (torchao's ``quantize_`` shape).

The config names one weight format, per-layer overrides by ``fnmatch`` pattern on the layer's
qualified name (``{"lm_head": "int8", "*.layers.0.*": "int8"}``; the first matching pattern wins) and
skip patterns (layers left as they are).

Output-layer policy (``output_policy="protect"``, the default): unless an override or skip pattern
names it, ``lm_head`` — which is the token embedding itself in tied models and the layer most
sensitive to rounding — is kept at int8 when the format has fewer than 8 bits per weight, and left
as it is when the format already has 8 or more (llama.cpp likewise keeps ``output.weight`` at
Q6_K / Q8_0). ``output_policy="same"`` quantizes it like every other layer. Every layer is quantized from its
dequantized float weight *before* any layer is replaced, so a bad spec or shape raises and leaves the model untouched.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from typing import Any, Iterator, Mapping, Optional

import torch
import torch.nn as nn

from ..errors import ConfigError
from ..quant import Packed, WeightFormat, build_format
from .layers import Linear


@dataclass(frozen=True)
class QuantizeConfig:
    """What to quantize and how. ``calibration`` records calibration settings (saved with the checkpoint)."""

    format: str
    overrides: Mapping[str, str] = field(default_factory=dict)
    skip: tuple[str, ...] = ()
    calibration: Optional[Mapping[str, Any]] = None
    output_policy: str = "protect"

    def __post_init__(self) -> None:
        if self.output_policy not in OUTPUT_POLICIES:
            raise ConfigError(f"output_policy {self.output_policy!r}: choose one of {', '.join(OUTPUT_POLICIES)}")
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
        if layer_name in OUTPUT_LAYERS and self.output_policy == "protect":
            return protected_output_spec(self.format)
        return self.format

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["skip"] = list(self.skip)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantizeConfig":
        # configs saved before the output policy existed quantized lm_head like every layer
        return cls(
            format=d["format"],
            overrides=d.get("overrides", {}),
            skip=tuple(d.get("skip", ())),
            calibration=d.get("calibration"),
            output_policy=d.get("output_policy", "same"),
        )


OUTPUT_LAYERS = ("lm_head",)
OUTPUT_POLICIES = ("protect", "same")
PROTECTED_OUTPUT_FORMAT = "int8"


def protected_output_spec(spec: str) -> Optional[str]:
    """The output layer's spec under the "protect" policy: int8 below 8 bits per weight, else None (kept)."""
    bits = build_format(spec).bits_per_weight(1, 4096)  # per-layer overheads vanish at this width
    return PROTECTED_OUTPUT_FORMAT if bits < 8 else None


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
        return {
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "skipped": self.skipped,
            "layers": [asdict(layer) for layer in self.layers],
        }


def linear_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.linear_layers()`` when the model has it, else every :class:`Linear` submodule."""
    if hasattr(model, "linear_layers"):
        yield from model.linear_layers()
        return
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            yield name, module


def packed_nbytes(packed: Packed) -> int:
    return sum(t.numel() * t.element_size() for t in packed.values())


def _check_prepacked(name: str, layer: nn.Module, fmt: WeightFormat, packed: Packed) -> None:
    shape = tuple(fmt.dequantize(packed).shape)
    if shape != (layer.out_features, layer.in_features):
        raise ConfigError(
            f"layer {name}: pre-packed {fmt.spec()} tensors decode to {shape}, the layer is "
            f"{(layer.out_features, layer.in_features)}"
        )


ROW_CHUNK_ELEMENTS = 1 << 22  # float weights dequantized at once while a large layer is quantized (16 MiB)


def quantized_weight(layer: Linear, fmt: WeightFormat, stats: Optional[Any] = None) -> Packed:
    """``fmt.quantize(layer.dequantized_weight(), stats)``; where ``fmt``'s rows pack independently, a run of rows
    at a time (dequantized from the layer's own packing, quantized, written into the packed result), so a large
    layer — a 262k-token ``lm_head`` — never exists in float32 whole. The bytes are the same either way."""
    rows = max(1, ROW_CHUNK_ELEMENTS // max(layer.in_features, 1))
    cuttable = type(layer.format).shard is not WeightFormat.shard
    if stats is not None or not fmt.rows_independent or not cuttable or layer.out_features <= rows:
        return fmt.quantize(layer.dequantized_weight(), stats)
    src, packed, out = layer.packed, {}, layer.out_features
    for start in range(0, out, rows):
        stop = min(start + rows, out)
        part = fmt.quantize(layer.format.dequantize(layer.format.shard(src, 0, start, stop)))
        if not packed:
            packed = {k: torch.empty((out, *t.shape[1:]), dtype=t.dtype, device=t.device) for k, t in part.items()}
        for k, t in part.items():
            packed[k][start:stop] = t
        del part
    return packed


def quantize_layer(name: str, layer: Linear, config: QuantizeConfig) -> None:
    """Re-quantize one layer to its spec under ``config`` (left as it is when skipped), as :func:`quantize`
    does for each; the loader uses it to quantize layer by layer."""
    spec = config.spec_for(name)
    if spec is None:
        return
    fmt = build_format(spec)
    try:
        packed = quantized_weight(layer, fmt)
    except ConfigError as exc:
        raise ConfigError(f"layer {name} ({layer.out_features}×{layer.in_features}): {exc}") from None
    layer.set_packed(fmt, packed)


def quantize(
    model: nn.Module,
    config: QuantizeConfig | str,
    stats: Optional[Mapping[str, Any]] = None,
    prepacked: Optional[Mapping[str, Packed]] = None,
) -> QuantizeSummary:
    """Re-quantize the linear layers of ``model`` in place; ``stats[layer_name]`` goes to formats that calibrate.

    ``prepacked[layer_name]``: tensors already packed in the layer's configured format by a calibration
    method (GPTQ), installed instead of rounding the weight to nearest.
    """
    if isinstance(config, str):
        config = QuantizeConfig(format=config)
    stats, prepacked = stats or {}, prepacked or {}
    planned: list[tuple[str, nn.Module, WeightFormat, Packed]] = []
    skipped: list[str] = []
    for name, layer in linear_layers(model):
        spec = config.spec_for(name)
        if spec is None:
            skipped.append(name)
            continue
        fmt = build_format(spec)
        if name in prepacked:
            packed = prepacked[name]
            _check_prepacked(name, layer, fmt, packed)
            planned.append((name, layer, fmt, packed))
            continue
        try:
            packed = quantized_weight(layer, fmt, stats.get(name))
        except ConfigError as exc:
            raise ConfigError(f"layer {name} ({layer.out_features}×{layer.in_features}): {exc}") from None
        planned.append((name, layer, fmt, packed))
    summary = []
    for name, layer, fmt, packed in planned:  # nothing is replaced until every layer quantized cleanly
        before = packed_nbytes(layer.packed)
        layer.set_packed(fmt, packed)
        summary.append(
            LayerSummary(
                name,
                fmt.spec(),
                (layer.out_features, layer.in_features),
                before,
                packed_nbytes(packed),
                fmt.bits_per_weight(layer.out_features, layer.in_features),
            )
        )
    model.quantize_config = config
    return QuantizeSummary(summary, skipped)
