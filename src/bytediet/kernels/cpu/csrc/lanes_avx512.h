// The streaming attention passes' vector kernels at 16 floats a load (the avx512vnni variant): Lanes16
// (decoder.cpp), chosen where head_dim % 16 == 0; the same walk as Lanes8's, kept separate code
// (one kernel written over the width ran slower: bench/RESULTS.md, Recording 11).
#pragma once
#include "isa.h"
#include "wide_rows.h"

#if BD_AVX512
namespace bd {
namespace {  // decoder.cpp's alone: internal linkage, as when they were written there

// Elements [o, o + 16) of the GGML block at b (o: 0 or 16) of BlockPages P, in one pass (load8_in's roundings).
template <class P>
inline __m512 block_load16(const uint8_t* b, long o) {
    using F = typename P::Format;
    SubScales s;
    F::scales(b, s);
    const uint8_t* qs = b + kCodeBytesAt<F>;
    __m512i c;
    if constexpr (std::is_same_v<F, Q8_0>) {
        c = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + o)));
    } else {  // nibble halves: elements 0–15 the low nibbles of the 16 code bytes, 16–31 their high nibbles
        c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
        c = _mm512_and_si512(o ? _mm512_srli_epi32(c, 4) : c, _mm512_set1_epi32(0x0F));
        if constexpr (kHighBits<F>) {  // bit j of the 32 high bits adds 16 to element j
            uint32_t qh;
            std::memcpy(&qh, b + kHighBitsAt<F>, 4);
            c = _mm512_mask_or_epi32(c, static_cast<__mmask16>(qh >> o), c, _mm512_set1_epi32(16));
        }
    }
    const __m512 f = _mm512_cvtepi32_ps(c);
    const __m512 dv = _mm512_set1_ps(s.d_lo[0]), mv = _mm512_set1_ps(s.m[0]);
    return P::FUSED_ROUNDING ? _mm512_fmadd_ps(dv, f, mv) : _mm512_add_ps(_mm512_mul_ps(dv, f), mv);
}

template <class P>
inline __m512 load16(const typename P::T* r, long i) {
    if constexpr (std::is_same_v<P, PagesF32>) {
        return _mm512_loadu_ps(r + i);
    } else if constexpr (std::is_same_v<P, PagesBF16>) {
        const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    } else if constexpr (std::is_same_v<P, PagesF16>) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + i)));
    } else if constexpr (std::is_same_v<P, PagesInt8>) {  // codes + 128
        const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
        return _mm512_cvtepi32_ps(_mm512_sub_epi32(c, _mm512_set1_epi32(128)));
    } else if constexpr (P::BLOCKS) {  // half a GGML block, decoded 16 values at once
        return block_load16<P>(r + (i >> 5) * P::row_size(32), i & 31);
    } else {  // two of the page type's 8-value loads
        const __m256 lo = P::load8(r, i), hi = P::load8(r, i + 8);
        return _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
    }
}

inline __m256 fold512(__m512 v) {  // the two 256-bit halves of v added
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

// The AVX-512 kernels: 16 floats a load.
struct Lanes16 {
    template <class P>
    static __m512 load(WideRow<P> r, long i) {
        if constexpr (kRowsInRegisters<P>)
            return load16<P>(r, i);
        else
            return _mm512_loadu_ps(r + i);
    }

    // One key row k (d floats) against NG queries q[0..NG): each product's 16 lanes folded to 8, stored at
    // out + 64·g (a head's 8 positions lie 8 floats apart, reduced together by hsum8_rows).
    template <class P, int NG,
              long D = 0>  // D: head_dim known at compile time (0: d), so the queries stay in registers
    static void dots(const float* const* q, WideRow<P> k, long d, float* out) {
        if constexpr (D > 0) d = D;
        __m512 acc[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) acc[g] = _mm512_setzero_ps();
#pragma GCC unroll 16
        for (long i = 0; i < d; i += 16) {
            const __m512 kv = load<P>(k, i);
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q[g] + i), kv, acc[g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(out + 64 * g, fold512(acc[g]));
    }

    // acc[g] (d floats) += Σ_j p[g][j] · v[j] over n rows for NG heads: 64 columns at a time in 4·NG registers.
    // ahead (n pointers, or null): memory to prefetch, ahead_bytes from each, one per row between the rows' products.
    template <class P, int NG>
    static void weighted(const float* const* p, const WideRow<P>* v, long n, long d, float* const* acc,
                         const char* const* ahead = nullptr, long ahead_bytes = 0) {
        long c = 0;
        for (; c + 64 <= d; c += 64) {
            __m512 a[NG][4];
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
                for (int u = 0; u < 4; ++u) a[g][u] = _mm512_loadu_ps(acc[g] + c + 16 * u);
            for (long j = 0; j < n; ++j) {
                if (ahead && c == 0 && ahead[j]) prefetch_bytes(ahead[j], ahead_bytes);
                const __m512 v0 = load<P>(v[j], c), v1 = load<P>(v[j], c + 16), v2 = load<P>(v[j], c + 32),
                             v3 = load<P>(v[j], c + 48);
#pragma GCC unroll 4
                for (int g = 0; g < NG; ++g) {
                    const __m512 wj = _mm512_set1_ps(p[g][j]);
                    a[g][0] = _mm512_fmadd_ps(wj, v0, a[g][0]);
                    a[g][1] = _mm512_fmadd_ps(wj, v1, a[g][1]);
                    a[g][2] = _mm512_fmadd_ps(wj, v2, a[g][2]);
                    a[g][3] = _mm512_fmadd_ps(wj, v3, a[g][3]);
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
                for (int u = 0; u < 4; ++u) _mm512_storeu_ps(acc[g] + c + 16 * u, a[g][u]);
        }
        for (; c < d; c += 16) {
            __m512 a[NG];
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) a[g] = _mm512_loadu_ps(acc[g] + c);
            for (long j = 0; j < n; ++j) {
                const __m512 vj = load<P>(v[j], c);
#pragma GCC unroll 4
                for (int g = 0; g < NG; ++g) a[g] = _mm512_fmadd_ps(_mm512_set1_ps(p[g][j]), vj, a[g]);
            }
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) _mm512_storeu_ps(acc[g] + c, a[g]);
        }
    }
};

}  // namespace
}  // namespace bd
#endif  // BD_AVX512
