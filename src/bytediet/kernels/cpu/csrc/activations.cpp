// Gated activations of the MLP over many rows (prefill), in one pass: out = GELU_tanh(gate) · up
// (Hendrycks & Gimpel 2016, arXiv 1606.08415, the tanh approximation used by Gemma). PyTorch's
// F.gelu(approximate="tanh") followed by a multiply costs ~3.7 ns per element on one Zen 3 core; this
// costs a fraction of that, the tanh as 1 − 2 / (e^{2z} + 1) with exp8 (relative error ≈ 2e-7).
#include "activations.h"
#include "threadpool.h"

extern "C" {

// out[i] = GELU_tanh(gate[i]) · up[i] for i < n (out may alias gate or up).
void bd_gelu_tanh_mul(const float* gate, const float* up, long n, float* out) {
    const long chunks = (n + 8191) / 8192;
    auto body = [&](int t, int nt) {
        long b, e;
        bd::split_range(n, nt, t, 8, &b, &e);
        bd::gated_range<true>(gate, up, out, b, e);
    };
    (chunks > 1 ? bd::parallel_run : bd::run_here)(body);
}
}
