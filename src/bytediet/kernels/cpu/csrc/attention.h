// Pieces of paged decode attention shared by the float/int8/fp8 pages (decoder.cpp: attend) and the TurboQuant
// pages (turboquant_pages.cpp): the walk over a sequence's pages, the softmax of one head's scores, and the
// merge of the per-chunk partials of flash-decoding (Dao et al. 2023).
#pragma once
#include <cmath>
#include <cstdint>

#include "isa.h"

namespace bd {
namespace attention {

// One chunk's softmax state of one (token, head): its max score and Σ exp(score − max).
struct Partial {
    float max, sum;
};

// Visit positions [lo, hi) of a sequence in page order: fn(position, slot), no division per position.
template <class Fn>
inline void for_each_slot(const int64_t* table, long block_size, long lo, long hi, Fn fn) {
    long p = lo;
    while (p < hi) {
        const long blk = p / block_size;
        const long base = table[blk] * block_size - blk * block_size;  // slot = base + p within this page
        const long end = (blk + 1) * block_size < hi ? (blk + 1) * block_size : hi;
        for (; p < end; ++p) fn(p, base + p);
    }
}

// The eight sums of a0…a7 as one vector: [Σa0, …, Σa7].
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// The eight sums of the 8-float rows f[0..8), f[8..16), …, f[56..64): products folded to 8 lanes per position,
// reduced 8 positions at a time (the streaming key pass, TurboQuant's score pass).
inline __m256 hsum8_rows(const float* f) {
    return hsum8(_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8), _mm256_loadu_ps(f + 16), _mm256_loadu_ps(f + 24),
                 _mm256_loadu_ps(f + 32), _mm256_loadu_ps(f + 40), _mm256_loadu_ps(f + 48), _mm256_loadu_ps(f + 56));
}

inline float dot(const float* a, const float* b, long n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    float s = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

// x with the sign of lane j flipped where bit j of `bits` is 0: the ±x_j of a 1-bit QJL sign code (bit 1: +).
inline __m256 signed8(__m256 x, uint8_t bits) {
    const __m256i lane = _mm256_and_si256(_mm256_set1_epi32(bits), _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128));
    const __m256i flip = _mm256_and_si256(_mm256_cmpeq_epi32(lane, _mm256_setzero_si256()),
                                          _mm256_set1_epi32(static_cast<int>(0x80000000u)));
    return _mm256_xor_ps(x, _mm256_castsi256_ps(flip));
}

inline void axpy(float a, const float* x, float* y, long n) {
    const __m256 va = _mm256_set1_ps(a);
    long i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}

// Scores s[0 .. n) of one head in a chunk → softmax numerators exp(s − max) over the allowed span [lo, hi),
// zeros elsewhere (a query tile's token sees less than the tile's span); returns (max, Σ). An empty span
// returns sum 0, which merge_chunks skips.
inline Partial softmax_span(float* s, long lo, long hi, long n) {
    float mx = -INFINITY, sum = 0.0f;
    long i = lo;
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= hi; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(s + i));
    mx = hmax(vmax);
    for (; i < hi; ++i) mx = s[i] > mx ? s[i] : mx;
    for (i = 0; i < lo && i < n; ++i) s[i] = 0.0f;
    if (hi > lo) {
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        for (i = lo; i + 8 <= hi; i += 8) {
            const __m256 ex = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), vmx));
            _mm256_storeu_ps(s + i, ex);
            vsum = _mm256_add_ps(vsum, ex);
        }
        sum = hsum(vsum);
        for (; i < hi; ++i) {
            s[i] = std::exp(s[i] - mx);
            sum += s[i];
        }
    }
    for (i = hi > lo ? hi : lo; i < n; ++i) s[i] = 0.0f;
    return Partial{mx, sum};
}

// The split of the context into chunks (flash-decoding) shared by decoder.cpp and turboquant_pages.cpp: about two
// work items per thread over `items` (query tiles, or tokens × KV heads) — an uneven split costs half a chunk —,
// none shorter than 128 positions; T tokens at positions[0 .. T), the longest sequence's positions in *longest.
inline long context_chunks(int threads, long items, const int64_t* positions, long T, long* longest) {
    *longest = 1;
    for (long t = 0; t < T; ++t) *longest = positions[t] + 1 > *longest ? positions[t] + 1 : *longest;
    long chunks = (2 * threads + items - 1) / items;
    if (chunks > (*longest + 127) / 128) chunks = (*longest + 127) / 128;
    if (chunks < 1) chunks = 1;
    return chunks;
}

// One (token, head)'s output from its chunks: out (d) = Σ_c e^(max_c − max) acc_c / Σ_c e^(max_c − max) sum_c,
// where parts (chunks) and acc (chunks, d) are the chunks' partials and unnormalised Σ p·v.
inline void merge_chunks(const Partial* parts, const float* acc, long chunks, long d, float* out) {
    float mx = -INFINITY;
    for (long c = 0; c < chunks; ++c)
        if (parts[c].sum > 0.0f && parts[c].max > mx) mx = parts[c].max;
    for (long j = 0; j < d; ++j) out[j] = 0.0f;
    float total = 0.0f;
    for (long c = 0; c < chunks; ++c) {
        if (parts[c].sum <= 0.0f) continue;
        const float w = std::exp(parts[c].max - mx);
        total += w * parts[c].sum;
        axpy(w, acc + c * d, out, d);
    }
    const float inv = 1.0f / total;
    for (long j = 0; j < d; ++j) out[j] *= inv;
}

}  // namespace attention
}  // namespace bd
