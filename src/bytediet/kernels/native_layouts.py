"""Block layouts for bytediet's own weight formats, so the GGML block kernels multiply them in place.

The native kernels (``csrc/gemm_blocks.cpp``) read a weight as rows of super-blocks of 32-weight sub-blocks,
each with a scale and an additive term (``block_formats.h``). bytediet's ``int4`` and ``int8`` formats keep
separate planes (codes, scales, offsets) — the layout of GPTQ/AWQ checkpoints — so at load time each is
repacked once into one of these layouts, with exactly the bytes the format stores (no extra precision, no
bytes added; the numbers it stands for are bit-identical):

* ``INT8_ROW`` (int8, one float32 scale per output channel): each row is its 4-byte float32 scale, then its
  K int8 codes. The product is Σ codes·x per row, times the scale once.
* ``INT4_GROUPS[(group, symmetric)]`` (int4-gG, G ∈ 32/64/128): each group of G weights is a block of
  ``[scale f16][offset f16][G/2 bytes of codes]`` (asymmetric: w = q·scale + offset, q ∈ 0..15) or
  ``[scale f16][G/2 bytes]`` (symmetric: w = (q − 8)·scale); inside a block, each 32 weights take 16 bytes,
  element e in the low nibble of byte e and element e + 16 in the high nibble (GGML's Q4 order).

* ``MXFP4_BLOCKS`` (mxfp4): per 32 weights ``[E8M0 scale byte][16 bytes of E2M1 codes in Q4 order]``.
* ``NVFP4_BLOCKS`` (nvfp4): a row starts with the tensor's float32 scale (4 bytes per row: the only bytes
  added), then per 32 weights ``[E4M3 scale of 0..15][E4M3 scale of 16..31][16 bytes of E2M1 codes]``.

* ``SPARSE24_INT8`` (sparse24-int8, 2:4 sparsity): a row starts with its float32 scale, then per 32 weights
  ``[16 int8 kept values][4 bytes: the 8 groups' position codes]`` (code = p0 | p1 << 2, two per byte, even
  group low): 5 bits per weight, and the kernel expands the 16 values into their 32 positions in registers
  (byte shuffles), so a 2:4 weight moves 5/8 of int8's bytes.

* ``FP8_ROW`` (fp8, E4M3 with one float32 scale per output channel): each row is its float32 scale, then its
  K E4M3 bytes: the format's bytes as they are. The kernel widens the codes to float in registers (a bit move
  makes each byte an f16 of value/2⁸, then one conversion instruction per 8 weights).
* ``SPARSE24_F16`` (sparse24, 2:4 with fp16 kept values): per 32 weights ``[16 f16 kept values][4 bytes: the
  8 groups' position codes]`` (36 bytes: 9 bits per weight, as the format); the kernel widens the 16 values and
  places them with one lane permute per 8 positions.

These two hold non-integer values, so they have no integer dot product: they multiply float activations only
(:data:`FLOAT_TYPES`, the ``f32`` activation mode).

The kernels multiply E2M1 codes as the int8 values 2·v ∈ {0, ±1, ±2, ±3, ±4, ±6, ±8, ±12} (a byte shuffle)
and fold the ½ into the block scale, so the FP4 formats use the same integer dot products as int4.

Type ids (``types.WeightType``) start at 100, clear of GGML's (0–39), and travel through the same
``ggml_type`` argument.
"""

from __future__ import annotations

import torch

from .types import WeightType

INT8_ROW = WeightType.INT8_ROW
INT4_GROUPS = {
    (32, False): WeightType.INT4_G32_ASYM,
    (64, False): WeightType.INT4_G64_ASYM,
    (128, False): WeightType.INT4_G128_ASYM,
    (32, True): WeightType.INT4_G32_SYM,
    (64, True): WeightType.INT4_G64_SYM,
    (128, True): WeightType.INT4_G128_SYM,
}  # (group, symmetric)
_INT4_BY_TYPE = {t: key for key, t in INT4_GROUPS.items()}
MXFP4_BLOCKS = WeightType.MXFP4_BLOCKS
NVFP4_BLOCKS = WeightType.NVFP4_BLOCKS
SPARSE24_INT8 = WeightType.SPARSE24_INT8
FP8_ROW = WeightType.FP8_ROW
SPARSE24_F16 = WeightType.SPARSE24_F16
TYPES = frozenset({INT8_ROW, *INT4_GROUPS.values(), MXFP4_BLOCKS, NVFP4_BLOCKS, SPARSE24_INT8, FP8_ROW, SPARSE24_F16})
#: layouts of non-integer values: multiplied with float activations only (no integer dot product)
FLOAT_TYPES = frozenset({FP8_ROW, SPARSE24_F16})
_BLOCK32 = {
    INT8_ROW: 32,
    MXFP4_BLOCKS: 17,
    NVFP4_BLOCKS: 18,
    SPARSE24_INT8: 20,
    FP8_ROW: 32,
    SPARSE24_F16: 36,
}  # bytes per 32 weights
#: E2M1 code (0..15) → value (OCP MX v1.0 §5.3.3); codes 8..15 are the negatives
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def is_native_layout(type_id: int) -> bool:
    """Whether ``type_id`` names one of these layouts (else it is a GGML type)."""
    return int(type_id) in TYPES


def row_header_bytes(type_id: int) -> int:
    """Bytes before a row's first block (INT8_ROW: its float32 scale; NVFP4: the tensor's float32 scale)."""
    return 4 if int(type_id) in (INT8_ROW, NVFP4_BLOCKS, SPARSE24_INT8, FP8_ROW) else 0


def block_weights(type_id: int) -> int:
    """Weights per block of this layout."""
    t = int(type_id)
    return 32 if t in _BLOCK32 else _INT4_BY_TYPE[t][0]


def block_bytes(type_id: int) -> int:
    """Bytes per block of this layout."""
    t = int(type_id)
    if t in _BLOCK32:
        return _BLOCK32[t]
    group, symmetric = _INT4_BY_TYPE[t]
    return (2 if symmetric else 4) + group // 2


def row_weights(type_id: int, row_bytes: int) -> int:
    """K, the weights of a row that takes ``row_bytes`` bytes in this layout."""
    body = row_bytes - row_header_bytes(type_id)
    if body % block_bytes(type_id):
        raise ValueError(f"layout {type_id}: {row_bytes} bytes per row is not a whole number of blocks")
    return body // block_bytes(type_id) * block_weights(type_id)


def pack_int8_rows(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 qweight (N, K) and float32 scale (N,) → INT8_ROW rows (N, 4 + K) uint8."""
    n, k = qweight.shape
    head = scale.to(torch.float32).contiguous().reshape(n, 1).view(torch.uint8)  # (N, 4)
    return torch.cat((head, qweight.contiguous().view(torch.uint8)), dim=1)


def pack_int4_groups(qweight: torch.Tensor, scale: torch.Tensor, offset, group: int) -> torch.Tensor:
    """bytediet int4 planes → INT4 group blocks.

    qweight (N, K/2) uint8 (element 2i in the low nibble of byte i), scale (N, K/G) float16, offset (N, K/G)
    float16 or None (symmetric) → (N, K/G · block_bytes) uint8.
    """
    n, k = qweight.shape[0], qweight.shape[1] * 2
    q4 = _q4_order(qweight).reshape(n, k // group, group // 2)  # GGML Q4 order
    parts = [scale.to(torch.float16).contiguous().reshape(n, -1, 1).view(torch.uint8)]
    if offset is not None:
        parts.append(offset.to(torch.float16).contiguous().reshape(n, -1, 1).view(torch.uint8))
    parts.append(q4)
    return torch.cat(parts, dim=-1).reshape(n, -1)


def _q4_order(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K/2) nibbles, element 2i low → (N, K/32, 16) bytes, element e low and e + 16 high per 32."""
    n, k = qweight.shape[0], qweight.shape[1] * 2
    codes = torch.stack((qweight & 0x0F, qweight >> 4), dim=-1).reshape(n, k // 32, 2, 16)
    return codes[:, :, 0] | (codes[:, :, 1] << 4)


def _q4_codes(b: torch.Tensor) -> torch.Tensor:
    """(..., 16) bytes in Q4 order → (..., 32) codes in element order."""
    return torch.cat((b & 0x0F, b >> 4), dim=-1)


def pack_mxfp4(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """mxfp4 planes: qweight (N, K/2) uint8, scale (N, K/32) uint8 E8M0 → MXFP4_BLOCKS rows (N, K/32 · 17)."""
    n = qweight.shape[0]
    return torch.cat((scale.reshape(n, -1, 1), _q4_order(qweight)), dim=-1).reshape(n, -1)


def pack_nvfp4(qweight: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor) -> torch.Tensor:
    """nvfp4 planes: qweight (N, K/2) uint8, scale (N, K/16) float8_e4m3fn, tensor_scale (1,) float32 →
    NVFP4_BLOCKS rows (N, 4 + K/32 · 18)."""
    n = qweight.shape[0]
    head = tensor_scale.to(torch.float32).reshape(1, 1).expand(n, 1).contiguous().view(torch.uint8)
    pairs = scale.contiguous().view(torch.uint8).reshape(n, -1, 2)
    return torch.cat((head, torch.cat((pairs, _q4_order(qweight)), dim=-1).reshape(n, -1)), dim=1)


def pack_sparse24_int8(values: torch.Tensor, index: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """sparse24-int8 planes: values (N, K/2) int8, index (N, K/8) uint8 (two group codes per byte), scale (N,)
    float32 → SPARSE24_INT8 rows (N, 4 + K/32 · 20). K must be a multiple of 32."""
    n = values.shape[0]
    head = scale.to(torch.float32).contiguous().reshape(n, 1).view(torch.uint8)
    body = torch.cat((values.contiguous().view(torch.uint8).reshape(n, -1, 16), index.reshape(n, -1, 4)), dim=-1)
    return torch.cat((head, body.reshape(n, -1)), dim=1)


def pack_fp8_rows(qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 planes: qweight (N, K) float8_e4m3fn, scale (N,) float32 → FP8_ROW rows (N, 4 + K) uint8."""
    return pack_int8_rows(qweight.contiguous().view(torch.int8), scale)


def pack_sparse24_f16(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """sparse24 planes: values (N, K/2) float16, index (N, K/8) uint8 (two group codes per byte) →
    SPARSE24_F16 rows (N, K/32 · 36). K must be a multiple of 32."""
    n = values.shape[0]
    vals = values.to(torch.float16).contiguous().view(torch.uint8).reshape(n, -1, 32)
    return torch.cat((vals, index.reshape(n, -1, 4)), dim=-1).reshape(n, -1)


def _sparse24_dense(vals: torch.Tensor, codes_bytes: torch.Tensor) -> torch.Tensor:
    """Per 32 weights: vals (N, B, 16) float, codes_bytes (N, B, 4) uint8 → dense (N, B·32) float32."""
    n = vals.shape[0]
    codes = torch.stack((codes_bytes & 15, codes_bytes >> 4), dim=-1).reshape(n, -1, 8).long()
    pos = torch.stack((codes & 3, codes >> 2), dim=-1)  # (N, B, 8, 2)
    dense = torch.zeros(n, vals.shape[1], 8, 4).scatter_(-1, pos, vals.float().reshape(n, -1, 8, 2))
    return dense.reshape(n, -1)


def dequantize(type_id: int, rows: torch.Tensor) -> torch.Tensor:
    """The reference decoder: rows (N, bytes per row) uint8 in layout ``type_id`` → weight (N, K) float32."""
    t = int(type_id)
    n = rows.shape[0]
    if t == MXFP4_BLOCKS:
        b = rows.reshape(n, -1, 17)
        x = torch.ldexp(torch.ones(b.shape[:2]), b[..., 0].to(torch.int32) - 127)  # 2^(e − 127)
        return (E2M1_VALUES[_q4_codes(b[..., 1:]).long()] * x[..., None]).reshape(n, -1)
    if t == NVFP4_BLOCKS:
        tensor_scale = rows[:, :4].contiguous().view(torch.float32)  # (N, 1)
        b = rows[:, 4:].reshape(n, -1, 18)
        s = b[..., :2].contiguous().view(torch.float8_e4m3fn).float() * tensor_scale[:, :, None]  # (N, K/32, 2)
        v = E2M1_VALUES[_q4_codes(b[..., 2:]).long()].reshape(n, -1, 2, 16)
        return (v * s[..., None]).reshape(n, -1)
    if t == SPARSE24_INT8:
        scale = rows[:, :4].contiguous().view(torch.float32)  # (N, 1)
        b = rows[:, 4:].reshape(n, -1, 20)
        return _sparse24_dense(b[..., :16].contiguous().view(torch.int8), b[..., 16:]) * scale
    if t == SPARSE24_F16:
        b = rows.reshape(n, -1, 36)
        return _sparse24_dense(b[..., :32].contiguous().view(torch.float16), b[..., 32:])
    if t == FP8_ROW:
        scale = rows[:, :4].contiguous().view(torch.float32)  # (N, 1)
        return rows[:, 4:].contiguous().view(torch.float8_e4m3fn).float() * scale
    if t == INT8_ROW:
        scale = rows[:, :4].contiguous().view(torch.float32)  # (N, 1)
        return rows[:, 4:].contiguous().view(torch.int8).float() * scale
    group, symmetric = _INT4_BY_TYPE[t]
    b = rows.reshape(n, -1, block_bytes(t))  # (N, groups, bytes)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # (N, groups, 1)
    qs = b[..., 2 if symmetric else 4 :].reshape(n, b.shape[1], group // 32, 16)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).reshape(n, b.shape[1], group).float()
    if symmetric:
        w = (q - 8) * d
    else:
        w = q * d + b[..., 2:4].contiguous().view(torch.float16).float()
    return w.reshape(n, -1)
