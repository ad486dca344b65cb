"""Triton device functions that decode a tile of a weight from its packed block rows, in registers.

Every layout the CPU kernels read (GGML's ``ggml-common.h`` blocks and :mod:`bytediet.kernels.native_layouts`)
is decoded per element: weight (n, k) finds its code and its block's scales by address arithmetic, with byte
loads only (rows and blocks are not aligned), so one function serves any tile shape and any row length.
Each decoder repeats its twin's float32 operations (``ggml_codecs.DECODERS``, ``native_layouts.dequantize``).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("bytediet's GPU kernels need triton: pip install 'triton>=3.6'") from e

# GGML type ids (gguf.GGMLQuantizationType) and bytediet layout ids (native_layouts), as constexprs: compiled
# @triton.jit code reads only constexpr globals (Python code uses ``.value``)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = map(tl.constexpr, (2, 3, 6, 7, 8, 12, 13, 14))
INT8_ROW, MXFP4, NVFP4, SPARSE24_INT8, FP8_ROW, SPARSE24_F16 = map(tl.constexpr, (100, 107, 108, 109, 110, 111))
INT4_FIRST, INT4_LAST = tl.constexpr(101), tl.constexpr(106)


def ids(*layouts) -> frozenset[int]:
    """The plain ints of layout constexprs."""
    return frozenset(c.value for c in layouts)


@triton.jit
def _u8(p, mask):
    """Byte at p, as int32."""
    return tl.load(p, mask=mask, other=0).to(tl.int32)


@triton.jit
def _f16(p, mask):
    """Little-endian float16 at p (any alignment) → float32."""
    bits = _u8(p, mask) | (_u8(p + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f32(p, mask):
    """Little-endian float32 at p (any alignment)."""
    bits = (_u8(p, mask) | (_u8(p + 1, mask) << 8) | (_u8(p + 2, mask) << 16)).to(tl.uint32)
    bits = bits | (_u8(p + 3, mask).to(tl.uint32) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _i8(p, mask):
    """Signed byte at p → float32."""
    return tl.load(p, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1(code):
    """E2M1 code 0..15 (int32) → its value (OCP MX v1.0 §5.3.3): 0, ½, 1, 1.5, 2, 3, 4, 6, then the negatives."""
    m = code & 7
    step = tl.where(m >= 6, 2.0, tl.where(m >= 4, 1.0, 0.5))
    mag = tl.where(m < 2, m.to(tl.float32) * 0.5, (2 + (m & 1)).to(tl.float32) * step)
    return tl.where(code >= 8, -mag, mag)


@triton.jit
def _e4m3(byte):
    """float8_e4m3fn byte (int32 0..255) → float32: normals, subnormals (m·2⁻⁹) and NaN (S.1111.111)."""
    e = (byte >> 3) & 15
    m = byte & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return tl.where(byte >= 128, -mag, mag)


@triton.jit
def _e8m0(byte):
    """E8M0 scale byte → 2^(byte − 127) in float32 (byte 0: the subnormal 2⁻¹²⁷; 255: inf, as ldexp)."""
    return tl.where(byte == 0, 1 << 22, byte << 23).to(tl.float32, bitcast=True)


@triton.jit
def _q4(blk, j, mask):
    """4-bit code of element j (0..31) of a 32-weight group stored in Q4 order at blk (16 bytes)."""
    return (_u8(blk + (j & 15), mask) >> ((j >> 4) * 4)) & 15


@triton.jit
def _k_scale_min(sc_ptr, s, mask):
    """6-bit scale and min of sub-block s (0..7) from the 12 packed bytes of a Q4_K/Q5_K super-block."""
    lo = s < 4
    a = _u8(sc_ptr + s, mask)  # scales[s]
    b = _u8(sc_ptr + (s + 4), mask)  # scales[s + 4] (in range for s < 8)
    c = _u8(sc_ptr + tl.where(lo, s, s - 4), mask)  # scales[s − 4] for s ≥ 4
    sc = tl.where(lo, a & 63, (b & 15) | ((c >> 6) << 4))
    mn = tl.where(lo, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def weight_tile(w_ptr, row_bytes, n, k, N, K, TYPE: tl.constexpr, GROUP: tl.constexpr, SYM: tl.constexpr):
    """W[n, k] as float32 for n (BN, 1) and k (1, BK) int32 indices; 0 outside (N, K).

    w_ptr: uint8 rows of ``row_bytes`` bytes; TYPE: the layout id; GROUP, SYM: the int4 group size and symmetry
    (ignored by the other layouts)."""
    mask = (n < N) & (k < K)
    row = w_ptr + n.to(tl.int64) * row_bytes
    if TYPE == Q4_0:
        blk = row + (k >> 5) * 18
        w = _f16(blk, mask) * (_q4(blk + 2, k & 31, mask) - 8).to(tl.float32)
    elif TYPE == Q4_1:
        blk = row + (k >> 5) * 20
        w = _f16(blk, mask) * _q4(blk + 4, k & 31, mask).to(tl.float32) + _f16(blk + 2, mask)
    elif TYPE == Q5_0:
        blk = row + (k >> 5) * 22
        j = k & 31
        q = _q4(blk + 6, j, mask) | (((_u8(blk + 2 + (j >> 3), mask) >> (j & 7)) & 1) << 4)
        w = _f16(blk, mask) * (q - 16).to(tl.float32)
    elif TYPE == Q5_1:
        blk = row + (k >> 5) * 24
        j = k & 31
        q = _q4(blk + 8, j, mask) | (((_u8(blk + 4 + (j >> 3), mask) >> (j & 7)) & 1) << 4)
        w = _f16(blk, mask) * q.to(tl.float32) + _f16(blk + 2, mask)
    elif TYPE == Q8_0:
        blk = row + (k >> 5) * 34
        w = _i8(blk + 2 + (k & 31), mask) * _f16(blk, mask)
    elif TYPE == Q4_K:
        blk = row + (k >> 8) * 144
        j = k & 255
        s = j >> 5  # sub-block: 2i from the low nibbles of bytes 32i.., 2i + 1 from their high nibbles
        q = (_u8(blk + 16 + (s >> 1) * 32 + (j & 31), mask) >> ((s & 1) * 4)) & 15
        sc, mn = _k_scale_min(blk + 4, s, mask)
        w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
    elif TYPE == Q5_K:
        blk = row + (k >> 8) * 176
        j = k & 255
        s = j >> 5
        q = (_u8(blk + 48 + (s >> 1) * 32 + (j & 31), mask) >> ((s & 1) * 4)) & 15
        q = q | (((_u8(blk + 16 + (j & 31), mask) >> s) & 1) << 4)
        sc, mn = _k_scale_min(blk + 4, s, mask)
        w = (_f16(blk, mask) * sc) * q.to(tl.float32) - _f16(blk + 2, mask) * mn
    elif TYPE == Q6_K:
        blk = row + (k >> 8) * 210
        j = k & 255
        h = j >> 7
        r = j & 127
        lo = (_u8(blk + h * 64 + (r & 63), mask) >> ((r >> 6) * 4)) & 15
        hi = (_u8(blk + 128 + h * 32 + (r & 31), mask) >> ((r >> 5) * 2)) & 3
        d = _f16(blk + 208, mask) * _i8(blk + 192 + (j >> 4), mask)
        w = d * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif TYPE == INT8_ROW:
        w = _i8(row + 4 + k, mask) * _f32(row, mask)
    elif TYPE == FP8_ROW:
        w = _e4m3(_u8(row + 4 + k, mask)) * _f32(row, mask)
    elif TYPE == MXFP4:
        blk = row + (k >> 5) * 17
        w = _e2m1(_q4(blk + 1, k & 31, mask)) * _e8m0(_u8(blk, mask))
    elif TYPE == NVFP4:
        blk = row + 4 + (k >> 5) * 18
        j = k & 31
        s = _e4m3(_u8(blk + (j >> 4), mask)) * _f32(row, mask)
        w = _e2m1(_q4(blk + 2, j, mask)) * s
    elif TYPE == SPARSE24_INT8:
        blk = row + 4 + (k >> 5) * 20
        j = k & 31
        g = j >> 2  # group of 4 positions; its two kept values are 2g and 2g + 1
        code = (_u8(blk + 16 + (g >> 1), mask) >> ((g & 1) * 4)) & 15
        p = j & 3
        kept = (p == (code & 3)) | (p == (code >> 2))
        v = _i8(blk + 2 * g + (p == (code >> 2)).to(tl.int32), mask & kept)
        w = v * _f32(row, mask)
    elif TYPE == SPARSE24_F16:
        blk = row + (k >> 5) * 36
        j = k & 31
        g = j >> 2
        code = (_u8(blk + 32 + (g >> 1), mask) >> ((g & 1) * 4)) & 15
        p = j & 3
        kept = (p == (code & 3)) | (p == (code >> 2))
        w = _f16(blk + 2 * (2 * g + (p == (code >> 2)).to(tl.int32)), mask & kept)
    else:
        tl.static_assert(TYPE >= INT4_FIRST and TYPE <= INT4_LAST, "unknown weight layout")
        HEAD: tl.constexpr = 2 if SYM else 4
        blk = row + (k // GROUP) * (HEAD + GROUP // 2)
        j = k % GROUP
        q = _q4(blk + HEAD + (j >> 5) * 16, j & 31, mask).to(tl.float32)
        if SYM:
            w = (q - 8.0) * _f16(blk, mask)
        else:
            w = q * _f16(blk, mask) + _f16(blk + 2, mask)
    return tl.where(mask, w, 0.0)


@triton.jit
def round_bf16(v):
    """float32 → the float32 of the nearest bfloat16 (ties to even): the interpreter's own cast truncates."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
