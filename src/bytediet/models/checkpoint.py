"""Save and load quantized models: ``model.safetensors`` + ``bytediet_config.json`` (+ the tokenizer).

The JSON config records the model configuration, each linear layer's format spec, the quantization
overrides and calibration settings, the source checkpoint's sha256 and the sha256 of every file written.
A save is written into a temporary directory next to ``out_dir`` and renamed into place, so a failure
never leaves a half-written checkpoint; a load verifies every checksum before reading a tensor.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from ..errors import CheckpointError
from .quantize import QuantizeConfig, build_format, linear_layers

CONFIG_FILE = "bytediet_config.json"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_GGUF = "tokenizer.gguf"
TOKENIZER_DIR = "tokenizer"
FORMAT_VERSION = 1
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "config.json",
    "generation_config.json",
)


def sha256_of(path: str | os.PathLike) -> str:
    """sha256 of a file, or of a directory's files (sorted by relative path, names included)."""
    path = Path(path)
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()


def _unique_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with shared storage written once: (tensors, aliases name → name of the stored copy)."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        if t.device.type == "meta":
            raise CheckpointError(f"cannot save {name}: it was never loaded (still on the meta device)")
        key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous()
    return tensors, aliases


def save_quantized(
    model: nn.Module,
    tokenizer_source_path: Optional[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    source_path: Optional[str | os.PathLike] = None,
    quantize_config: Optional[QuantizeConfig] = None,
    calibration: Optional[dict[str, Any]] = None,
    overwrite: bool = False,
) -> Path:
    """Write ``model`` (any module tree of ``Linear`` layers; ``model.config`` is recorded when present).

    tokenizer_source_path: a ``.gguf`` file (its metadata is copied into ``tokenizer.gguf``) or a Hugging
    Face directory (its tokenizer files are copied), or None. source_path defaults to ``model.source_path``.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise CheckpointError(f"{out_dir} already exists; choose another directory or pass overwrite=True")
    source_path = source_path or getattr(model, "source_path", None)
    quantize_config = quantize_config or getattr(model, "quantize_config", None)
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        tensors, aliases = _unique_tensors(model)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "writer": "bytediet"})
        if tokenizer_source_path is not None:
            _copy_tokenizer(Path(tokenizer_source_path), tmp)
        config = _describe(model, aliases, source_path, quantize_config, calibration)
        config["files"] = {str(p.relative_to(tmp)): sha256_of(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        with open(tmp / CONFIG_FILE, "w", encoding="utf-8") as fh:
            json.dump(config, fh, indent=2, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        _replace_dir(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out_dir


def _describe(model, aliases, source_path, quantize_config, calibration) -> dict[str, Any]:
    cfg = getattr(model, "config", None)
    return {
        "format_version": FORMAT_VERSION,
        "model_config": cfg.to_dict() if hasattr(cfg, "to_dict") else None,
        "dtype": str(getattr(model, "dtype", torch.float32)).removeprefix("torch."),
        "layers": {name: layer.format.spec() for name, layer in linear_layers(model)},
        "aliases": aliases,
        "quantize_config": quantize_config.to_dict() if quantize_config is not None else None,
        "calibration": calibration
        if calibration is not None
        else (quantize_config.calibration if quantize_config is not None else None),
        "source": {
            "path": str(source_path) if source_path else None,
            "sha256": sha256_of(source_path) if source_path and Path(source_path).exists() else None,
        },
    }


def _copy_tokenizer(src: Path, dst: Path) -> None:
    if src.is_file() and src.suffix.lower() == ".gguf":
        from .gguf import write_metadata_only

        write_metadata_only(src, dst / TOKENIZER_GGUF)
    elif src.is_dir():
        (dst / TOKENIZER_DIR).mkdir()
        for name in _HF_TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, dst / TOKENIZER_DIR / name)
    else:
        raise CheckpointError(f"{src}: not a .gguf file or a Hugging Face directory; cannot take a tokenizer from it")


def _replace_dir(tmp: Path, out_dir: Path) -> None:
    """Move ``tmp`` to ``out_dir``; an existing ``out_dir`` is swapped out first and removed after."""
    old = None
    if out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's JSON config after verifying every file's sha256."""
    path = Path(path)
    cfg_path = path / CONFIG_FILE
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: not a bytediet checkpoint (no {CONFIG_FILE})")
    try:
        config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_path}: corrupt JSON ({exc}); re-save the checkpoint") from None
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{cfg_path}: format_version {config.get('format_version')!r}, this bytediet reads {FORMAT_VERSION}"
        )
    for name, digest in config.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing; the checkpoint is incomplete, re-save it")
        if sha256_of(f) != digest:
            raise CheckpointError(
                f"{path}: {name} does not match its sha256 in {CONFIG_FILE}; the file is corrupt or was modified"
            )
    if WEIGHTS_FILE not in config.get("files", {}):
        raise CheckpointError(f"{cfg_path}: lists no {WEIGHTS_FILE}")
    return config


def load_quantized(
    path: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    model: Optional[nn.Module] = None,
    load_tokenizer: bool = True,
):
    """Load a saved checkpoint → ``(model, tokenizer)``.

    ``model``: an already-built module to fill (any tree of ``Linear`` layers); by default the model is
    built from the recorded ModelConfig with ``bytediet.models.loader.build_model``. Float parameters
    are cast to ``dtype``; packed buffers keep their stored dtype.
    """
    path = Path(path)
    config = read_config(path)
    if model is None:
        model = _build(config, dtype)
    tensors = load_file(str(path / WEIGHTS_FILE))
    for name, target in config.get("aliases", {}).items():
        tensors[name] = tensors[target]
    _install(model, tensors, config, dtype, path)
    model.source_path = str(path)
    if config.get("quantize_config"):
        model.quantize_config = QuantizeConfig.from_dict(config["quantize_config"])
    tokenizer = _load_tokenizer(path) if load_tokenizer else None
    return model, tokenizer


def _build(config: dict[str, Any], dtype: torch.dtype) -> nn.Module:
    from ..config import ModelConfig
    from .loader import build_model

    mc = dict(config.get("model_config") or {})
    if not mc:
        raise CheckpointError("the checkpoint records no model_config; pass the model to fill with model=")
    mc["layer_types"] = tuple(mc.get("layer_types", ()))
    try:
        return build_model(ModelConfig(**mc), dtype)
    except TypeError as exc:
        raise CheckpointError(f"the checkpoint's model_config does not fit this bytediet: {exc}") from None


def _install(model: nn.Module, tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype, path: Path) -> None:
    used: set[str] = set()
    layers = dict(linear_layers(model))
    if set(layers) != set(config["layers"]):
        missing, extra = sorted(set(config["layers"]) - set(layers)), sorted(set(layers) - set(config["layers"]))
        raise CheckpointError(
            f"{path}: the checkpoint's layers do not match the model (only in checkpoint: {missing[:3]}, "
            f"only in model: {extra[:3]}); was it saved from another architecture?"
        )
    for name, layer in layers.items():
        prefix = f"{name}.packed_"
        packed = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not packed:
            raise CheckpointError(f"{path}: no packed tensors for layer {name}")
        layer.set_packed(build_format(config["layers"][name]), packed)
        used.update(prefix + k for k in packed)
    modules = dict(model.named_modules())
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name not in tensors:
            raise CheckpointError(f"{path}: tensor {name} is missing from {WEIGHTS_FILE}")
        t = tensors[name]
        if tuple(t.shape) != tuple(param.shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(t.shape)}, the model expects {tuple(param.shape)}")
        owner, _, attr = name.rpartition(".")
        setattr(modules[owner], attr, nn.Parameter(t.to(dtype) if t.is_floating_point() else t, requires_grad=False))
        used.add(name)
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise CheckpointError(f"{path}: {len(unknown)} tensors fit no module of the model, e.g. {unknown[:3]}")


def _load_tokenizer(path: Path):
    if (path / TOKENIZER_GGUF).is_file():
        target = path / TOKENIZER_GGUF
    elif (path / TOKENIZER_DIR).is_dir():
        target = path / TOKENIZER_DIR
    else:
        return None
    from .tokenizer import load_tokenizer

    return load_tokenizer(target)
