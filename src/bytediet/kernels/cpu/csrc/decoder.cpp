// One decode step for every sequence of a batch (one new token each) through all layers, in one call:
// no Python between operations, no fork/join per op (the persistent pool), buffers reused across steps,
// the activation row quantized once for q/k/v and once for gate/up. Per layer and token:
//   h = RMSNorm(x); q, k, v = h·Wqkvᵀ; (q, k RMSNorm per head); RoPE(q, k); k, v → cache slot;
//   a = softmax(q·Kᵀ·scale over the sequence's pages, causal, optional sliding window)·V;
//   x += o(a) (gemma3: x += RMSNorm(o(a))); h = RMSNorm(x); x += down(act(gate(h))·up(h)) (gemma3: normed).
// The reference is the module path of bytediet.models (layers.py) that runs every other step.
#include "decoder.h"

#include <atomic>
#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <utility>
#include <vector>

#include "activations.h"
#include "attention.h"
#include "gemm_blocks.h"
#include "isa.h"
#include "threadpool.h"

namespace bd {
namespace {

using attention::Partial;
using attention::for_each_slot;

struct Scratch {
    std::vector<float> h, q, k, v, att, o, gate, up, chunk_acc;
    std::vector<Partial> chunk_parts;
    std::vector<long> tiles;  // attention: first token of each query tile, then T
    QuantizedActivations act;
    std::vector<float> sums;  // f32 mode: the sum of each activation block
};

void rmsnorm(const float* x, const float* w, long n, float eps, float* y) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        acc = _mm256_fmadd_ps(v, v, acc);
    }
    float ss = hsum(acc);
    for (; i < n; ++i) ss += x[i] * x[i];
    const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (long j = 0; j < n; ++j) y[j] = x[j] * r * w[j];
}

// RoPE of a token's query heads q (hq, d) and key heads k (hkv, d) at one position: one cos/sin per frequency
// for both (libm's sincos is most of the cost at head_dim 256).
void rope(float* q, long hq, float* k, long hkv, long d, const float* inv_freq, long pos) {
    const long half = d / 2;
    for (long i = 0; i < half; ++i) {
        const float f = static_cast<float>(pos) * inv_freq[i];
        const float c = std::cos(f), s = std::sin(f);
        for (long h = 0; h < hq + hkv; ++h) {
            float* p = h < hq ? q + h * d : k + (h - hq) * d;
            const float a = p[i], b = p[i + half];
            p[i] = a * c - b * s;
            p[i + half] = b * c + a * s;
        }
    }
}

// The KV rows of one head are 1–3 cache lines apart from the next position's, a stride the hardware prefetcher
// follows late: without this the score loop waits on memory for most of its time.
constexpr long kPrefetchRows = 64;

template <class E>
inline void prefetch_row(const E* p, long words) {  // the cache lines of ``words`` 4-byte words from p
    const char* c = reinterpret_cast<const char*>(p);
    for (long i = 0; i < words * 4; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// KV page element types: each gives a row's 8 values at j as floats (times the row's scale, applied once per
// row by the caller), and the write of a new row. The torch codecs that own these pages (kvcache/full.py,
// kvcache/tokenwise.py) round the same way, so the module path and this step leave identical pages.
struct PagesF32 {
    using T = float;
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) { return _mm256_loadu_ps(r + j); }
    static void write(const float* x, long d, T* r, uint16_t*) { std::memcpy(r, x, sizeof(float) * d); }
};

struct PagesBF16 {
    using T = uint16_t;
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) {
        __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
    static void write(const float* x, long d, T* r, uint16_t*) {
        for (long i = 0; i < d; ++i) {  // round to nearest even, as torch's float → bfloat16
            uint32_t b;
            std::memcpy(&b, x + i, 4);
            r[i] = std::isnan(x[i]) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
        }
    }
};

struct PagesF16 {
    using T = uint16_t;
    static constexpr bool SCALED = false;
    static __m256 load8(const T* r, long j) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + j))); }
    static void write(const float* x, long d, T* r, uint16_t*) {
        long i = 0;
        for (; i + 8 <= d; i += 8)
            _mm_storeu_si128(reinterpret_cast<__m128i*>(r + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
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

struct PagesInt8 {  // kvcache int8: per token and head, scale = fp16(max(amax / 127, 1e-6)), code = q + 128
    using T = uint8_t;
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

inline float row_scale(const void* scales, long idx) {
    return scales ? _cvtsh_ss(static_cast<const uint16_t*>(scales)[idx]) : 1.0f;
}

// Linear layers sharing one input: quantized once (q8) or summed per block once (f32).
class Input {
  public:
    Input(const float* x, long m, long k, int activations, Scratch& s) : x_(x), m_(m), k_(k), act_(activations), s_(s) {
        if (act_ == 1) {
            s.sums.resize(m * (k / 32));
            block_sums(x, m, k, s.sums.data());
        } else {
            rows_ = act_ == 3 ? s.act.quantize_per_token(x, m, k) : s.act.quantize(x, m, k, act_ == 2);
        }
    }
    void apply(const LinearDesc& l, float* y) const {
        const long nb = k_ / 32;
        if (panel(l, y)) return;
        if (act_ != 1 && l.interleaved)
            gemm_x4_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else if (act_ != 1)
            gemm_blocks_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else
            gemm_blocks_f32(l.ggml_type, l.blocks, l.n, l.k, FloatRows{x_, s_.sums.data(), k_, nb}, m_, y, l.n, l.bias);
    }

    // Products of this input by several weights (q/k/v, gate/up): one parallel region when all are interleaved.
    void apply_all(std::initializer_list<std::pair<const LinearDesc*, float*>> outs) const {
        bool fused = act_ != 1 && m_ < kPanelMinRows;
        for (auto& o : outs) fused = fused && o.first->interleaved;
        if (!fused) {
            for (auto& o : outs) apply(*o.first, o.second);
            return;
        }
        X4Product products[4];
        int n = 0;
        for (auto& o : outs) products[n++] = X4Product{o.first->ggml_type, o.first->blocks, o.first->n, o.first->k,
                                                       o.second, o.first->bias};
        gemm_x4_many(products, n, rows_, m_);
    }

  private:
    // A step of many rows (a batch of decodes) with q16 activations: the register-blocked panel GEMM
    // (gemm_panel.cpp) where this build has it — 1.2–1.7× the x4 kernels at 16 rows on a Zen 5 VM.
    static constexpr long kPanelMinRows = 8;
    bool panel(const LinearDesc& l, float* y) const {
        if (act_ != 2 || m_ < kPanelMinRows) return false;
        const uint8_t* src = l.interleaved ? l.source : l.blocks;
        return src && gemm_panel_q16(l.ggml_type, src, l.n, l.k, rows_, m_, y, l.n, l.bias) == 0;
    }

    QuantizedRows rows_{};  // q8/q16: the quantized input in the scratch buffers
    const float* x_;
    long m_, k_;
    int act_;
    Scratch& s_;
};

// Rows of keys or values as float32 for the block kernels below: fp32 pages are read in place, other page
// types are widened once per row into an L1 tile (not once per query head, as a per-head dot would).
// kvcache fp8 (uncalibrated): per token and head, scale = fp16(max(amax / 448, 1e-6)), code = E4M3(x / scale)
// (sign, 4 exponent bits with bias 7, 3 mantissa bits; no infinity; torch.float8_e4m3fn's rounding: to nearest
// even, after the codec's clamp to ±448).
struct PagesFP8 {
    using T = uint8_t;
    static constexpr bool SCALED = true;
    static __m256 load8(const T* r, long j) {
        const __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + j)));
        const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
        // normals: exponent and mantissa shifted into float32's fields, the bias moved from 7 to 127
        const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
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
        if (m == 8) { m = 0; ++e; }
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

template <class P>
inline const float* widen_row(const typename P::T* r, long d, float* tile) {
    if constexpr (std::is_same_v<typename P::T, float>) {
        return r;
    } else {
        for (long j = 0; j < d; j += 8) _mm256_storeu_ps(tile + j, P::load8(r, j));
        return tile;
    }
}

// The eight sums of a0…a7 as one vector: [Σa0, …, Σa7].
inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

// Scores of 8 keys (rows k[0..7], each d floats) against q (d floats): one pass, eight accumulators, one
// transpose-reduction — the per-key horizontal sum was most of the instructions of a dot per key.
inline __m256 dot8(const float* q, const float* const* k, long d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (long i = 0; i < d; i += 8) {
        const __m256 qi = _mm256_loadu_ps(q + i);
        a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[0] + i), a0);
        a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[1] + i), a1);
        a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[2] + i), a2);
        a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[3] + i), a3);
        a4 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[4] + i), a4);
        a5 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[5] + i), a5);
        a6 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[6] + i), a6);
        a7 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k[7] + i), a7);
    }
    return hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// acc (d floats) += Σ_j w[j] · v[j] over n rows, d a multiple of 8: 64 columns at a time in eight named
// accumulators (eight independent FMA chains; GCC kept an array of __m256 on the stack, a load and a store
// around every FMA: 2.3× slower), then the remaining columns 8 at a time.
inline void weighted_sum(const float* w, const float* const* v, long n, long d, float* acc) {
    long c = 0;
    for (; c + 64 <= d; c += 64) {
        float* o = acc + c;
        __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8), a2 = _mm256_loadu_ps(o + 16),
               a3 = _mm256_loadu_ps(o + 24), a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40),
               a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
        for (long j = 0; j < n; ++j) {
            const __m256 wj = _mm256_set1_ps(w[j]);
            const float* r = v[j] + c;
            a0 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r), a0);
            a1 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 8), a1);
            a2 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 16), a2);
            a3 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 24), a3);
            a4 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 32), a4);
            a5 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 40), a5);
            a6 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 48), a6);
            a7 = _mm256_fmadd_ps(wj, _mm256_loadu_ps(r + 56), a7);
        }
        _mm256_storeu_ps(o, a0), _mm256_storeu_ps(o + 8, a1), _mm256_storeu_ps(o + 16, a2);
        _mm256_storeu_ps(o + 24, a3), _mm256_storeu_ps(o + 32, a4), _mm256_storeu_ps(o + 40, a5);
        _mm256_storeu_ps(o + 48, a6), _mm256_storeu_ps(o + 56, a7);
    }
    for (; c < d; c += 8) {
        __m256 a = _mm256_loadu_ps(acc + c);
        for (long j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(v[j] + c), a);
        _mm256_storeu_ps(acc + c, a);
    }
}

// Attention of each token's query heads over its sequence's pages (flash-decoding, Dao et al. 2023):
// work items are (query tile, context chunk). A tile is one token, or up to kQueryTile consecutive tokens of
// one sequence (a prefill chunk: token_rows[t] names each token's block table row, null = row t), which
// share every key and value row read — a prefill reads its context once per tile, not once per token.
// An item walks its chunk's positions in order, 16 at a time, and for every KV head reads the rows once
// for all the query heads that share it (GQA), leaving a partial (max, Σexp, Σexp·v) per (token, head);
// a second pass merges the chunks. q, out: (T, Hq, D).
// Walking positions (not heads) outermost reads each page front to back — a head-major walk touched every
// third row group of a page and ran at a quarter of the read bandwidth. Keys go 8 at a time (dot8: one
// reduction per 8 scores) and values 16 at a time (weighted_sum: the head's output in registers).
// Page rows are read in place in their stored type (P) and widened once per row; int8/fp8 rows' scales
// multiply the row's score and its softmax weight. Items come from a shared counter (a prefill's late,
// long tiles do not all land on one thread). head_dim is a multiple of 8 (checked by the caller).
template <class P>
void attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T, const int64_t* positions,
            const int64_t* token_rows, const int64_t* block_tables, long bt_stride, long block_size, Scratch& s) {
    using E = typename P::T;
    constexpr long kRowBlock = 16;  // positions per block (rows gathered, and for narrow pages widened)
    constexpr long kQueryTile = 8;  // tokens of one prefill chunk sharing the row reads
    const E* k_pages = static_cast<const E*>(L.k_cache);
    const E* v_pages = static_cast<const E*>(L.v_cache);
    const long hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim, group = hq / hkv;
    const int nt = num_threads();
    std::vector<long>& tiles = s.tiles;
    tiles.clear();
    for (long t = 0; t < T; ++t)
        if (t == 0 || !token_rows || token_rows[t] != token_rows[t - 1] || positions[t] != positions[t - 1] + 1 ||
            t - tiles.back() == kQueryTile)
            tiles.push_back(t);
    const long ntiles = static_cast<long>(tiles.size());
    tiles.push_back(T);
    long longest = 1;
    for (long t = 0; t < T; ++t) longest = positions[t] + 1 > longest ? positions[t] + 1 : longest;
    // two chunks per thread (an uneven split costs half a chunk), none shorter than 128 positions
    long chunks = (2 * nt + ntiles - 1) / ntiles;
    if (chunks > (longest + 127) / 128) chunks = (longest + 127) / 128;
    if (chunks < 1) chunks = 1;
    const long chunk_len = (longest + chunks - 1) / chunks;
    std::vector<float>& acc = s.chunk_acc;  // the caller's buffers: the pool's threads write into them
    std::vector<Partial>& parts = s.chunk_parts;
    acc.resize(T * hq * chunks * d);
    parts.resize(T * hq * chunks);
    auto window_start = [&](long pos) { return L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0L; };
    std::atomic<long> next_item{0};
    parallel_run([&](int, int) {
        std::vector<float> scores, tile(kRowBlock * d), weights(kRowBlock);
        const float* rows[kRowBlock];
        long slots[kRowBlock];
        float row_scales[kRowBlock];
        for (long item = next_item++; item < ntiles * chunks; item = next_item++) {
            const long ti = item / chunks, c = item % chunks;
            const long t0 = tiles[ti], qn = tiles[ti + 1] - t0;
            const long ws = window_start(positions[t0]), last = positions[t0 + qn - 1];
            const long lo = c * chunk_len > ws ? c * chunk_len : ws;
            const long hi = (c + 1) * chunk_len < last + 1 ? (c + 1) * chunk_len : last + 1;
            const long n = hi > lo ? hi - lo : 0;
            const int64_t* table = block_tables + (token_rows ? token_rows[t0] : t0) * bt_stride;
            const long ns = (n + 7) / 8 * 8;  // a (token, head) row of scores, padded for the 8-wide stores
            scores.resize(qn * hq * ns);
            // Positions [lo, hi) a block at a time: fn(first position, count) with slots[0 .. count) filled.
            auto for_each_block = [&](const E* pages, auto fn) {
                long filled = 0, first = lo;
                for_each_slot(table, block_size, lo, hi, [&](long p, long slot) {
                    // every head's row of a later position of this page
                    prefetch_row(pages + (slot + kPrefetchRows) * hkv * d, hkv * d * sizeof(E) / 4);
                    if (filled == 0) first = p;
                    slots[filled] = slot;
                    if (++filled == kRowBlock) { fn(first, filled); filled = 0; }
                });
                if (filled) fn(first, filled);
            };
            // The rows of KV head kvh at the block's slots, as floats; their scales (int8/fp8) in row_scales.
            auto gather = [&](const E* pages, const void* scale_pages, long kvh, long count) {
                for (long j = 0; j < count; ++j) {
                    const long idx = slots[j] * hkv + kvh;
                    rows[j] = widen_row<P>(pages + idx * d, d, tile.data() + j * d);
                    row_scales[j] = P::SCALED ? row_scale(scale_pages, idx) : 1.0f;
                }
            };
            for_each_block(k_pages, [&](long first, long count) {  // scores: (qn, hq, ns)
                for (long kvh = 0; kvh < hkv; ++kvh) {
                    gather(k_pages, L.k_scale, kvh, count);
                    for (long j = count; j < kRowBlock; ++j) rows[j] = rows[0];  // pad: scores past n are unused
                    for (long j0 = 0; j0 < count; j0 += 8) {
                        const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(m.attention_scale),
                                                        _mm256_loadu_ps(row_scales + j0));
                        for (long tt = 0; tt < qn; ++tt)
                            for (long g = 0; g < group; ++g) {
                                const long h = kvh * group + g;
                                _mm256_storeu_ps(scores.data() + (tt * hq + h) * ns + (first - lo) + j0,
                                                 _mm256_mul_ps(dot8(q + ((t0 + tt) * hq + h) * d, rows + j0, d), sc));
                            }
                    }
                }
            });
            for (long tt = 0; tt < qn; ++tt) {
                // this token's keys: [vlo, vhi) of the chunk (a tile's later tokens see more, earlier fewer)
                const long pos = positions[t0 + tt], from = window_start(pos);
                const long vlo = (from > lo ? from : lo) - lo, vhi = (pos + 1 < hi ? pos + 1 : hi) - lo;
                for (long h = 0; h < hq; ++h) {
                    float* sg = scores.data() + (tt * hq + h) * ns;
                    const long slot_index = ((t0 + tt) * hq + h) * chunks + c;
                    parts[slot_index] = attention::softmax_span(sg, vlo, vhi, n);
                    float* o = acc.data() + slot_index * d;
                    for (long j = 0; j < d; ++j) o[j] = 0.0f;
                }
            }
            for_each_block(v_pages, [&](long first, long count) {
                for (long kvh = 0; kvh < hkv; ++kvh) {
                    gather(v_pages, L.v_scale, kvh, count);
                    for (long tt = 0; tt < qn; ++tt)
                        for (long g = 0; g < group; ++g) {
                            const long h = kvh * group + g;
                            const float* w = scores.data() + (tt * hq + h) * ns + (first - lo);
                            if (P::SCALED) {
                                for (long j = 0; j < count; ++j) weights[j] = w[j] * row_scales[j];
                                w = weights.data();
                            }
                            weighted_sum(w, rows, count, d, acc.data() + (((t0 + tt) * hq + h) * chunks + c) * d);
                        }
                }
            });
        }
    });
    for (long th = 0; th < T * hq; ++th)  // merge the chunks of each (token, head)
        attention::merge_chunks(parts.data() + th * chunks, acc.data() + th * chunks * d, chunks, d, out + th * d);
}

template <class Fn>
void with_pages(int kv_dtype, Fn fn) {
    switch (kv_dtype) {
        case 1: fn(PagesBF16{}); break;
        case 2: fn(PagesF16{}); break;
        case 3: fn(PagesInt8{}); break;
        case 4: fn(PagesFP8{}); break;
        default: fn(PagesF32{}); break;
    }
}

// x += out for T rows of hidden size; gemma3 (sandwich) normalises out first with its post-norm weight.
void add_residual(const ModelDesc& m, float* x, float* out, long T, const float* post_norm) {
    const long H = m.hidden;
    for (long t = 0; t < T; ++t) {
        float* ot = out + t * H;
        if (m.sandwich) rmsnorm(ot, post_norm, H, m.eps, ot);
        for (long i = 0; i < H; ++i) x[t * H + i] += ot[i];
    }
}

void layer_step(const ModelDesc& m, const LayerDesc& L, float* x, long T, const int64_t* positions,
                const int64_t* slots, const int64_t* block_tables, long bt_stride, long block_size, Scratch& s) {
    const long H = m.hidden, hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim, I = m.intermediate;
    s.h.resize(T * H); s.q.resize(T * hq * d); s.k.resize(T * hkv * d); s.v.resize(T * hkv * d);
    s.att.resize(T * hq * d); s.o.resize(T * H); s.gate.resize(T * I); s.up.resize(T * I);
    for (long t = 0; t < T; ++t) rmsnorm(x + t * H, L.attn_norm, H, m.eps, s.h.data() + t * H);
    {
        Input in(s.h.data(), T, H, m.activations, s);
        in.apply_all({{&L.q, s.q.data()}, {&L.k, s.k.data()}, {&L.v, s.v.data()}});
    }
    for (long t = 0; t < T; ++t) {
        float* qt = s.q.data() + t * hq * d;
        float* kt = s.k.data() + t * hkv * d;
        if (L.q_norm) {
            for (long h = 0; h < hq; ++h) rmsnorm(qt + h * d, L.q_norm, d, m.eps, qt + h * d);
            for (long h = 0; h < hkv; ++h) rmsnorm(kt + h * d, L.k_norm, d, m.eps, kt + h * d);
        }
        rope(qt, hq, kt, hkv, d, L.inv_freq, positions[t]);
        if (L.kv_dtype == kTurboQuantPages) {
            turboquant_write(*L.k_tq, kt, slots[t], positions[t], hkv, d);
            turboquant_write(*L.v_tq, s.v.data() + t * hkv * d, slots[t], positions[t], hkv, d);
            continue;
        }
        with_pages(L.kv_dtype, [&](auto pages) {
            using P = decltype(pages);
            using E = typename P::T;
            for (long h = 0; h < hkv; ++h) {
                const long idx = slots[t] * hkv + h;
                P::write(kt + h * d, d, static_cast<E*>(L.k_cache) + idx * d, static_cast<uint16_t*>(L.k_scale) + idx);
                P::write(s.v.data() + (t * hkv + h) * d, d, static_cast<E*>(L.v_cache) + idx * d,
                         static_cast<uint16_t*>(L.v_scale) + idx);
            }
        });
    }
    if (L.kv_dtype == kTurboQuantPages)
        turboquant_attend(m, L, s.q.data(), s.att.data(), T, positions, block_tables, bt_stride, block_size);
    else with_pages(L.kv_dtype, [&](auto pages) {
        attend<decltype(pages)>(m, L, s.q.data(), s.att.data(), T, positions, nullptr, block_tables, bt_stride,
                                block_size, s);
    });
    {
        Input in(s.att.data(), T, hq * d, m.activations, s);
        in.apply(L.o, s.o.data());
    }
    add_residual(m, x, s.o.data(), T, L.post_attn_norm);
    for (long t = 0; t < T; ++t)
        rmsnorm(x + t * H, m.sandwich ? L.pre_ffn_norm : L.post_attn_norm, H, m.eps, s.h.data() + t * H);
    {
        Input in(s.h.data(), T, H, m.activations, s);
        in.apply_all({{&L.gate, s.gate.data()}, {&L.up, s.up.data()}});
    }
    if (m.gelu)  // vectorised: a libm tanh/exp per element cost ~0.7 ms of a Gemma-3 step (36 864 of them)
        gated_range<true>(s.gate.data(), s.up.data(), s.gate.data(), 0, T * I);
    else
        gated_range<false>(s.gate.data(), s.up.data(), s.gate.data(), 0, T * I);
    {
        Input in(s.gate.data(), T, I, m.activations, s);
        in.apply(L.down, s.o.data());
    }
    add_residual(m, x, s.o.data(), T, L.post_ffn_norm);
}

}  // namespace
}  // namespace bd

extern "C" {

// Paged attention of T tokens over their sequences' pages (the module path's attention: prefill chunks, and
// decodes of models the one-call step does not cover): q, out (T, hq, d) float32; token t at positions[t]
// reads block table row token_rows[t] of block_tables (bt_stride entries per row); pages (slots, hkv, d) of
// kv_dtype (int8/fp8: fp16 scales (slots, hkv)); window 0 = full causal. Returns 0, -1 for a bad kv_dtype
// or head_dim.
int bd_paged_attention(int kv_dtype, const float* q, float* out, long T, long hq, long hkv, long d, float scale,
                       long window, const int64_t* positions, const int64_t* token_rows, const int64_t* block_tables,
                       long bt_stride, long block_size, void* k_pages, void* v_pages, void* k_scale, void* v_scale) {
    if (kv_dtype < 0 || kv_dtype > 4 || d % 8 || hq % hkv) return -1;
    static thread_local bd::Scratch scratch;
    bd::ModelDesc m{};
    m.num_heads = hq, m.num_kv_heads = hkv, m.head_dim = d, m.attention_scale = scale;
    bd::LayerDesc L{};
    L.k_cache = k_pages, L.v_cache = v_pages, L.k_scale = k_scale, L.v_scale = v_scale, L.window = window;
    bd::with_pages(kv_dtype, [&](auto pages) {
        bd::attend<decltype(pages)>(m, L, q, out, T, positions, token_rows, block_tables, bt_stride, block_size,
                                    scratch);
    });
    return 0;
}

// rows (rows, d) KV page rows of kv_dtype (and their fp16 scales for int8/fp8) → out (rows, d) float32, as the
// attention reads them. d a multiple of 8. Returns 0, -1 for an unknown kv_dtype.
int bd_read_kv_rows(int kv_dtype, const void* pages, const void* scales, long rows, long d, float* out) {
    if (kv_dtype < 0 || kv_dtype > 4) return -1;
    bd::with_pages(kv_dtype, [&](auto p) {
        using P = decltype(p);
        const typename P::T* r = static_cast<const typename P::T*>(pages);
        for (long i = 0; i < rows; ++i) {
            const float s = P::SCALED ? bd::row_scale(scales, i) : 1.0f;
            for (long j = 0; j < d; j += 8)
                _mm256_storeu_ps(out + i * d + j, _mm256_mul_ps(P::load8(r + i * d, j), _mm256_set1_ps(s)));
        }
    });
    return 0;
}

// x: (T, hidden) float32 embeddings in, hidden states after the last layer out (before the final norm).
// Token t is the one new token of a sequence: positions[t], slots[t] (its cache slot), block table row t
// (bt_stride entries) of its pages. Returns 0.
int bd_decode_step(const bd::ModelDesc* m, float* x, long T, const int64_t* positions, const int64_t* slots,
                   const int64_t* block_tables, long bt_stride, long block_size) {
    static thread_local bd::Scratch scratch;
    for (long l = 0; l < m->num_layers; ++l)
        bd::layer_step(*m, m->layers[l], x, T, positions, slots, block_tables, bt_stride, block_size, scratch);
    return 0;
}
}
