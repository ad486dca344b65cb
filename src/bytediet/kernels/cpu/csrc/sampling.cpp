// The sampler's last step over a whole vocabulary: softmax at a temperature and inverse transform sampling with one
// uniform per row, in two passes over each row of logits (kernels/reference.py sample_rows is the twin). PyTorch's
// divide, softmax, block sums and cumulative sums cost ~70 ms a step at batch 64 × 262k tokens (Gemma-3) on 2 cores;
// here every row is read twice and nothing is written but its token:
//   1. the row's maximum;
//   2. e = exp((x − max) · 1/T) summed in float32 per block of kBlock tokens, the blocks' ends accumulated in float64;
//   3. the block holding u · total, then a float64 running sum inside that one block (recomputing its e) finds the
//      token — the reference's two-level inverse CDF. A token whose e is 0 (masked to −inf, NaN, or below float
//      range) is never picked: rounding that runs onto one takes the nearest token of positive mass before it.
#include <cmath>
#include <vector>

#include "isa.h"
#include "threadpool.h"

namespace bd {
namespace {

constexpr long kBlock = 256;  // tokens per block of the two-level inverse CDF (reference.CDF_BLOCK)

// e^z for 8 lanes, 0 where z < −87 (below float32's normal range: masked −inf logits and NaN too).
inline __m256 mass8(__m256 x, __m256 max, __m256 inv_t) {
    const __m256 z = _mm256_mul_ps(_mm256_sub_ps(x, max), inv_t);
    const __m256 keep = _mm256_cmp_ps(z, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(exp8(z), keep);
}

// Lanes [i, i + 8) of the row, −inf past its end.
inline __m256 load8(const float* row, long i, long V) {
    if (i + 8 <= V) return _mm256_loadu_ps(row + i);
    alignas(32) float tail[8];
    for (int j = 0; j < 8; ++j) tail[j] = i + j < V ? row[i + j] : -INFINITY;
    return _mm256_load_ps(tail);
}

float row_max(const float* row, long V) {
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (long i = 0; i < V; i += 8) m = _mm256_max_ps(load8(row, i, V), m);  // a NaN lane keeps m
    return hmax(m);
}

// Tokens in block b of a row of V.
inline long block_len(long V, long b) { return V - b * kBlock < kBlock ? V - b * kBlock : kBlock; }

// The masses of tokens [b0, b0 + kBlock) ∩ [0, V) into e (kBlock floats).
inline void block_mass(const float* row, long V, long b0, __m256 max, __m256 inv_t, float* e) {
    for (long i = 0; i < kBlock; i += 8) _mm256_storeu_ps(e + i, mass8(load8(row, b0 + i, V), max, inv_t));
}

int64_t sample_row(const float* row, long V, float inv_t, double u, std::vector<double>& ends) {
    const float m = row_max(row, V);
    if (!(m > -INFINITY)) return 0;  // nothing to sample from: every logit −inf (or NaN)
    const __m256 max = _mm256_set1_ps(m), it = _mm256_set1_ps(inv_t);
    const long nb = (V + kBlock - 1) / kBlock;
    ends.resize(nb);
    double total = 0.0;
    for (long b = 0; b < nb; ++b) {
        __m256 acc = _mm256_setzero_ps();
        for (long i = 0; i < kBlock; i += 8) acc = _mm256_add_ps(acc, mass8(load8(row, b * kBlock + i, V), max, it));
        total += hsum(acc);
        ends[b] = total;
    }
    const double target = u * total;
    long b = 0;
    while (b < nb - 1 && !(ends[b] > target)) ++b;
    alignas(32) float e[kBlock];
    block_mass(row, V, b * kBlock, max, it, e);
    double cum = b > 0 ? ends[b - 1] : 0.0;
    const long n = block_len(V, b);
    long k = 0;
    for (; k < n - 1; ++k) {
        cum += e[k];
        if (cum > target) break;
    }
    if (e[k] > 0.0f) return b * kBlock + k;
    // rounding ran onto a token of no mass: the last one of positive mass before it, else the first after it
    for (long bb = b; bb >= 0; --bb) {
        if (bb != b) block_mass(row, V, bb * kBlock, max, it, e);
        const long last = bb == b ? k : block_len(V, bb) - 1;
        for (long j = last; j >= 0; --j)
            if (e[j] > 0.0f) return bb * kBlock + j;
    }
    for (long bb = b; bb < nb; ++bb) {
        block_mass(row, V, bb * kBlock, max, it, e);
        for (long j = 0; j < block_len(V, bb); ++j)
            if (e[j] > 0.0f) return bb * kBlock + j;
    }
    return 0;  // unreachable: the maximum itself has mass 1
}

}  // namespace
}  // namespace bd

extern "C" {

// out[r] for r < B: a token of row r of logits (B, V) float32, drawn with the uniform u[r] in [0, 1) from
// softmax(logits[r] · inv_t[r]) (inv_t = 1 / temperature > 0): the first token whose cumulative mass exceeds
// u[r] times the row's total. A row whose logits are all −inf gets token 0.
void bd_sample_rows(const float* logits, long B, long V, const float* inv_t, const double* u, int64_t* out) {
    auto body = [&](int t, int nt) {
        static thread_local std::vector<double> ends;
        long b, e;
        bd::split_range(B, nt, t, 1, &b, &e);
        for (long r = b; r < e; ++r) out[r] = bd::sample_row(logits + r * V, V, inv_t[r], u[r], ends);
    };
    (B > 1 && B * V >= 65536 ? bd::parallel_run : bd::run_here)(body);
}
}
