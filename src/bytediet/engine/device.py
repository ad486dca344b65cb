"""Where the engine runs: the device resolved once, the model moved there, the KV pool sized from the device's free
memory (vLLM's ``gpu_memory_utilization``), and the check that every layer has a kernel on the GPU path — a
weight format or KV page type without one is refused at start, never run on a slow path without saying so."""

from __future__ import annotations

from typing import Optional

import torch

from ..errors import ConfigError
from ..kernels import backend
from ..models.placement import GiB

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str, tensor_parallel_size: int = 1) -> str:
    """``auto`` → ``cuda`` where torch sees a GPU for every tensor-parallel rank (none: ``cpu``); ``cuda`` with no
    GPU, or with fewer GPUs than ranks, is the user's error (one line)."""
    name = str(name).strip().lower()
    if name not in DEVICES:
        raise ConfigError(f"device must be one of {', '.join(DEVICES)}, got {name!r}")
    gpus = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 0
    if name == "auto":
        if gpus == 0:
            return "cpu"
        name = "cuda"
    if name == "cuda" and gpus == 0:
        raise ConfigError(
            f"--device cuda: torch {torch.__version__} sees no CUDA GPU on this machine; "
            "run with --device cpu (or auto)"
        )
    if name == "cuda" and gpus < tensor_parallel_size:
        raise ConfigError(
            f"--tensor-parallel-size {tensor_parallel_size} on CUDA needs a GPU per rank, and torch sees {gpus}; "
            f"use --tensor-parallel-size {gpus} or fewer, or --device cpu"
        )
    return name


def activation_reserve(model, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Bytes kept free beside the weights and KV pool for one step's activations (float32 upper bound: the
    widest layer's in- and outputs per token, logits of every sequence) and CUDA graph buffers."""
    c = model.config
    per_token = 4 * (4 * c.hidden_size + 3 * c.intermediate_size + 2 * c.num_heads * c.head_dim)
    return max_num_batched_tokens * per_token + 2 * max_num_seqs * c.vocab_size * 4 + GiB // 4


def kv_bytes_free(model, utilization: float, reserve: int) -> int:
    """``utilization`` of the model's CUDA device's memory, less what is in use (the weights, other processes) and
    ``reserve`` (activations): the KV pool's bytes there, ≤ 0 where nothing is left (a module-level function, so
    that each tensor-parallel rank can answer it for its own GPU)."""
    free, total = torch.cuda.mem_get_info(model.device)
    return int(total * utilization) - (total - free) - reserve


def kv_budget_from_free_memory(model, utilization: float, reserve: int, per_rank=None) -> int:
    """The KV pool's bytes on the model's CUDA device (:func:`kv_bytes_free`; ``per_rank``: every rank's answer,
    of which the least decides, since every rank allocates as many blocks); refuses a budget of nothing in one
    line."""
    if not 0 < utilization <= 1:
        raise ConfigError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    budget = min(per_rank) if per_rank else kv_bytes_free(model, utilization, reserve)
    if budget <= 0:
        free, total = torch.cuda.mem_get_info(model.device)
        raise ConfigError(
            f"out of GPU memory at start: {(total - free) / GiB:.1f} GiB of {total / GiB:.1f} GiB are "
            f"in use (weights {model.weight_bytes() / GiB:.1f} GiB), and --gpu-memory-utilization "
            f"{utilization} leaves no room for the KV cache; raise it or use a smaller --weights format"
            + (" or a larger --tensor-parallel-size" if per_rank else "")
        )
    return budget


def check_kernels(model, caches, codec_name: str = "") -> None:
    """On the Triton path, refuse (one line, naming it) a weight format or KV page type that has no GPU kernel."""
    for name, lin in model.linear_layers():
        try:
            weight = lin.device_weight(model.dtype)
        except ConfigError as e:
            raise ConfigError(f"weight format {lin.format.spec()} ({name}): {e}") from e
        if weight is None and lin.format is not None and lin.format.name not in ("fp32", "bf16", "fp16"):
            raise ConfigError(
                f"weight format {lin.format.spec()} ({name}) has no GPU kernel; run with --device cpu "
                "or quantize to int8, int4-gN, fp8, mxfp4, nvfp4, sparse24 or a GGUF block type"
            )
    for i, cache in enumerate(caches):
        pages = cache.attention_pages()
        try:
            if pages is None:
                raise ConfigError("its pages have no reader outside the codec")
            backend.check_attention(pages)
        except ConfigError as e:
            raise ConfigError(
                f"KV cache {codec_name} (layer {i}): no GPU attention kernel ({e}); choose another "
                "--kv-cache-dtype (bf16, int8, fp8, q8_0, q4_0, turboquant…) or --device cpu"
            ) from e


def describe(model, caches, decode: str) -> dict:
    """What runs each part on the model's device: backend, the weight layouts' kernels, the KV pages', decode."""
    out = backend.describe(model.device)
    if out["backend"] != "triton":
        return out
    layouts = {}
    for _, lin in model.linear_layers():
        if lin.format is not None:
            weight = lin.device_weight(model.dtype)
            layouts[lin.format.spec()] = "torch F.linear" if weight is None else weight.kernel
    pages = caches[0].attention_pages() if caches else None
    kv = None if pages is None else f"{pages['k_dtype']}/{pages.get('v_dtype') or pages['k_dtype']}"
    return {**out, "linear": layouts, "attention": f"triton paged attention ({kv} pages)", "decode": decode}


def memory_summary(device: Optional[torch.device]) -> Optional[dict]:
    """Free and total bytes of a CUDA device, or None on the CPU."""
    if device is None or torch.device(device).type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"free_bytes": free, "total_bytes": total}
