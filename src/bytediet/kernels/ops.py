"""The kernels the rest of bytediet calls: native when this machine has them, the reference otherwise.

Every function here has a twin of the same name and signature in :mod:`bytediet.kernels.reference`
(plus an optional ``variant`` to force an ISA build, for tests) and a test comparing the two on fresh
random inputs for every variant this CPU can run.
"""

from __future__ import annotations

import ctypes
import functools
import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import dense_gemm, native_layouts, reference, tuning
from .cpu.dispatch import NativeLibrary, native
from .cpu.structs import (
    LAYER_LINEARS,
    LAYER_TENSORS,
    CodePagesDesc,
    LayerDesc,
    LinearDesc,
    ModelDesc,
    TQPagesDesc,
    TQPartDesc,
)
from .decoder_spec import (
    ATTENTION_PAGE_TYPES,
    BLOCK_PAGE_TYPES,
    CODE_PAGE_TYPES,
    FLOAT_PAGE_DTYPES,
    PAGE_ALIGN,
    POLAR_MAX_DIM,
    CodePageSide,
    DecoderSpec,
    LinearSpec,
    TurboQuantPageSpec,
)
from .ggml_codecs import block_size_of
from .types import Activations, KVPage, Status, WeightType

NATIVE_GEMM_TYPES = frozenset(WeightType)  # GGML's block types and bytediet's layouts the native GEMMs multiply


class NativeKernelError(ValueError):
    """A native entry point refused its input (a :class:`~bytediet.kernels.types.Status` other than OK) and did no
    work; the message says which input and where it runs instead."""


def _status_name(rc: int) -> str:
    try:
        return Status(rc).name.lower().replace("_", " ")
    except ValueError:
        return f"status {rc}"


def _library(variant: Optional[str]) -> Optional[NativeLibrary]:
    return native(variant)


def native_library() -> Optional[NativeLibrary]:
    """The loaded native library (None: the reference kernels run), with this machine's tuning applied."""
    lib = _library(None)
    if lib is not None:
        _apply_tuning(lib.path, lib.bd_num_threads())
    return lib


@functools.lru_cache(maxsize=None)
def _apply_tuning(path: str, threads: int) -> None:
    tuning.apply(_library(None))


def tuned_kernel(ggml_type: int, n: int, k: int, batch: int = 1) -> Optional[str]:
    """``bytediet tune``'s winner for this product on this machine ("x4" or "rows"), or None (untuned)."""
    table = tuning.current(_library(None))
    return None if table is None else table.kernel_for(ggml_type, n, k, batch)


def has_native_gemm(ggml_type: int, variant: Optional[str] = None, k: Optional[int] = None) -> bool:
    """Whether a native kernel multiplies this block type here (else the reference runs); with ``k``, also
    whether rows of k weights are whole blocks of it (a tensor-parallel slice may not be)."""
    if int(ggml_type) not in NATIVE_GEMM_TYPES or _library(variant) is None:
        return False
    return k is None or (k % _block_weights(ggml_type) == 0 and k % reference.ACTIVATION_BLOCK == 0)


@functools.lru_cache(maxsize=None)
def _say_reference_once(what: str) -> None:
    warnings.warn(f"bytediet: no native kernel for {what}; it runs on the PyTorch reference path", stacklevel=3)


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) → (M, K) contiguous float32, a view when it already is one."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.to(torch.float32).contiguous()


def _like_input(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """y (M, N) float32 → (..., N) in x's leading shape and dtype."""
    y = y.reshape(*x.shape[:-1], y.shape[-1])
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor, variant: Optional[str] = None) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.gelu_tanh_mul` (one native pass over float32 CPU tensors)."""
    return _gated("bd_gelu_tanh_mul", reference.gelu_tanh_mul, gate, up, variant)


def silu_mul(gate: torch.Tensor, up: torch.Tensor, variant: Optional[str] = None) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.silu_mul` (one native pass over float32 CPU tensors)."""
    return _gated("bd_silu_mul", reference.silu_mul, gate, up, variant)


def _gated(native: str, twin: Callable, gate: torch.Tensor, up: torch.Tensor, variant: Optional[str]) -> torch.Tensor:
    """act(gate) · up by the native function ``native``, or by its twin (GPU tensors, autograd, other dtypes)."""
    lib = _library(variant) if gate.device.type == "cpu" else None  # no native build for GPU tensors
    if lib is None or _needs_grad(gate, up) or not _same_float32(gate, up):
        return twin(gate, up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    getattr(lib, native)(gate.data_ptr(), up.data_ptr(), gate.numel(), out.data_ptr())
    return out


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether autograd tracks these (recovery training): the torch ops then, for their backward."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _same_float32(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == torch.float32 and b.dtype == torch.float32 and a.shape == b.shape


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: Optional[str] = None) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.rms_norm` (one native pass over float32 CPU rows)."""
    lib = _library(variant) if x.device.type == "cpu" else None  # no native build for GPU tensors
    if (
        lib is None
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.shape[-1] != weight.numel()
        or _needs_grad(x, weight)
    ):
        return reference.rms_norm(x, weight, eps)  # autograd (recovery training) needs the torch ops
    x = x.contiguous()
    out = torch.empty_like(x)
    n = weight.numel()
    lib.bd_rms_norm_rows(x.data_ptr(), weight.contiguous().data_ptr(), x.numel() // n, n, eps, out.data_ptr())
    return out


def sample_rows(
    logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor, variant: Optional[str] = None
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.sample_rows` (two native passes over each float32 CPU row)."""
    lib = _library(variant) if logits.device.type == "cpu" else None  # no native build for GPU tensors
    if lib is None or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return reference.sample_rows(logits, inv_temperature, u)
    logits = logits.contiguous()
    inv_t = inv_temperature.to(device="cpu", dtype=torch.float32).contiguous()
    uu = u.to(device="cpu", dtype=torch.float64).contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.long)
    B, V = logits.shape
    lib.bd_sample_rows(logits.data_ptr(), B, V, inv_t.data_ptr(), uu.data_ptr(), out.data_ptr())
    return out


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


def quantize_rows_per_token(x: torch.Tensor, variant: Optional[str] = None):
    """See :func:`bytediet.kernels.reference.quantize_rows_per_token`."""
    lib = _library(variant)
    m, k = x.shape
    if lib is None or k % reference.ACTIVATION_BLOCK:
        return reference.quantize_rows_per_token(x)
    x = x.to(torch.float32).contiguous()
    q = torch.empty(m, k, dtype=torch.int8)
    d, s = torch.empty(m, k // reference.ACTIVATION_BLOCK), torch.empty(m, k // reference.ACTIVATION_BLOCK)
    lib.bd_quantize_rows_per_token(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), s.data_ptr())
    return q, d[:, 0].contiguous() if k else torch.zeros(m)


def quantize_rows_q16(x: torch.Tensor, variant: Optional[str] = None):
    """See :func:`bytediet.kernels.reference.quantize_rows_q16`."""
    lib = _library(variant)
    if lib is None:
        return reference.quantize_rows_q16(x)
    m, k = x.shape
    x = x.to(torch.float32).contiguous()
    q, q2 = torch.empty(m, k, dtype=torch.int8), torch.empty(m, k, dtype=torch.int8)
    d, d2, s = (torch.empty(m, k // reference.ACTIVATION_BLOCK) for _ in range(3))
    lib.bd_quantize_rows_q16(x.data_ptr(), m, k, q.data_ptr(), d.data_ptr(), q2.data_ptr(), d2.data_ptr(), s.data_ptr())
    return q, d, q2, d2, s


def gemm_blocks(
    ggml_type: int,
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activations: str = "q8",
    variant: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.gemm_blocks`."""
    lib = _library(variant)
    if lib is None or int(ggml_type) not in NATIVE_GEMM_TYPES or x.device.type != "cpu":
        if lib is not None:
            _say_reference_once(f"GGML type {int(ggml_type)}")
        return reference.gemm_blocks(ggml_type, blocks, x, bias, activations)
    mode = Activations.named(activations)
    if int(ggml_type) in native_layouts.FLOAT_TYPES and mode != Activations.F32:
        raise ValueError(
            f"layout {int(ggml_type)} holds float values: it multiplies f32 activations, not {activations!r}"
        )
    x2 = _float_rows(x)
    n, m, k = blocks.shape[0], x2.shape[0], x2.shape[1]
    y = torch.empty(m, n, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias if bias.dtype == torch.float32 and bias.is_contiguous() else bias.float().contiguous()
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    rc = lib.bd_gemm_blocks(
        int(ggml_type),
        blocks.data_ptr(),
        n,
        k,
        x2.data_ptr(),
        m,
        y.data_ptr(),
        None if b is None else b.data_ptr(),
        mode,
    )
    if rc != 0:
        raise ValueError(f"GGML type {int(ggml_type)}: {k} values per row are not whole super-blocks")
    return _like_input(y, x)


def _block_weights(ggml_type: int) -> int:
    """Weights per block (super-block) of a GGML type or a bytediet layout."""
    if native_layouts.is_native_layout(ggml_type):
        return native_layouts.block_weights(ggml_type)
    return block_size_of(ggml_type)


def row_weights(ggml_type: int, row_bytes: int) -> int:
    """K of a weight row of ``row_bytes`` bytes in this block type (GGML or bytediet layout)."""
    if native_layouts.is_native_layout(ggml_type):
        return native_layouts.row_weights(ggml_type, row_bytes)
    return row_bytes // reference.block_bytes(ggml_type) * _block_weights(ggml_type)


def dequantize_blocks(
    ggml_type: int, blocks: torch.Tensor, dtype: torch.dtype = torch.float32, variant: Optional[str] = None
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.dequantize_blocks` (the native decoder fuses and parallelises it;
    float32 and bfloat16 are written directly, other dtypes converted from float32)."""
    lib = _library(variant)
    if lib is None or int(ggml_type) not in NATIVE_GEMM_TYPES or blocks.device.type != "cpu":
        return reference.dequantize_blocks(ggml_type, blocks, dtype)
    n, k = blocks.shape[0], row_weights(ggml_type, blocks.shape[1])
    blocks = blocks if blocks.is_contiguous() else blocks.contiguous()
    direct = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty(n, k, dtype=direct)
    decode = lib.bd_dequantize_blocks_bf16 if direct == torch.bfloat16 else lib.bd_dequantize_blocks
    if decode(int(ggml_type), blocks.data_ptr(), n, k, out.data_ptr()) != 0:
        return reference.dequantize_blocks(ggml_type, blocks, dtype)
    return out.to(dtype)


PREFILL_TUNE_ROWS = tuning.PREFILL_ROWS  # `bytediet tune` times panel vs fp32 at this many rows


def has_gemm_panel(ggml_type: int, variant: Optional[str] = None) -> bool:
    """Whether the native library here has the register-blocked q16 GEMM for this type (AVX-512 VNNI builds,
    integer-code formats)."""
    lib = _library(variant)
    return lib is not None and bool(lib.bd_has_gemm_panel(int(ggml_type)))


def gemm_panel(
    ggml_type: int,
    blocks: torch.Tensor,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    variant: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.gemm_panel` (the reference runs where the library lacks it)."""
    lib = _library(variant)
    if lib is None or not lib.bd_has_gemm_panel(int(ggml_type)):
        return reference.gemm_panel(ggml_type, blocks, x, bias)
    x2 = _float_rows(x)
    n, m, k = blocks.shape[0], x2.shape[0], x2.shape[1]
    if row_weights(ggml_type, blocks.shape[1]) != k:
        raise ValueError(f"GGML type {int(ggml_type)} rows of {blocks.shape[1]} bytes do not hold {k} weights")
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.bd_gemm_panel(int(ggml_type), blocks.data_ptr(), n, k, x2.data_ptr(), m, y.data_ptr(), _ptr(b))
    if rc != 0:
        raise ValueError(f"GGML type {int(ggml_type)} ({n}×{k}) has no panel kernel (code {rc})")
    return _like_input(y, x)


# Products of at least this many rows (prefill chunks) in the q16 and f32 modes decode the weight once for a float
# GEMM (or the panel GEMM): compute-bound, where it beats the integer row kernels (bench/RESULTS.md, Recording 4).
DENSE_GEMM_MIN_ROWS = 64
# From this many rows (a batched decode step) the q16 panel GEMM beats the interleaved row kernels on every layer of
# SmolLM2 and Gemma-3 (even at 12, 1.2-2x at 16-48 rows: bench/RESULTS.md "Recording 15"); the same q16 numbers.
PANEL_MIN_ROWS = 12


@dataclass
class LinearWeight:
    """What :func:`linear` needs to choose the kernel of one linear layer: its shape, its activation mode
    (``types.Activations`` names), the rows a native block kernel multiplies (``native``: (WeightType id, rows),
    or None), the row-interleaved copy of them (``interleaved``, of GGML type ``interleaved_type``, or None), and
    ``apply(x, bias)``, the weight format's own product (``WeightFormat.apply``) for everything else."""

    in_features: int
    out_features: int
    activations: Optional[str]  # None: a format without native kernels (float weights)
    apply: Callable[[torch.Tensor, Optional[torch.Tensor]], torch.Tensor]
    native: Optional[tuple[int, torch.Tensor]] = None
    interleaved: Optional[torch.Tensor] = None
    interleaved_type: Optional[int] = None
    device: Optional[Callable] = None  # the GPU path: dtype → backend.DeviceWeight (or None: a float weight)


DECODE_CHUNK_BYTES = 64 << 20  # a large weight is decoded for a float GEMM this many bytes of rows at a time
# A weight whose float copy is over DECODE_CHUNK_BYTES (an lm_head: it leaves the caches) costs more to decode than a
# product of fewer rows than this saves over its x4 kernels — Zen 2 AVX2, 64 rows: Gemma-3's 262k × 640 head 301
# against 576 ms, SmolLM2's 49k × 576 48 against 58 ms (bench/RESULTS.md, Recording 24).
DECODED_LARGE_WEIGHT_MIN_ROWS = 256


def decoded_linear(ggml_type: int, blocks: torch.Tensor, x: torch.Tensor, gemm: torch.dtype) -> torch.Tensor:
    """x Wᵀ with W decoded from its blocks to ``gemm`` (a float GEMM, compute-bound prefill): a weight larger
    than :data:`DECODE_CHUNK_BYTES` decoded and multiplied a run of output rows at a time, so a 150k-token
    ``lm_head`` never exists whole in float32 (each output column the same dot product, up to the GEMM's blocking)."""
    n, k = blocks.shape[0], row_weights(ggml_type, blocks.shape[1])
    rows = max(1, DECODE_CHUNK_BYTES // (k * torch.finfo(gemm).bits // 8))
    xg = x.to(gemm)
    if rows >= n:
        return torch.nn.functional.linear(xg, dequantize_blocks(ggml_type, blocks, dtype=gemm)).to(x.dtype)
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    for lo in range(0, n, rows):
        w = dequantize_blocks(ggml_type, blocks[lo : lo + rows], dtype=gemm)
        y[..., lo : lo + w.shape[0]] = torch.nn.functional.linear(xg, w)
    return y


def linear(w: LinearWeight, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """y = x Wᵀ (+ bias), x (..., in_features) → (..., out_features), by the one kernel chosen here for this weight,
    input and machine: the panel GEMM or a decoded float GEMM for prefill-sized q16/f32 inputs, the interleaved (x4)
    kernels, the block kernels, else the format's own product; on the GPU path (CUDA, or BYTEDIET_BACKEND=triton)
    the Triton GEMM or the FP8 / 2:4 tensor cores as ``w.device`` prepared them (kernels/backend.py)."""
    if w.device is not None:
        prepared = w.device(x.dtype)
        if prepared is not None:
            return prepared(x, bias)
    native = w.native if x.device.type == "cpu" else None
    if native is not None and x.numel() >= DENSE_GEMM_MIN_ROWS * w.in_features and w.activations in ("q16", "f32"):
        # compute-bound: for q16, int8 dot products on a register-blocked panel of the weight where the library has
        # them, or the weight decoded once and a float GEMM (bf16 where asked for, dense_gemm.py); exact fp32 for
        # f32. q8 keeps its integer kernel, and q8-token (int8-w8a8) the rounding that defines the format.
        q16 = x.dtype == torch.float32 and w.activations == "q16"
        grad = _needs_grad(x)  # recovery training: keep F.linear's backward
        if (
            q16
            and not grad
            and dense_gemm.kind() == "int8"
            and has_gemm_panel(native[0])
            and tuned_kernel(native[0], w.out_features, w.in_features, PREFILL_TUNE_ROWS) != "fp32"
        ):
            return gemm_panel(native[0], native[1], x, bias)
        if q16 and not grad and w.interleaved is not None and _decode_outweighs(w, x.numel() // w.in_features):
            return gemm_x4(w.interleaved_type, w.interleaved, x, bias, w.activations)
        y = decoded_linear(native[0], native[1], x, dense_gemm.dtype() if q16 else x.dtype)
        return y if bias is None else y + bias.to(x.dtype)
    rows = x.numel() // w.in_features
    if native is not None and rows >= PANEL_MIN_ROWS and w.activations == "q16" and x.dtype == torch.float32:
        if has_gemm_panel(native[0]) and not _needs_grad(x):
            return gemm_panel(native[0], native[1], x, bias)
    if w.interleaved is not None and w.activations in X4_ACTIVATIONS:
        # the same weight laid out for the x4 kernels; a layer since switched to another mode reads its blocks below
        return gemm_x4(w.interleaved_type, w.interleaved, x, bias, w.activations)
    if native is not None:
        return gemm_blocks(native[0], native[1], x, bias, w.activations)
    return w.apply(x, bias)


def _decode_outweighs(w: LinearWeight, rows: int) -> bool:
    """Whether decoding ``w`` for a float GEMM of ``rows`` rows costs more than it saves over the x4 kernels: a
    weight whose float32 copy is over DECODE_CHUNK_BYTES, below DECODED_LARGE_WEIGHT_MIN_ROWS rows."""
    return w.out_features * w.in_features * 4 > DECODE_CHUNK_BYTES and rows < DECODED_LARGE_WEIGHT_MIN_ROWS


# --- row-interleaved (x4) weights ----------------------------------------------------------------------------

X4_TYPES = reference.X4_TYPES  # Q4_0, Q4_1, Q5_0, Q8_0 (gemm_x4.cpp), Q4_K, Q6_K (gemm_kx4.cpp)


def can_interleave(ggml_type: int, n: int, k: int) -> bool:
    """Whether ``repack_x4`` takes this weight (and a native library is here to use it)."""
    return (
        int(ggml_type) in X4_TYPES
        and n % 4 == 0
        and k % block_size_of(int(ggml_type)) == 0
        and _library(None) is not None
    )


def repack_x4(ggml_type: int, blocks: torch.Tensor, variant: Optional[str] = None) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.repack_x4`."""
    lib = _library(variant)
    if lib is None:
        return reference.repack_x4(ggml_type, blocks)
    n = blocks.shape[0]
    k = row_weights(ggml_type, blocks.shape[1])
    blocks = blocks.contiguous()
    row_bytes = lib.bd_x4_row_bytes(int(ggml_type), k)
    out = torch.empty(n * row_bytes, dtype=torch.uint8)
    rc = lib.bd_repack_x4(int(ggml_type), blocks.data_ptr(), n, k, out.data_ptr()) if row_bytes else -1
    if rc != 0:
        raise ValueError(
            f"GGML type {int(ggml_type)} ({n}×{k}) does not interleave (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, "
            "Q6_K with rows % 4 == 0)"
        )
    return out.reshape(n, -1)


X4_ACTIVATIONS = ("q8", "q16")  # the activation modes the interleaved (x4) kernels multiply


def gemm_x4(
    ggml_type: int,
    packed: torch.Tensor,
    x: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    activations: str = "q8",
    variant: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.gemm_x4`."""
    lib = _library(variant)
    if lib is None:
        return reference.gemm_x4(ggml_type, packed, x, bias, activations)
    if activations not in X4_ACTIVATIONS:
        raise ValueError(f"the interleaved kernels take q8 or q16 activations, got {activations!r}")
    x2 = _float_rows(x)
    n, m, k = packed.shape[0], x2.shape[0], x2.shape[1]
    if packed.shape[1] != lib.bd_x4_row_bytes(int(ggml_type), k):
        raise ValueError(
            f"interleaved GGML type {int(ggml_type)} rows of {packed.shape[1]} bytes do not hold {k} weights"
        )
    y = torch.empty(m, n, dtype=torch.float32)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.bd_gemm_x4(
        int(ggml_type), packed.data_ptr(), n, k, x2.data_ptr(), m, y.data_ptr(), _ptr(b), Activations.named(activations)
    )
    if rc != 0:
        raise ValueError(f"GGML type {int(ggml_type)} ({n}×{k}) has no interleaved kernel")
    return _like_input(y, x)


# --- the one-call decode step --------------------------------------------------------------------------------


def _code_side(page_type: str, side: Optional[CodePageSide], d: int) -> tuple[Optional[CodePagesDesc], list]:
    """(the C struct of a code page type's side data, the tensors it points into) — (None, []) for other pages."""
    if page_type not in CODE_PAGE_TYPES:
        return None, []
    if side is None:
        raise ValueError(f"{page_type!r} pages need their CodePageSide (scales, zero points)")
    as_type = lambda t, dtype: None if t is None else t.to(dtype).contiguous()
    scale, zero, stage = (as_type(t, torch.float16) for t in (side.scale, side.zero, side.stage))
    stage_of = as_type(side.stage_of, torch.int32)
    transform, table = (as_type(t, torch.float32) for t in (side.transform, side.table))
    window = side.window or side.group
    missing = [
        what
        for what, gone in (
            ("zero points", zero is None and (page_type.startswith(("kivi", "int")))),
            ("group size", page_type.startswith("kivi") and side.group < 1),
            ("staging pages and window", stage_of is not None and (stage is None or window < 1)),
            ("sketch or rotation", transform is None and page_type.startswith(("qjl", "polar"))),
            ("centroid cos/sin table", table is None and page_type == "polarquant"),
        )
        if gone
    ]
    if missing:
        raise ValueError(f"{page_type!r} pages need their {', '.join(missing)}")
    keep = [t for t in (scale, zero, stage_of, stage, transform, table) if t is not None]
    return CodePagesDesc(
        _ptr(scale), _ptr(zero), _ptr(stage_of), _ptr(stage), side.group, window, _ptr(transform), _ptr(table)
    ), keep


def _ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _addr(desc: Optional[ctypes.Structure]) -> Optional[int]:
    return None if desc is None else ctypes.addressof(desc)


def _query_batch(q, out, hkv, scale, window, positions, token_rows, block_tables, block_size) -> tuple[list, list]:
    """(args, keep): the arguments both native paged attentions take for the queries and their batch (dispatch's
    _ATTENTION_BATCH), and the int64 index tensors they point at, to keep alive through the call."""
    keep = [x.to(torch.int64).contiguous() for x in (positions, token_rows, block_tables)]
    t, hq, d = q.shape
    args = [q.data_ptr(), out.data_ptr(), t, hq, hkv, d, scale, window or 0, *(x.data_ptr() for x in keep)]
    return args + [block_tables.shape[1], block_size], keep


def _linear_desc(lin: LinearSpec) -> LinearDesc:
    return LinearDesc(
        _ptr(lin.blocks), _ptr(lin.bias), lin.n, lin.k, lin.ggml_type, int(lin.interleaved), _ptr(lin.source)
    )


def _tq_desc(pages: TurboQuantPageSpec) -> TQPagesDesc:
    if not 1 <= len(pages.parts) <= 2:
        raise ValueError(f"the native step reads TurboQuant pages of 1 or 2 parts, got {len(pages.parts)}")
    if (pages.rope_mean is None) != (pages.inv_freq is None):
        raise ValueError("TurboQuant pages with a pre-RoPE mean need the layer's inv_freq, and only they do")
    desc = TQPagesDesc(
        channels=_ptr(pages.channels),
        mean=_ptr(pages.mean),
        rope_mean=_ptr(pages.rope_mean),
        inv_freq=_ptr(pages.inv_freq),
        num_parts=len(pages.parts),
    )
    for i, p in enumerate(pages.parts):
        desc.parts[i] = TQPartDesc(
            _ptr(p.rotation),
            _ptr(p.codebook),
            _ptr(p.norm),
            _ptr(p.idx),
            p.dim,
            p.bits,
            0,
            _ptr(p.signs),
            _ptr(p.res_norm),
            _ptr(p.sketch),
        )
    return desc


def _model_desc(spec: DecoderSpec) -> ModelDesc:
    layers = (LayerDesc * len(spec.layers))()
    keep = []  # the TurboQuant descriptors the layers point at
    for i, ls in enumerate(spec.layers):
        layer = layers[i]
        for name in LAYER_TENSORS:
            setattr(layer, name, _ptr(getattr(ls, name)))
        for name in LAYER_LINEARS:
            setattr(layer, name, _linear_desc(getattr(ls, name)))
        layer.window = ls.window
        layer.k_scale, layer.v_scale = _ptr(ls.k_scale), _ptr(ls.v_scale)
        layer.k_rot, layer.v_rot = _ptr(ls.k_rot), _ptr(ls.v_rot)
        layer.k_dtype = KVPage.named(ls.k_dtype)
        layer.v_dtype = KVPage.named(ls.v_dtype or ls.k_dtype)
        if ls.k_dtype == "turboquant":  # keys, values or both (the other side's pages: k_cache / v_cache)
            keep.append(_tq_desc(ls.k_tq))
            layer.k_tq = ctypes.addressof(keep[-1])
        if (ls.v_dtype or ls.k_dtype) == "turboquant":
            keep.append(_tq_desc(ls.v_tq))
            layer.v_tq = ctypes.addressof(keep[-1])
    model = ModelDesc(
        ctypes.cast(layers, ctypes.POINTER(LayerDesc)),
        len(spec.layers),
        spec.hidden,
        spec.intermediate,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.eps,
        spec.attention_scale,
        int(spec.gelu),
        int(spec.sandwich),
        Activations.named(spec.activations),
        0,
    )
    model._layers, model._tq = layers, keep  # keep what the struct points at alive with it
    return model


def attention_over_pages(
    q: torch.Tensor,
    positions: torch.Tensor,
    token_rows: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    scale: float,
    window: Optional[int],
    k_dtype: str,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: Optional[torch.Tensor] = None,
    v_scale: Optional[torch.Tensor] = None,
    v_dtype: Optional[str] = None,
    k_side: Optional[CodePageSide] = None,
    v_side: Optional[CodePageSide] = None,
    variant: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.attention_over_pages` (native: flash-decoding over the pages in
    place, every token of a ragged batch in one call; code pages widened row by row from their side data, QJL keys
    scored on their sign bits against the query sketched once, PolarQuant's against the query rotated once)."""
    lib = _library(variant)
    t, hq, d = q.shape
    v_dtype = v_dtype or k_dtype
    args = (q, positions, token_rows, block_tables, block_size, scale, window, k_dtype, k_cache, v_cache, k_scale)
    args += (v_scale, v_dtype, k_side, v_side)  # attention_over_pages's arguments, as the reference takes them
    if k_dtype == "turboquant" or v_dtype == "turboquant":
        return _turboquant_attention(lib, args)
    readable = ATTENTION_PAGE_TYPES + CODE_PAGE_TYPES
    fits = lambda t: d % PAGE_ALIGN.get(t, 8) == 0 and (t != "polarquant" or d <= POLAR_MAX_DIM)
    if (
        lib is None
        or d % 8
        or q.dtype != torch.float32
        or k_dtype not in readable
        or v_dtype not in readable
        or not (fits(k_dtype) and fits(v_dtype))
    ):
        return reference.attention_over_pages(*args)
    q = q.contiguous()
    (k_desc, k_keep), (v_desc, v_keep) = _code_side(k_dtype, k_side, d), _code_side(v_dtype, v_side, d)
    out = torch.empty_like(q)
    batch, keep = _query_batch(q, out, k_cache.shape[1], scale, window, positions, token_rows, block_tables, block_size)
    rc = lib.bd_paged_attention(
        KVPage.named(k_dtype),
        KVPage.named(v_dtype),
        *batch,
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        _ptr(k_scale),
        _ptr(v_scale),
        _addr(k_desc),
        _addr(v_desc),
    )
    del keep, k_keep, v_keep  # the index and side tensors lived through the call
    if rc != 0:
        raise ValueError(
            f"native paged attention refused {k_dtype!r} keys, {v_dtype!r} values, {hq} heads over "
            f"{k_cache.shape[1]} KV heads of dim {d}"
        )
    return out


# query heads per KV head and head_dim the native TurboQuant attention takes: csrc/turboquant_pages.cpp's kMaxGroup,
# kMaxHeadDim (the native decode step checks the same, models/native_decode.py)
TQ_MAX_GROUP, TQ_MAX_HEAD_DIM = 64, 512


def _turboquant_attention(lib, args: tuple) -> torch.Tensor:
    """attention_over_pages on TurboQuant pages — keys (MSE or inner-product variant), values (MSE) or both, their
    :class:`TurboQuantPageSpec` in k_side/v_side; the other side row or block pages (k_cache/v_cache, with
    k_scale/v_scale: an ``auto:<bits>`` plan's k=q5_0,v=turboquant4) — by the decode step's kernel on codes, every
    token with its block table row."""
    q, positions, token_rows, block_tables, block_size, scale, window, k_dtype, k_cache, v_cache, k_scale = args[:11]
    v_scale, v_dtype, k_side, v_side = args[11:]
    t, hq, d = q.shape
    tq = [side for dtype, side in ((k_dtype, k_side), (v_dtype, v_side)) if dtype == "turboquant"]
    rows = [(dtype, pages) for dtype, pages in ((k_dtype, k_cache), (v_dtype, v_cache)) if dtype != "turboquant"]
    hkv = tq[0].parts[0].norm.shape[1]
    bits_ok = all(1 <= p.bits <= 8 for side in tq for p in side.parts)
    rows_ok = all(
        dtype in ATTENTION_PAGE_TYPES and pages is not None and d % PAGE_ALIGN.get(dtype, 8) == 0
        for dtype, pages in rows
    )
    if (
        lib is None
        or q.dtype != torch.float32
        or d % 8
        or d > TQ_MAX_HEAD_DIM
        or hq // hkv > TQ_MAX_GROUP
        or not bits_ok
        or not rows_ok
    ):
        return reference.attention_over_pages(*args)
    q = q.contiguous()
    k_desc, v_desc = (
        _tq_desc(side) if dtype == "turboquant" else None for dtype, side in ((k_dtype, k_side), (v_dtype, v_side))
    )
    out = torch.empty_like(q)
    batch, keep = _query_batch(q, out, hkv, scale, window, positions, token_rows, block_tables, block_size)
    rc = lib.bd_turboquant_attention(
        KVPage.named(k_dtype),
        KVPage.named(v_dtype),
        _addr(k_desc),
        _addr(v_desc),
        _ptr(k_cache),
        _ptr(v_cache),
        _ptr(k_scale),
        _ptr(v_scale),
        *batch,
    )
    del keep
    if rc != 0:
        raise ValueError(
            f"native TurboQuant attention refused {k_dtype!r} keys, {v_dtype!r} values, {hq} heads over "
            f"{hkv} KV heads of dim {d}"
        )
    return out


def _page_row(page_type: str, d: int) -> tuple[torch.dtype, int]:
    """(element dtype, elements) of a page row of ``d`` values of this page type (GGML block pages: uint8 bytes)."""
    if page_type in BLOCK_PAGE_TYPES:
        return torch.uint8, d // 32 * reference.block_bytes(BLOCK_PAGE_TYPES[page_type])
    return FLOAT_PAGE_DTYPES.get(page_type, torch.uint8), d


def _row_values(page_type: str, width: int) -> int:
    """D, the values of a page row of ``width`` elements of this page type (the inverse of _page_row)."""
    if page_type in BLOCK_PAGE_TYPES:
        return width // reference.block_bytes(BLOCK_PAGE_TYPES[page_type]) * 32
    return width


def read_kv_rows(
    page_type: str, pages: torch.Tensor, scales: Optional[torch.Tensor] = None, variant: Optional[str] = None
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.read_kv_rows` (the page decoding of the native attention)."""
    lib = _library(variant)
    d = _row_values(page_type, pages.shape[-1])
    if lib is None or d % 8 or page_type not in ATTENTION_PAGE_TYPES:
        return reference.read_kv_rows(page_type, pages, scales)
    pages = pages.contiguous()
    scales = None if scales is None else scales.contiguous()
    out = torch.empty(*pages.shape[:-1], d, dtype=torch.float32)
    rc = lib.bd_read_kv_rows(
        KVPage.named(page_type), pages.data_ptr(), _ptr(scales), pages[..., 0].numel(), d, out.data_ptr()
    )
    if rc != 0:
        raise NativeKernelError(f"the native kernels read no {page_type!r} rows of {d} values")
    return out


def write_kv_rows(page_type: str, x: torch.Tensor, variant: Optional[str] = None):
    """See :func:`bytediet.kernels.reference.write_kv_rows` (the page encoding of the native decode step)."""
    lib = _library(variant)
    d = x.shape[-1]
    if lib is None or d % 8 or page_type not in ATTENTION_PAGE_TYPES or (page_type in BLOCK_PAGE_TYPES and d % 32):
        return reference.write_kv_rows(page_type, x)
    x = x.to(torch.float32).contiguous()
    dtype, width = _page_row(page_type, d)
    pages = torch.empty(*x.shape[:-1], width, dtype=dtype)
    scales = torch.empty(*x.shape[:-1], 1, dtype=torch.float16) if page_type in ("int8", "fp8") else None
    rc = lib.bd_write_kv_rows(
        KVPage.named(page_type), x.data_ptr(), x[..., 0].numel(), d, pages.data_ptr(), _ptr(scales)
    )
    if rc != 0:
        raise NativeKernelError(f"the native kernels write no {page_type!r} rows of {d} values")
    return pages, scales


def decode_step(
    spec: DecoderSpec,
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    token_rows: Optional[torch.Tensor] = None,
    variant: Optional[str] = None,
) -> torch.Tensor:
    """See :func:`bytediet.kernels.reference.decode_step`."""
    lib = _library(variant)
    if lib is None:
        return reference.decode_step(spec, x, positions, slots, block_tables, block_size, token_rows)
    if spec.native is None:
        spec.native = _model_desc(spec)
    x = x.to(torch.float32).contiguous().clone()
    positions, slots = positions.contiguous(), slots.contiguous()
    block_tables = block_tables.contiguous()
    rows = None if token_rows is None else token_rows.to(torch.int64).contiguous()
    rc = lib.bd_decode_step(
        ctypes.addressof(spec.native),
        x.data_ptr(),
        x.shape[0],
        positions.data_ptr(),
        slots.data_ptr(),
        _ptr(rows),
        block_tables.data_ptr(),
        block_tables.shape[1],
        block_size,
    )
    if rc != Status.OK:
        pages = sorted({(ls.k_dtype, ls.v_dtype or ls.k_dtype) for ls in spec.layers})
        raise NativeKernelError(
            f"the native decode step refused its layers' pages ({_status_name(rc)}): keys/values "
            f"{', '.join('/'.join(p) for p in pages)} at head_dim {spec.head_dim}; it reads row, "
            "block and TurboQuant pages only — run these layers on the module path"
        )
    return x


def turboquant_write(
    pages: TurboQuantPageSpec,
    x: torch.Tensor,
    slots: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    variant: Optional[str] = None,
) -> None:
    """See :func:`bytediet.kernels.reference.turboquant_write` (the decode step's write of the new token)."""
    lib = _library(variant)
    if lib is None:
        return reference.turboquant_write(pages, x, slots, positions)
    if pages.rope_mean is not None and positions is None:
        raise ValueError("keys calibrated with a pre-RoPE mean are written at their positions: pass positions")
    x = x.to(torch.float32).contiguous()
    slots = slots.to(torch.int64).contiguous()
    pos = (torch.zeros_like(slots) if positions is None else positions).to(torch.int64).contiguous()
    desc = _tq_desc(pages)
    if (
        lib.bd_turboquant_write(
            ctypes.addressof(desc), x.data_ptr(), x.shape[0], slots.data_ptr(), pos.data_ptr(), x.shape[1], x.shape[2]
        )
        != 0
    ):
        raise NativeKernelError("the native TurboQuant write refused its pages")
