"""Calibration state as plain data: what a calibrated KV codec needs besides its name.

A state is nested dicts and lists of numbers (JSON) or tensors (``torch.save``). Layer-keyed maps are
stored with string keys (JSON's only key type) and read back with :func:`layer_map`. :func:`to_plain`
turns tensors into lists so a state can sit inline in a run config; :func:`read_state` accepts the data
itself or a path to a ``.json`` or ``torch.save`` file of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import ConfigError


def to_plain(state: Any) -> Any:
    """Tensors → nested lists, dict keys → strings: JSON-ready."""
    if isinstance(state, torch.Tensor):
        return state.tolist()
    if isinstance(state, dict):
        return {str(k): to_plain(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return [to_plain(v) for v in state]
    return state


def read_state(state: Any) -> Optional[dict]:
    """``state`` itself (a dict or None), or the dict stored at the path ``state``."""
    if state is None or isinstance(state, dict):
        return state
    if not isinstance(state, (str, Path)):
        raise ConfigError(f"KV calibration state must be a dict or a file path, got {type(state).__name__}")
    path = Path(state).expanduser()
    try:
        if path.suffix == ".json":
            data = json.loads(path.read_text())
        else:
            data = torch.load(path, weights_only=True, map_location="cpu")
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"cannot read the KV calibration state {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"KV calibration state {path} must hold a dict")
    return data


def layer_map(data: dict, convert: Callable[[Any], Any] = lambda x: torch.as_tensor(x, dtype=torch.float32)) -> dict:
    """{"0": x, "1": y} (or int keys) → {0: convert(x), 1: convert(y)}."""
    try:
        return {int(k): convert(v) for k, v in data.items()}
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"bad layer-keyed KV calibration state: {exc}") from None
