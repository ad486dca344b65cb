"""Plain-PyTorch reference kernels: the truth every fast kernel is tested against."""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from . import native_layouts, turboquant_pages
from .decoder_spec import (
    BLOCK_PAGE_TYPES,
    CODE_PAGE_BITS,
    CODE_PAGE_TYPES,
    FLOAT_PAGE_DTYPES,
    DecoderSpec,
    LayerSpec,
    TurboQuantPageSpec,
)
from .ggml_codecs import DECODERS, ENCODERS


def sequence_slots(block_table: torch.Tensor, context_len: int, block_size: int) -> torch.Tensor:
    """Cache slots of a sequence's first ``context_len`` tokens. block_table: (max_blocks,) → (context_len,)."""
    n_blocks = -(-context_len // block_size)
    blocks = block_table[:n_blocks].to(torch.int64)
    offsets = torch.arange(block_size, device=block_table.device, dtype=torch.int64)
    return (blocks[:, None] * block_size + offsets[None, :]).reshape(-1)[:context_len]


def causal_window_mask(query_positions: torch.Tensor, num_keys: int, window: Optional[int]) -> torch.Tensor:
    """Boolean mask (n_q, num_keys): True where a query may attend to a key (keys at positions 0..num_keys-1)."""
    key_pos = torch.arange(num_keys, device=query_positions.device)
    allowed = key_pos[None, :] <= query_positions[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > query_positions[:, None] - window
    return allowed


def attention_over_context(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: Optional[int] = None
) -> torch.Tensor:
    """Causal grouped-query attention of the last n tokens of a context over the whole context.

    q: (n, Hq, D) for positions ctx-n .. ctx-1;  k, v: (ctx, Hkv, D)  →  (n, Hq, D).
    One 4-D ``scaled_dot_product_attention`` call with ``enable_gqa`` (the query heads of a KV head share it,
    no copy of K/V): PyTorch's fused CPU kernel, 3–4× faster than the math path a 3-D grouped call with a
    repeated mask falls to (measured: 11 ms against 41 ms for 512 × 512 tokens, 9/3 heads, one thread).
    """
    n = q.shape[0]
    ctx = k.shape[0]
    if window is not None and ctx <= window:  # every key is inside every query's window: plain causal attention,
        window = None  # whose fused kernel skips the blocks above the diagonal (a mask makes it compute them all)
    mask = (
        None
        if window is None and n == ctx
        else causal_window_mask(torch.arange(ctx - n, ctx, device=q.device), ctx, window)
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def batch_slots(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of every context token of S sequences, padded: (S, max_ctx); padding points at slot 0."""
    max_ctx = int(context_lens.max())
    pos = torch.arange(max_ctx, device=block_tables.device)
    blocks = block_tables[:, pos // block_size].clamp(min=0)
    slots = blocks * block_size + pos % block_size
    return torch.where(pos[None, :] < context_lens[:, None], slots, torch.zeros_like(slots))


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: Optional[int] = None,
) -> torch.Tensor:
    """One query per sequence over padded contexts, batched.

    q: (S, Hq, D); k, v: (S, L, Hkv, D) (positions ≥ context_lens are padding) → (S, Hq, D).
    The query of sequence s sits at position context_lens[s] − 1.
    """
    s, hq, d = q.shape
    hkv = k.shape[2]
    pos = torch.arange(k.shape[1], device=q.device)
    allowed = pos[None, :] < context_lens[:, None]  # (S, L)
    if window is not None:
        allowed &= pos[None, :] > (context_lens[:, None] - 1 - window)
    qg = q.view(s, hkv, hq // hkv, d)  # (S, Hkv, G, D)
    scores = torch.einsum("shgd,slhd->shgl", qg, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    out = torch.einsum("shgl,slhd->shgd", scores.softmax(-1), v)
    return out.reshape(s, hq, d)


def paged_attention(
    q: torch.Tensor,
    meta,
    scale: float,
    window: Optional[int],
    gather: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
) -> torch.Tensor:
    """Reference paged attention over a ragged batch.

    q: (T, Hq, D); ``gather(slots)`` returns full-precision (k, v) for a tensor of slots, each
    ``slots.shape + (Hkv, D)``. Sequences with a single new token (decodes) are batched in one call;
    the others (prefill chunks) run one by one. Returns (T, Hq, D).
    """
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    decodes = [i for i, n in enumerate(meta.query_lens_list) if n == 1]
    if len(decodes) > 1:
        idx = torch.tensor(decodes, device=q.device)
        rows = meta.query_start_loc[idx]
        ctx = meta.context_lens[idx]
        k, v = gather(batch_slots(meta.block_tables[idx], ctx, meta.block_size))
        out[rows] = decode_attention(q[rows], k.to(q.dtype), v.to(q.dtype), ctx, scale, window)
    batched = set(decodes) if len(decodes) > 1 else set()
    for s, (n, ctx) in enumerate(zip(meta.query_lens_list, meta.context_lens_list)):
        if n == 0 or s in batched:
            continue
        slots = sequence_slots(meta.block_tables[s], ctx, meta.block_size)
        k, v = gather(slots)
        lo = starts[s]
        out[lo : lo + n] = attention_over_context(q[lo : lo + n], k.to(q.dtype), v.to(q.dtype), scale, window)
    return out


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
    k_side=None,
    v_side=None,
) -> torch.Tensor:
    """Twin of the native paged attention: q (T, Hq, D); token t at ``positions[t]`` attends causally (and within
    ``window``) over the pages of block table row ``token_rows[t]``; key pages of ``k_dtype``, value pages of
    ``v_dtype`` (default: the same), each (slots, Hkv, D) rows or (slots, Hkv, D/32 · block bytes) GGML blocks
    (int8/fp8 with float16 scales (slots, Hkv[, 1])), or code pages (slots, Hkv, D·bits/8) with their
    ``k_side``/``v_side`` (:class:`~bytediet.kernels.decoder_spec.CodePageSide`, see :func:`read_code_rows`), or
    ``"turboquant"`` pages described by k_side/v_side (:class:`~bytediet.kernels.decoder_spec.TurboQuantPageSpec`).
    One token at a time, plainly. → (T, Hq, D) float32."""
    out = torch.empty(q.shape, dtype=torch.float32)
    dtypes = (k_dtype, v_dtype or k_dtype)
    d = q.shape[-1]

    def read(dtype, pages, s, side, slots, first):
        if dtype == "turboquant":  # side: the TurboQuantPageSpec; keys with a pre-RoPE mean need the positions
            return turboquant_pages.read(side, slots, torch.arange(first, first + len(slots)))
        if dtype in CODE_PAGE_TYPES:
            return read_code_rows(dtype, pages, side, slots, d)
        return read_kv_rows(dtype, pages[slots], None if s is None else s[slots].reshape(len(slots), -1, 1))

    for t in range(q.shape[0]):
        pos = int(positions[t])
        slots = sequence_slots(block_tables[int(token_rows[t])], pos + 1, block_size)
        first = max(0, pos + 1 - window) if window else 0
        slots = slots[first:]
        k, v = (
            read(*args, slots, first) for args in zip(dtypes, (k_cache, v_cache), (k_scale, v_scale), (k_side, v_side))
        )
        out[t] = decode_attention(q[t : t + 1].float(), k[None], v[None], torch.tensor([k.shape[0]]), scale)[0]
    return out


def _unpack_codes(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """uint8 (..., n·bits/8), 2 or 4 bits a code, code k in bits (k·bits) mod 8 … of byte ⌊k·bits/8⌋ (kvcache's
    bitpack layout) → float32 codes (..., n)."""
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :n].float()


def read_code_rows(page_type: str, codes: torch.Tensor, side, slots: torch.Tensor, d: int) -> torch.Tensor:
    """The rows at ``slots`` (L,) of code pages (``decoder_spec.CODE_PAGE_TYPES``: codes (slots, H, row bytes)
    uint8, side data ``side``, a :class:`~bytediet.kernels.decoder_spec.CodePageSide`) → float32 (L, H, D):
    code · scale + zero, per channel over each key group or per token in groups of G channels, a row whose window is
    still open read from its staging page; QJL keys √(π/2)/m · ‖k − μ‖ · Sᵀ sign (without the mean μ: it shifts every
    score of a query alike); PolarQuant rows decoded down the polar tree in the rotated basis, then rotated back."""
    if page_type.startswith("qjl"):
        m = int(page_type[3]) * d
        signs = _unpack_codes(codes[slots], 1, m) * 2 - 1  # (L, H, m)
        return (signs @ side.transform) * ((math.sqrt(math.pi / 2) / m) * side.scale[slots].float())[..., None]
    if page_type == "polarquant":
        return _polar_rows(codes[slots], side.scale[slots].float(), side.table, d) @ side.transform
    q = _unpack_codes(codes[slots], CODE_PAGE_BITS[page_type], d)  # (L, H, D)
    if page_type.startswith("kivi"):
        g = slots // side.group
        x = q * side.scale[g].float() + side.zero[g].float()
    else:
        n, h = q.shape[:2]
        group = d // side.scale.shape[-1]
        x = (
            q.reshape(n, h, d // group, group) * side.scale[slots].float()[..., None]
            + side.zero[slots].float()[..., None]
        ).reshape(n, h, d)
    if side.stage_of is not None:
        window = side.window or side.group
        page = side.stage_of[slots // window].long()
        open_ = page >= 0
        if bool(open_.any()):
            x[open_] = side.stage[page[open_], slots[open_] % window].float()
    return x


def _polar_rows(rows: torch.Tensor, radii: torch.Tensor, table: torch.Tensor, d: int) -> torch.Tensor:
    """PolarQuant rows (..., 23·D/64) uint8 and their radii (..., D/16) → (..., D) float32 in the rotated basis: from
    the radii down, r ← (r·cos ψ, r·sin ψ) per pair with each level's centroid cos/sin (``table``, CodePageSide's)."""
    sizes = [d // 4, d // 16, d // 32, d // 64]  # bytes of levels 1..4 (4, 2, 2, 2 bits)
    levels = torch.split(rows, sizes, dim=-1)
    tables = torch.split(table.float(), [32, 8, 8, 8])
    r = radii
    for lvl in (3, 2, 1, 0):
        bits = 4 if lvl == 0 else 2
        c = _unpack_codes(levels[lvl], bits, d >> (lvl + 1)).long()
        cos, sin = tables[lvl].reshape(2, -1)
        r = torch.stack([r * cos[c], r * sin[c]], dim=-1).flatten(-2)
    return r


# --- low-bit linear layers (twins of kernels/cpu/csrc/gemm_blocks.cpp) --------------------------------------

ACTIVATION_BLOCK = 32  # activations are quantized in blocks of 32 values, one scale each


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016, arXiv 1606.08415) of ``gate``, times ``up``:
    the gated MLP's activation (gemma3). gate, up: (..., I) → (..., I)."""
    return F.gelu(gate, approximate="tanh") * up


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU (Elfwing et al. 2017, arXiv 1702.03118) of ``gate``, times ``up``: the gated MLP's activation (llama,
    qwen2). gate, up: (..., I) → (..., I)."""
    return F.silu(gate) * up


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467) over the last dimension, in float32:
    x (..., n), weight (n,) → x / sqrt(mean(x²) + eps) · weight, in x's dtype."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


# --- sampling (twin of kernels/cpu/csrc/sampling.cpp) -----------------------------------------------------------

#: tokens per block of the two-level inverse CDF: block masses first, then one block's running sum
CDF_BLOCK = 256


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse transform sampling: row ``b`` picks the first token whose cumulative mass exceeds
    ``u[b]`` times the row's total. probs (B, V) >= 0, u (B,) in [0, 1]; returns (B,) int64.

    Two levels, so no running sum covers the whole vocabulary (one in float64 cost ~70 ms a step at batch 64):
    the masses of blocks of :data:`CDF_BLOCK` tokens (float32 sums, pairwise: exact to a few float32 ulps of the
    block's mass, the precision of the float32 probabilities themselves), accumulated in float64, find the block;
    then a float64 running sum inside that one block finds the token, so tokens keep their share down to ~1e-16
    of the total within a block. A token with zero probability is never picked: its cumulative mass equals its
    predecessor's, so the first index that exceeds ``u`` is never it; only rounding at the end of a row or a
    block can run past it, and those rows take the last token of positive probability before it.
    """
    B, V = probs.shape
    pad = -V % CDF_BLOCK
    blocks = (torch.nn.functional.pad(probs, (0, pad)) if pad else probs).view(B, -1, CDF_BLOCK)
    nb = blocks.shape[1]
    ends = blocks.sum(dim=-1).double().cumsum(dim=-1)  # (B, nb) mass up to each block's end
    target = (u.to(torch.float64) * ends[:, -1]).unsqueeze(1)
    j = torch.searchsorted(ends, target, right=True).clamp(max=nb - 1)  # (B, 1) the block holding target
    start = torch.where(j > 0, ends.gather(1, (j - 1).clamp(min=0)), torch.zeros_like(target))
    inside = blocks[torch.arange(B, device=probs.device), j.squeeze(1)].double().cumsum(dim=-1) + start
    k = torch.searchsorted(inside, target, right=True).clamp(max=CDF_BLOCK - 1)
    idx = (j * CDF_BLOCK + k).squeeze(1).clamp(max=V - 1)
    past_end = probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    if bool(past_end.any()):
        positions = torch.arange(V, device=probs.device).expand(B, V)
        last_positive = torch.where((probs > 0) & (positions <= idx.unsqueeze(1)), positions, -1).amax(dim=-1)
        last_positive = torch.where(
            last_positive >= 0, last_positive, torch.where(probs > 0, positions, -1).amax(dim=-1)
        )
        idx = torch.where(past_end, last_positive, idx)
    return idx


def sample_rows(logits: torch.Tensor, inv_temperature: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``logits`` (B, V), drawn with the uniform ``u[b]`` from softmax(logits[b] ·
    inv_temperature[b]) by :func:`inverse_cdf`; inv_temperature (B,) > 0, u (B,) in [0, 1). Returns (B,) int64."""
    return inverse_cdf((logits.float() * inv_temperature.float().unsqueeze(1)).softmax(dim=-1), u)


def quantize_rows_q8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization of activation rows in blocks of 32 (llama.cpp's ``quantize_row_q8_1``).

    x: (M, K) float, K a multiple of 32 → codes (M, K) int8, scales d (M, K/32) float32 and
    s = d · Σcodes (M, K/32) float32. d = amax/127, codes = round-half-even(x · (1/d)), all in float32.
    """
    m, k = x.shape
    if k % ACTIVATION_BLOCK:
        raise ValueError(f"activation rows of {k} values are not whole blocks of {ACTIVATION_BLOCK}")
    b = x.float().reshape(m, k // ACTIVATION_BLOCK, ACTIVATION_BLOCK)
    d = b.abs().amax(-1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(b * inv[..., None])
    return q.to(torch.int8).reshape(m, k), d, d * q.sum(-1)


def quantize_rows_q16(x: torch.Tensor):
    """Two int8 planes per block: x ≈ d·q + d2·q2, where (q2, d2) = :func:`quantize_rows_q8` of the rounding
    error x − d·q (a product, then a difference, in float32). The error left is ≤ amax/64516 per block: int16
    precision on int8 dot-product instructions (twice the integer work of q8, the same weight reads).

    x: (M, K) → q, d, q2, d2 as in quantize_rows_q8, and s = d·Σq + d2·Σq2 (M, K/32).
    """
    q, d, s = quantize_rows_q8(x)
    residual = x.float() - dequantize_rows_q8(q, d)
    q2, d2, s2 = quantize_rows_q8(residual)
    return q, d, q2, d2, s + s2


def quantize_rows_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 quantization with one scale per row (SmoothQuant's per-token W8A8, arXiv 2211.10438).

    x: (M, K) float → codes (M, K) int8 and d (M,) float32: d = amax(row)/127, codes = round-half-even(x · (1/d)),
    all in float32 (a zero row: d = 0, codes 0).
    """
    xf = x.float()
    d = xf.abs().amax(dim=1) / 127
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(xf * inv[:, None]).clamp_(-127, 127).to(torch.int8), d


def dequantize_rows_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float values the int8 activation codes stand for: (M, K) int8, (M, K/32) → (M, K) float32."""
    m, k = q.shape
    return (q.float().reshape(m, -1, ACTIVATION_BLOCK) * d[..., None]).reshape(m, k)


def dequantize_blocks(ggml_type: int, blocks: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """GGML blocks (N, bytes per row) uint8 → weight (N, K) float32 (bit-identical to ``gguf.quants``), then
    rounded to ``dtype`` (bfloat16: to nearest even, for a bf16 GEMM).

    Also takes bytediet's own layouts (:mod:`bytediet.kernels.native_layouts`, type ids ≥ 100)."""
    if native_layouts.is_native_layout(ggml_type):
        return native_layouts.dequantize(ggml_type, blocks).to(dtype)
    decode = DECODERS[ggml_type]
    n = blocks.shape[0]
    values = decode(blocks.reshape(-1, block_bytes(ggml_type)))
    return values.reshape(n, -1).to(dtype)


def block_bytes(ggml_type: int) -> int:
    """Bytes of one GGML block (super-block for the K-quants) of this type."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return GGML_QUANT_SIZES[GGMLQuantizationType(int(ggml_type))][1]


def gemm_blocks(
    ggml_type: int, blocks: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None, activations: str = "q8"
) -> torch.Tensor:
    """y = x · Wᵀ + b for a weight W kept in GGML blocks.

    blocks: (N, bytes per row) uint8; x: (..., K) → y: (..., N) in x's dtype. ``activations``: ``"q8"``
    multiplies W with x as :func:`quantize_rows_q8` rounds it (the integer-dot-product path), ``"f32"``
    with x itself, ``"q16"`` with the two int8 planes of :func:`quantize_rows_q16`, ``"q8-token"`` with x as
    :func:`quantize_rows_per_token` rounds it (one scale per row: int8-w8a8). Layouts of non-integer values
    (:data:`~bytediet.kernels.native_layouts.FLOAT_TYPES`) take ``"f32"`` only. Computed in float64, so a fast
    kernel differs from this only by its float32 rounding.
    """
    k = x.shape[-1]
    if int(ggml_type) in native_layouts.FLOAT_TYPES and activations != "f32":
        raise ValueError(
            f"layout {int(ggml_type)} holds float values: it multiplies f32 activations, not {activations!r}"
        )
    w = dequantize_blocks(ggml_type, blocks)
    if w.shape[1] != k:
        raise ValueError(f"weight rows hold {w.shape[1]} values, activations {k}")
    x2 = x.reshape(-1, k).float()
    if activations == "q8":
        q, d, _ = quantize_rows_q8(x2)
        x2 = dequantize_rows_q8(q, d)
    elif activations == "q16":
        q, d, q2, d2, _ = quantize_rows_q16(x2)
        x2 = dequantize_rows_q8(q, d).double() + dequantize_rows_q8(q2, d2).double()
    elif activations == "q8-token":
        q, d = quantize_rows_per_token(x2)
        x2 = q.float() * d[:, None]
    elif activations != "f32":
        raise ValueError(f"activations must be 'q8', 'q16', 'f32' or 'q8-token', got {activations!r}")
    y = x2.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


E4M3_MAX = 448.0  # the largest float8_e4m3fn value


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token E4M3 activations for W8A8 FP8: x (M, K) float → codes (M, K) float8_e4m3fn of x / s and
    s (M, 1) float32 = amax(row) / 448 (1 for a zero row), the cast rounding to nearest even."""
    xf = x.float()
    s = xf.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (xf / s).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s


def fp8_w8a8_linear(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Twin of ``kernels/triton/fp8.py``: y = (s_x · x_q) · (qweight · scale)ᵀ (+ bias), x rounded per token by
    :func:`quantize_rows_fp8`. x (..., K); qweight (N, K) float8_e4m3fn; scale (N,) float32 → (..., N) in x's
    dtype, computed in float64."""
    xq, sx = quantize_rows_fp8(x.reshape(-1, x.shape[-1]))
    y = (xq.double() * sx.double()) @ (qweight.double() * scale.double()[:, None]).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


# --- row-interleaved (x4) weights (twins of kernels/cpu/csrc/gemm_x4.cpp) ------------------------------------

_X4_SCALES = {2: 1, 3: 2, 6: 1, 8: 1}  # f16 scales per block: Q4_0 d; Q4_1 d, m; Q5_0 d; Q8_0 d
_KX4_BYTES = {12: 592, 14: 840}  # bytes per 4 rows × 256 weights: Q4_K (its 6-bit scales as bytes), Q6_K
X4_TYPES = frozenset(_X4_SCALES) | frozenset(_KX4_BYTES)


def _codes(ggml_type: int, blocks: torch.Tensor) -> torch.Tensor:
    """(n, bytes per row) → (n, nb, 32) uint8 codes in element order (Q8_0: the int8 bytes; Q5_0: 5-bit codes)."""
    n = blocks.shape[0]
    b = blocks.reshape(n, -1, block_bytes(ggml_type))
    if ggml_type == 8:
        return b[..., 2:]
    if ggml_type == 6:  # d, qh (bit j = bit 4 of element j), qs (Q4 nibbles)
        high = ((b[..., 2:6].to(torch.int64) << torch.arange(0, 32, 8)).sum(-1, keepdim=True) >> torch.arange(32)) & 1
        qs = b[..., 6:]
        return torch.cat((qs & 0x0F, qs >> 4), dim=-1) | (high.to(torch.uint8) << 4)
    qs = b[..., 2 * _X4_SCALES[ggml_type] :]
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bit_masks(u: torch.Tensor) -> torch.Tensor:
    """(..., 32) codes → (..., 4) bytes of the 32-bit mask of their bit 4 (little-endian)."""
    bits = ((u >> 4) & 1).to(torch.int64).reshape(*u.shape[:-1], 4, 8)
    return (bits << torch.arange(8)).sum(-1).to(torch.uint8)


def repack_x4(ggml_type: int, blocks: torch.Tensor) -> torch.Tensor:
    """Interleave four rows at a time (Q4_K and Q6_K: :func:`repack_kx4`), or for the 32-weight formats:

    Interleave four rows at a time, block by block: (n, bytes per row) → same shape, n % 4 == 0.

    Per group of 4 rows and block: the 4 rows' f16 scales (d, then Q4_1's m), then the codes as
    U_k[8r + e] = code 8k + e of row r (k = 0..3): Q4 packs U0 | U1 << 4 and U2 | U3 << 4 (64 bytes), Q5_0
    packs their low 4 bits so and adds four 32-bit masks of bit 4 of U_0..U_3 (16 bytes), Q8_0 stores
    U0..U3 (128 bytes). The layout of llama.cpp's repack.cpp, made for one 32-byte load to serve four rows.
    """
    n = blocks.shape[0]
    if ggml_type not in X4_TYPES or n % 4:
        raise ValueError(
            f"GGML type {ggml_type} ({n} rows) does not interleave (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K "
            "with rows % 4 == 0)"
        )
    if ggml_type in _KX4_BYTES:
        return repack_kx4(ggml_type, blocks)
    ts, ns = block_bytes(ggml_type), _X4_SCALES[ggml_type]
    b = blocks.reshape(n // 4, 4, -1, ts)  # (G, 4, nb, ts)
    scales = b[..., : 2 * ns].reshape(n // 4, 4, -1, ns, 2).permute(0, 2, 3, 1, 4).reshape(n // 4, -1, 8 * ns)
    codes = _codes(ggml_type, blocks).reshape(n // 4, 4, -1, 4, 8)  # (G, r, nb, k, e)
    u = codes.permute(0, 2, 3, 1, 4).reshape(n // 4, -1, 4, 32)  # (G, nb, k, 8r + e)
    parts = [scales]
    if ggml_type == 8:
        parts.append(u.reshape(n // 4, u.shape[1], -1))
    else:
        low = u & 0x0F
        parts.append(torch.cat((low[:, :, 0] | (low[:, :, 1] << 4), low[:, :, 2] | (low[:, :, 3] << 4)), dim=-1))
        if ggml_type == 6:
            parts.append(_bit_masks(u).reshape(n // 4, u.shape[1], 16))
    out = torch.cat(parts, dim=-1)  # (G, nb, 4·ts)
    return out.reshape(n, -1)


def unpack_x4(ggml_type: int, packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_x4`."""
    if ggml_type in _KX4_BYTES:
        return unpack_kx4(ggml_type, packed)
    n = packed.shape[0]
    ts, ns = block_bytes(ggml_type), _X4_SCALES[ggml_type]
    g = packed.reshape(n // 4, -1, 4 * ts)  # (G, nb, 4·ts)
    nb = g.shape[1]
    scales = g[..., : 8 * ns].reshape(n // 4, nb, ns, 4, 2).permute(0, 3, 1, 2, 4).reshape(n // 4, 4, nb, 2 * ns)
    c = g[..., 8 * ns :]
    if ggml_type == 8:
        u = c.reshape(n // 4, nb, 4, 32)
    else:
        lo, hi = c[..., :32], c[..., 32:64]
        u = torch.stack((lo & 0x0F, lo >> 4, hi & 0x0F, hi >> 4), dim=2)  # (G, nb, k, 32)
        if ggml_type == 6:
            masks = c[..., 64:80].reshape(n // 4, nb, 4, 4).to(torch.int64)
            word = (masks << torch.arange(0, 32, 8)).sum(-1, keepdim=True)  # (G, nb, k, 1)
            u = u | ((((word >> torch.arange(32)) & 1) << 4).to(torch.uint8))
    codes = u.reshape(n // 4, nb, 4, 4, 8).permute(0, 3, 1, 2, 4).reshape(n // 4, 4, nb, 32)
    if ggml_type == 6:  # back to d, qh, qs
        qh = _bit_masks(codes)
        codes = torch.cat((qh, (codes[..., :16] & 0x0F) | ((codes[..., 16:] & 0x0F) << 4)), dim=-1)
    elif ggml_type != 8:
        codes = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat((scales, codes), dim=-1).reshape(n, -1)


def _k_codes(ggml_type: int, sb: torch.Tensor) -> torch.Tensor:
    """Super-blocks (..., 144 | 210) → (..., 8, 32) unsigned codes of sub-block j, element e (Q6_K: 0..63)."""
    lead = sb.shape[:-1]
    if ggml_type == 12:  # sub-block j: nibble j % 2 of qs[32·(j // 2) + e]
        qs = sb[..., 16:144].reshape(*lead, 4, 1, 32)
        return torch.cat((qs & 0x0F, qs >> 4), dim=-2).reshape(*lead, 8, 32)
    ql = sb[..., :128].reshape(*lead, 2, 1, 2, 32)  # (half, ·, j & 1, e)
    lo = torch.cat((ql & 0x0F, ql >> 4), dim=-3)  # (half, (j >> 1) & 1, j & 1, e)
    qh = sb[..., 128:192].reshape(*lead, 2, 1, 32)
    hi = ((qh >> (2 * torch.arange(4, dtype=torch.uint8))[:, None]) & 3).reshape(*lead, 2, 2, 2, 32)
    return (lo | (hi << 4)).reshape(*lead, 8, 32)


def _k_blocks(ggml_type: int, codes: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_k_codes` for the code bytes: (..., 8, 32) → Q4_K qs (..., 128) or Q6_K ql + qh (..., 192)."""
    lead = codes.shape[:-2]
    if ggml_type == 12:
        c = codes.reshape(*lead, 4, 2, 32)
        return (c[..., 0, :] | (c[..., 1, :] << 4)).reshape(*lead, 128)
    c = codes.reshape(*lead, 2, 2, 2, 32)  # (half, b1, b0, e)
    ql = (c[..., 0, :, :] & 0x0F) | ((c[..., 1, :, :] & 0x0F) << 4)  # (half, b0, e)
    t = (c >> 4).reshape(*lead, 2, 4, 32).to(torch.int64) << (2 * torch.arange(4))[:, None]
    return torch.cat((ql.reshape(*lead, 128), t.sum(-2).to(torch.uint8).reshape(*lead, 64)), dim=-1)


def _q4k_scales(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes (..., 12) → the 6-bit scales and mins (..., 8) each (ggml's get_scale_min_k4)."""
    sc = torch.cat((q[..., 0:4] & 63, (q[..., 8:12] & 0x0F) | ((q[..., 0:4] >> 6) << 4)), dim=-1)
    mn = torch.cat((q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)), dim=-1)
    return sc, mn


def _q4k_pack_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_q4k_scales`."""
    return torch.cat(
        (
            (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
            (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ),
        dim=-1,
    )


def repack_kx4(ggml_type: int, blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K or Q6_K rows (n, bytes per row), n % 4 == 0 → the interleaved layout of csrc/gemm_kx4.cpp:
    (n, 148 per 256 weights) for Q4_K, (n, 210 per 256) for Q6_K.

    Per group of 4 rows and super-block: Q4_K d[4], dmin[4] (f16), its 6-bit scales and mins as bytes sc[8][4],
    mn[8][4], then per sub-block j the codes U_k[8r + e] = code 8k + e of row r as U0 | U1 << 4, U2 | U3 << 4;
    Q6_K d[4], its int8 scales sc[16][4], then per sub-block those 64 bytes of the low 4 bits and 32 bytes of the
    high 2 bits U0 >> 4 | (U1 >> 4) << 2 | (U2 >> 4) << 4 | (U3 >> 4) << 6.
    """
    n = blocks.shape[0]
    ts = block_bytes(ggml_type)
    sb = blocks.reshape(n // 4, 4, -1, ts).permute(0, 2, 1, 3)  # (G, ns, r, ts)
    g, ns = sb.shape[0], sb.shape[1]
    u = _k_codes(ggml_type, sb).reshape(g, ns, 4, 8, 4, 8).permute(0, 1, 3, 4, 2, 5).reshape(g, ns, 8, 4, 32)
    low = u & 0x0F  # (G, ns, j, k, 8r + e)
    codes = [low[..., 0, :] | (low[..., 1, :] << 4), low[..., 2, :] | (low[..., 3, :] << 4)]
    if ggml_type == 12:
        sc, mn = _q4k_scales(sb[..., 4:16])  # (G, ns, r, 8)
        head = [
            sb[..., 0:2].reshape(g, ns, 8),
            sb[..., 2:4].reshape(g, ns, 8),
            sc.transpose(-1, -2).reshape(g, ns, 32),
            mn.transpose(-1, -2).reshape(g, ns, 32),
        ]
    else:
        head = [sb[..., 208:210].reshape(g, ns, 8), sb[..., 192:208].transpose(-1, -2).reshape(g, ns, 64)]
        hb = u >> 4
        codes.append(hb[..., 0, :] | (hb[..., 1, :] << 2) | (hb[..., 2, :] << 4) | (hb[..., 3, :] << 6))
    body = torch.cat(codes, dim=-1).reshape(g, ns, -1)  # (G, ns, j · (64 | 96))
    return torch.cat(head + [body], dim=-1).reshape(n, -1)  # group g's super-blocks fill its 4 rows' bytes


def unpack_kx4(ggml_type: int, packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`repack_kx4`."""
    n = packed.shape[0]
    gb = _KX4_BYTES[ggml_type]
    p = packed.reshape(n // 4, -1, gb)  # (G, ns, bytes)
    g, ns = p.shape[0], p.shape[1]
    step, at = (64, 80) if ggml_type == 12 else (96, 72)
    c = p[..., at:].reshape(g, ns, 8, step)
    u = torch.stack((c[..., 0:32] & 0x0F, c[..., 0:32] >> 4, c[..., 32:64] & 0x0F, c[..., 32:64] >> 4), dim=3)
    if ggml_type == 14:
        hb = c[..., 64:96]
        u = u | torch.stack([((hb >> (2 * k)) & 3) << 4 for k in range(4)], dim=3)
    codes = u.reshape(g, ns, 8, 4, 4, 8).permute(0, 1, 4, 2, 3, 5).reshape(g, ns, 4, 8, 32)  # (G, ns, r, j, e)
    body = _k_blocks(ggml_type, codes)  # (G, ns, r, 128 | 192)
    if ggml_type == 12:
        sc = p[..., 16:48].reshape(g, ns, 8, 4).transpose(-1, -2)
        mn = p[..., 48:80].reshape(g, ns, 8, 4).transpose(-1, -2)
        sb = torch.cat(
            (p[..., 0:8].reshape(g, ns, 4, 2), p[..., 8:16].reshape(g, ns, 4, 2), _q4k_pack_scales(sc, mn), body), -1
        )
    else:
        sc = p[..., 8:72].reshape(g, ns, 16, 4).transpose(-1, -2)
        sb = torch.cat((body, sc, p[..., 0:8].reshape(g, ns, 4, 2)), dim=-1)
    return sb.permute(0, 2, 1, 3).reshape(n, -1)


def gemm_panel(
    ggml_type: int, blocks: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """The prefill (compute-bound) product of ``csrc/gemm_panel.cpp``: :func:`gemm_blocks` with ``"q16"``
    activations — W in its blocks (N, bytes per row) uint8, x (..., K) → (..., N). The native kernel unpacks
    the weight a panel of 32 rows at a time and dots it with both activation planes (AVX-512 VNNI)."""
    return gemm_blocks(ggml_type, blocks, x, bias, "q16")


def gemm_x4(
    ggml_type: int, packed: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None, activations: str = "q8"
) -> torch.Tensor:
    """:func:`gemm_blocks` with int8 (``q8``) or two-plane (``q16``) activations on a :func:`repack_x4` weight."""
    if activations not in ("q8", "q16"):
        raise ValueError(f"the interleaved kernels take q8 or q16 activations, got {activations!r}")
    return gemm_blocks(ggml_type, unpack_x4(ggml_type, packed), x, bias, activations)


# --- the one-call decode step (twin of kernels/cpu/csrc/decoder.cpp) ----------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (T, H, D), positions: (T,)."""
    f = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = f.cos()[:, None, :], f.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def quantize_int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV int8 pages: x (..., D) → codes (..., D) uint8 = round(x / s) + 128 and s (..., 1) float16, where
    s = fp16(max(amax / 127, 1e-6)) (the ``int8`` KV codec's per-token, per-head rounding)."""
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-6).to(torch.float16)
    q = torch.round(x / scale.float()).clamp(-127, 127) + 128
    return q.to(torch.uint8), scale


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """KV fp8 pages: x (..., D) → E4M3 codes (..., D) uint8 of x / s and s (..., 1) float16, where
    s = fp16(max(amax / 448, 1e-6)) (the uncalibrated ``fp8`` KV codec's per-token, per-head rounding)."""
    scale = (x.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-6).to(torch.float16)
    codes = (x / scale.float()).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, scale


_ROW_QUANTIZERS = {"int8": quantize_int8_rows, "fp8": quantize_fp8_rows}


def turboquant_write(
    pages: TurboQuantPageSpec, x: torch.Tensor, slots: torch.Tensor, positions: Optional[torch.Tensor] = None
) -> None:
    """TurboQuant pages: quantize x (T, Hkv, D) into ``slots`` (T,) (:func:`turboquant_pages.write`); ``positions``
    (T,) for keys calibrated with a pre-RoPE mean."""
    turboquant_pages.write(pages, x, slots, positions)


def write_kv_rows(page_type: str, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Rows x (..., D) float32 → (pages, scales): KV page rows of ``page_type`` (``decoder_spec.ATTENTION_PAGE_TYPES``)
    as the KV codecs store them — float rows (..., D); int8/fp8 codes (..., D) uint8 and float16 scales (..., 1);
    GGML blocks (..., D/32 · block bytes) uint8 (kvcache/ggml_block.py) — scales None but for int8/fp8."""
    if page_type in _ROW_QUANTIZERS:
        return _ROW_QUANTIZERS[page_type](x)
    if page_type in BLOCK_PAGE_TYPES:
        blocks = ENCODERS[BLOCK_PAGE_TYPES[page_type]](x.float().reshape(-1, 32).contiguous())
        return blocks.reshape(*x.shape[:-1], -1), None
    return x.to(FLOAT_PAGE_DTYPES[page_type]), None


def _write_rows(
    page_type: str, pages: torch.Tensor, scales: Optional[torch.Tensor], slots: torch.Tensor, x: torch.Tensor
) -> None:
    """x (T, Hkv, D) → rows ``slots`` of pages of ``page_type`` (and their scales)."""
    rows, scale = write_kv_rows(page_type, x)
    pages[slots] = rows
    if scale is not None:
        scales[slots] = scale.reshape(scales[slots].shape)


def _sides(layer: LayerSpec) -> tuple[tuple, tuple]:
    """(page type, pages, scales, TurboQuant spec) of the layer's keys and of its values."""
    return (
        (layer.k_dtype, layer.k_cache, layer.k_scale, layer.k_tq),
        (layer.v_dtype or layer.k_dtype, layer.v_cache, layer.v_scale, layer.v_tq),
    )


def _write_pages(
    layer: LayerSpec, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor
) -> None:
    for (dtype, pages, scales, tq), x in zip(_sides(layer), (k, v)):
        if dtype == "turboquant":
            turboquant_pages.write(tq, x, slots, positions)
        else:
            _write_rows(dtype, pages, scales, slots, x)


def read_kv_rows(page_type: str, pages: torch.Tensor, scales: Optional[torch.Tensor] = None) -> torch.Tensor:
    """KV page rows (..., D) of ``page_type`` (one of ``decoder_spec.ATTENTION_PAGE_TYPES``; int8/fp8 with their
    float16 ``scales`` (..., 1); the GGML block types as (..., D/32 · block bytes) uint8) → float32 (..., D):
    the values attention reads."""
    if page_type == "int8":
        return (pages.float() - 128) * scales.float()
    if page_type == "fp8":
        return pages.view(torch.float8_e4m3fn).float() * scales.float()
    if page_type in BLOCK_PAGE_TYPES:
        ggml_type = BLOCK_PAGE_TYPES[page_type]
        values = DECODERS[ggml_type](pages.reshape(-1, block_bytes(ggml_type)))
        return values.reshape(*pages.shape[:-1], -1)
    return pages.float()


def _read_pages(layer: LayerSpec, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (k, v) of ``slots`` (T, L): row t's context, column j at position j → (T, L, Hkv, D)."""
    positions = torch.arange(slots.shape[-1]).expand(slots.shape)
    return tuple(
        turboquant_pages.read(tq, slots, positions)
        if dtype == "turboquant"
        else read_kv_rows(dtype, pages[slots], None if scales is None else scales[slots].reshape(*slots.shape, -1, 1))
        for dtype, pages, scales, tq in _sides(layer)
    )


def _decode_layer(
    spec: DecoderSpec, layer: LayerSpec, x: torch.Tensor, positions, slots, block_tables, block_size: int
) -> torch.Tensor:
    t, d = x.shape[0], spec.head_dim

    def lin(layer_spec, h):
        if layer_spec.interleaved:
            return gemm_x4(layer_spec.ggml_type, layer_spec.blocks, h, layer_spec.bias, spec.activations)
        return gemm_blocks(layer_spec.ggml_type, layer_spec.blocks, h, layer_spec.bias, spec.activations)

    h = _rms(x, layer.attn_norm, spec.eps)
    q = lin(layer.q, h).view(t, spec.num_heads, d)
    k = lin(layer.k, h).view(t, spec.num_kv_heads, d)
    v = lin(layer.v, h).view(t, spec.num_kv_heads, d)
    if layer.q_norm is not None:
        q, k = _rms(q, layer.q_norm, spec.eps), _rms(k, layer.k_norm, spec.eps)
    q, k = _rope(q, positions, layer.inv_freq), _rope(k, positions, layer.inv_freq)
    if layer.k_rot is not None:  # rotated pages (kvcache/rotated.py): q·k = (q Rᵀ)·(k Rᵀ)
        q, k = q @ layer.k_rot.T, k @ layer.k_rot.T
    if layer.v_rot is not None:
        v = v @ layer.v_rot.T
    _write_pages(layer, slots, k, v, positions)
    context_lens = positions + 1
    kk, vv = _read_pages(layer, batch_slots(block_tables, context_lens, block_size))
    att = decode_attention(q, kk, vv, context_lens, spec.attention_scale, layer.window or None)
    if layer.v_rot is not None:  # Σ p v = (Σ p v Rᵀ) R
        att = att @ layer.v_rot
    o = lin(layer.o, att.reshape(t, -1))
    x = x + (_rms(o, layer.post_attn_norm, spec.eps) if spec.sandwich else o)
    h = _rms(x, layer.pre_ffn_norm if spec.sandwich else layer.post_attn_norm, spec.eps)
    g = lin(layer.gate, h)
    g = F.gelu(g, approximate="tanh") if spec.gelu else F.silu(g)
    down = lin(layer.down, g * lin(layer.up, h))
    return x + (_rms(down, layer.post_ffn_norm, spec.eps) if spec.sandwich else down)


def decode_step(
    spec: DecoderSpec,
    x: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    token_rows: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """All layers of a decode step, one new token per sequence (or a verifying sequence's last token and its
    drafts, at consecutive positions); writes each layer's k, v into its pages.

    x: (T, hidden) embeddings; positions, slots: (T,) int64; block_tables: (S, max_blocks) int64, token t's row
    token_rows[t] (None: row t, S = T). Returns the hidden states (T, hidden) after the last layer (before the
    final norm).
    """
    if token_rows is not None:
        block_tables = block_tables[token_rows]
    x = x.float()
    for layer in spec.layers:
        x = _decode_layer(spec, layer, x, positions, slots, block_tables, block_size)
    return x


def sparse24_positions(index: torch.Tensor, groups: int) -> torch.Tensor:
    """The compressed 2:4 layout's positions: index (out, ⌈groups/2⌉) uint8 → (out, groups, 2) int64.

    One 4-bit code per group of 4 input columns, two groups per byte (even group in the low nibble);
    a code holds the first kept position in bits 0–1 and the second in bits 2–3 (first < second).
    """
    codes = torch.stack([index & 15, index >> 4], dim=-1).reshape(index.shape[0], -1)[:, :groups]
    return torch.stack([codes & 3, (codes >> 2) & 3], dim=-1).long()


def sparse24_matmul(
    x: torch.Tensor, values: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """y = x Wᵀ read straight from the compressed 2:4 layout (no dense weight is formed).

    x: (T, k); values: (out, k/2) kept weights in column order (float, or int8 with ``scale`` (out,));
    index: (out, ⌈k/8⌉) uint8 positions (:func:`sparse24_positions`) → (T, out) float32.
    Each output gathers, per group g, the two inputs x[4g + p] its positions p name.
    """
    out, kept = values.shape
    pos = sparse24_positions(index, kept // 2)  # (out, k/4, 2)
    cols = (pos + 4 * torch.arange(kept // 2)[None, :, None]).reshape(out, kept)  # (out, k/2) input columns
    w = values.float() if scale is None else values.float() * scale.float()[:, None]
    return torch.einsum("tok,ok->to", x.float()[:, cols], w)
