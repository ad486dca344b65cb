"""Parsers of comma-separated flag values shared by the sub-commands (a ``_`` module: not a command)."""

from __future__ import annotations

from typing import Optional

from ..errors import ConfigError


def _prefix(what: Optional[str]) -> str:
    return f"{what}: " if what else ""


def positive_ints(text: str, what: Optional[str] = None) -> tuple[int, ...]:
    """``"1,4,16"`` → ``(1, 4, 16)``; at least one value, all >= 1. ``what`` (the flag) starts the error."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{_prefix(what)}expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{_prefix(what)}expected positive integers, got {text!r}")
    return values


def floats(text: str, what: Optional[str] = None) -> tuple[float, ...]:
    """``"0,0.5,1"`` → ``(0.0, 0.5, 1.0)``; at least one value (range checks are the caller's)."""
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{_prefix(what)}expected comma-separated fractions, got {text!r}") from None
    if not values:
        raise ConfigError(f"{_prefix(what)}expected at least one fraction, got {text!r}")
    return values
