// One decode step for every sequence of a batch (one new token each) through all layers, in one call:
// no Python between operations, no fork/join per op (the persistent pool), buffers reused across steps,
// the activation row quantized once for q/k/v and once for gate/up. Per layer and token:
//   h = RMSNorm(x); q, k, v = h·Wqkvᵀ; (q, k RMSNorm per head); RoPE(q, k); k, v → cache slot;
//   a = softmax(q·Kᵀ·scale over the sequence's pages, causal, optional sliding window)·V;
//   x += o(a) (gemma3: x += RMSNorm(o(a))); h = RMSNorm(x); x += down(act(gate(h))·up(h)) (gemma3: normed).
// The reference is the module path of bytediet.models (layers.py) that runs every other step.
#include "decoder.h"

#include <algorithm>
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
#include "kv_pages.h"
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

// RoPE of a token's query heads q (hq, d) and key heads k (hkv, d) at one position: one cos/sin per frequency
// for both (libm's sincos is most of the cost at head_dim 256).
// rows × d vectors in place: x ← R x (back: x ← Rᵀ x); R (d, d) row-major, orthogonal (kvcache/rotated.py)
void rotate_rows(float* x, long rows, long d, const float* R, bool back) {
    std::vector<float> y(d);
    for (long r = 0; r < rows; ++r) {
        float* v = x + r * d;
        std::fill(y.begin(), y.end(), 0.f);
        for (long i = 0; i < d; ++i) {
            const float* row = R + i * d;
            if (back) {
                const float vi = v[i];
                for (long j = 0; j < d; ++j) y[j] += vi * row[j];
            } else {
                float s = 0.f;
                for (long j = 0; j < d; ++j) s += row[j] * v[j];
                y[i] = s;
            }
        }
        std::copy(y.begin(), y.end(), v);
    }
}

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
// Page rows are read in place in their stored type and widened once per row (kv_pages.h); int8/fp8 rows' scales
// multiply the row's score and its softmax weight. Keys and values may be stored in different page types
// (k=q8_0,v=q4_0): an item's key pass and value pass are each instantiated per page type and chosen once per
// call (9 + 9 instances, not 81 pairs). Items come from a shared counter (a prefill's late, long tiles do not
// all land on one thread). head_dim is a multiple of 8 (of 32 for block pages; checked by the callers).
constexpr long kRowBlock = 16;  // positions per block (rows gathered, and for narrow pages widened)
constexpr long kQueryTile = 8;  // tokens of one prefill chunk sharing the row reads

struct AttendCall {  // what every item of one call shares
    const ModelDesc& m;
    const LayerDesc& L;
    const float* q;  // (T, hq, d)
    long chunks, block_size;
    float* acc;      // (T, hq, chunks, d): each chunk's unnormalised Σ p·v
    const CodePagesDesc* k_side;  // code pages' side data (kv_pages.h), null for row and block pages
    const CodePagesDesc* v_side;
};

struct Item {  // query tile [t0, t0 + qn) over positions [lo, hi) (n of them) of chunk c of its sequence
    long t0, qn, c, lo, hi, n, ns;  // ns: n padded to 8, a (token, head) row of scores
    const int64_t* table;           // the sequence's block table row
};

struct Worker {  // a thread's buffers: the item's scores (qn, hq, ns), then the block of rows at hand
    std::vector<float> scores, tile, weights;
    const float* rows[kRowBlock];
    long slots[kRowBlock];
    float row_scales[kRowBlock];
};

// The item's positions a block at a time: fn(first position, count) with w.slots[0 .. count) filled.
template <class P, class Fn>
void for_each_row_block(const AttendCall& a, const Item& it, const typename P::T* pages, Worker& w, Fn fn) {
    const long stride = a.m.num_kv_heads * P::row_size(a.m.head_dim);  // every head's row of one slot
    long filled = 0, first = it.lo;
    for_each_slot(it.table, a.block_size, it.lo, it.hi, [&](long p, long slot) {
        // every head's row of a later position of this page
        prefetch_row(pages + (slot + kPrefetchRows) * stride, stride * static_cast<long>(sizeof(typename P::T)) / 4);
        if (filled == 0) first = p;
        w.slots[filled] = slot;
        if (++filled == kRowBlock) { fn(first, filled); filled = 0; }
    });
    if (filled) fn(first, filled);
}

// The rows of KV head kvh at the block's slots as floats (w.rows); their scales (int8/fp8, else 1) in w.row_scales.
template <class P>
void gather(const AttendCall& a, const typename P::T* pages, const void* scale_pages, const CodePagesDesc* side,
            long kvh, long count, Worker& w) {
    const long hkv = a.m.num_kv_heads, d = a.m.head_dim, rs = P::row_size(d);
    for (long j = 0; j < count; ++j) {
        if constexpr (P::SIDE) {  // code pages: scale and zero beside the pages, found from the slot
            w.rows[j] = P::widen_at(*side, pages, w.slots[j], kvh, hkv, d, w.tile.data() + j * d);
            w.row_scales[j] = 1.0f;
        } else {
            const long idx = w.slots[j] * hkv + kvh;
            w.rows[j] = widen_row<P>(pages + idx * rs, d, w.tile.data() + j * d);
            w.row_scales[j] = P::SCALED ? row_scale(scale_pages, idx) : 1.0f;
        }
    }
}

// The item's scores scale · q·k (times the key rows' scales) → w.scores (qn, hq, ns).
template <class P>
void key_pass(const AttendCall& a, const Item& it, Worker& w) {
    const long hq = a.m.num_heads, hkv = a.m.num_kv_heads, d = a.m.head_dim, group = hq / hkv;
    const auto* pages = static_cast<const typename P::T*>(a.L.k_cache);
    for_each_row_block<P>(a, it, pages, w, [&](long first, long count) {
        for (long kvh = 0; kvh < hkv; ++kvh) {
            gather<P>(a, pages, a.L.k_scale, a.k_side, kvh, count, w);
            for (long j = count; j < kRowBlock; ++j) w.rows[j] = w.rows[0];  // pad: scores past n are unused
            for (long j0 = 0; j0 < count; j0 += 8) {
                const __m256 sc =
                    _mm256_mul_ps(_mm256_set1_ps(a.m.attention_scale), _mm256_loadu_ps(w.row_scales + j0));
                for (long tt = 0; tt < it.qn; ++tt)
                    for (long g = 0; g < group; ++g) {
                        const long h = kvh * group + g;
                        _mm256_storeu_ps(w.scores.data() + (tt * hq + h) * it.ns + (first - it.lo) + j0,
                                         _mm256_mul_ps(dot8(a.q + ((it.t0 + tt) * hq + h) * d, w.rows + j0, d), sc));
                    }
            }
        }
    });
}

// Each (token, head)'s chunk accumulator += Σ p · v over the item's positions (p: the softmax numerators in
// w.scores, times the value rows' scales).
template <class P>
void value_pass(const AttendCall& a, const Item& it, Worker& w) {
    const long hq = a.m.num_heads, hkv = a.m.num_kv_heads, d = a.m.head_dim, group = hq / hkv;
    const auto* pages = static_cast<const typename P::T*>(a.L.v_cache);
    for_each_row_block<P>(a, it, pages, w, [&](long first, long count) {
        for (long kvh = 0; kvh < hkv; ++kvh) {
            gather<P>(a, pages, a.L.v_scale, a.v_side, kvh, count, w);
            for (long tt = 0; tt < it.qn; ++tt)
                for (long g = 0; g < group; ++g) {
                    const long h = kvh * group + g;
                    const float* p = w.scores.data() + (tt * hq + h) * it.ns + (first - it.lo);
                    if (P::SCALED) {
                        for (long j = 0; j < count; ++j) w.weights[j] = p[j] * w.row_scales[j];
                        p = w.weights.data();
                    }
                    weighted_sum(p, w.rows, count, d, a.acc + (((it.t0 + tt) * hq + h) * a.chunks + it.c) * d);
                }
        }
    });
}

using Pass = void (*)(const AttendCall&, const Item&, Worker&);

// The key pass of page type k_dtype and the value pass of v_dtype; false if either has no pages the attention
// reads here, or head_dim d does not fit them (a multiple of 8; of 32 for block pages and per-token code pages).
bool passes(int k_dtype, int v_dtype, long d, Pass& keys, Pass& values) {
    auto fits = [d](int t) {
        const bool whole_blocks = t >= kFirstBlockPages && t != kFirstCodePages && t != kFirstCodePages + 1;
        return d > 0 && d % 8 == 0 && (!whole_blocks || d % 32 == 0);
    };
    return fits(k_dtype) && fits(v_dtype) &&
           with_attention_pages(k_dtype, [&](auto p) { keys = &key_pass<decltype(p)>; }) &&
           with_attention_pages(v_dtype, [&](auto p) { values = &value_pass<decltype(p)>; });
}

void attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T, const int64_t* positions,
            const int64_t* token_rows, const int64_t* block_tables, long bt_stride, long block_size, Scratch& s,
            Pass keys, Pass values, const CodePagesDesc* k_side = nullptr, const CodePagesDesc* v_side = nullptr) {
    const long hq = m.num_heads, d = m.head_dim;
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
    const AttendCall call{m, L, q, chunks, block_size, acc.data(), k_side, v_side};
    auto window_start = [&](long pos) { return L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0L; };
    std::atomic<long> next_item{0};
    parallel_run([&](int, int) {
        Worker w;
        w.tile.resize(kRowBlock * d);
        w.weights.resize(kRowBlock);
        for (long item = next_item++; item < ntiles * chunks; item = next_item++) {
            Item it{};
            const long ti = item / chunks;
            it.c = item % chunks, it.t0 = tiles[ti], it.qn = tiles[ti + 1] - it.t0;
            const long ws = window_start(positions[it.t0]), last = positions[it.t0 + it.qn - 1];
            it.lo = it.c * chunk_len > ws ? it.c * chunk_len : ws;
            it.hi = (it.c + 1) * chunk_len < last + 1 ? (it.c + 1) * chunk_len : last + 1;
            it.n = it.hi > it.lo ? it.hi - it.lo : 0;
            it.ns = (it.n + 7) / 8 * 8;
            it.table = block_tables + (token_rows ? token_rows[it.t0] : it.t0) * bt_stride;
            w.scores.resize(it.qn * hq * it.ns);
            keys(call, it, w);
            for (long tt = 0; tt < it.qn; ++tt) {
                // this token's keys: [vlo, vhi) of the chunk (a tile's later tokens see more, earlier fewer)
                const long pos = positions[it.t0 + tt], from = window_start(pos);
                const long vlo = (from > it.lo ? from : it.lo) - it.lo;
                const long vhi = (pos + 1 < it.hi ? pos + 1 : it.hi) - it.lo;
                for (long h = 0; h < hq; ++h) {
                    const long slot_index = ((it.t0 + tt) * hq + h) * chunks + it.c;
                    float* sg = w.scores.data() + (tt * hq + h) * it.ns;
                    parts[slot_index] = attention::softmax_span(sg, vlo, vhi, it.n);
                    float* o = acc.data() + slot_index * d;
                    for (long j = 0; j < d; ++j) o[j] = 0.0f;
                }
            }
            values(call, it, w);
        }
    });
    for (long th = 0; th < T * hq; ++th)  // merge the chunks of each (token, head)
        attention::merge_chunks(parts.data() + th * chunks, acc.data() + th * chunks * d, chunks, d, out + th * d);
}

// Row idx (slot · hkv + head) of pages of type kv_dtype ← x (d floats), and its fp16 scale for int8/fp8.
void write_row(int kv_dtype, const float* x, long d, void* pages, void* scales, long idx) {
    with_pages(kv_dtype, [&](auto p) {
        using P = decltype(p);
        P::write(x, d, static_cast<typename P::T*>(pages) + idx * P::row_size(d), static_cast<uint16_t*>(scales) + idx);
    });
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
        if (L.k_rot) {  // rotated pages (kvcache/rotated.py): q·k = (R q)·(R k)
            rotate_rows(qt, hq, d, L.k_rot, false);
            rotate_rows(kt, hkv, d, L.k_rot, false);
        }
        if (L.v_rot) rotate_rows(s.v.data() + t * hkv * d, hkv, d, L.v_rot, false);
        if (L.k_dtype == kTurboQuantPages) {
            turboquant_write(*L.k_tq, kt, slots[t], positions[t], hkv, d);
            turboquant_write(*L.v_tq, s.v.data() + t * hkv * d, slots[t], positions[t], hkv, d);
            continue;
        }
        for (long h = 0; h < hkv; ++h) {
            const long idx = slots[t] * hkv + h;
            write_row(L.k_dtype, kt + h * d, d, L.k_cache, L.k_scale, idx);
            write_row(L.v_dtype, s.v.data() + (t * hkv + h) * d, d, L.v_cache, L.v_scale, idx);
        }
    }
    Pass keys = nullptr, values = nullptr;
    if (L.k_dtype == kTurboQuantPages)
        turboquant_attend(m, L, s.q.data(), s.att.data(), T, positions, block_tables, bt_stride, block_size);
    else if (L.k_dtype < kFirstCodePages && L.v_dtype < kFirstCodePages && passes(L.k_dtype, L.v_dtype, d, keys, values))
        attend(m, L, s.q.data(), s.att.data(), T, positions, nullptr, block_tables, bt_stride, block_size, s, keys,
               values);
    if (L.v_rot) rotate_rows(s.att.data(), T * hq, d, L.v_rot, true);
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
// reads block table row token_rows[t] of block_tables (bt_stride entries per row); key pages (slots, hkv,
// row_size(d)) of page type k_dtype, value pages of v_dtype (int8/fp8: fp16 scales (slots, hkv)); window 0 =
// full causal; code pages (ids 10..13) with their side data k_side / v_side (bd::CodePagesDesc, else null).
// Returns 0, -1 for a page type the attention does not read, a head_dim it does not fit, or missing side data.
int bd_paged_attention(int k_dtype, int v_dtype, const float* q, float* out, long T, long hq, long hkv, long d,
                       float scale, long window, const int64_t* positions, const int64_t* token_rows,
                       const int64_t* block_tables, long bt_stride, long block_size, void* k_pages, void* v_pages,
                       void* k_scale, void* v_scale, const void* k_side, const void* v_side) {
    bd::Pass keys = nullptr, values = nullptr;
    if (hkv <= 0 || hq % hkv || !bd::passes(k_dtype, v_dtype, d, keys, values)) return -1;
    if ((k_dtype >= bd::kFirstCodePages && !k_side) || (v_dtype >= bd::kFirstCodePages && !v_side)) return -1;
    static thread_local bd::Scratch scratch;
    bd::ModelDesc m{};
    m.num_heads = hq, m.num_kv_heads = hkv, m.head_dim = d, m.attention_scale = scale;
    bd::LayerDesc L{};
    L.k_cache = k_pages, L.v_cache = v_pages, L.k_scale = k_scale, L.v_scale = v_scale, L.window = window;
    bd::attend(m, L, q, out, T, positions, token_rows, block_tables, bt_stride, block_size, scratch, keys, values,
               static_cast<const bd::CodePagesDesc*>(k_side), static_cast<const bd::CodePagesDesc*>(v_side));
    return 0;
}

// rows KV page rows of kv_dtype ((rows, row_size(d)), and their fp16 scales for int8/fp8) → out (rows, d) float32,
// as the attention reads them. d a multiple of 8 (of 32 for block pages). Returns 0, -1 for a page type without
// row pages or a d they do not fit.
int bd_read_kv_rows(int kv_dtype, const void* pages, const void* scales, long rows, long d, float* out) {
    bd::Pass keys = nullptr, values = nullptr;
    if (kv_dtype >= bd::kFirstCodePages || !bd::passes(kv_dtype, kv_dtype, d, keys, values)) return -1;
    bd::with_pages(kv_dtype, [&](auto p) {
        using P = decltype(p);
        const typename P::T* r = static_cast<const typename P::T*>(pages);
        for (long i = 0; i < rows; ++i) {
            const float* x = bd::widen_row<P>(r + i * P::row_size(d), d, out + i * d);
            const __m256 s = _mm256_set1_ps(P::SCALED ? bd::row_scale(scales, i) : 1.0f);
            for (long j = 0; j < d; j += 8) _mm256_storeu_ps(out + i * d + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), s));
        }
    });
    return 0;
}

// x (rows, d) float32 → rows KV page rows of kv_dtype (rows, row_size(d)), and for int8/fp8 their fp16 scales
// (rows): the decode step's write of a new token's keys or values. Returns 0, -1 as bd_read_kv_rows.
int bd_write_kv_rows(int kv_dtype, const float* x, long rows, long d, void* pages, void* scales) {
    bd::Pass keys = nullptr, values = nullptr;
    if (kv_dtype >= bd::kFirstCodePages || !bd::passes(kv_dtype, kv_dtype, d, keys, values)) return -1;
    for (long i = 0; i < rows; ++i) bd::write_row(kv_dtype, x + i * d, d, pages, scales, i);
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
