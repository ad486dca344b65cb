"""Which backend multiplies and attends: the native CPU kernels, or Triton (the GPU's kernels).

Triton runs where the tensors are on CUDA, and everywhere when ``BYTEDIET_BACKEND=triton`` is set: the GPU code
path on the CPU, its kernels in Triton's interpreter (``TRITON_INTERPRET=1``, set here if it is not), which is how
the tests keep that path from rotting without a GPU. The model's layers ask :func:`triton_selected` once per call
and hand their tensors to :func:`gemm` / :func:`attention_over_pages`; nothing else in the code names a backend.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from ..errors import ConfigError
from . import native_layouts

BACKEND_ENV = "BYTEDIET_BACKEND"
BACKENDS = ("auto", "triton")  # auto: native kernels on the CPU, Triton on CUDA


def forced() -> bool:
    """Whether ``BYTEDIET_BACKEND=triton`` asks for the Triton kernels whatever the device."""
    value = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ConfigError(f"{BACKEND_ENV}={value!r}: choose one of {', '.join(BACKENDS)}")
    return value == "triton"


def triton_selected(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run on ``x``: it is on CUDA, or ``BYTEDIET_BACKEND=triton`` is set."""
    return x.device.type == "cuda" or forced()


def name_for(device: torch.device | str) -> str:
    """The backend that runs on ``device``: ``triton`` (CUDA, or forced), else ``native`` (the CPU kernels)."""
    return "triton" if torch.device(device).type == "cuda" or forced() else "native"


def _interpret_without_gpu() -> None:
    """``BYTEDIET_BACKEND=triton`` without a GPU: Triton's interpreter, chosen before triton is first imported."""
    if os.environ.get(BACKEND_ENV, "").strip().lower() == "triton" and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_without_gpu()


def _triton_modules():
    """(gemm_blocks module, paged_attention module), imported on first use."""
    try:
        from .triton import gemm_blocks, paged_attention
    except ImportError as e:
        raise ConfigError(
            f"the Triton kernels cannot be imported ({e}); install triton (pip install triton) or run with --device cpu"
        ) from e
    return gemm_blocks, paged_attention


def has_gemm(type_id: int) -> bool:
    """Whether the Triton GEMM multiplies weights of this kernel type id (a GGML type or a bytediet layout)."""
    gemm_blocks, _ = _triton_modules()
    return int(type_id) in gemm_blocks.TYPES


def check_attention(pages: dict) -> None:
    """Refuse (ConfigError, one line) pages the Triton paged attention does not read: ``pages`` as a cache's
    ``attention_pages()`` gives them (page types, TurboQuant layouts); checked once, before the first step."""
    _, paged_attention = _triton_modules()
    try:
        paged_attention.check_pages(pages["k_dtype"], pages.get("v_dtype"), pages.get("k_side"), pages.get("v_side"))
    except (NotImplementedError, ValueError) as e:
        raise ConfigError(str(e).splitlines()[0]) from e


@dataclass(frozen=True)
class DeviceWeight:
    """A linear layer's weight as the GPU path multiplies it, prepared once (:func:`prepare`): ``kernel`` names
    what runs (reported by ``generate --json`` and ``bench``); calling it gives x (..., K) · Wᵀ (+ bias)."""

    kernel: str
    type_id: int
    blocks: Optional[torch.Tensor] = None  # the packed rows the Triton GEMM reads
    fp8: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # (E4M3 codes (N, K), scale (N,)): W8A8 _scaled_mm
    sparse: Optional[torch.Tensor] = None  # PyTorch's semi-structured 2:4 tensor (cuSPARSELt / CUTLASS)

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.fp8 is not None:
            from .triton.fp8 import fp8_linear

            return fp8_linear(x, *self.fp8, bias)
        if self.sparse is not None:
            from .triton.sparse24 import sparse24_linear

            return sparse24_linear(x, self.sparse, bias)
        return gemm(self.type_id, self.blocks, x, bias)


def prepare(type_id: int, blocks: torch.Tensor, dtype: torch.dtype) -> DeviceWeight:
    """The weight of layout ``type_id`` (rows ``blocks`` on its device) for activations of ``dtype``: FP8_ROW on
    FP8 tensor cores (W8A8 through ``torch._scaled_mm``, sm_89+), SPARSE24_F16 on 2:4 sparse tensor cores
    (sm_80+, shapes they take) — on CUDA; every other layout, and those elsewhere, by the Triton GEMM."""
    t = int(type_id)
    if blocks.device.type == "cuda" and t == native_layouts.FP8_ROW:
        from .triton.fp8 import fp8_unsupported_reason, fp8_weight_from_rows

        if fp8_unsupported_reason(blocks.device) is None and blocks.shape[0] % 16 == 0:
            qweight, scale = fp8_weight_from_rows(blocks)
            if qweight.shape[1] % 16 == 0:
                return DeviceWeight("fp8 W8A8 torch._scaled_mm", t, fp8=(qweight, scale))
    if blocks.device.type == "cuda" and t == native_layouts.SPARSE24_F16 and dtype in (torch.float16, torch.bfloat16):
        from .triton.sparse24 import semi_structured_unsupported_reason, sparse24_weight_from_rows

        k = native_layouts.row_weights(t, blocks.shape[1])
        if semi_structured_unsupported_reason(blocks.device) is None and blocks.shape[0] % 64 == 0 and k % 128 == 0:
            return DeviceWeight(
                "sparse24 semi-structured (2:4 tensor cores)", t, sparse=sparse24_weight_from_rows(blocks, dtype)
            )
    if not has_gemm(t):
        raise ConfigError(f"weight layout {t} has no GPU kernel; run with --device cpu")
    try:
        _triton_modules()[0].row_weights(t, blocks.shape[1])
    except ValueError as e:  # a row cut mid-block (a tensor-parallel shard of a tiny layer, an odd K)
        raise ConfigError(f"{e}: the GPU kernels read whole blocks; run with --device cpu") from e
    return DeviceWeight(f"triton gemm_blocks type {t}", t, blocks=blocks.contiguous())


def gemm(type_id: int, blocks: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (..., K) times the weight in ``blocks`` (out, row bytes) of layout ``type_id`` → (..., out) in x's dtype."""
    gemm_blocks, _ = _triton_modules()
    return gemm_blocks.gemm_blocks(int(type_id), blocks, x, bias)


def attention_over_pages(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """:func:`bytediet.kernels.ops.attention_over_pages` (the same arguments, without ``variant``) by the Triton paged
    attention (split-K flash-decoding), in q's dtype."""
    _, paged_attention = _triton_modules()
    # a float32 model gets float32 dots unless torch allows TF32 for its own float32 products
    exact = q.dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32
    out = paged_attention.attention_over_pages(q, *args, **kwargs, precision="ieee" if exact else None)
    return out.to(q.dtype)  # the kernel accumulates and returns float32


def describe(device: torch.device | str) -> dict:
    """What multiplies and attends on ``device``: the backend, and for Triton whether it is compiled or
    interpreted (``TRITON_INTERPRET=1``: the CPU test path)."""
    backend = name_for(device)
    out = {"backend": backend, "device": str(device)}
    if backend == "triton":
        out["triton"] = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    return out
