"""``optimize --device``: where the run's models, engines and calibration run, and what the GPU path cannot run.

On CUDA (or the GPU code path on the CPU, ``BYTEDIET_BACKEND=triton``) every linear and the paged attention run
the Triton kernels: a candidate whose weight format or KV pages have none, or whose building fails on the device,
is skipped with the reason (:func:`objection`), never run on a slow path. The GPU's free memory is checked against
the checkpoint before anything is loaded (:func:`check_gpu_memory`).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import BytedietError, ConfigError

GB = 1e9


def gpu_path(device: str) -> bool:
    """Whether candidates on ``device`` run the Triton kernels (CUDA, or ``BYTEDIET_BACKEND=triton`` on the CPU)."""
    from ..kernels.backend import name_for

    return name_for(device) == "triton"


def device_key(device: str) -> Optional[str]:
    """What a run's cached numbers depend on besides the CPU: the GPU's name (or ``cpu:triton``); None for the
    native CPU path, so CPU runs keep their keys."""
    if device == "cuda":
        return f"cuda:{torch.cuda.get_device_name()}"
    return "cpu:triton" if gpu_path(device) else None


def objection(model, kv) -> Optional[str]:
    """Why ``model`` (a built candidate) with KV codec ``kv`` (a spec or a calibrated codec) cannot run on the GPU
    path — a weight format or KV page type without a Triton kernel, checked as the engine checks it at start — or
    None. Only meaningful where :func:`gpu_path` holds."""
    from ..engine.device import check_kernels
    from ..kvcache import get_kv_codec
    from ..kvcache.base import default_block_size

    codec = get_kv_codec(kv, model.dtype)
    try:
        caches = model.new_caches(1, default_block_size(codec), codec)
        check_kernels(model, caches, codec.name)
    except BytedietError as e:
        return str(e)
    return None


def build_failure(exc: Exception) -> str:
    """A candidate that failed to build or calibrate on the device, in one line (the op without a CUDA kernel)."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return f"cannot be built on this device ({type(exc).__name__}: {first}); run it with --device cpu"


def check_gpu_memory(model_spec: str, device: str) -> Optional[dict]:
    """On CUDA: the checkpoint as loaded (:func:`bytediet.perf.memory.footprint`) against the GPU's free memory,
    refused in one line when it cannot fit; the numbers for the report. None on the CPU."""
    if device != "cuda":
        return None
    from ..perf.memory import footprint

    fp = footprint(model_spec, packed_embedding=True)
    free, total = torch.cuda.mem_get_info()
    need = fp.loaded_bytes
    if need > free:
        raise ConfigError(
            f"bytediet optimize --device cuda: the checkpoint needs about {need / GB:.1f} GB on the GPU and "
            f"{torch.cuda.get_device_name()} has {free / GB:.1f} GB free of {total / GB:.1f} GB; "
            "free the GPU, or run with --device cpu"
        )
    return {"gpu": torch.cuda.get_device_name(), "free_bytes": free, "total_bytes": total, "model_bytes": need}
