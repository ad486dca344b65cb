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
#include "code_pages.h"
#include "gemm_blocks.h"
#include "isa.h"
#include "kv_pages.h"
#include "lanes_avx2.h"
#include "lanes_avx512.h"
#include "threadpool.h"

namespace bd {
namespace {

using attention::for_each_slot;
using attention::Partial;

struct Scratch {
    std::vector<float> h, q, k, v, att, o, gate, up, chunk_acc, kq;
    std::vector<Partial> chunk_parts;
    std::vector<long> tiles;  // attention: first token of each query tile, then T
    QuantizedActivations act;
    std::vector<float> sums;  // f32 mode: the sum of each activation block
};

// rows × d vectors in place: x ← R x (back: x ← Rᵀ x); R (d, d) row-major, orthogonal (kvcache/rotated.py) —
// the same dot / axpy rows as TurboQuant's query and output rotations (turboquant_pages.cpp).
void rotate_rows(float* x, long rows, long d, const float* R, bool back) {
    std::vector<float> y(d);
    for (long r = 0; r < rows; ++r) {
        float* v = x + r * d;
        if (back) {
            std::fill(y.begin(), y.end(), 0.f);
            for (long i = 0; i < d; ++i) attention::axpy(v[i], R + i * d, y.data(), d);
        } else {
            for (long i = 0; i < d; ++i) y[i] = attention::dot(R + i * d, v, d);
        }
        std::copy(y.begin(), y.end(), v);
    }
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

// Positions ahead whose rows the key pass on codes prefetches: a head's rows are strided, which the hardware
// prefetcher follows late (8: the fastest measured, bench/RESULTS.md, Recording 10).
constexpr long kPrefetchRows = 8;

// Linear layers sharing one input: quantized once (q8) or summed per block once (f32).
class Input {
  public:
    Input(const float* x, long m, long k, int activations, Scratch& s)
        : x_(x), m_(m), k_(k), act_(static_cast<Activations>(activations)), s_(s) {
        if (act_ == Activations::F32) {
            s.sums.resize(m * (k / 32));
            block_sums(x, m, k, s.sums.data());
        } else {
            rows_ = act_ == Activations::Q8_TOKEN ? s.act.quantize_per_token(x, m, k)
                                                  : s.act.quantize(x, m, k, act_ == Activations::Q16);
        }
    }
    void apply(const LinearDesc& l, float* y) const {
        const long nb = k_ / 32;
        if (panel(l, y)) return;
        if (act_ != Activations::F32 && l.interleaved)
            gemm_x4_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else if (act_ != Activations::F32)
            gemm_blocks_q8(l.ggml_type, l.blocks, l.n, l.k, rows_, m_, y, l.n, l.bias);
        else
            gemm_blocks_f32(l.ggml_type, l.blocks, l.n, l.k, FloatRows{x_, s_.sums.data(), k_, nb}, m_, y, l.n, l.bias);
    }

    // Products of this input by several weights (q/k/v, gate/up): one parallel region when all are interleaved.
    void apply_all(std::initializer_list<std::pair<const LinearDesc*, float*>> outs) const {
        bool fused = act_ != Activations::F32 && m_ < kPanelMinRows;
        for (auto& o : outs) fused = fused && o.first->interleaved;
        if (!fused) {
            for (auto& o : outs) apply(*o.first, o.second);
            return;
        }
        X4Product products[4];
        int n = 0;
        for (auto& o : outs)
            products[n++] =
                X4Product{o.first->ggml_type, o.first->blocks, o.first->n, o.first->k, o.second, o.first->bias};
        gemm_x4_many(products, n, rows_, m_);
    }

  private:
    // A step of many rows (a batch of decodes) with q16 activations: the register-blocked panel GEMM
    // (gemm_panel.cpp) where this build has it, faster than x4 from 8 rows (bench/RESULTS.md, Recording 10).
    static constexpr long kPanelMinRows = 8;
    bool panel(const LinearDesc& l, float* y) const {
        if (act_ != Activations::Q16 || m_ < kPanelMinRows) return false;
        const uint8_t* src = l.interleaved ? l.source : l.blocks;
        return src && gemm_panel_q16(l.ggml_type, src, l.n, l.k, rows_, m_, y, l.n, l.bias) == 0;
    }

    QuantizedRows rows_{};  // q8/q16: the quantized input in the scratch buffers
    const float* x_;
    long m_, k_;
    Activations act_;
    Scratch& s_;
};

// Attention of each token's query heads over its sequence's pages (flash-decoding, Dao et al. 2023):
// work items are (query tile, context chunk). A tile is one token, or up to kQueryTile consecutive tokens of
// one sequence (a prefill chunk: token_rows[t] names each token's block table row, null = row t), which
// share every key and value row read — a prefill reads its context once per tile, not once per token.
// An item walks its chunk's positions in order, 16 at a time, and for every KV head reads the rows once
// for all the query heads that share it (GQA), leaving a partial (max, Σexp, Σexp·v) per (token, head);
// a second pass merges the chunks. q, out: (T, Hq, D).
// Positions (not heads) are walked outermost, so each page is read front to back; the streaming passes (below)
// read each row once for all the heads that share it, keys in address order, prefetching between the products
// (why: bench/RESULTS.md, Recording 10). Keys scored on their codes (QJL) keep a head-major pass, 8 keys per
// reduction (P::dot8).
// Page rows are read in place in their stored type and widened once per row (kv_pages.h); int8/fp8 rows' scales
// multiply the row's score and its softmax weight. Keys and values may be stored in different page types
// (k=q8_0,v=q4_0): an item's key pass and value pass are each instantiated per page type and chosen once per
// call (9 + 9 instances, not 81 pairs). Items come from a shared counter (a prefill's late, long tiles do not
// all land on one thread). head_dim is a multiple of 8 (of 32 for block pages; checked by the callers).
constexpr long kRowBlock = 16;  // positions per block (rows gathered, and for narrow pages widened)
constexpr long kQueryTile = 8;  // tokens of one prefill chunk sharing the row reads
// The streaming passes prefetch the rows this many positions ahead, one position's rows between two positions'
// products (the fastest of 4/8/16 and 8/16/32: bench/RESULTS.md, Recording 10).
constexpr long kKeyAhead = 8;
constexpr long kValueAhead = 16;

struct AttendCall {  // what every item of one call shares
    const ModelDesc& m;
    const LayerDesc& L;
    const float* q;  // (T, hq, kd): the queries as the key pages score them (q itself, or transformed: code_pages.h)
    long kd;
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
    std::vector<float> folded, key_scales;  // the streaming key pass: (qn, hq, 8, 8) folded dots; (hkv, 8) row scales
    long ahead[kRowBlock];  // the streaming passes: the slot some positions after each (−1: none)
    const uint8_t* codes[kRowBlock];  // keys scored on their codes (ON_CODES): the rows as stored
    long slots[kRowBlock];
    float row_scales[kRowBlock];
};

// The item's positions a block at a time: fn(first position, count) with w.slots[0 .. count) filled. Prefetch:
// every head's row of the position kPrefetchRows slots further in the page, as each slot is collected (the key pass
// on codes); or, with ahead > 0, none, and w.ahead[0 .. count) names the slot `ahead` positions later through the
// block table (−1 past the item) for the streaming passes, which prefetch it between their loads.
template <class P, class Fn>
void for_each_row_block(const AttendCall& a, const Item& it, const typename P::T* pages, Worker& w, Fn fn,
                        long ahead = 0) {
    const long stride = a.m.num_kv_heads * P::row_size(a.m.head_dim);  // every head's row of one slot
    const long bs = a.block_size;
    long filled = 0, first = it.lo;
    long ahead_pos = it.lo + ahead, ahead_blk = ahead_pos / bs, ahead_off = ahead_pos % bs;
    for_each_slot(it.table, bs, it.lo, it.hi, [&](long p, long slot) {
        if (ahead) {
            w.ahead[filled] = ahead_pos < it.hi ? it.table[ahead_blk] * bs + ahead_off : -1;
            ++ahead_pos;
            if (++ahead_off == bs) ahead_off = 0, ++ahead_blk;
        } else {  // every head's row of a later position of this page
            prefetch_bytes(reinterpret_cast<const char*>(pages + (slot + kPrefetchRows) * stride),
                           stride * static_cast<long>(sizeof(typename P::T)));
        }
        if (filled == 0) first = p;
        w.slots[filled] = slot;
        if (++filled == kRowBlock) {
            fn(first, filled);
            filled = 0;
        }
    });
    if (filled) fn(first, filled);
}

// The rows of KV head kvh at the block's slots as stored (w.codes: keys scored on their codes), their scales
// (QJL's norms) in w.row_scales.
template <class P>
void gather_codes(const AttendCall& a, const typename P::T* pages, const CodePagesDesc* side, long kvh, long count,
                  Worker& w) {
    const long hkv = a.m.num_kv_heads, d = a.m.head_dim, rs = P::row_size(d);
    for (long j = 0; j < count; ++j) {
        w.codes[j] = pages + (w.slots[j] * hkv + kvh) * rs;
        w.row_scales[j] = P::row_scale_at(*side, w.slots[j], kvh, hkv, d);
    }
}

// The item's scores scale · q·k (times the key rows' scales) → w.scores (qn, hq, ns), for keys scored on their
// codes (ON_CODES: P::dot8 scores 8 of them against a query).
template <class P>
void key_pass_on_codes(const AttendCall& a, const Item& it, Worker& w) {
    const long hq = a.m.num_heads, hkv = a.m.num_kv_heads, kd = a.kd, group = hq / hkv;
    const auto* pages = static_cast<const typename P::T*>(a.L.k_cache);
    for_each_row_block<P>(a, it, pages, w, [&](long first, long count) {
        for (long kvh = 0; kvh < hkv; ++kvh) {
            gather_codes<P>(a, pages, a.k_side, kvh, count, w);
            for (long j = count; j < kRowBlock; ++j) w.codes[j] = w.codes[0];  // pad: unused
            for (long j0 = 0; j0 < count; j0 += 8) {
                const __m256 sc =
                    _mm256_mul_ps(_mm256_set1_ps(a.m.attention_scale), _mm256_loadu_ps(w.row_scales + j0));
                for (long tt = 0; tt < it.qn; ++tt)
                    for (long g = 0; g < group; ++g) {
                        const long h = kvh * group + g;
                        const float* qh = a.q + ((it.t0 + tt) * hq + h) * kd;
                        _mm256_storeu_ps(w.scores.data() + (tt * hq + h) * it.ns + (first - it.lo) + j0,
                                         _mm256_mul_ps(P::dot8(qh, w.codes + j0, kd), sc));
                    }
            }
        }
    });
}

// Rows (rows, d) → (rows, P::query_size(d)) in out: the queries as key pages of type P score them (QUERY: QJL's
// sketch, PolarQuant's rotation), once per call, the rows split over the pool.
template <class P>
void prepare_queries(const CodePagesDesc& side, const float* q, long rows, long d, float* out) {
    if constexpr (P::QUERY) {
        parallel_run([&](int t, int nt) {
            long b, e;
            split_range(rows, nt, t, 1, &b, &e);
            for (long r = b; r < e; ++r) P::prepare(side, q + r * d, d, out + r * P::query_size(d));
        });
    }
}

// The outputs (rows, d) of value pages of type P summed in a rotated basis, turned back in place (FINISH).
template <class P>
void finish_values(const CodePagesDesc& side, float* out, long rows, long d) {
    if constexpr (P::FINISH) {
        parallel_run([&](int t, int nt) {
            long b, e;
            split_range(rows, nt, t, 1, &b, &e);
            for (long r = b; r < e; ++r) P::finish(side, d, out + r * d);
        });
    }
}

// The streaming passes (any row or block page type, head_dim a multiple of the vector width): every key row is
// loaded once for all the query heads that share it (GQA, up to kGroupTile at a time) and every value row once for
// all their outputs. The walk (address order, prefetch between products) is one template; its vector kernels are
// Lanes16's (lanes_avx512.h: 16 floats a load) where the build has them and head_dim % 16 == 0, else Lanes8's
// (lanes_avx2.h); two separate sets, not one over the width (bench/RESULTS.md, Recording 11).
constexpr int kGroupTile = 4;

// Row and block pages (float, bf16, fp16, int8, fp8 rows; llama.cpp's q8_0/q5_0/q4_1/q4_0 blocks: not code pages)
// are widened in registers by the streaming passes, a vector a load, never through the tile (its store and reload
// cost int8 pages more than their 4× fewer bytes saved: batch 1 at 8k context ran at fp32's speed).
template <class P>
inline WideRow<P> wide_row_at(const AttendCall& a, const typename P::T* pages, const void* scale_pages,
                              const CodePagesDesc* side, long slot, long kvh, float* tile, float& scale) {
    const long hkv = a.m.num_kv_heads, d = a.m.head_dim;
    if constexpr (kRowsInRegisters<P>) {
        const long idx = slot * hkv + kvh;
        scale = P::SCALED ? row_scale(scale_pages, idx) : 1.0f;
        return pages + idx * P::row_size(d);
    } else {
        scale = P::row_scale_at(*side, slot, kvh, hkv, d);
        return P::widen_at(*side, pages, slot, kvh, hkv, d, tile);
    }
}

// fn(first head, NG) over the group's heads, kGroupTile at a time, NG a compile-time constant.
template <class Fn>
inline void for_each_head_tile(long group, Fn fn) {
    for (long g0 = 0; g0 < group; g0 += kGroupTile) {
        switch (group - g0 < kGroupTile ? group - g0 : kGroupTile) {
            case 1: fn(g0, std::integral_constant<int, 1>{}); break;
            case 2: fn(g0, std::integral_constant<int, 2>{}); break;
            case 3: fn(g0, std::integral_constant<int, 3>{}); break;
            default: fn(g0, std::integral_constant<int, 4>{}); break;
        }
    }
}

// Keys in address order — every KV head's row of a position before the next position's (a stride the prefetchers
// follow: bench/RESULTS.md, Recording 10). Each row's dots with its heads' queries are folded to 8 lanes and kept
// (w.folded) until 8 positions are in, then reduced 8 at a time.
template <class P, class V>
void key_pass_stream(const AttendCall& a, const Item& it, Worker& w) {
    const long hq = a.m.num_heads, hkv = a.m.num_kv_heads, kd = a.kd, group = hq / hkv, d = a.m.head_dim;
    const auto* pages = static_cast<const typename P::T*>(a.L.k_cache);
    float* folded = w.folded.data();  // (qn, hq, 8 positions, 8 lanes)
    float* scales = w.key_scales.data();  // (hkv, 8 positions)
    const long slot_bytes = hkv * P::row_size(d) * static_cast<long>(sizeof(typename P::T));
    for_each_row_block<P>(
        a, it, pages, w,
        [&](long first, long count) {
            for (long j0 = 0; j0 < count; j0 += 8) {
                for (long j = 0; j < 8; ++j) {
                    const long slot =
                        w.slots[j0 + j < count ? j0 + j : j0];  // pad with a real row: its scores are unused
                    if (j0 + j < count && w.ahead[j0 + j] >= 0)
                        prefetch_bytes(reinterpret_cast<const char*>(pages) + w.ahead[j0 + j] * slot_bytes, slot_bytes);
                    for (long kvh = 0; kvh < hkv; ++kvh) {
                        const WideRow<P> row = wide_row_at<P>(a, pages, a.L.k_scale, a.k_side, slot, kvh,
                                                              w.tile.data() + (j * hkv + kvh) * d, scales[kvh * 8 + j]);
                        for (long tt = 0; tt < it.qn; ++tt)
                            for_each_head_tile(group, [&](long g0, auto ng) {
                                constexpr int NG = decltype(ng)::value;
                                const long h0 = kvh * group + g0;
                                const float* qs[NG];
                                for (int g = 0; g < NG; ++g) qs[g] = a.q + ((it.t0 + tt) * hq + h0 + g) * kd;
                                float* dst = folded + ((tt * hq + h0) * 8 + j) * 8;
                                if (kd == 64)
                                    V::template dots<P, NG, 64>(qs, row, kd, dst);
                                else
                                    V::template dots<P, NG>(qs, row, kd, dst);
                            });
                    }
                }
                for (long kvh = 0; kvh < hkv; ++kvh) {
                    const __m256 sc =
                        _mm256_mul_ps(_mm256_set1_ps(a.m.attention_scale), _mm256_loadu_ps(scales + kvh * 8));
                    for (long tt = 0; tt < it.qn; ++tt)
                        for (long g = 0; g < group; ++g) {
                            const long h = kvh * group + g;
                            _mm256_storeu_ps(w.scores.data() + (tt * hq + h) * it.ns + (first - it.lo) + j0,
                                             _mm256_mul_ps(attention::hsum8_rows(folded + (tt * hq + h) * 64), sc));
                        }
                }
            }
        },
        kKeyAhead);
}

template <class P, class V>
void value_pass_stream(const AttendCall& a, const Item& it, Worker& w) {
    const long hq = a.m.num_heads, hkv = a.m.num_kv_heads, d = a.m.head_dim, group = hq / hkv;
    const auto* pages = static_cast<const typename P::T*>(a.L.v_cache);
    const long row_bytes = P::row_size(d) * static_cast<long>(sizeof(typename P::T));
    for_each_row_block<P>(
        a, it, pages, w,
        [&](long first, long count) {
            for (long kvh = 0; kvh < hkv; ++kvh) {
                const char*
                    ahead[kRowBlock];  // this head's row kValueAhead positions on, fetched by the first head tile
                for (long j = 0; j < count; ++j)
                    ahead[j] = w.ahead[j] < 0
                                   ? nullptr
                                   : reinterpret_cast<const char*>(pages) + (w.ahead[j] * hkv + kvh) * row_bytes;
                WideRow<P> rows[kRowBlock];
                for (long j = 0; j < count; ++j)
                    rows[j] = wide_row_at<P>(a, pages, a.L.v_scale, a.v_side, w.slots[j], kvh, w.tile.data() + j * d,
                                             w.row_scales[j]);
                for (long tt = 0; tt < it.qn; ++tt)
                    for_each_head_tile(group, [&](long g0, auto ng) {
                        constexpr int NG = decltype(ng)::value;
                        const long h0 = kvh * group + g0;
                        const float* ps[NG];
                        float* accs[NG];
                        for (int g = 0; g < NG; ++g) {
                            ps[g] = w.scores.data() + (tt * hq + h0 + g) * it.ns + (first - it.lo);
                            if (P::SCALED) {
                                float* scaled = w.weights.data() + g * kRowBlock;
                                for (long j = 0; j < count; ++j) scaled[j] = ps[g][j] * w.row_scales[j];
                                ps[g] = scaled;
                            }
                            accs[g] = a.acc + (((it.t0 + tt) * hq + h0 + g) * a.chunks + it.c) * d;
                        }
                        V::template weighted<P, NG>(ps, rows, count, d, accs, tt == 0 && g0 == 0 ? ahead : nullptr,
                                                    row_bytes);
                    });
            }
        },
        kValueAhead);
}

using Pass = void (*)(const AttendCall&, const Item&, Worker&);

struct Passes {  // the passes of one call's key and value page types, chosen once per call
    Pass keys = nullptr, values = nullptr;
    long query_size = 0;  // > 0: the key pass scores queries transformed by `prepare` to this width
    void (*prepare)(const CodePagesDesc&, const float*, long, long, float*) = nullptr;
    void (*finish)(const CodePagesDesc&, float*, long, long) = nullptr;  // non-null: values turned back after
};

// The passes of key page type k_dtype and value page type v_dtype; false if either has no pages the attention
// reads here, or head_dim d does not fit them (a multiple of P::ALIGN, at most P::MAX_DIM).
bool passes(int k_dtype, int v_dtype, long d, Passes& ps) {
    bool fit = d > 0;
    auto fits = [&](auto p) { fit = fit && d % decltype(p)::ALIGN == 0 && d <= decltype(p)::MAX_DIM; };
    const bool known = with_attention_pages(k_dtype,
                                            [&](auto p) {
                                                using P = decltype(p);
                                                fits(p);
                                                if constexpr (P::QUERY)
                                                    ps.query_size = P::query_size(d), ps.prepare = &prepare_queries<P>;
                                                const long kd = ps.query_size ? ps.query_size : d;
                                                if constexpr (P::ON_CODES) {
                                                    ps.keys = &key_pass_on_codes<P>;
                                                } else if (kd % 8 == 0) {
                                                    ps.keys = &key_pass_stream<P, Lanes8>;
#if BD_AVX512
                                                    if (kd % 16 == 0) ps.keys = &key_pass_stream<P, Lanes16>;
#endif
                                                }
                                            }) &&
                       with_attention_pages(v_dtype, [&](auto p) {
                           using P = decltype(p);
                           fits(p);
                           if constexpr (!P::ON_CODES) {  // codes scored as keys are not values
                               if (d % 8 == 0) ps.values = &value_pass_stream<P, Lanes8>;
#if BD_AVX512
                               if (d % 16 == 0) ps.values = &value_pass_stream<P, Lanes16>;
#endif
                           }
                           if constexpr (P::FINISH) ps.finish = &finish_values<P>;
                       });
    return known && fit && ps.keys && ps.values;
}

void attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T, const int64_t* positions,
            const int64_t* token_rows, const int64_t* block_tables, long bt_stride, long block_size, Scratch& s,
            const Passes& ps, const CodePagesDesc* k_side = nullptr, const CodePagesDesc* v_side = nullptr) {
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
    long longest;
    const long chunks = attention::context_chunks(nt, ntiles, positions, T, &longest);
    const long chunk_len = (longest + chunks - 1) / chunks;
    std::vector<float>& acc = s.chunk_acc;  // the caller's buffers: the pool's threads write into them
    std::vector<Partial>& parts = s.chunk_parts;
    acc.resize(T * hq * chunks * d);
    parts.resize(T * hq * chunks);
    long kd = d;  // the key pass's query width
    if (ps.prepare) {
        kd = ps.query_size;
        s.kq.resize(T * hq * kd);
        ps.prepare(*k_side, q, T * hq, d, s.kq.data());
        q = s.kq.data();
    }
    const AttendCall call{m, L, q, kd, chunks, block_size, acc.data(), k_side, v_side};
    auto window_start = [&](long pos) { return L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0L; };
    std::atomic<long> next_item{0};
    parallel_run([&](int, int) {
        Worker w;
        w.tile.resize(kRowBlock * m.num_kv_heads *
                      (kd > d ? kd : d));  // the streaming key pass: 8 positions × hkv rows
        w.folded.resize(kQueryTile * hq * 64);
        w.key_scales.resize(m.num_kv_heads * 8);
        w.weights.resize(kRowBlock * kGroupTile);  // per head of a tile of heads (the streaming value pass)
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
            ps.keys(call, it, w);
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
            ps.values(call, it, w);
        }
    });
    for (long th = 0; th < T * hq; ++th)  // merge the chunks of each (token, head)
        attention::merge_chunks(parts.data() + th * chunks, acc.data() + th * chunks * d, chunks, d, out + th * d);
    if (ps.finish) ps.finish(*v_side, out, T * hq, d);
}

// Row idx (slot · hkv + head) of pages of type page_type ← x (d floats), and its fp16 scale for int8/fp8.
void write_row(int page_type, const float* x, long d, void* pages, void* scales, long idx) {
    with_pages(page_type, [&](auto p) {
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

// Whether the decode step reads and writes layer L's pages (else it must do no work): TurboQuant on either side
// (the MSE codes: the step writes no inner-product signs), or row or block pages on both sides that the attention
// passes read at this head_dim, with their scales where the type keeps them. ps: the passes of the latter.
Status step_pages(const ModelDesc& m, const LayerDesc& L, Passes& ps) {
    const bool tq_k = L.k_dtype == kTurboQuantPages, tq_v = L.v_dtype == kTurboQuantPages;
    if ((tq_k && !L.k_tq) || (tq_v && !L.v_tq)) return Status::MISSING_PAGES;
    if (tq_k || tq_v) {
        for (const TQPagesDesc* pg : {tq_k ? L.k_tq : nullptr, tq_v ? L.v_tq : nullptr})
            for (int i = 0; pg && i < pg->num_parts && i < 2; ++i)
                if (pg->parts[i].signs) return Status::UNSUPPORTED_PAGES;
        return turboquant_reads(m, L) ? Status::OK : Status::UNSUPPORTED_PAGES;
    }
    if (has_side_data(L.k_dtype) || has_side_data(L.v_dtype) || !passes(L.k_dtype, L.v_dtype, m.head_dim, ps))
        return Status::UNSUPPORTED_PAGES;
    bool scales = true;
    with_pages(L.k_dtype, [&](auto p) { scales = scales && (!decltype(p)::SCALED || L.k_scale); });
    with_pages(L.v_dtype, [&](auto p) { scales = scales && (!decltype(p)::SCALED || L.v_scale); });
    return L.k_cache && L.v_cache && scales ? Status::OK : Status::MISSING_PAGES;
}

// One layer of the step; its pages passed step_pages (bd_decode_step checks every layer before any work).
void layer_step(const ModelDesc& m, const LayerDesc& L, float* x, long T, const int64_t* positions,
                const int64_t* slots, const int64_t* token_rows, const int64_t* block_tables, long bt_stride,
                long block_size, Scratch& s) {
    const long H = m.hidden, hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim, I = m.intermediate;
    s.h.resize(T * H);
    s.q.resize(T * hq * d);
    s.k.resize(T * hkv * d);
    s.v.resize(T * hkv * d);
    s.att.resize(T * hq * d);
    s.o.resize(T * H);
    s.gate.resize(T * I);
    s.up.resize(T * I);
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
        const float* vt = s.v.data() + t * hkv * d;
        if (L.k_dtype == kTurboQuantPages) turboquant_write(*L.k_tq, kt, slots[t], positions[t], hkv, d);
        if (L.v_dtype == kTurboQuantPages) turboquant_write(*L.v_tq, vt, slots[t], positions[t], hkv, d);
        for (long h = 0; h < hkv; ++h) {
            const long idx = slots[t] * hkv + h;
            if (L.k_dtype != kTurboQuantPages) write_row(L.k_dtype, kt + h * d, d, L.k_cache, L.k_scale, idx);
            if (L.v_dtype != kTurboQuantPages) write_row(L.v_dtype, vt + h * d, d, L.v_cache, L.v_scale, idx);
        }
    }
    Passes ps;
    step_pages(m, L, ps);
    if (L.k_dtype == kTurboQuantPages || L.v_dtype == kTurboQuantPages)  // either side (row pages beside)
        turboquant_attend(m, L, s.q.data(), s.att.data(), T, positions, token_rows, block_tables, bt_stride,
                          block_size);
    else
        attend(m, L, s.q.data(), s.att.data(), T, positions, token_rows, block_tables, bt_stride, block_size, s, ps);
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
    if (m.gelu)  // vectorised, not a libm tanh per element (bench/RESULTS.md, Recording 5)
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
// full causal; code pages (code_pages.h) with their side data k_side / v_side (bd::CodePagesDesc, else null).
// Returns 0, -1 for a page type the attention does not read, a head_dim it does not fit, or missing side data.
int bd_paged_attention(int k_dtype, int v_dtype, const float* q, float* out, long T, long hq, long hkv, long d,
                       float scale, long window, const int64_t* positions, const int64_t* token_rows,
                       const int64_t* block_tables, long bt_stride, long block_size, void* k_pages, void* v_pages,
                       void* k_scale, void* v_scale, const void* k_side, const void* v_side) {
    bd::Passes ps;
    if (hkv <= 0 || hq % hkv || !bd::passes(k_dtype, v_dtype, d, ps)) return -1;
    if ((bd::has_side_data(k_dtype) && !k_side) || (bd::has_side_data(v_dtype) && !v_side)) return -1;
    static thread_local bd::Scratch scratch;
    bd::ModelDesc m{};
    m.num_heads = hq, m.num_kv_heads = hkv, m.head_dim = d, m.attention_scale = scale;
    bd::LayerDesc L{};
    L.k_cache = k_pages, L.v_cache = v_pages, L.k_scale = k_scale, L.v_scale = v_scale, L.window = window;
    bd::attend(m, L, q, out, T, positions, token_rows, block_tables, bt_stride, block_size, scratch, ps,
               static_cast<const bd::CodePagesDesc*>(k_side), static_cast<const bd::CodePagesDesc*>(v_side));
    return 0;
}

// rows KV page rows of page_type ((rows, row_size(d)), and their fp16 scales for int8/fp8) → out (rows, d) float32,
// as the attention reads them. d a multiple of 8 (of 32 for block pages). Returns 0, -1 for a page type without
// row pages or a d they do not fit.
int bd_read_kv_rows(int page_type, const void* pages, const void* scales, long rows, long d, float* out) {
    bd::Passes ps;
    if (bd::has_side_data(page_type) || !bd::passes(page_type, page_type, d, ps)) return -1;
    bd::with_pages(page_type, [&](auto p) {
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

// x (rows, d) float32 → rows KV page rows of page_type (rows, row_size(d)), and for int8/fp8 their fp16 scales
// (rows): the decode step's write of a new token's keys or values. Returns 0, -1 as bd_read_kv_rows.
int bd_write_kv_rows(int page_type, const float* x, long rows, long d, void* pages, void* scales) {
    bd::Passes ps;
    if (bd::has_side_data(page_type) || !bd::passes(page_type, page_type, d, ps)) return -1;
    for (long i = 0; i < rows; ++i) bd::write_row(page_type, x + i * d, d, pages, scales, i);
    return 0;
}

// x: (T, hidden) float32 embeddings in, hidden states after the last layer out (before the final norm).
// Token t is a new token of a sequence: positions[t], slots[t] (its cache slot), block table row token_rows[t]
// (null: row t; bt_stride entries) of its pages. A verifying sequence's rows (its last token and its drafts, at
// consecutive positions of one table row) attend as one query tile: its context is read once, not once a row.
// Returns Status::OK, or (having done no work: x and the pages untouched) UNSUPPORTED_PAGES / MISSING_PAGES for a
// layer whose pages the step cannot read and write (step_pages).
int bd_decode_step(const bd::ModelDesc* m, float* x, long T, const int64_t* positions, const int64_t* slots,
                   const int64_t* token_rows, const int64_t* block_tables, long bt_stride, long block_size) {
    for (long l = 0; l < m->num_layers; ++l) {
        bd::Passes ps;
        const bd::Status st = bd::step_pages(*m, m->layers[l], ps);
        if (st != bd::Status::OK) return bd::id(st);
    }
    static thread_local bd::Scratch scratch;
    for (long l = 0; l < m->num_layers; ++l)
        bd::layer_step(*m, m->layers[l], x, T, positions, slots, token_rows, block_tables, bt_stride, block_size,
                       scratch);
    return 0;
}
}
