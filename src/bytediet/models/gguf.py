"""GGUF checkpoints: metadata → :class:`ModelConfig`; tensors memory-mapped and converted one at a time.

Uses the ``gguf`` package's reader and dequantizers. Each tensor's source type is remembered so a
weight format can keep native blocks packed instead of dequantizing them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..config import ModelConfig
from ..errors import CheckpointError
from .arch import ARCHITECTURES, Architecture

if TYPE_CHECKING:
    import gguf


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: HF-style module name, shape (out, in) / (n,), ggml type, raw bytes."""

    gguf_name: str
    name: str
    shape: tuple[int, ...]
    ggml_type: Any  # gguf.GGMLQuantizationType
    raw: np.ndarray  # memory-mapped: uint8 blocks for quantized types, floats otherwise

    @property
    def type_name(self) -> str:
        return self.ggml_type.name

    def dequantize(self) -> np.ndarray:
        """Float32 array of ``shape``."""
        import gguf

        try:
            arr = gguf.quants.dequantize(self.raw, self.ggml_type)
        except NotImplementedError as exc:
            raise CheckpointError(
                f"tensor {self.gguf_name!r} has type {self.type_name}, which the gguf package cannot dequantize "
                f"({exc}); re-export the checkpoint with a common type (F16, Q8_0, Q4_K, ...)"
            ) from exc
        # writable and contiguous: float tensors come back as read-only views of the memory map
        return np.require(arr, np.float32, ["C", "W"]).reshape(self.shape)


class GGUFCheckpoint:
    """An opened GGUF file: its architecture adapter, configuration and tensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such file")
        with open(self.path, "rb") as f:
            magic = f.read(4)
        if magic != b"GGUF":
            raise CheckpointError(f"{self.path}: not a GGUF file (bad magic {magic!r}, expected b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as exc:  # the reader raises assorted errors on damaged files
            raise CheckpointError(f"{self.path}: corrupt GGUF file ({type(exc).__name__}: {exc})") from exc
        self._check_tensor_extents()
        arch_name = self.field("general.architecture")
        try:
            self.arch: Architecture = ARCHITECTURES.get(arch_name)()
        except KeyError:
            kind = "MoE family" if self.field(f"{arch_name}.expert_count", 0) else "architecture"
            raise CheckpointError(
                f"{self.path}: unsupported {kind} {arch_name!r}; bytediet loads {', '.join(ARCHITECTURES.names())}"
            ) from None
        self.config = self._read_config()

    def field(self, key: str, default: Any = ...) -> Any:
        f = self.reader.fields.get(key)
        if f is None:
            if default is ...:
                raise CheckpointError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return f.contents()

    def _check_tensor_extents(self) -> None:
        size = self.path.stat().st_size
        for t in self.reader.tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CheckpointError(
                    f"{self.path}: truncated file: tensor {t.name!r} needs bytes up to {end} but the file has {size}"
                )

    def _read_config(self) -> ModelConfig:
        arch = self.field("general.architecture")  # the key prefix (qwen2moe for the qwen2_moe adapter)
        names = {t.name for t in self.reader.tensors}
        extra = {
            "__has_output": "output.weight" in names,
            "__has_qkv_bias": "blk.0.attn_q.bias" in names,
            "__vocab_from_tokens": len(self.reader.fields["tokenizer.ggml.tokens"].data)
            if "tokenizer.ggml.tokens" in self.reader.fields
            else 0,
            "__name": self.field("general.name", ""),
        }

        def meta(key: str, default: Any = ...) -> Any:
            if key in extra:
                return extra[key]
            return self.field(f"{arch}.{key}", default)

        try:
            config = self.arch.config_from_gguf(meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: cannot read the {arch} configuration: {exc}") from exc
        experts = int(self.field(f"{arch}.expert_count", 0) or 0)
        if experts and not config.num_experts:
            raise CheckpointError(
                f"{self.path}: {arch} with {experts} experts is not an MoE family bytediet "
                f"loads (MoE families: mixtral as llama, qwen2moe, olmoe)"
            )
        return config

    def tensors(self) -> Iterator[GGUFTensor]:
        """Tensors in file order, with HF-style names; tensors the model does not use are skipped."""
        for t in self.reader.tensors:
            name = self.arch.gguf_name_to_module(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if "{e}" in name:  # all experts stacked (n_expert, out, in): blocks run along `in`, so slice rows
                data = t.data.reshape(shape[0], -1, t.data.shape[-1])
                for e in range(shape[0]):
                    yield GGUFTensor(t.name, name.format(e=e), shape[1:], t.tensor_type, data[e])
                continue
            yield GGUFTensor(t.name, name, shape, t.tensor_type, t.data)


# ------------------------------------------------------------------------------------- writing
def copy_metadata(reader: "gguf.GGUFReader", writer: "gguf.GGUFWriter", skip: tuple[str, ...] = ()) -> None:
    """Copy every key-value field of ``reader`` into ``writer`` (the writer already has general.architecture)."""
    import gguf

    for key, f in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in skip:
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = f.contents()
        writer.add_key_value(key, value, vtype, sub)


def write_metadata_only(source: str | os.PathLike, out_path: str | os.PathLike) -> None:
    """A GGUF with ``source``'s metadata and no tensors (e.g. to carry a tokenizer)."""
    import gguf

    reader = gguf.GGUFReader(str(source))
    writer = gguf.GGUFWriter(str(out_path), gguf_field(reader, "general.architecture"))
    copy_metadata(reader, writer)
    finish_writer(writer)


def gguf_field(reader: "gguf.GGUFReader", key: str):
    f = reader.fields.get(key)
    if f is None:
        raise CheckpointError(f"GGUF file lacks the {key!r} field")
    return f.contents()


def finish_writer(writer: "gguf.GGUFWriter") -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
