// KV page types of the native attention and decode step (decoder.cpp): how one stored row — one token's K or V of
// one KV head, D values — is read as floats, and how a new row is written. The torch codecs that own these pages
// (kvcache/full.py, tokenwise.py, fp8.py, ggml_block.py) round the same way, so the module path and the native
// step leave identical pages. The ids are types.h's KVPage (TURBOQUANT: its own file; code
// pages — KIVI's, QJL's keys, PolarQuant's, HF QuantizedCache's — which the attention reads with side data and the
// decode step neither reads nor writes: code_pages.h).
//
// A page type P gives: T (the stored element), row_size(d) (elements of T per row: pages are (slots, H, row_size)),
// ALIGN (head_dim a multiple of it), SCALED (a per-row fp16 scale beside the pages — int8, fp8 — applied once per
// row by the caller), BLOCKS (the row is GGML blocks, widened a row at a time by P::widen), P::load8 (8 values at
// a time, in registers), write(x, d, row, scale); the flags of code pages (SIDE, QUERY, ON_CODES, FINISH) are
// PageTraits'.
#pragma once
#include <cmath>
#include <cstring>
#include <type_traits>

#include "block_formats.h"
#include "isa.h"
#include "types.h"

namespace bd {

// What a page type is unless it says otherwise: rows of head_dim values (a multiple of 8) read alone. Code pages
// (code_pages.h) set SIDE (widened from side data, by slot and head: P::widen_at), QUERY (keys scored against a
// query transformed once per call: P::prepare, P::query_size), ON_CODES (keys scored on the codes: P::dot8 instead
// of widened rows) and FINISH (values summed in a rotated basis, turned back once per head: P::finish).
struct PageTraits {
    static constexpr bool SCALED = false, BLOCKS = false, SIDE = false, QUERY = false, ON_CODES = false, FINISH = false;
    static constexpr long ALIGN = 8, MAX_DIM = 1L << 20;
};

template <class E>
struct RowPages : PageTraits {  // D elements of E per row
    using T = E;
    static long row_size(long d) { return d; }
};

struct PagesF32 : RowPages<float> {
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) { return _mm256_loadu_ps(r + j); }
    static void write(const float* x, long d, T* r, uint16_t*) { std::memcpy(r, x, sizeof(float) * d); }
};

struct PagesBF16 : RowPages<uint16_t> {
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    static void write(const float* x, long d, T* r, uint16_t*) {
        for (long i = 0; i < d; ++i) {  // round to nearest even, as torch's float → bfloat16
            uint32_t b;
            std::memcpy(&b, x + i, 4);
            r[i] = std::isnan(x[i]) ? static_cast<uint16_t>(0x7FC0)
                                    : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
        }
    }
};

struct PagesF16 : RowPages<uint16_t> {
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j)));
    }
    static void write(const float* x, long d, T* r, uint16_t*) {
        long i = 0;
        for (; i + 8 <= d; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
        for (; i < d; ++i) r[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    }
};

// The per-token, per-head scale of the int8 and fp8 KV codecs: fp16(max(amax / qmax, 1e-6)), stored at *scale;
// returns it as float (what the codes are divided by).
inline float store_row_scale(const float* x, long d, float qmax, uint16_t* scale) {
    float amax = 0.0f;
    for (long i = 0; i < d; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    float s = amax / qmax;
    s = s > 1e-6f ? s : 1e-6f;
    *scale = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT);
    return _cvtsh_ss(*scale);
}

inline float row_scale(const void* scales, long idx) {
    return scales ? _cvtsh_ss(static_cast<const uint16_t*>(scales)[idx]) : 1.0f;
}

// kvcache int8: per token and head, scale = fp16(max(amax / 127, 1e-6)), code = q + 128
struct PagesInt8 : RowPages<uint8_t> {
    static constexpr bool SCALED = true;
    static __m256 load8(const T* r, long j) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + j)));
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(128)));
    }
    static void write(const float* x, long d, T* r, uint16_t* scale) {
        const float sf = store_row_scale(x, d, 127.0f, scale);
        for (long i = 0; i < d; ++i) {
            float q = std::nearbyint(x[i] / sf);  // round half to even (the default rounding mode), as torch.round
            q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
            r[i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
        }
    }
};

// kvcache fp8 (uncalibrated): per token and head, scale = fp16(max(amax / 448, 1e-6)), code = E4M3(x / scale)
// (sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinity; torch.float8_e4m3fn's rounding: to nearest
// even, after the codec's clamp to ±448).
struct PagesFP8 : RowPages<uint8_t> {
    static constexpr bool SCALED = true;
    static __m256 load8(const T* r, long j) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + j)));
        const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
        // normals: exponent and mantissa shifted into float32's fields, the bias moved from 7 to 127
        const __m256 normal =
            _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
        // subnormals (exponent field 0): mantissa · 2⁻⁹, computed in integers (the pool runs with DAZ)
        const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));
        const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag));
        const __m256 v = _mm256_blendv_ps(normal, sub, is_sub);
        const __m256 sign = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24));
        return _mm256_or_ps(v, sign);
    }
    static uint8_t encode(float v) {  // |v| ≤ 448
        const uint8_t sign = std::signbit(v) ? 0x80 : 0;
        const float a = std::fabs(v);
        if (a < 1.0f / 64.0f)  // below the smallest normal: steps of 2⁻⁹, round half to even
            return sign | static_cast<uint8_t>(std::nearbyint(a * 512.0f));
        uint32_t b;
        std::memcpy(&b, &a, 4);
        int e = static_cast<int>(b >> 23) - 127;
        uint32_t m = (b & 0x7FFFFF) >> 20;
        const uint32_t rest = b & 0xFFFFF;
        if (rest > 0x80000 || (rest == 0x80000 && (m & 1))) ++m;
        if (m == 8) {
            m = 0;
            ++e;
        }
        return sign | static_cast<uint8_t>(((e + 7) << 3) | m);
    }
    static void write(const float* x, long d, T* r, uint16_t* scale) {
        const float sf = store_row_scale(x, d, 448.0f, scale);
        for (long i = 0; i < d; ++i) {
            float q = x[i] / sf;
            q = q < -448.0f ? -448.0f : (q > 448.0f ? 448.0f : q);
            r[i] = encode(q);
        }
    }
};

// The encoders: ggml-quants.c's reference quantizers (quantize_row_*_ref), float step for float step as
// kernels/ggml_codecs.py's ENCODERS (bit-identical to gguf.quants): x (32 floats) → one block at b.
namespace kv_blocks {

inline void store_f16(uint8_t* b, float v) {
    const uint16_t h = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT);
    std::memcpy(b, &h, 2);
}

inline float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

inline float signed_absmax(const float* x) {  // the first value of largest magnitude, sign kept
    long best = 0;
    for (long i = 1; i < 32; ++i) best = std::fabs(x[i]) > std::fabs(x[best]) ? i : best;
    return x[best];
}

inline uint8_t trunc_code(float v, int top) {  // trunc, clamp to a byte, then to the top code
    v = std::trunc(v);
    const int q = v < 0.0f ? 0 : (v > 255.0f ? 255 : static_cast<int>(v));
    return static_cast<uint8_t>(q < top ? q : top);
}

inline void pack_halves(const uint8_t* q, uint8_t* qs) {  // element j in the low nibble of byte j, j + 16 in its high
    for (int j = 0; j < 16; ++j) qs[j] = static_cast<uint8_t>((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
}

inline void q8_0(const float* x, uint8_t* b) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
    const float d = amax / 127.0f, id = inverse(d);
    store_f16(b, d);
    for (int i = 0; i < 32; ++i) b[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[i] * id)));
}

inline void q4_0(const float* x, uint8_t* b) {
    const float d = signed_absmax(x) / -8.0f, id = inverse(d);
    uint8_t q[32];
    for (int i = 0; i < 32; ++i) q[i] = trunc_code(x[i] * id + 8.5f, 15);
    store_f16(b, d);
    pack_halves(q, b + 2);
}

inline void q5_0(const float* x, uint8_t* b) {
    const float d = signed_absmax(x) / -16.0f, id = inverse(d);
    uint8_t q[32];
    uint32_t qh = 0;
    for (int i = 0; i < 32; ++i) {
        q[i] = trunc_code(x[i] * id + 16.5f, 31);
        qh |= static_cast<uint32_t>((q[i] >> 4) & 1) << i;
    }
    store_f16(b, d);
    std::memcpy(b + 2, &qh, 4);
    pack_halves(q, b + 6);
}

inline void q4_1(const float* x, uint8_t* b) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < 32; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    const float d = (hi - lo) / 15.0f, id = inverse(d);
    uint8_t q[32];
    for (int i = 0; i < 32; ++i) q[i] = trunc_code((x[i] - lo) * id + 0.5f, 15);
    store_f16(b, d);
    store_f16(b + 2, lo);
    pack_halves(q, b + 4);
}

inline void q5_1(const float* x, uint8_t* b) {
    float lo = x[0], hi = x[0];
    for (int i = 1; i < 32; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    const float d = (hi - lo) / 31.0f, id = inverse(d);
    uint8_t q[32];
    uint32_t qh = 0;
    for (int i = 0; i < 32; ++i) {
        q[i] = trunc_code((x[i] - lo) * id + 0.5f, 31);
        qh |= static_cast<uint32_t>((q[i] >> 4) & 1) << i;
    }
    store_f16(b, d);
    store_f16(b + 2, lo);
    std::memcpy(b + 4, &qh, 4);
    pack_halves(q, b + 8);
}

}  // namespace kv_blocks

// Codes of elements [o, o + 8) of one block (o a multiple of 8) as 8 bytes (the low half of an __m128i), straight
// from the block's bytes (block_formats.h's codes() decodes all 32): the nibble formats keep element j in the low
// nibble of byte j and element j + 16 in its high nibble; q5_0 adds bit j of its 32 high bits as 16, looked up 8 at
// a time (kQ5HighBits: 2 KiB) — a per-lane variable shift of the bits cost q5_0's read more than its widen did.
struct Q5HighBits {
    uint64_t bytes[256];  // byte k = 16 where bit k of the index is set
    constexpr Q5HighBits() : bytes() {
        for (int i = 0; i < 256; ++i)
            for (int k = 0; k < 8; ++k)
                if ((i >> k) & 1) bytes[i] |= uint64_t{16} << (8 * k);
    }
};
inline constexpr Q5HighBits kQ5HighBits{};

template <class F>
constexpr long kCodeBytesAt = 2;  // where a block's code bytes start: after its f16 scale (q8_0, q4_0)
template <>
constexpr long kCodeBytesAt<Q4_1> = 4;  // after scale and minimum
template <>
constexpr long kCodeBytesAt<Q5_0> = 6;  // after scale and the 32 high bits (at b + 2)
template <>
constexpr long kCodeBytesAt<Q5_1> = 8;  // after scale, minimum and the 32 high bits (at b + 4)
template <class F>
constexpr bool kHighBits = std::is_same_v<F, Q5_0> || std::is_same_v<F, Q5_1>;  // 5-bit codes: bit 4 apart
template <class F>
constexpr long kHighBitsAt = kCodeBytesAt<F> - 4;  // the 32 high bits, just before the code bytes

inline __m128i nibbles8(const uint8_t* qs, long o) {  // elements o .. o + 7 of a nibble-halves block
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + (o & 15)));
    return _mm_and_si128(o & 16 ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
}

template <class F>
inline __m128i block_codes8(const uint8_t* b, long o) {
    const uint8_t* qs = b + kCodeBytesAt<F>;
    if constexpr (std::is_same_v<F, Q8_0>) return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + o));
    const __m128i c = nibbles8(qs, o);
    if constexpr (kHighBits<F>)
        return _mm_or_si128(
            c, _mm_loadl_epi64(reinterpret_cast<const __m128i*>(&kQ5HighBits.bytes[b[kHighBitsAt<F> + (o >> 3)]])));
    return c;
}

// llama.cpp's KV block types (kvcache/ggml_block.py): a row is D/32 GGML blocks of format F (block_formats.h's
// traits: 32 values d·code + m each). Widened as kernels/ggml_codecs.py's decoders round: q8_0, q5_0, q4_0
// (m = 0, −16d, −8d: a multiple of d) in one fused step, which is d·(code − offset) rounded once; q4_1's own
// minimum m is added after the product (FUSED = false), two roundings. Written by ENCODE, one block at a time.
// Read either a row at a time (widen: into a float tile) or 8 values at a time in registers (load8: the streaming
// attention passes; the same roundings; 16 at a time: lanes_avx512.h's block_load16).
template <class F, bool FUSED, void (*ENCODE)(const float*, uint8_t*)>
struct BlockPages : PageTraits {
    using T = uint8_t;
    using Format = F;  // the GGML block format (block_formats.h)
    static constexpr bool FUSED_ROUNDING = FUSED;  // d·code + m in one fma (else a product, then the sum)
    static constexpr bool BLOCKS = true;
    static constexpr long ALIGN = 32;
    static long row_size(long d) { return d / 32 * F::BYTES; }
    static __m256 load8(const T* r, long j) { return load8_in(r + (j >> 5) * F::BYTES, j & 31); }
    static __m256 load8_in(const T* b, long o) {  // elements [o, o + 8) of the block at b
        SubScales s;
        F::scales(b, s);
        const __m128i c = block_codes8<F>(b, o);
        const __m256 f = _mm256_cvtepi32_ps(F::SIGNED ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c));
        const __m256 dv = _mm256_set1_ps(s.d_lo[0]), mv = _mm256_set1_ps(s.m[0]);
        return FUSED ? _mm256_fmadd_ps(dv, f, mv) : _mm256_add_ps(_mm256_mul_ps(dv, f), mv);
    }
    static void widen(const T* r, long d, float* out) {
        for (long b = 0; b < d / 32; ++b, r += F::BYTES, out += 32) {
            SubScales s;
            F::scales(r, s);
            const __m256i c = F::codes(r, 0);
            const __m256 dv = _mm256_set1_ps(s.d_lo[0]), mv = _mm256_set1_ps(s.m[0]);
            const __m128i half[2] = {_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1)};
            for (int k = 0; k < 4; ++k) {
                const __m128i bytes = k & 1 ? _mm_srli_si128(half[k >> 1], 8) : half[k >> 1];
                const __m256 f =
                    _mm256_cvtepi32_ps(F::SIGNED ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes));
                const __m256 v = FUSED ? _mm256_fmadd_ps(dv, f, mv) : _mm256_add_ps(_mm256_mul_ps(dv, f), mv);
                _mm256_storeu_ps(out + 8 * k, v);
            }
        }
    }
    static void write(const float* x, long d, T* r, uint16_t*) {
        for (long b = 0; b < d / 32; ++b) ENCODE(x + 32 * b, r + F::BYTES * b);
    }
};

using PagesQ8_0 = BlockPages<Q8_0, true, kv_blocks::q8_0>;
using PagesQ5_0 = BlockPages<Q5_0, true, kv_blocks::q5_0>;
using PagesQ4_1 = BlockPages<Q4_1, false, kv_blocks::q4_1>;
using PagesQ4_0 = BlockPages<Q4_0, true, kv_blocks::q4_0>;
using PagesQ5_1 = BlockPages<Q5_1, false, kv_blocks::q5_1>;

// A row's d values as floats (before a SCALED type's row scale): fp32 rows in place, the others widened into tile.
template <class P>
inline const float* widen_row(const typename P::T* r, long d, float* tile) {
    if constexpr (std::is_same_v<typename P::T, float>) {
        return r;
    } else if constexpr (P::BLOCKS) {
        P::widen(r, d, tile);
        return tile;
    } else {
        for (long j = 0; j < d; j += 8) _mm256_storeu_ps(tile + j, P::load8(r, j));
        return tile;
    }
}

// fn(P{}) for page type id page_type (not TurboQuant's); returns false for an id with no row pages.
template <class Fn>
bool with_pages(int page_type, Fn fn) {
    switch (static_cast<KVPage>(page_type)) {
        case KVPage::FP32: fn(PagesF32{}); return true;
        case KVPage::BF16: fn(PagesBF16{}); return true;
        case KVPage::FP16: fn(PagesF16{}); return true;
        case KVPage::INT8: fn(PagesInt8{}); return true;
        case KVPage::FP8: fn(PagesFP8{}); return true;
        case KVPage::Q8_0: fn(PagesQ8_0{}); return true;
        case KVPage::Q5_0: fn(PagesQ5_0{}); return true;
        case KVPage::Q4_1: fn(PagesQ4_1{}); return true;
        case KVPage::Q4_0: fn(PagesQ4_0{}); return true;
        case KVPage::Q5_1: fn(PagesQ5_1{}); return true;
        default: return false;
    }
}

}  // namespace bd
