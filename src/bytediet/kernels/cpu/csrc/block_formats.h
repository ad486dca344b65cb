// GGML block formats as seen by the kernels: each format is a sequence of super-blocks of SUB
// sub-blocks of 32 weights. For sub-block j a format gives
//   codes: 32 bytes in element order, unsigned (SIGNED = false) or signed (SIGNED = true);
//   d_lo, d_hi: the scale of elements 0..15 and 16..31 (equal except for Q6_K's 16-element scales);
//   m: the additive term per element (a zero point or min, or −offset·d for Q4_0/Q5_0),
// so that weight[e] = d_e · code[e] + m. Byte layouts: ggml-common.h (and bytediet.kernels.ggml_codecs,
// whose PyTorch decoders are the reference these are tested against). A row may start with HEADER bytes
// holding a scale of the whole row (row_scale), applied once to the row's product: bytediet's own layouts
// (kernels/native_layouts.py) use that for int8's per-channel scale; the GGML formats have none.
#pragma once
#include <cmath>
#include <type_traits>

#include "isa.h"
#include "types.h"

namespace bd {

struct SubScales {
    float d_lo[8], d_hi[8], m[8];
};

struct NoRowHeader {
    static constexpr int HEADER = 0;
    static float row_scale(const uint8_t*) { return 1.0f; }
};

struct Float32RowHeader {  // a row starts with a float32 scale of the whole row
    static constexpr int HEADER = 4;
    static float row_scale(const uint8_t* row) {
        float s;
        std::memcpy(&s, row, 4);
        return s;
    }
};

struct UnitSubScales {  // blocks without scales of their own (a row scale or none): unit scales, no offset
    static void scales(const uint8_t*, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = 1.0f;
        s.m[0] = 0.0f;
    }
};

// Formats whose 32-weight sub-blocks have two scales (Q6_K) set SPLIT; the others use d_lo only.

struct Q4_0 : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 18;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        float d = f16_to_f32(b);
        s.d_lo[0] = s.d_hi[0] = d;
        s.m[0] = -8.0f * d;
    }
    static __m256i codes(const uint8_t* b, int) { return nibbles_halves(b + 2); }
};

struct Q4_1 : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 20;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = f16_to_f32(b);
        s.m[0] = f16_to_f32(b + 2);
    }
    static __m256i codes(const uint8_t* b, int) { return nibbles_halves(b + 4); }
};

inline __m256i q5_codes(const uint8_t* qh, const uint8_t* qs) {
    uint32_t bits;
    std::memcpy(&bits, qh, 4);
    __m256i high = _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(0x10));
    return _mm256_or_si256(nibbles_halves(qs), high);
}

struct Q5_0 : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 22;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        float d = f16_to_f32(b);
        s.d_lo[0] = s.d_hi[0] = d;
        s.m[0] = -16.0f * d;
    }
    static __m256i codes(const uint8_t* b, int) { return q5_codes(b + 2, b + 6); }
};

struct Q5_1 : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 24;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = f16_to_f32(b);
        s.m[0] = f16_to_f32(b + 2);
    }
    static __m256i codes(const uint8_t* b, int) { return q5_codes(b + 4, b + 8); }
};

struct Q8_0 : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 34;
    static constexpr bool SIGNED = true, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = f16_to_f32(b);
        s.m[0] = 0.0f;
    }
    static __m256i codes(const uint8_t* b, int) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)); }
};

// K-quants: 256 weights per super-block, 6-bit sub-block scales and mins packed in 12 bytes.
inline void k_scales_mins(const uint8_t* b, SubScales& s) {
    float d = f16_to_f32(b), dmin = f16_to_f32(b + 2);
    const uint8_t* q = b + 4;
    for (int j = 0; j < 8; ++j) {
        int sc, mn;
        if (j < 4) {
            sc = q[j] & 63;
            mn = q[j + 4] & 63;
        } else {
            sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
            mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
        s.d_lo[j] = s.d_hi[j] = d * static_cast<float>(sc);
        s.m[j] = -dmin * static_cast<float>(mn);
    }
}

inline __m256i k_nibbles(const uint8_t* qs, int j) {  // sub-block j: nibble j%2 of bytes 32·(j/2)..+31
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * (j >> 1)));
    if (j & 1) v = _mm256_srli_epi16(v, 4);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

struct Q4_K : NoRowHeader {
    static constexpr int SUB = 8, BYTES = 144;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) { k_scales_mins(b, s); }
    static __m256i codes(const uint8_t* b, int j) { return k_nibbles(b + 16, j); }
};

struct Q5_K : NoRowHeader {
    static constexpr int SUB = 8, BYTES = 176;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) { k_scales_mins(b, s); }
    static __m256i codes(const uint8_t* b, int j) {
        __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
        __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
        return _mm256_or_si256(k_nibbles(b + 48, j), _mm256_slli_epi16(high, 4));
    }
};

struct Q6_K
    : NoRowHeader {  // 16-element int8 scales, 6-bit codes stored as 4 low bits (ql) + 2 high bits (qh), offset 32
    static constexpr int SUB = 8, BYTES = 210;
    static constexpr bool SIGNED = true, SPLIT = true;
    static void scales(const uint8_t* b, SubScales& s) {
        float d = f16_to_f32(b + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
        for (int j = 0; j < 8; ++j) {
            s.d_lo[j] = d * static_cast<float>(sc[2 * j]);
            s.d_hi[j] = d * static_cast<float>(sc[2 * j + 1]);
            s.m[j] = 0.0f;
        }
    }
    static __m256i codes(const uint8_t* b, int j) {
        int half = j >> 2;
        __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (j & 1)));
        if ((j >> 1) & 1) lo = _mm256_srli_epi16(lo, 4);
        lo = _mm256_and_si256(lo, _mm256_set1_epi8(0x0F));
        __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
        hi = _mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * (j & 3))), _mm256_set1_epi8(3));
        __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
        return _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    }
};

// bytediet's own formats, repacked once at load time (kernels/native_layouts.py; types.h's WeightType from 100).

// int4-gG: blocks of G weights, [scale f16][offset f16, asymmetric only][G/2 bytes of nibbles in Q4 order].
template <int G, bool SYMMETRIC>  // as native_layouts.INT4_GROUPS' (group, symmetric) key
struct Int4Groups : NoRowHeader {
    static constexpr int SUB = G / 32, CODES = SYMMETRIC ? 2 : 4, BYTES = CODES + G / 2;
    static constexpr bool SIGNED = false, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        const float d = f16_to_f32(b), m = SYMMETRIC ? -8.0f * d : f16_to_f32(b + 2);
        for (int j = 0; j < SUB; ++j) {
            s.d_lo[j] = s.d_hi[j] = d;
            s.m[j] = m;
        }
    }
    static __m256i codes(const uint8_t* b, int j) { return nibbles_halves(b + CODES + 16 * j); }
};

// int8 with one float32 scale per output channel: a row is [scale f32][K int8 codes].
struct Int8Row : Float32RowHeader, UnitSubScales {
    static constexpr int SUB = 1, BYTES = 32;
    static constexpr bool SIGNED = true, SPLIT = false;
    static __m256i codes(const uint8_t* b, int) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)); }
};

// E2M1 codes (4 bits) → int8 2·value: {0, 1, 2, 3, 4, 6, 8, 12} and their negatives (codes 8..15).
inline __m256i e2m1_codes(const uint8_t* qs) {
    const __m256i lut = _mm256_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12, 0, 1, 2, 3, 4, 6, 8,
                                         12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm256_shuffle_epi8(lut, nibbles_halves(qs));
}

inline float e4m3_to_f32_slow(uint8_t b) {  // OCP FP8 E4M3 (fn: no infinities; 0x7F/0xFF are NaN)
    const int e = (b >> 3) & 15, mnt = b & 7;
    float v = e == 0 ? std::ldexp(static_cast<float>(mnt), -9) : std::ldexp(static_cast<float>(8 + mnt), e - 10);
    if ((b & 0x7F) == 0x7F) v = NAN;
    return b & 0x80 ? -v : v;
}

// 256-entry tables, built once: a libm ldexp per 32 weights cost more than the dot product itself.
struct ScaleTables {
    float e4m3[256], e8m0_half[256];  // E4M3 → float; E8M0 byte e → 2^(e − 128) (the E2M1 ½ folded in)
    ScaleTables() {
        for (int b = 0; b < 256; ++b) {
            e4m3[b] = e4m3_to_f32_slow(static_cast<uint8_t>(b));
            e8m0_half[b] = b == 255 ? NAN : std::ldexp(1.0f, b - 128);
        }
    }
};

inline const ScaleTables& scale_tables() {
    static const ScaleTables tables;
    return tables;
}

inline float e4m3_to_f32(uint8_t b) { return scale_tables().e4m3[b]; }

// mxfp4: per 32 weights [E8M0 scale][16 bytes of E2M1 codes]; weight = 2^(e − 127) · v = (2^(e − 128)) · (2v).
struct MXFP4Blocks : NoRowHeader {
    static constexpr int SUB = 1, BYTES = 17;
    static constexpr bool SIGNED = true, SPLIT = false;
    static void scales(const uint8_t* b, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = scale_tables().e8m0_half[b[0]];
        s.m[0] = 0.0f;
    }
    static __m256i codes(const uint8_t* b, int) { return e2m1_codes(b + 1); }
};

// nvfp4: a row starts with the tensor's f32 scale; per 32 weights [E4M3 scale 0..15][E4M3 scale 16..31][codes].
struct NVFP4Blocks : Float32RowHeader {
    static constexpr int SUB = 1, BYTES = 18;
    static constexpr bool SIGNED = true, SPLIT = true;
    static void scales(const uint8_t* b, SubScales& s) {
        s.d_lo[0] = 0.5f * e4m3_to_f32(b[0]);
        s.d_hi[0] = 0.5f * e4m3_to_f32(b[1]);
        s.m[0] = 0.0f;
    }
    static __m256i codes(const uint8_t* b, int) { return e2m1_codes(b + 2); }
};

// sparse24-int8 (2:4): a row is [scale f32], then per 32 weights [16 int8 kept values][8 group codes, 4 bits
// each: p0 | p1 << 2]. The codes become a byte-shuffle index that scatters the values into their positions.
struct Sparse24Int8 : Float32RowHeader, UnitSubScales {
    static constexpr int SUB = 1, BYTES = 20;
    static constexpr bool SIGNED = true, SPLIT = false;
    // T_k[c] (both 128-bit lanes): where position k of a group with code c takes its value from: 0 the first
    // kept value, 1 the second, -128 (0x80) nothing (a zero).
    static __m256i table(int k) {
        switch (k) {
            case 0:
                return _mm256_setr_epi8(0, 1, 1, 1, 0, -128, -128, -128, 0, -128, -128, -128, 0, -128, -128, -128, 0, 1,
                                        1, 1, 0, -128, -128, -128, 0, -128, -128, -128, 0, -128, -128, -128);
            case 1:
                return _mm256_setr_epi8(-128, 0, -128, -128, 1, 0, 1, 1, -128, 0, -128, -128, -128, 0, -128, -128, -128,
                                        0, -128, -128, 1, 0, 1, 1, -128, 0, -128, -128, -128, 0, -128, -128);
            case 2:
                return _mm256_setr_epi8(-128, -128, 0, -128, -128, -128, 0, -128, 1, 1, 0, 1, -128, -128, 0, -128, -128,
                                        -128, 0, -128, -128, -128, 0, -128, 1, 1, 0, 1, -128, -128, 0, -128);
            default:
                return _mm256_setr_epi8(-128, -128, -128, 0, -128, -128, -128, 0, -128, -128, -128, 0, 1, 1, 1, 0, -128,
                                        -128, -128, 0, -128, -128, -128, 0, -128, -128, -128, 0, 1, 1, 1, 0);
        }
    }
    static __m256i codes(const uint8_t* b, int) {
        const __m256i t0 = table(0), t1 = table(1), t2 = table(2), t3 = table(3);  // constants: no loads
        uint32_t packed;
        std::memcpy(&packed, b + 16, 4);
        const __m256i nib = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(packed)),
                                                               _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                             _mm256_set1_epi32(15));
        const __m256i rep = _mm256_mullo_epi32(nib, _mm256_set1_epi32(0x01010101));  // lane g: its code in every byte
        const __m256i m0 = _mm256_set1_epi32(0x000000FF), m1 = _mm256_set1_epi32(0x0000FF00),
                      m2 = _mm256_set1_epi32(0x00FF0000), m3 = _mm256_set1_epi32(static_cast<int>(0xFF000000u));
        __m256i idx = _mm256_or_si256(_mm256_or_si256(_mm256_and_si256(_mm256_shuffle_epi8(t0, rep), m0),
                                                      _mm256_and_si256(_mm256_shuffle_epi8(t1, rep), m1)),
                                      _mm256_or_si256(_mm256_and_si256(_mm256_shuffle_epi8(t2, rep), m2),
                                                      _mm256_and_si256(_mm256_shuffle_epi8(t3, rep), m3)));
        idx = _mm256_add_epi8(idx, _mm256_setr_epi32(0x00000000, 0x02020202, 0x04040404, 0x06060606, 0x08080808,
                                                     0x0A0A0A0A, 0x0C0C0C0C, 0x0E0E0E0E));  // group g: + 2g
        const __m256i vals = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
        return _mm256_shuffle_epi8(vals, idx);
    }
};

}  // namespace bd

namespace bd {

// Formats whose stored values are not integers (FP8 codes, fp16 kept values) have no integer dot product:
// they set FLOAT and give values(b, j, out): sub-block j's 32 weights as floats before d_lo/d_hi and the row
// scale (codes() is not used). The kernels multiply them with float activations only (act mode f32).
template <class F, class = void>
struct is_float_format : std::false_type {};
template <class F>
struct is_float_format<F, std::void_t<decltype(F::FLOAT)>> : std::bool_constant<F::FLOAT> {};

// 16 E4M3 bytes → 16 f16 bit patterns (sign to bit 15, exponent and mantissa to bits 13..7): as f16 that is the
// E4M3 value / 2^8 exactly, subnormals included (E4M3 bias 7, f16 bias 15; an E4M3 subnormal m·2^-9 becomes
// the f16 subnormal m·2^-17). The 2^8 is folded into the block scale. 0x7F/0xFF (NaN) decode as ±480 / 2^8:
// the fp8 format never stores them (its quantizer saturates at ±448).
inline void e4m3_to_f32x16(__m128i b, __m256 out[2]) {
    const __m128i keep = _mm_set1_epi16(static_cast<short>(0xBFFF));  // srai copied the sign into bit 14 too
    const __m128i lo = _mm_and_si128(_mm_srai_epi16(_mm_unpacklo_epi8(_mm_setzero_si128(), b), 1), keep);
    const __m128i hi = _mm_and_si128(_mm_srai_epi16(_mm_unpackhi_epi8(_mm_setzero_si128(), b), 1), keep);
    out[0] = _mm256_cvtph_ps(lo);
    out[1] = _mm256_cvtph_ps(hi);
}

// fp8: a row is [scale f32][K E4M3 codes]; weight = scale · e4m3(code).
struct FP8Row : Float32RowHeader {
    static constexpr int SUB = 1, BYTES = 32;
    static constexpr bool SIGNED = true, SPLIT = false, FLOAT = true;
    static void scales(const uint8_t*, SubScales& s) {
        s.d_lo[0] = s.d_hi[0] = 256.0f;  // the 2^8 of e4m3_to_f32x16
        s.m[0] = 0.0f;
    }
    static void values(const uint8_t* b, int, __m256 out[4]) {
        e4m3_to_f32x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), out);
        e4m3_to_f32x16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)), out + 2);
    }
    static __m256i codes(const uint8_t*, int) { return _mm256_setzero_si256(); }  // unused (FLOAT)
};

// Formats that set GATHER multiply float activations without forming the dense weight: prepare(b, j) reads
// sub-block j once per weight row, dot(p, x) gives 8 lanes whose sum is Σ weight·x over its 32 positions.
template <class F, class = void>
struct is_gather_format : std::false_type {};
template <class F>
struct is_gather_format<F, std::void_t<decltype(F::GATHER)>> : std::bool_constant<F::GATHER> {};

// sparse24 (2:4, fp16 kept values): per 32 weights [16 f16 kept values][8 group codes, 4 bits each: p0 | p1 << 2,
// two per byte, even group low]: 36 bytes, 9 bits per weight. Against float activations (GATHER) the kept
// values multiply the activations at their positions, gathered by lane permutes (16 products per 32 weights,
// no zeros); values() (the dense decode, for the compute-bound path) places each value with one permute per 8.
struct Sparse24F16 : NoRowHeader, UnitSubScales {
    static constexpr int SUB = 1, BYTES = 36;
    static constexpr bool SIGNED = true, SPLIT = false, FLOAT = true, GATHER = true;
    struct Gather {  // code byte of groups (a, b) → positions of their 4 kept values inside their 8 activations
        alignas(16) int32_t pos[256][4];
        Gather() {
            for (int c = 0; c < 256; ++c)
                for (int g = 0; g < 2; ++g) {
                    const int code = (c >> (4 * g)) & 15;
                    pos[c][2 * g] = 4 * g + (code & 3);
                    pos[c][2 * g + 1] = 4 * g + (code >> 2);
                }
        }
    };
    static inline const Gather kGather{};
    struct Prepared {
        __m256 v0, v1;  // kept values 0..7 (groups 0..3), 8..15 (groups 4..7)
        __m256i idx0, idx1;  // lanes 0..3: positions in activations 0..7 (resp. 16..23), lanes 4..7: in 8..15 (24..31)
    };
    __attribute__((always_inline)) static Prepared prepare(const uint8_t* b, int) {
        const auto quad = [](const uint8_t c) {
            return _mm_load_si128(reinterpret_cast<const __m128i*>(kGather.pos[c]));
        };
        return Prepared{_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b))),
                        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16))),
                        _mm256_set_m128i(quad(b[33]), quad(b[32])), _mm256_set_m128i(quad(b[35]), quad(b[34]))};
    }
    __attribute__((always_inline)) static __m256 dot(const Prepared& p, const float* x) {
        const __m256 g0 = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(x), p.idx0),
                                          _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 8), p.idx0), 0xF0);
        const __m256 g1 = _mm256_blend_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 16), p.idx1),
                                          _mm256_permutevar8x32_ps(_mm256_loadu_ps(x + 24), p.idx1), 0xF0);
        return _mm256_fmadd_ps(p.v1, g1, _mm256_mul_ps(p.v0, g0));
    }
    struct Table {  // code byte of groups (a, b) → lane index per position (kept value 0..3 of the pair), mask
        alignas(32) int32_t idx[256][8];
        alignas(32) int32_t keep[256][8];
        Table() {
            for (int c = 0; c < 256; ++c)
                for (int g = 0; g < 2; ++g) {
                    const int code = (c >> (4 * g)) & 15, p0 = code & 3, p1 = code >> 2;
                    for (int p = 0; p < 4; ++p) {
                        const bool first = p == p0, second = p == p1 && p1 != p0;
                        idx[c][4 * g + p] = 2 * g + (second ? 1 : 0);
                        keep[c][4 * g + p] = first || second ? -1 : 0;
                    }
                }
        }
    };
    static inline const Table kTable{};  // built when the library loads: no guard in the inner loop
    __attribute__((always_inline)) static void values(const uint8_t* b, int, __m256 out[4]) {
        const Table& t = kTable;
        const __m256 v0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));  // values 0..7
        const __m256 v1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16)));  // values 8..15
        for (int k = 0; k < 4; ++k) {  // positions 8k..8k+7 = groups 2k, 2k+1 = kept values 4k..4k+3
            const int c = b[32 + k];
            const __m256i idx = _mm256_add_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(t.idx[c])),
                                                 _mm256_set1_epi32(4 * (k & 1)));  // odd k: lanes 4..7
            const __m256 v = _mm256_permutevar8x32_ps(k < 2 ? v0 : v1, idx);
            out[k] =
                _mm256_and_ps(v, _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(t.keep[c]))));
        }
    }
    static __m256i codes(const uint8_t*, int) { return _mm256_setzero_si256(); }  // unused (FLOAT)
};

// fn(F{}) for the format of a kernel type id (GGML ids, then bytediet's own 100–111); -1 for another id.
template <class Fn>
int with_format(int ggml_type, Fn fn) {
    switch (static_cast<WeightType>(ggml_type)) {
        case WeightType::Q4_0: fn(Q4_0{}); return 0;
        case WeightType::Q4_1: fn(Q4_1{}); return 0;
        case WeightType::Q5_0: fn(Q5_0{}); return 0;
        case WeightType::Q5_1: fn(Q5_1{}); return 0;
        case WeightType::Q8_0: fn(Q8_0{}); return 0;
        case WeightType::Q4_K: fn(Q4_K{}); return 0;
        case WeightType::Q5_K: fn(Q5_K{}); return 0;
        case WeightType::Q6_K: fn(Q6_K{}); return 0;
        case WeightType::INT8_ROW: fn(Int8Row{}); return 0;
        case WeightType::INT4_G32_ASYM: fn(Int4Groups<32, false>{}); return 0;
        case WeightType::INT4_G64_ASYM: fn(Int4Groups<64, false>{}); return 0;
        case WeightType::INT4_G128_ASYM: fn(Int4Groups<128, false>{}); return 0;
        case WeightType::INT4_G32_SYM: fn(Int4Groups<32, true>{}); return 0;
        case WeightType::INT4_G64_SYM: fn(Int4Groups<64, true>{}); return 0;
        case WeightType::INT4_G128_SYM: fn(Int4Groups<128, true>{}); return 0;
        case WeightType::MXFP4_BLOCKS: fn(MXFP4Blocks{}); return 0;
        case WeightType::NVFP4_BLOCKS: fn(NVFP4Blocks{}); return 0;
        case WeightType::SPARSE24_INT8: fn(Sparse24Int8{}); return 0;
        case WeightType::FP8_ROW: fn(FP8Row{}); return 0;
        case WeightType::SPARSE24_F16: fn(Sparse24F16{}); return 0;
        default: return -1;
    }
}

}  // namespace bd
