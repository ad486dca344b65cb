"""Hugging Face checkpoint directories: ``config.json`` + ``*.safetensors`` (single or sharded).

Tensors are read lazily with ``safetensors.safe_open`` one at a time; names are already the HF
module names the model uses. Gemma's RMSNorm weights are stored as ``w`` and applied as ``1 + w``:
the offset is added here, so the model's norm is always ``x · w``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError
from .arch import ARCHITECTURES, Architecture


@dataclass
class HFTensor:
    gguf_name: str  # the checkpoint's own name (kept for error messages)
    name: str
    shape: tuple[int, ...]
    type_name: str
    _array: np.ndarray

    def dequantize(self) -> np.ndarray:
        return np.require(self._array, np.float32, ["C", "W"])


class HFCheckpoint:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{self.path}: not a Hugging Face model directory (config.json is missing)")
        try:
            self.hf_config = json.loads(cfg_path.read_text())
        except ValueError as exc:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({exc})") from exc
        model_type = self.hf_config.get("model_type", "")
        if model_type == "gemma3_text":
            model_type = "gemma3"
        try:
            self.arch: Architecture = ARCHITECTURES.get(model_type)()
        except KeyError:
            moe = any(self.hf_config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
            raise CheckpointError(
                f"{cfg_path}: unsupported {'MoE family' if moe else 'model_type'} {model_type!r}; "
                f"bytediet loads {', '.join(ARCHITECTURES.names())}"
            ) from None
        try:
            self.config: ModelConfig = self.arch.config_from_hf(self.hf_config)
        except KeyError as exc:
            raise CheckpointError(f"{cfg_path}: missing key {exc}") from exc
        experts = max(int(self.hf_config.get(k) or 0) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        if experts and not self.config.num_experts:
            raise CheckpointError(
                f"{cfg_path}: model_type {model_type!r} with {experts} experts is not an MoE family "
                f"bytediet loads (MoE families: mixtral, qwen2_moe, olmoe)"
            )
        self.files = self._weight_files()

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.path / n for n in names]
        else:
            files = sorted(self.path.glob("*.safetensors"))
        missing = [f for f in files if not f.is_file()]
        if missing or not files:
            raise CheckpointError(
                f"{self.path}: safetensors file(s) missing: {[str(m) for m in missing] or '*.safetensors'}"
            )
        return files

    def tensors(self) -> Iterator[HFTensor]:
        from safetensors import safe_open

        offset = getattr(self.arch, "norm_weight_offset_in_hf", 0.0)
        for f in self.files:
            try:
                handle = safe_open(str(f), framework="pt")
            except Exception as exc:
                raise CheckpointError(f"{f}: corrupt safetensors file ({exc})") from exc
            with handle:
                for name in handle.keys():
                    hf_name = name[len("language_model.") :] if name.startswith("language_model.") else name
                    hf_name = self.arch.hf_name_to_module(hf_name)
                    if "rotary_emb" in hf_name:
                        continue
                    t = handle.get_tensor(name)
                    array = t.float().numpy()
                    if offset and hf_name.endswith("norm.weight"):
                        array = array + offset
                    yield HFTensor(name, hf_name, tuple(t.shape), str(t.dtype).replace("torch.", ""), array)
