"""Where a loaded model's tensors live: the whole model moved to one device once, its CPU-only kernel copies dropped
there and a tied LM head tied again (the engine's device, and each tensor-parallel rank's own GPU)."""

from __future__ import annotations

import torch

from ..errors import ConfigError
from ..kernels import backend

GiB = 1 << 30


def rank_device(device: str, rank: int) -> str:
    """The device tensor-parallel rank ``rank`` computes on: its own GPU (``cuda:<rank>``) on CUDA, else ``device``."""
    return f"cuda:{rank}" if torch.device(device).type == "cuda" else str(device)


def move_model(model, device: str):
    """The model on ``device`` (its CPU-only kernel copies dropped there); a CUDA out-of-memory is the user's error."""
    if torch.device(device).type == "cpu" and model.device.type == "cpu":
        return model
    head, table = model.lm_head, model.model.embed_tokens.weight
    tied = head.format is not None and "weight" in head.packed and head.packed["weight"].data_ptr() == table.data_ptr()
    try:
        model.to(device)  # moves every parameter and buffer (a module already there stays)
    except torch.cuda.OutOfMemoryError as e:
        raise ConfigError(
            f"out of GPU memory loading the model's {model.weight_bytes() / GiB:.1f} GiB of weights "
            f"onto {device}; choose a smaller --weights format (e.g. int4-g128) or a larger --tensor-parallel-size"
        ) from e
    if tied:  # Module.to copies each tensor once: one table for the embedding and the LM head again
        head.set_packed(head.format, {"weight": model.model.embed_tokens.weight.data})
    for _, lin in model.linear_layers():
        lin.interleaved = None  # the native CPU kernels' interleaved copy: not used on the device
        # the kernels' layout: made again there from the planes, or, the planes dropped, the only copy: moved
        lin._native = (lin._native[0], lin._native[1].to(device)) if lin.planes_dropped else None
        lin._device_weight = None  # the GPU path's prepared weight: made again, on the device
    return model


def one_copy_on_gpu_path(model) -> int:
    """On the GPU path (CUDA, or ``BYTEDIET_BACKEND=triton``), each quantized layer kept only as the Triton GEMM
    reads it — its packed planes dropped beside the repacked rows (:func:`~.share.native_only`), so a served
    int4 model costs its bytes once, not twice; the bytes freed (0 off the GPU path). For a model that is only
    run: a tool that saves or re-packs it needs the planes."""
    from .share import native_only

    if not backend.triton_selected(torch.empty(0, device=model.device)):
        return 0
    freed = native_only(model)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()  # the planes' blocks back to the device before the KV pool is sized
    return freed
