"""The kernels the rest of bytediet calls: native when this machine has them, the reference otherwise.

Every function here has a twin of the same name and signature in :mod:`bytediet.kernels.reference`
(plus an optional ``variant`` to force an ISA build, for tests) and a test comparing the two on fresh
random inputs for every variant this CPU can run.
"""
from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch

from . import reference
from .cpu.dispatch import NativeLibrary, native

NATIVE_GEMM_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})  # GGML Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K
_ACTIVATION_MODES = {"q8": 0, "f32": 1}


def _library(variant: Optional[str]) -> Optional[NativeLibrary]:
    return native(variant)


def has_native_gemm(ggml_type: int, variant: Optional[str] = None) -> bool:
    """Whether a native kernel multiplies this GGML block type here (else the reference runs)."""
    return int(ggml_type) in NATIVE_GEMM_TYPES and _library(variant) is not None


@functools.lru_cache(maxsize=None)
def _say_reference_once(what: str) -> None:
    warnings.warn(f"bytediet: no native kernel for {what}; it runs on the PyTorch reference path", stacklevel=3)


def quantize_rows_q8(x: torch.Tensor, variant: Optional[str] = None):
    """See :func:`bytediet.kernels.reference.quantize_rows_q8`."""
    lib = _library(variant)
    if lib is None:
        return reference.quantize_rows_q8(x)
    m, k = x.shape
    if k % reference.ACTIVATION_BLOCK:
        raise ValueError(f"activation rows of {k} values are not whole blocks of {reference.ACTIVATION_BLOCK}")
    x = x.to(torch.float32).contiguous()
    q = torch.empty(m, k, dtype=torch.int8)
    d = torch.empty(m, k // reference.ACTIVATION_BLOCK)
    s = torch.empty_like(d)
    lib.bd_quantize_rows_q8(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d, s


def gemm_blocks(ggml_type: int, blocks: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None,
                activations: str = "q8", variant: Optional[str] = None) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.gemm_blocks`."""
    lib = _library(variant)
    if lib is None or int(ggml_type) not in NATIVE_GEMM_TYPES or x.device.type != "cpu":
        if lib is not None:
            _say_reference_once(f"GGML type {int(ggml_type)}")
        return reference.gemm_blocks(ggml_type, blocks, x, bias, activations)
    mode = _ACTIVATION_MODES.get(activations)
    if mode is None:
        raise ValueError(f"activations must be 'q8' or 'f32', got {activations!r}")
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.dtype != torch.float32 or not x2.is_contiguous():
        x2 = x2.to(torch.float32).contiguous()
    n, m = blocks.shape[0], x2.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    rc = lib.bd_gemm_blocks(int(ggml_type), blocks.data_ptr(), n, k, x2.data_ptr(), m, y.data_ptr(),
                            None if b is None else b.data_ptr(), mode)
    if rc != 0:
        raise ValueError(f"GGML type {int(ggml_type)}: {k} values per row are not whole super-blocks")
    y = y.reshape(*x.shape[:-1], n)
    return y if x.dtype == torch.float32 else y.to(x.dtype)
