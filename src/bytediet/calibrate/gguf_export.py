"""Export a model to GGUF with the ``gguf`` package's writer, in the block types llama.cpp reads.

The source GGUF supplies the metadata (architecture hyper-parameters, tokenizer, chat template) and
every tensor that is not a linear layer (embeddings, norms), copied byte for byte. Each linear layer
is written from the model: layers already in a ``gguf-*`` format keep their blocks; the others are
encoded from their dequantized weight to ``ggml_type`` (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1). Llama's q/k
rows are permuted back to llama.cpp's interleaved-RoPE order (the inverse of the loader's un-permute).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from ..errors import ConfigError
from ..kernels.ggml_codecs import ENCODERS
from ..models.arch import ARCHITECTURES
from ..models.gguf import copy_metadata, finish_writer, gguf_field
from ..quant.gguf_blocks import GGUFBlocks

_FILE_TYPES = {
    GGMLQuantizationType.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
    GGMLQuantizationType.Q4_0: gguf.LlamaFileType.MOSTLY_Q4_0,
    GGMLQuantizationType.Q4_1: gguf.LlamaFileType.MOSTLY_Q4_1,
    GGMLQuantizationType.Q5_0: gguf.LlamaFileType.MOSTLY_Q5_0,
    GGMLQuantizationType.Q5_1: gguf.LlamaFileType.MOSTLY_Q5_1,
}


def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation (rotate-half halves → interleaved pairs), on whole rows. w: (out, ...)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def linear_blocks(layer, ggml_type: Optional[GGMLQuantizationType]) -> tuple[np.ndarray, GGMLQuantizationType]:
    """A linear layer's weight as GGML blocks (out, bytes_per_row): its own blocks, or encoded to ``ggml_type``."""
    fmt = layer.format
    if isinstance(fmt, GGUFBlocks) and (ggml_type is None or fmt.ggml_type == ggml_type):
        return layer.packed["blocks"].numpy(), fmt.ggml_type
    if ggml_type is None:
        raise ConfigError(f"layer in format {fmt.spec()} is not a GGUF block type; pass ggml_type (e.g. Q8_0)")
    if ggml_type not in ENCODERS:
        raise ConfigError(f"cannot encode {ggml_type.name}; choose one of {', '.join(t.name for t in ENCODERS)}")
    bs = gguf.GGML_QUANT_SIZES[ggml_type][0]
    w = layer.dequantized_weight().float()
    if w.shape[1] % bs:
        raise ConfigError(f"in_features {w.shape[1]} is not a multiple of the {ggml_type.name} block size {bs}")
    blocks = ENCODERS[ggml_type](w.reshape(-1, bs)).reshape(w.shape[0], -1)
    return blocks.numpy(), ggml_type


def export_gguf(
    model,
    source: str | os.PathLike,
    out_path: str | os.PathLike,
    ggml_type: Optional[str | GGMLQuantizationType] = None,
) -> Path:
    """Write ``model`` as a GGUF file next to its ``source`` GGUF's metadata; returns the path.

    ``ggml_type``: the block type for linear layers not already in a GGUF format ("Q8_0", "Q4_0", ...).
    Written to a temporary file and renamed, so a failure leaves nothing behind.
    """
    gtype = GGMLQuantizationType[ggml_type.upper()] if isinstance(ggml_type, str) else ggml_type
    reader = gguf.GGUFReader(str(source))
    arch_name = gguf_field(reader, "general.architecture")
    arch = ARCHITECTURES.get(arch_name)()
    layers = dict(model.linear_layers())
    out_path = Path(out_path)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), arch_name)
    try:
        copy_metadata(reader, writer, skip=("general.file_type",))
        if gtype in _FILE_TYPES:
            writer.add_file_type(_FILE_TYPES[gtype])
        written = set()
        for t in reader.tensors:
            module = (arch.gguf_name_to_module(t.name) or "").rpartition(".")[0]
            if module in layers and t.name.endswith(".weight"):
                _add_linear(writer, t.name, module, layers[module], gtype, arch, model.config)
                written.add(module)
            else:
                writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)  # bytes as they are
        lm_head = layers.get("lm_head")
        if "lm_head" not in written and lm_head is not None and not _shares_embedding(model, lm_head):
            _add_linear(writer, "output.weight", "lm_head", lm_head, gtype, arch, model.config)
        finish_writer(writer)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _add_linear(writer, gguf_name, module, layer, gtype, arch, config) -> None:
    blocks, btype = linear_blocks(layer, gtype)
    if getattr(arch, "permuted_qk", False):
        if module.endswith("self_attn.q_proj"):
            blocks = permute_rope_rows(blocks, config.num_heads)
        elif module.endswith("self_attn.k_proj"):
            blocks = permute_rope_rows(blocks, config.num_kv_heads)
    writer.add_tensor(gguf_name, np.ascontiguousarray(blocks), raw_dtype=btype)


def _shares_embedding(model, lm_head) -> bool:
    packed = lm_head.packed
    emb = model.model.embed_tokens.weight
    return "weight" in packed and packed["weight"].data_ptr() == emb.data_ptr()
