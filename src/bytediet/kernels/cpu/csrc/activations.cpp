// Gated activations of the MLP over many rows (prefill), in one pass: out = GELU_tanh(gate) · up
// (Hendrycks & Gimpel 2016, arXiv 1606.08415, the tanh approximation used by Gemma). PyTorch's
// F.gelu(approximate="tanh") followed by a multiply costs ~3.7 ns per element on one Zen 3 core; this
// costs a fraction of that, the tanh as 1 − 2 / (e^{2z} + 1) with exp8 (relative error ≈ 2e-7).
#include "isa.h"
#include "threadpool.h"

namespace bd {
namespace {

inline __m256 gelu_tanh8(__m256 x) {
    const __m256 c = _mm256_set1_ps(0.7978845608028654f), a = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
    const __m256 z = _mm256_mul_ps(c, _mm256_fmadd_ps(_mm256_mul_ps(a, x), _mm256_mul_ps(x, x), x));
    const __m256 e = exp8(_mm256_add_ps(z, z));
    const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, t));
}

inline float gelu_tanh1(float x) {  // the tail: the same formula one value at a time
    alignas(32) float v[8] = {x};
    _mm256_store_ps(v, gelu_tanh8(_mm256_load_ps(v)));
    return v[0];
}

}  // namespace
}  // namespace bd

extern "C" {

// out[i] = GELU_tanh(gate[i]) · up[i] for i < n (out may alias gate or up).
void bd_gelu_tanh_mul(const float* gate, const float* up, long n, float* out) {
    const long chunks = (n + 8191) / 8192;
    auto body = [&](int t, int nt) {
        long b, e;
        bd::split_range(n, nt, t, 8, &b, &e);
        long i = b;
        for (; i + 8 <= e; i += 8)
            _mm256_storeu_ps(out + i, _mm256_mul_ps(bd::gelu_tanh8(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
        for (; i < e; ++i) out[i] = bd::gelu_tanh1(gate[i]) * up[i];
    };
    (chunks > 1 ? bd::parallel_run : bd::run_here)(body);
}
}
