// The x4 kernels' accumulator lanes (gemm_x4.cpp, gemm_kx4.cpp): how a tile's sums become its rows' outputs, and
// AVX-512's paired lanes, both q16 planes in one vector (row r, plane p, half h in lane 4r + 2p + h; PairedRows).
#pragma once
#include "gemm_blocks.h"
#include "isa.h"

namespace bd {

// Row r's output from its lanes (row r in lanes 2r, 2r+1): plane 1's two, then plane 2's (q16), then the bias. Every
// variant and tile sums in this order, so their results are the same bits.
inline float x4_row_sum(const float* plane1, const float* plane2, int r, const float* bias) {
    const float one = plane1[2 * r] + plane1[2 * r + 1];
    return (plane2 ? one + (plane2[2 * r] + plane2[2 * r + 1]) : one) + (bias ? bias[r] : 0.0f);
}

// y[m0 + c, n0 .. n0 + 3] of NC rows from their 8-lane sums (acc2: plane 2's when TWO).
template <int NC, bool TWO>
inline void x4_store(const __m256* acc, const __m256* acc2, long m0, float* y, long ldy, long n0, const float* bias) {
    for (int c = 0; c < NC; ++c) {
        alignas(32) float lanes[8], lanes2[8];
        _mm256_store_ps(lanes, acc[c]);
        if constexpr (TWO) _mm256_store_ps(lanes2, acc2[c]);
        for (int r = 0; r < 4; ++r)
            y[(m0 + c) * ldy + n0 + r] = x4_row_sum(lanes, TWO ? lanes2 : nullptr, r, bias ? bias + n0 : nullptr);
    }
}

#if BD_AVX512
// Each of a block's four weight rows (8 bytes of a 256-bit vector) twice: once per plane.
inline __m512i rows_twice(__m256i u) {
    return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 0, 1, 1, 2, 2, 3, 3), _mm512_castsi256_si512(u));
}

// 8 row-pair lanes (row r in 2r, 2r+1) spread to the 16 paired lanes: both planes, or plane 1 only (plane 2's 0).
inline __m512 spread(__m256 v, __mmask16 lanes = 0xFFFF) {
    return _mm512_maskz_permutexvar_ps(lanes, _mm512_setr_epi32(0, 1, 0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7, 6, 7),
                                       _mm512_castps256_ps512(v));
}
constexpr __mmask16 kPlaneOne = 0x3333;

// Both planes' activation bytes 8k..8k+7 of row block rb, four times over.
inline __m512i paired_x(const PairedRows& px, long rb, int k) {
    return _mm512_broadcast_i32x4(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(px.codes.data() + rb * 64 + 16 * k)));
}

// The (d, d, d2, d2) activation scales of row block rb, four times over.
inline __m512 paired_scales(const PairedRows& px, long rb) {
    return _mm512_broadcast_f32x4(_mm_loadu_ps(px.scales.data() + rb * 4));
}

// Four int32 corrections starting at p (one run of codes: plane 1's even and odd, plane 2's), four times over.
inline __m512i paired_corr(const int32_t* p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// x4_store for the paired lanes.
template <int NC>
inline void x4_store_paired(const __m512* acc, long m0, float* y, long ldy, long n0, const float* bias) {
    for (int c = 0; c < NC; ++c) {
        alignas(64) float lanes[16], plane1[8], plane2[8];
        _mm512_store_ps(lanes, acc[c]);
        for (int r = 0; r < 4; ++r)
            for (int h = 0; h < 2; ++h) plane1[2 * r + h] = lanes[4 * r + h], plane2[2 * r + h] = lanes[4 * r + 2 + h];
        for (int r = 0; r < 4; ++r)
            y[(m0 + c) * ldy + n0 + r] = x4_row_sum(plane1, plane2, r, bias ? bias + n0 : nullptr);
    }
}
#endif

}  // namespace bd
