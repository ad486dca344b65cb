// One decode step for every sequence of a batch (one new token each) through all layers, in one call:
// no Python between operations, no fork/join per op (the persistent pool), buffers reused across steps,
// the activation row quantized once for q/k/v and once for gate/up. Per layer and token:
//   h = RMSNorm(x); q, k, v = h·Wqkvᵀ; (q, k RMSNorm per head); RoPE(q, k); k, v → cache slot;
//   a = softmax(q·Kᵀ·scale over the sequence's pages, causal, optional sliding window)·V;
//   x += o(a) (gemma3: x += RMSNorm(o(a))); h = RMSNorm(x); x += down(act(gate(h))·up(h)) (gemma3: normed).
// The reference is the module path of bytediet.models (layers.py) that runs every other step.
#include "decoder.h"

#include <cmath>
#include <initializer_list>
#include <utility>
#include <vector>

#include "activations.h"
#include "gemm_blocks.h"
#include "isa.h"
#include "threadpool.h"

namespace bd {
namespace {

struct Partial {
    float max, sum;
};

struct Scratch {
    std::vector<float> h, q, k, v, att, o, gate, up, chunk_acc;
    std::vector<Partial> chunk_parts;
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
constexpr long kPrefetchRows = 6;

template <class E>
inline void prefetch_row(const E* p, long words) {  // the cache lines of ``words`` 4-byte words from p
    const char* c = reinterpret_cast<const char*>(p);
    for (long i = 0; i < words * 4; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

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

inline void axpy(float a, const float* x, float* y, long n) {
    const __m256 va = _mm256_set1_ps(a);
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
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

struct PagesInt8 {  // kvcache int8: per token and head, scale = fp16(max(amax / 127, 1e-6)), code = q + 128
    using T = uint8_t;
    static constexpr bool SCALED = true;
    static __m256 load8(const T* r, long j) {
        __m256i c = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + j)));
        return _mm256_cvtepi32_ps(_mm256_sub_epi32(c, _mm256_set1_epi32(128)));
    }
    static void write(const float* x, long d, T* r, uint16_t* scale) {
        float amax = 0.0f;
        for (long i = 0; i < d; ++i) amax = std::fabs(x[i]) > amax ? std::fabs(x[i]) : amax;
        float s = amax / 127.0f;
        s = s > 1e-6f ? s : 1e-6f;
        const uint16_t h = _cvtss_sh(s, _MM_FROUND_TO_NEAREST_INT);
        *scale = h;
        const float sf = _cvtsh_ss(h);
        for (long i = 0; i < d; ++i) {
            float q = std::nearbyint(x[i] / sf);  // round half to even (the default rounding mode), as torch.round
            q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
            r[i] = static_cast<uint8_t>(static_cast<int>(q) + 128);
        }
    }
};

template <class P>
inline float page_dot(const float* q, const typename P::T* r, long d) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    long i = 0;
    for (; i + 16 <= d; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), P::load8(r, i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), P::load8(r, i + 8), a1);
    }
    for (; i + 8 <= d; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), P::load8(r, i), a0);
    return hsum(_mm256_add_ps(a0, a1));
}

template <class P>
inline void page_axpy(float a, const typename P::T* r, float* y, long d) {
    const __m256 va = _mm256_set1_ps(a);
    for (long i = 0; i + 8 <= d; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, P::load8(r, i), _mm256_loadu_ps(y + i)));
}

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
            rows_ = s.act.quantize(x, m, k, act_ == 2);
        }
    }
    void apply(const LinearDesc& l, float* y) const {
        const long nb = k_ / 32;
        if (act_ != 1 && l.interleaved)
            gemm_x4_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else if (act_ != 1)
            gemm_blocks_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else
            gemm_blocks_f32(l.ggml_type, l.blocks, l.n, l.k, FloatRows{x_, s_.sums.data(), k_, nb}, m_, y, l.n, l.bias);
    }

    // Products of this input by several weights (q/k/v, gate/up): one parallel region when all are interleaved.
    void apply_all(std::initializer_list<std::pair<const LinearDesc*, float*>> outs) const {
        bool fused = act_ != 1;
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
    QuantizedRows rows_{};  // q8/q16: the quantized input in the scratch buffers
    const float* x_;
    long m_, k_;
    int act_;
    Scratch& s_;
};

// Attention of each token's query heads over its sequence's pages (flash-decoding, Dao et al. 2023):
// work items are (token, KV head, context chunk); an item reads each key and value row of its chunk once
// for all the query heads that share the KV head (GQA) and leaves a partial (max, Σexp, Σexp·v) per head;
// a second pass merges the chunks. q, out: (T, Hq, D).
// Page rows are read in place in their stored type (P) and widened in registers; int8 rows' scales multiply
// the row's dot product and its softmax weight once. head_dim is a multiple of 8 (checked by the caller).
template <class P>
void attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T, const int64_t* positions,
            const int64_t* block_tables, long bt_stride, long block_size, Scratch& s) {
    using E = typename P::T;
    const E* k_pages = static_cast<const E*>(L.k_cache);
    const E* v_pages = static_cast<const E*>(L.v_cache);
    const long hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim, group = hq / hkv;
    const int nt = num_threads();
    long longest = 1;
    for (long t = 0; t < T; ++t) longest = positions[t] + 1 > longest ? positions[t] + 1 : longest;
    // enough chunks for every thread to have work, none shorter than 128 positions
    long chunks = (2 * nt + T * hkv - 1) / (T * hkv);
    if (chunks > (longest + 127) / 128) chunks = (longest + 127) / 128;
    if (chunks < 1) chunks = 1;
    const long chunk_len = (longest + chunks - 1) / chunks;
    std::vector<float>& acc = s.chunk_acc;  // the caller's buffers: the pool's threads write into them
    std::vector<Partial>& parts = s.chunk_parts;
    acc.resize(T * hq * chunks * d);
    parts.resize(T * hq * chunks);
    parallel_run([&](int t, int nthreads) {
        long b, e;
        split_range(T * hkv * chunks, nthreads, t, 1, &b, &e);
        std::vector<float> scores;
        for (long item = b; item < e; ++item) {
            const long tok = item / (hkv * chunks), kvh = (item / chunks) % hkv, c = item % chunks;
            const long pos = positions[tok];
            const long first_pos = L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0;
            const long lo = c * chunk_len > first_pos ? c * chunk_len : first_pos;
            const long hi = (c + 1) * chunk_len < pos + 1 ? (c + 1) * chunk_len : pos + 1;
            const long n = hi > lo ? hi - lo : 0;
            const int64_t* table = block_tables + tok * bt_stride;
            const float* qg = q + (tok * hq + kvh * group) * d;
            scores.resize(group * n + 8);
            for_each_slot(table, block_size, lo, hi, [&](long p, long slot) {  // scores of the group's heads: (group, n)
                const E* krow = k_pages + (slot * hkv + kvh) * d;
                prefetch_row(krow + kPrefetchRows * hkv * d, d * sizeof(E) / 4);  // a later row of this page
                const float sc = m.attention_scale * (P::SCALED ? row_scale(L.k_scale, slot * hkv + kvh) : 1.0f);
                for (long g = 0; g < group; ++g) scores[g * n + (p - lo)] = page_dot<P>(qg + g * d, krow, d) * sc;
            });
            for (long g = 0; g < group; ++g) {
                float* sg = scores.data() + g * n;
                float mx = -INFINITY;
                for (long i = 0; i < n; ++i) mx = sg[i] > mx ? sg[i] : mx;
                float sum = 0.0f;
                long i = 0;
                const __m256 vmx = _mm256_set1_ps(mx);
                __m256 vsum = _mm256_setzero_ps();
                for (; i + 8 <= n; i += 8) {
                    __m256 ex = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), vmx));
                    _mm256_storeu_ps(sg + i, ex);
                    vsum = _mm256_add_ps(vsum, ex);
                }
                sum = hsum(vsum);
                for (; i < n; ++i) { sg[i] = std::exp(sg[i] - mx); sum += sg[i]; }
                const long slot_index = (tok * hq + kvh * group + g) * chunks + c;
                parts[slot_index] = Partial{mx, sum};
                float* o = acc.data() + slot_index * d;
                for (long j = 0; j < d; ++j) o[j] = 0.0f;
            }
            for_each_slot(table, block_size, lo, hi, [&](long p, long slot) {
                const E* vrow = v_pages + (slot * hkv + kvh) * d;
                prefetch_row(vrow + kPrefetchRows * hkv * d, d * sizeof(E) / 4);
                const float vs = P::SCALED ? row_scale(L.v_scale, slot * hkv + kvh) : 1.0f;
                for (long g = 0; g < group; ++g)
                    page_axpy<P>(scores[g * n + (p - lo)] * vs, vrow,
                                 acc.data() + ((tok * hq + kvh * group + g) * chunks + c) * d, d);
            });
        }
    });
    for (long th = 0; th < T * hq; ++th) {  // merge the chunks of each (token, head)
        float mx = -INFINITY;
        for (long c = 0; c < chunks; ++c)
            if (parts[th * chunks + c].sum > 0.0f && parts[th * chunks + c].max > mx) mx = parts[th * chunks + c].max;
        float* o = out + th * d;
        for (long j = 0; j < d; ++j) o[j] = 0.0f;
        float total = 0.0f;
        for (long c = 0; c < chunks; ++c) {
            const Partial& pc = parts[th * chunks + c];
            if (pc.sum <= 0.0f) continue;
            const float w = std::exp(pc.max - mx);
            total += w * pc.sum;
            axpy(w, acc.data() + (th * chunks + c) * d, o, d);
        }
        const float inv = 1.0f / total;
        for (long j = 0; j < d; ++j) o[j] *= inv;
    }
}

template <class Fn>
void with_pages(int kv_dtype, Fn fn) {
    switch (kv_dtype) {
        case 1: fn(PagesBF16{}); break;
        case 2: fn(PagesF16{}); break;
        case 3: fn(PagesInt8{}); break;
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
    with_pages(L.kv_dtype, [&](auto pages) {
        attend<decltype(pages)>(m, L, s.q.data(), s.att.data(), T, positions, block_tables, bt_stride, block_size, s);
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
