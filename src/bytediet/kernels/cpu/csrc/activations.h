// Vectorised activations shared by the decode step (decoder.cpp) and the prefill pass (activations.cpp).
#pragma once
#include <cmath>

#include "isa.h"

namespace bd {

// GELU with the tanh approximation (Hendrycks & Gimpel 2016, arXiv 1606.08415): tanh(z) as 1 − 2 / (e^{2z} + 1)
// with exp8 (relative error ≈ 2e-7); saturates cleanly (exp8 clamps its argument).
inline __m256 gelu_tanh8(__m256 x) {
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), a = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
    const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x));
    const __m256 e = exp8(_mm256_add_ps(z, z));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}

// SiLU x · σ(x) = x / (1 + e^{−x}).
inline __m256 silu8(__m256 x) {
    const __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

// y = x / sqrt(mean(x²) + eps) · w over one row of n values (RMSNorm, Zhang & Sennrich 2019, arXiv 1910.07467;
// y may alias x): the sum of squares in float32 over 8 lanes, then (x · r) · w per value.
inline void rmsnorm(const float* x, const float* w, long n, float eps, float* y) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    const __m256 rv = _mm256_set1_ps(r);
    for (i = 0; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
    for (; i < n; ++i) y[i] = x[i] * r * w[i];
}

// out[i] = act(gate[i]) · up[i] for i in [b, e), act = GELU-tanh or SiLU; the tail one value at a time through
// the same vector formula (out may alias gate or up).
template <bool GELU>
inline void gated_range(const float* gate, const float* up, float* out, long b, long e) {
    auto act = [](__m256 v) { return GELU ? gelu_tanh8(v) : silu8(v); };
    long i = b;
    for (; i + 8 <= e; i += 8)
        _mm256_storeu_ps(out + i, _mm256_mul_ps(act(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    for (; i < e; ++i) {
        alignas(32) float v[8] = {gate[i]};
        _mm256_store_ps(v, act(_mm256_load_ps(v)));
        out[i] = v[0] * up[i];
    }
}

}  // namespace bd
