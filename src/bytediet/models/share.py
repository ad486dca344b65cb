"""A copy of a loaded model that shares its big tensors: a configuration costs only the layers it changes.

``bytediet optimize`` measures many configurations of one checkpoint. Each is :func:`shared_copy` of the
checkpoint as loaded (a GGUF on its own blocks) with some layers replaced: quantizing a copy dequantizes
one layer at a time from the shared blocks (:func:`bytediet.models.quantize.quantize`), so no run holds
a float copy of the whole model, and dropping the copy frees exactly what it added.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .layers import Linear, PackedEmbedding


def shared_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors a :func:`shared_copy` shares: every linear layer's packed buffers and native layouts, and the
    token embedding. Norms and biases are copied (calibration's scale folding rewrites them)."""
    tensors: list[torch.Tensor] = []
    for module in model.modules():
        if isinstance(module, Linear):
            tensors += [t for _, t in module.named_buffers(recurse=False)]
            if module.interleaved is not None:
                tensors.append(module.interleaved)
            if module._native is not None:
                tensors.append(module._native[1])
        elif isinstance(module, nn.Embedding):
            tensors.append(module.weight)
        elif isinstance(module, PackedEmbedding):
            tensors.append(module.packed_blocks)
    return tensors


def shared_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose modules are its own but whose :func:`shared_tensors` are ``model``'s.

    Replacing a layer's weights in the copy (``set_packed``, ``set_weight``, a format's activation mode) leaves
    ``model`` as it was; writing *into* a shared tensor in place would not, and nothing here does.
    """
    memo = {id(t): t for t in shared_tensors(model)}
    return copy.deepcopy(model, memo)


def float_layers_as_loaded(model: nn.Module, names: set[str]) -> None:
    """Make the linear layers ``names`` of a :func:`shared_copy` compute what an fp32 load of the checkpoint
    computes for a layer a weight format leaves as it is: a native block format runs its shared blocks at float
    activations (decoded to float32 for a prefill — the same numbers — and never held as float32); another
    packed format is dequantized to float32."""
    from ..quant.base import get_weight_format
    from ..quant.common import NativeActivations

    fp32 = get_weight_format("fp32")
    for name, layer in model.linear_layers():
        if name not in names or layer.format is None or layer.format.spec() == "fp32":
            continue
        floated = copy.copy(layer.format)  # its own: the loaded model's format object is shared
        if isinstance(floated, NativeActivations) and layer.native_weight() is not None:
            floated = floated.with_activations("f32")
        if getattr(floated, "activations", None) == "f32":
            layer.format = floated
        else:
            layer.set_packed(fp32, fp32.quantize(layer.dequantized_weight()))


def native_only(model: nn.Module) -> int:
    """Keep each linear layer of ``model`` only as its kernels multiply it (:meth:`Linear.keep_native_only`: the
    packed planes dropped beside their repacked copy — the native CPU kernels', or on the GPU path the Triton
    GEMM's); the bytes freed. For a model that is measured or served, not saved: a checkpoint stores the planes."""
    dtype = getattr(model, "dtype", torch.float32)
    return sum(layer.dropped_plane_bytes for _, layer in model.linear_layers() if layer.keep_native_only(dtype))


def float_embedding(model: nn.Module) -> None:
    """Give ``model`` (a :func:`shared_copy`) a float32 token embedding in place of a
    :class:`~bytediet.models.layers.PackedEmbedding` — what a checkpoint saved from it stores."""
    table = model.model.embed_tokens
    if isinstance(table, PackedEmbedding):
        model.model.embed_tokens = nn.Embedding(
            table.num_embeddings, table.embedding_dim, _weight=table.weight, _freeze=True
        )
