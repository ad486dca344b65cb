"""Helpers shared by the quantized weight formats: input checks, spec-suffix parsing, activation modes."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError


def check_weight(
    weight: torch.Tensor, fmt_name: str, multiple_of: int = 1, group_sizes: tuple[int, ...] = ()
) -> torch.Tensor:
    """Validate a (out, in) float weight for ``fmt_name`` and return it as contiguous float32.

    ``multiple_of``: the block / group size that must divide in_features; ``group_sizes``: the sizes the
    format offers, suggested when it does not divide.
    """
    if weight.dim() != 2:
        raise ConfigError(
            f"{fmt_name}: expected a 2-D weight (out_features, in_features), got shape {tuple(weight.shape)}"
        )
    k = weight.shape[1]
    if k % multiple_of:
        valid = [g for g in group_sizes if k % g == 0]
        hint = (
            f"valid group sizes for it: {', '.join(map(str, valid))}"
            if valid
            else "override this layer with a format without blocks (e.g. int8 or fp8)"
        )
        raise ConfigError(f"{fmt_name}: block size {multiple_of} does not divide in_features ({k}); {hint}")
    w = weight.detach().float().contiguous()
    if not torch.isfinite(w).all():
        raise ConfigError(f"{fmt_name}: the weight contains NaN or Inf; cannot quantize it")
    return w


def split_spec(suffix: str, fmt_name: str, allowed: str) -> list[str]:
    """``"-g64-sym"`` → ``["g64", "sym"]``; anything not starting with ``-`` is an error naming ``allowed``."""
    if not suffix:
        return []
    if not suffix.startswith("-") or "--" in suffix or suffix.endswith("-"):
        raise ConfigError(f"cannot read weight format {fmt_name + suffix!r}; write {allowed}")
    return suffix[1:].split("-")


def no_parameters(cls, suffix: str):
    """``from_spec`` for formats that take no parameters: only the bare name is accepted."""
    if suffix:
        raise ConfigError(f"weight format {cls.name!r} takes no parameters, got {cls.name + suffix!r}")
    return cls()


ACTIVATION_MODES = ("q16", "q8", "f32")
ACTIVATION_SUFFIXES = {"a16": "q16", "a8": "q8", "af32": "f32"}  # spec parts, e.g. int4-g64-a8


class NativeActivations:
    """How a format's native kernel multiplies its activations (a measured accuracy/speed trade).

    ``"q16"`` (the default): two int8 planes per block of 32 (int16-like precision, integer dot products);
    ``"q8"``: one int8 plane (llama.cpp's method, a small measured cost); ``"f32"``: float activations, codes
    widened in registers. kernels/reference.py defines each exactly; bench/RESULTS.md has their measured cost.
    """

    activations: str = "q16"

    @property
    def activation_bits(self):
        """The activation precision the native kernel rounds to (blocks of 32), None for float."""
        return {"q8": 8, "q16": 16, "f32": None}[self.activations]

    def with_activations(self, activations: str):
        """This format with its activations in ``"q16"``, ``"q8"`` or ``"f32"``."""
        if activations not in ACTIVATION_MODES:
            raise ConfigError(f"activations must be one of {', '.join(ACTIVATION_MODES)}, got {activations!r}")
        self.activations = activations
        return self

    def activation_suffix(self) -> str:
        """The spec part that names a non-default activation mode ("" for q16)."""
        return {"q16": "", "q8": "-a8", "f32": "-af32"}[self.activations]


def activations_only(cls, suffix: str):
    """``from_spec`` for formats whose only option is the native kernel's activation precision
    (``-a8``, ``-a16``, ``-af32``; none for the default q16)."""
    if not suffix:
        return cls()
    mode = ACTIVATION_SUFFIXES.get(suffix[1:]) if suffix.startswith("-") else None
    if mode is None:
        raise ConfigError(
            f"weight format {cls.name!r} takes only an activation precision: {cls.name}, {cls.name}-a8 "
            f"or {cls.name}-af32, got {cls.name + suffix!r}"
        )
    return cls().with_activations(mode)


def check_block_cut(fmt_name: str, start: int, stop: int, block: int) -> None:
    """A tensor-parallel column slice ``[start, stop)`` must fall on the format's blocks of ``block`` columns."""
    if start % block or stop % block:
        raise ConfigError(
            f"{fmt_name}: columns [{start}, {stop}) do not fall on its blocks of {block}; load with --weights int8 "
            "or fp32 for this tensor-parallel size, or choose a size that splits the layer on whole blocks"
        )


def shard_columns_in_units(
    packed: dict[str, torch.Tensor],
    dim: int,
    start: int,
    stop: int,
    fmt_name: str,
    *,
    columns: Optional[dict[str, int]] = None,
    block: int = 1,
    whole: tuple[str, ...] = (),
) -> dict[str, torch.Tensor]:
    """The slice ``[start, stop)`` along ``dim`` of a format whose tensors are per output row (tensor parallelism,
    :meth:`bytediet.quant.base.WeightFormat.shard`).

    ``columns``: tensors that run along the input dimension, each with the input columns one of its elements
    covers (2 for nibble-packed codes, the group size for group scales); ``whole``: per-tensor state kept as is
    (e.g. NVFP4's tensor scale); any other tensor is per output row (cut with the rows, kept whole by a column
    slice: it was computed over the whole row, so the ranks' partial products still sum to the unsplit layer's).
    A column slice must fall on the format's ``block`` boundaries, else :class:`ConfigError` says what to do.
    """
    if dim == 1:
        check_block_cut(fmt_name, start, stop, block)
    out = {}
    for name, t in packed.items():
        if name in whole:
            out[name] = t
        elif dim == 0:
            out[name] = t[start:stop].contiguous()
        elif columns and name in columns:
            unit = columns[name]
            out[name] = t[:, start // unit : stop // unit].contiguous()
        else:
            out[name] = t
    return out
