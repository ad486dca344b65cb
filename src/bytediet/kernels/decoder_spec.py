"""A decoder stack described as plain tensors, for the one-call decode step (``ops.decode_step``).

The model layer builds a :class:`DecoderSpec` from its modules and KV pages once; the kernels read the
tensors in place (no copies), so the spec stays valid as long as the model and caches live.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from gguf import GGMLQuantizationType as T


@dataclass
class LinearSpec:
    """A linear layer in GGML blocks: blocks (n, bytes per row) uint8, bias (n,) float32 or None.

    ``interleaved``: the blocks are in the row-interleaved layout of ``ops.repack_x4`` (same byte count);
    ``source``: then the GGML blocks themselves, which the panel GEMM reads for steps of many rows.
    """

    blocks: torch.Tensor
    ggml_type: int
    n: int
    k: int
    bias: Optional[torch.Tensor] = None
    interleaved: bool = False
    source: Optional[torch.Tensor] = None


ROW_PAGE_TYPES = ("fp32", "bf16", "fp16", "int8", "fp8")  # pages stored as (slots, H, D) rows (ids 0..4)
# llama.cpp's KV cache types (kvcache/ggml_block.py): pages (slots, H, D/32 · block bytes) uint8, each row the
# GGML blocks of its D values (ids 6..9) → their GGML type
BLOCK_PAGE_TYPES = {"q8_0": T.Q8_0, "q5_0": T.Q5_0, "q4_1": T.Q4_1, "q4_0": T.Q4_0}
# code pages the native attention reads (not the decode step: their codecs quantize groups of tokens), each with a
# CodePageSide: KIVI's keys (kvcache/kivi.py) at 2 and 4 bits (ids 10, 11), and per-token asymmetric codes in groups
# of 32 channels (kvcache/tokenwise.py: KIVI's and QJL's values; named as that half) at 2 and 4 bits (ids 12, 13)
CODE_PAGE_TYPES = ("kivi2-keys", "kivi4-keys", "int2-token-g32-asym", "int4-token-g32-asym")
# the page types of the kernels; a type's id in the kernels is its index here (5: TurboQuant's codes)
KV_PAGE_TYPES = ROW_PAGE_TYPES + ("turboquant",) + tuple(BLOCK_PAGE_TYPES) + CODE_PAGE_TYPES
# the page types the native attention (ops.attention_over_pages) reads in place, keys of one and values of another
ATTENTION_PAGE_TYPES = ROW_PAGE_TYPES + tuple(BLOCK_PAGE_TYPES)
CODE_PAGE_BITS = {"kivi2-keys": 2, "kivi4-keys": 4, "int2-token-g32-asym": 2, "int4-token-g32-asym": 4}
FLOAT_PAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # their element types


@dataclass
class CodePageSide:
    """What code pages (:data:`CODE_PAGE_TYPES`, codes (slots, H, D·bits/8) uint8 packed as kvcache/bitpack.py) keep
    beside them; x = code · scale + zero (float32, two roundings), per channel or per group of 32 channels.

    KIVI keys: ``scale``/``zero`` (slots / group, H, D) float16 per key group of ``group`` tokens (a slot's group is
    slot // group); ``stage_of`` (slots / group,) int32, the staging page of a group still open, else −1, whose rows
    are read from ``stage`` (pages, group, H, D) float16 instead. Per-token codes: ``scale``/``zero`` (slots, H,
    D/32) float16; the rest unused.
    """

    scale: torch.Tensor
    zero: torch.Tensor
    stage_of: Optional[torch.Tensor] = None
    stage: Optional[torch.Tensor] = None
    group: int = 0


@dataclass
class TurboQuantPart:
    """One part of TurboQuant pages (arXiv 2504.19874, MSE variant): ``dim`` channels at ``bits`` (1…8) bits.

    rotation (dim, dim) float32 R (a part x is stored as u = x Rᵀ / ‖x‖); codebook (2**bits,) float32 sorted
    centroids; norm (slots, Hkv) float16 ‖x‖; idx (slots, Hkv, dim·bits/8) uint8, the nearest centroid of each
    coordinate of u packed little-endian (code j of each 8-code word in bits j·b … j·b + b − 1).
    """

    dim: int
    bits: int
    rotation: torch.Tensor
    codebook: torch.Tensor
    norm: torch.Tensor
    idx: torch.Tensor

    def __post_init__(self) -> None:
        # constants: copied to the layout the kernel reads (a Haar rotation from torch.linalg.qr is column-major)
        self.rotation = self.rotation.float().contiguous()
        self.codebook = self.codebook.float().contiguous()
        if not (self.norm.is_contiguous() and self.idx.is_contiguous()):
            raise ValueError("TurboQuant pages (norm, idx) must be contiguous: the native step writes them in place")


@dataclass
class TurboQuantPageSpec:
    """K (or V) pages of kvcache's ``turboquant`` codec: x − mean, channels reordered (``channels`` (Hkv, D) int64,
    outliers first; None = identity), cut into 1 or 2 :class:`TurboQuantPart` s in that order.

    Keys calibrated with a pre-RoPE mean μ store x − RoPE(μ, p) at position p instead (``rope_mean`` (Hkv, D),
    rotated by the layer's ``inv_freq`` (D/2,), rotate-half RoPE); their scores gain q·RoPE(μ, p)."""

    parts: list[TurboQuantPart]
    channels: Optional[torch.Tensor] = None
    mean: Optional[torch.Tensor] = None  # (Hkv, D) float32, a calibrated constant
    rope_mean: Optional[torch.Tensor] = None  # (Hkv, D) float32, a calibrated pre-RoPE key mean
    inv_freq: Optional[torch.Tensor] = None  # (D/2,) float32, with rope_mean


@dataclass
class LayerSpec:
    """One decoder layer. Norm weights (hidden,) or (head_dim,) float32.

    Caches: (slots, Hkv, D) pages of ``kv_dtype``: float32, bfloat16 or float16 values, or (int8) uint8 codes
    q + 128 with ``k_scale``/``v_scale`` (slots, Hkv, 1) float16 (x = q · scale: kvcache's ``int8`` codec), or
    (fp8) uint8 E4M3 codes with the same scales (x = e4m3(code) · scale: the uncalibrated ``fp8`` codec), or
    (q8_0, q5_0, q4_1, q4_0) uint8 (slots, Hkv, D/32 · block bytes) GGML blocks (llama.cpp's KV types), or
    (turboquant) the codes, norms and constants of ``k_tq``/``v_tq``. ``kv_dtype`` is the keys' type, and the
    values' unless ``v_dtype`` names another (any of :data:`ATTENTION_PAGE_TYPES`: k=q8_0,v=q4_0).
    """

    attn_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    inv_freq: torch.Tensor  # (head_dim / 2,)
    k_cache: Optional[torch.Tensor]
    v_cache: Optional[torch.Tensor]
    q: LinearSpec
    k: LinearSpec
    v: LinearSpec
    o: LinearSpec
    gate: LinearSpec
    up: LinearSpec
    down: LinearSpec
    window: int = 0  # sliding window in tokens, 0 = full causal
    pre_ffn_norm: Optional[torch.Tensor] = None  # sandwich norms (gemma3)
    post_ffn_norm: Optional[torch.Tensor] = None
    q_norm: Optional[torch.Tensor] = None  # per-head q/k RMSNorm (gemma3)
    k_norm: Optional[torch.Tensor] = None
    kv_dtype: str = "fp32"  # one of KV_PAGE_TYPES: the keys' pages, and the values' unless v_dtype
    v_dtype: Optional[str] = None  # the values' pages when their type differs (both ATTENTION_PAGE_TYPES)
    k_scale: Optional[torch.Tensor] = None  # int8 and fp8 pages only
    v_scale: Optional[torch.Tensor] = None
    k_tq: Optional[TurboQuantPageSpec] = None  # turboquant pages only (k_cache, v_cache are then None)
    v_tq: Optional[TurboQuantPageSpec] = None
    k_rot: Optional[torch.Tensor] = None  # (D, D) float32 R: key pages hold k Rᵀ (kvcache/rotated.py); q is rotated too
    v_rot: Optional[torch.Tensor] = None  # value pages hold v Rᵀ; the attention output is rotated back (· R)


@dataclass
class DecoderSpec:
    layers: list[LayerSpec]
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    attention_scale: float
    gelu: bool  # GELU (tanh) instead of SiLU
    sandwich: bool  # gemma3: x += norm(attn(norm(x))), x += norm(mlp(norm(x)))
    activations: str = "q8"  # "q8", "q16", "f32" or "q8-token" (int8-w8a8), as in ops.gemm_blocks
    native: Any = field(default=None, repr=False)  # the C structs built from this spec (kernels/ops.py)
