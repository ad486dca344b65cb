// ISA helpers shared by every kernel family. One source, compiled once per variant:
//   avx2        -mavx2 -mfma -mf16c                     (the portable variant, every x86-64 CPU since 2013)
//   avx512vnni  + -mavx512f -mavx512bw -mavx512vl -mavx512vnni   (integer dot products with vpdpbusd)
// Only the helpers below differ between variants; the kernels are written once against them, and code for one ISA
// alone sits in its own file behind BD_AVX512 (lanes_avx2.h, lanes_avx512.h, gemm_panel.cpp's kernels).
#pragma once
#include <immintrin.h>
#include <cstdint>
#include <cstring>

// 1 in the avx512vnni variant (AVX-512 F, BW, VL and VNNI), 0 in the avx2 one: the one test of the ISA.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define BD_AVX512 1
#else
#define BD_AVX512 0
#endif

namespace bd {

#if BD_AVX512
constexpr const char* kIsa = "avx512vnni";
#else
constexpr const char* kIsa = "avx2";
#endif

inline float f16_to_f32(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline float hmax(__m256 v) {
    __m128 lo = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_max_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_max_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

// Σ u·s over groups of four bytes: 32 unsigned bytes × 32 signed bytes → 8 int32 lanes (lane i: bytes 4i..4i+3).
// AVX2's maddubs saturates at ±32767 per byte pair: callers keep |u·s| pairs below that (u ≤ 128, |s| ≤ 127).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if BD_AVX512
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// Σ a·b for two signed byte vectors (a in [-128, 127], b in [-127, 127]): |a| · sign(b, a).
inline __m256i dot_s8s8(__m256i a, __m256i b) { return dot_u8s8(_mm256_sign_epi8(a, a), _mm256_sign_epi8(b, a)); }

// 16 bytes of packed nibbles → 32 bytes: low nibbles are elements 0..15, high nibbles 16..31 (ggml's Q4 layout).
inline __m256i nibbles_halves(const uint8_t* p) {
    __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m256i v = _mm256_set_m128i(_mm_srli_epi16(t, 4), t);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// 32 bits → 32 bytes, byte j = 0xFF where bit j is set.
inline __m256i bits_to_bytes(uint32_t x) {
    const __m256i shuf =
        _mm256_setr_epi64x(0x0000000000000000LL, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(x)), shuf);
    const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, mask), mask);
}

inline __m256 load_u8_as_f32(const uint8_t* p) {  // 8 unsigned bytes → 8 floats
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

inline __m256 load_s8_as_f32(const uint8_t* p) {  // 8 signed bytes → 8 floats
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

}  // namespace bd

namespace bd {

// e^x for 8 floats (Cephes' range reduction + degree-5 polynomial, relative error ≈ 2e-7); x ≤ −88 → 0.
inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(88.3762626647949f), lo = _mm256_set1_ps(-88.3762626647949f);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace bd
