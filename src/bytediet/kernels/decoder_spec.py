"""A decoder stack described as plain tensors, for the one-call decode step (``ops.decode_step``).

The model layer builds a :class:`DecoderSpec` from its modules and KV pages once; the kernels read the
tensors in place (no copies), so the spec stays valid as long as the model and caches live.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from gguf import GGMLQuantizationType as T

from .types import KVPage, PageKind, page_names


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


# the page types by kind (ids and names: types.KVPage). Row pages: (slots, H, D) rows of one element type
ROW_PAGE_TYPES = page_names(PageKind.ROW)
# llama.cpp's KV cache types (kvcache/ggml_block.py): pages (slots, H, D/32 · block bytes) uint8, each row the
# GGML blocks of its D values → their GGML type (the enum member's name)
BLOCK_PAGE_TYPES = {name: T[KVPage.named(name).name] for name in page_names(PageKind.BLOCK)}
# code pages the native attention reads (not the decode step: their codecs quantize groups of tokens or keep
# per-layer transforms), each with a CodePageSide (kernels/cpu/csrc/code_pages.h): per-channel keys over groups of
# tokens at 2 and 4 bits (KIVI's, kvcache/kivi.py, and HF QuantizedCache's, kvcache/hfquant.py, behind its
# full-precision window), per-token asymmetric codes in groups of 32 channels (kvcache/tokenwise.py: KIVI's and QJL's
# values) and of 64 (HF's values, behind their window) at 2 and 4 bits, QJL keys of sketch m = r·D (kvcache/qjl.py:
# r = 1..4, scored on the sign bits) and PolarQuant's keys and values
CODE_PAGE_TYPES = page_names(PageKind.CODE)
KV_PAGE_TYPES = tuple(m.page_name for m in KVPage)  # every page type's name, in id order
# the row and block page types the native attention (ops.attention_over_pages) reads in place, keys of one and values
# of another; it also reads CODE_PAGE_TYPES with their side data, and "turboquant" pages (MSE or inner-product keys,
# MSE values) described by a TurboQuantPageSpec per half
ATTENTION_PAGE_TYPES = ROW_PAGE_TYPES + tuple(BLOCK_PAGE_TYPES)
CODE_PAGE_BITS = {
    "kivi2-keys": 2,
    "kivi4-keys": 4,
    "int2-token-g32-asym": 2,
    "int4-token-g32-asym": 4,
    "int2-token-g64-asym": 2,
    "int4-token-g64-asym": 4,
    "qjl1-keys": 1,
    "qjl2-keys": 1,
    "qjl3-keys": 1,
    "qjl4-keys": 1,
}  # bits per code (PolarQuant: 4 at its first level, 2 above)
# head_dim must be a multiple of this for the native attention to read a page type (GGML blocks: 32 values)
PAGE_ALIGN = {
    **{t: 32 for t in BLOCK_PAGE_TYPES},
    "int2-token-g32-asym": 32,
    "int4-token-g32-asym": 32,
    "int2-token-g64-asym": 64,
    "int4-token-g64-asym": 64,
    "polarquant": 64,
}
POLAR_MAX_DIM = 512  # the widest PolarQuant row the native attention widens
FLOAT_PAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # their element types


@dataclass
class CodePageSide:
    """What code pages (:data:`CODE_PAGE_TYPES`, codes (slots, H, row bytes) uint8 packed as kvcache/bitpack.py) keep
    beside them.

    Per-channel keys (``kivi<b>-keys``): x = code · scale + zero (float32, two roundings), ``scale``/``zero``
    (slots / group, H, D) float16 per key group of ``group`` tokens (a slot's group is slot // group). Per-token codes
    (``int<b>-token-g<G>-asym``): the same with ``scale``/``zero`` (slots, H, D/G) float16. Either may keep its newest
    tokens in full precision: ``stage_of`` (slots / window,) int32, the staging page of a ``window`` of tokens still
    open (KIVI: its key group, ``window`` 0 = ``group``; HF QuantizedCache: its residual), else −1, whose rows are
    read from ``stage`` (pages, window, H, D) float16 instead.

    QJL keys (``qjl<r>-keys``, D·r sign bits a row): k ≈ √(π/2)/m · ‖k − μ‖ · Sᵀ sign, with ``scale`` (slots, H) float16
    ‖k − μ‖ and ``transform`` the sketch S (m = r·D, D) float32; the calibrated mean μ adds q·μ to every score of a
    query, which the softmax ignores, so it is not kept here. PolarQuant (row: the 4-bit level-1 angle codes, then the
    2-bit codes of levels 2, 3, 4): ``scale`` (slots, H, D/16) float16 radii, ``transform`` its rotation R (D, D),
    ``table`` (56,) float32 cos then sin of the centroids of level 1 (16 each), then of levels 2, 3, 4 (4 each); the
    row is R-rotated, x = y R.
    """

    scale: torch.Tensor
    zero: Optional[torch.Tensor] = None
    stage_of: Optional[torch.Tensor] = None
    stage: Optional[torch.Tensor] = None
    group: int = 0
    window: int = 0
    transform: Optional[torch.Tensor] = None
    table: Optional[torch.Tensor] = None


@dataclass
class TurboQuantPart:
    """One part of TurboQuant pages (arXiv 2504.19874, MSE variant): ``dim`` channels at ``bits`` (1…8) bits.

    rotation (dim, dim) float32 R (a part x is stored as u = x Rᵀ / ‖x‖); codebook (2**bits,) float32 sorted
    centroids; norm (slots, Hkv) float16 ‖x‖; idx (slots, Hkv, dim·bits/8) uint8, the nearest centroid of each
    coordinate of u packed little-endian (code j of each 8-code word in bits j·b … j·b + b − 1).

    Inner-product keys (``turboquant_prod``; ``bits`` is then the part's bits − 1, its MSE codes) also keep the
    1-bit QJL sketch of the residual r = u − c[idx]: signs (slots, Hkv, dim/8) uint8 of S r (bit set: ≥ 0),
    res_norm (slots, Hkv) float16 ‖r‖, sketch (dim, dim) float32 S; u ≈ c[idx] + √(π/2)/dim · ‖r‖ · Sᵀ sign.
    The native attention reads them (module path); the decode step does not write them.
    """

    dim: int
    bits: int
    rotation: torch.Tensor
    codebook: torch.Tensor
    norm: torch.Tensor
    idx: torch.Tensor
    signs: Optional[torch.Tensor] = None
    res_norm: Optional[torch.Tensor] = None
    sketch: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # constants: copied to the layout the kernel reads (a Haar rotation from torch.linalg.qr is column-major)
        self.rotation = self.rotation.float().contiguous()
        self.codebook = self.codebook.float().contiguous()
        self.sketch = None if self.sketch is None else self.sketch.float().contiguous()
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

    Caches: (slots, Hkv, D) pages of ``k_dtype``: float32, bfloat16 or float16 values, or (int8) uint8 codes
    q + 128 with ``k_scale``/``v_scale`` (slots, Hkv, 1) float16 (x = q · scale: kvcache's ``int8`` codec), or
    (fp8) uint8 E4M3 codes with the same scales (x = e4m3(code) · scale: the uncalibrated ``fp8`` codec), or
    (q8_0, q5_0, q4_1, q4_0) uint8 (slots, Hkv, D/32 · block bytes) GGML blocks (llama.cpp's KV types), or
    (turboquant) the codes, norms and constants of ``k_tq``/``v_tq``. ``k_dtype`` is the keys' type, and the
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
    k_dtype: str = "fp32"  # one of KV_PAGE_TYPES: the keys' pages, and the values' unless v_dtype
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
