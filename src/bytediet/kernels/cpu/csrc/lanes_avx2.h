// The streaming attention passes' vector kernels at 8 floats a load (every variant): Lanes8 (decoder.cpp).
#pragma once
#include "isa.h"
#include "wide_rows.h"

namespace bd {
namespace {  // decoder.cpp's alone: internal linkage, as when they were written there

// The AVX2 kernels: 8 floats a load.
struct Lanes8 {
    template <class P>
    static __m256 load(WideRow<P> r, long i) {
        if constexpr (kRowsInRegisters<P>)
            return P::load8(r, i);
        else
            return _mm256_loadu_ps(r + i);
    }

    // One key row k (d floats) against NG queries q[0..NG): each product's 8 lanes stored at out + 64·g (a head's
    // 8 positions lie 8 floats apart, reduced together by hsum8_rows).
    template <class P, int NG, long D = 0>  // D: head_dim known at compile time (0: d)
    static void dots(const float* const* q, WideRow<P> k, long d, float* out) {
        if constexpr (D > 0) d = D;
        __m256 acc[NG];
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) acc[g] = _mm256_setzero_ps();
#pragma GCC unroll 8
        for (long i = 0; i < d; i += 8) {
            const __m256 kv = load<P>(k, i);
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q[g] + i), kv, acc[g]);
        }
#pragma GCC unroll 4
        for (int g = 0; g < NG; ++g) _mm256_storeu_ps(out + 64 * g, acc[g]);
    }

    // acc[g] (d floats) += Σ_j p[g][j] · v[j] over n rows for NG heads, 8·U columns at a time in U·NG of the 16
    // ymm registers (U = 4 up to 3 heads, 2 for 4). ahead (n pointers, or null): memory to prefetch, ahead_bytes
    // from each, one per row between the rows' products.
    template <class P, int NG>
    static void weighted(const float* const* p, const WideRow<P>* v, long n, long d, float* const* acc,
                         const char* const* ahead = nullptr, long ahead_bytes = 0) {
        constexpr int U = NG <= 3 ? 4 : 2;
        long c = 0;
        for (; c + 8 * U <= d; c += 8 * U) {
            __m256 a[NG][U];
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
                for (int u = 0; u < U; ++u) a[g][u] = _mm256_loadu_ps(acc[g] + c + 8 * u);
            for (long j = 0; j < n; ++j) {
                if (ahead && c == 0 && ahead[j]) prefetch_bytes(ahead[j], ahead_bytes);
                __m256 wj[NG];
#pragma GCC unroll 4
                for (int g = 0; g < NG; ++g) wj[g] = _mm256_set1_ps(p[g][j]);
#pragma GCC unroll 4
                for (int u = 0; u < U; ++u) {
                    const __m256 vu = load<P>(v[j], c + 8 * u);
#pragma GCC unroll 4
                    for (int g = 0; g < NG; ++g) a[g][u] = _mm256_fmadd_ps(wj[g], vu, a[g][u]);
                }
            }
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g)
                for (int u = 0; u < U; ++u) _mm256_storeu_ps(acc[g] + c + 8 * u, a[g][u]);
        }
        for (; c < d; c += 8) {
            __m256 a[NG];
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) a[g] = _mm256_loadu_ps(acc[g] + c);
            for (long j = 0; j < n; ++j) {
                const __m256 vj = load<P>(v[j], c);
#pragma GCC unroll 4
                for (int g = 0; g < NG; ++g) a[g] = _mm256_fmadd_ps(_mm256_set1_ps(p[g][j]), vj, a[g]);
            }
#pragma GCC unroll 4
            for (int g = 0; g < NG; ++g) _mm256_storeu_ps(acc[g] + c, a[g]);
        }
    }
};

}  // namespace
}  // namespace bd
