// TurboQuant pages in the native decode step (see turboquant_pages.h): the write of a new token and
// flash-decoding attention on the codes, with the work split of decoder.cpp's attend (attention::context_chunks):
// work items are (token, KV head, context chunk); an item scores the chunk's keys for all the query heads of
// its GQA group from codes unpacked in registers (8 codes: one broadcast word, a variable shift and a mask;
// centroids by an in-register permute for b ≤ 4, a gather above), keeps a partial (max, Σexp, Σexp·norm·c)
// per head in rotated coordinates, and a final pass merges the chunks and rotates back once per head.
#include "turboquant_pages.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "decoder.h"
#include "isa.h"
#include "kv_pages.h"
#include "threadpool.h"

namespace bd {
namespace {

constexpr long kMaxHeadDim = 512;
constexpr long kMaxGroup = 64;  // query heads per KV head (checked on the Python side)

using attention::axpy;
using attention::dot;
using attention::for_each_slot;
using attention::Partial;

// 8 codes of B ≤ 4 bits in the low 8·B bits of the 32-bit little-endian word w.
template <int B>
inline __m256i codes8_word(uint32_t w) {
    const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                            _mm256_set1_epi32((1 << B) - 1));
}

// The 8 codes of one word (B bytes of the stream) → 8 int32 lanes.
template <int B>
inline __m256i codes8(const uint8_t* p) {
    if constexpr (B == 8) {
        return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    } else if constexpr (B <= 4) {
        uint32_t w = 0;
        std::memcpy(&w, p, B);
        return codes8_word<B>(w);
    } else {  // 5–7 bits: 40–56 bits per word, shifted as four 64-bit lanes twice
        uint64_t w = 0;
        std::memcpy(&w, p, B);
        const __m256i all = _mm256_set1_epi64x(static_cast<long long>(w));
        const __m256i lo = _mm256_srlv_epi64(all, _mm256_setr_epi64x(0, B, 2 * B, 3 * B));
        const __m256i hi = _mm256_srlv_epi64(all, _mm256_setr_epi64x(4 * B, 5 * B, 6 * B, 7 * B));
        const __m256i even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6);
        const __m256i c =
            _mm256_blend_epi32(_mm256_permutevar8x32_epi32(lo, even), _mm256_permutevar8x32_epi32(hi, even), 0xF0);
        return _mm256_and_si256(c, _mm256_set1_epi32((1 << B) - 1));
    }
}

// Word w of a row of `row` bytes (B ≤ 4): one 4-byte load, at the word or, near the row's end, the row's last 4
// bytes shifted down — assembling the last B bytes in memory stalled every row on a failed store-to-load forward.
template <int B>
inline __m256i row_codes8(const uint8_t* codes, long w, long row) {
    if constexpr (B <= 4) {
        uint32_t word;
        if (w * B + 4 <= row) {
            std::memcpy(&word, codes + w * B, 4);
            return codes8_word<B>(word);
        }
        if (row >= 4) {
            std::memcpy(&word, codes + row - 4, 4);
            return codes8_word<B>(word >> (8 * (w * B - (row - 4))));
        }
    }
    return codes8<B>(codes + w * B);
}

// Codes → centroids: one permute for ≤ 8 centroids, two and a blend on bit 3 for 16, a gather above.
template <int B>
struct Centroids {
    __m256 lo, hi;
    const float* table;
    explicit Centroids(const float* cb) : table(cb) {
        alignas(32) float t[16] = {0};
        for (int i = 0; i < (1 << B) && i < 16; ++i) t[i] = cb[i];
        lo = _mm256_load_ps(t);
        hi = _mm256_load_ps(t + 8);
    }
    __m256 operator()(__m256i c) const {
        if constexpr (B <= 3) {
            return _mm256_permutevar8x32_ps(lo, c);
        } else if constexpr (B == 4) {
            return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, c), _mm256_permutevar8x32_ps(hi, c),
                                    _mm256_castsi256_ps(_mm256_slli_epi32(c, 28)));
        } else {
            return _mm256_i32gather_ps(table, c, 4);
        }
    }
};

template <class Fn>
void with_bits(int bits, Fn fn) {
    switch (bits) {
        case 1: fn(std::integral_constant<int, 1>{}); break;
        case 2: fn(std::integral_constant<int, 2>{}); break;
        case 3: fn(std::integral_constant<int, 3>{}); break;
        case 4: fn(std::integral_constant<int, 4>{}); break;
        case 5: fn(std::integral_constant<int, 5>{}); break;
        case 6: fn(std::integral_constant<int, 6>{}); break;
        case 7: fn(std::integral_constant<int, 7>{}); break;
        default: fn(std::integral_constant<int, 8>{}); break;
    }
}

// The chunk [lo, hi) of one sequence and KV head, for the `group` query heads that read it.
struct Span {
    const int64_t* table;
    long block_size, lo, hi, hkv, kvh, group;
};

// scores (group, n) += ‖k_p‖ · ((R_p q)·c[idx] + √(π/2)/d_p · ‖r‖ · (S_p R_p q)·sign) for part P (the sign term: inner-
// product keys only), whose rotated query coordinates start at `off` of each (group, qw) row of qr and sketched ones
// at `off` + d. G: the group size when known at compile time (accumulators in registers), else 0.
// Each position's products stay unreduced (folded to 8 lanes: (group, 8 positions, 8 lanes)) until 8 positions
// are in, then one hsum8 per head gives their 8 scores — a horizontal sum per position and head was a third of the
// score pass. scores (group, n) += norm · Σ lanes.
template <int G>
struct ScoreFold {
    alignas(32) float folded[(G ? G : kMaxGroup) * 64];
    alignas(32) float norms[8];
    long group, n, lo, first = 0, j = 0;
    float* scores;

    ScoreFold(long group_, long n_, long lo_, float* scores_) : group(group_), n(n_), lo(lo_), scores(scores_) {}
    void add(long p, float norm, const __m256* acc) {  // acc: (group) the position's folded products
        if (j == 0) first = p;
        norms[j] = norm;
        for (long g = 0; g < group; ++g) _mm256_store_ps(folded + g * 64 + 8 * j, acc[g]);
        if (++j == 8) flush();
    }
    void flush() {
        for (long i = j; i < 8; ++i) {  // a last, partial group of positions
            norms[i] = 0.0f;
            for (long g = 0; g < group; ++g) _mm256_store_ps(folded + g * 64 + 8 * i, _mm256_setzero_ps());
        }
        const __m256 nv = _mm256_load_ps(norms);
        for (long g = 0; g < group; ++g) {
            alignas(32) float lanes[8];
            _mm256_store_ps(lanes, _mm256_mul_ps(nv, attention::hsum8_rows(folded + g * 64)));
            float* out = scores + g * n + (first - lo);
            for (long i = 0; i < j; ++i) out[i] += lanes[i];
        }
        j = 0;
    }
};

// Where the passes read a row: CodeRows<B>, part P's codes as centroids (in registers) with the row's norm as its
// scale; PageRows<PG>, row or block pages of kv_pages.h with their row scale (int8, fp8) or 1 — the other side of
// a layer whose keys or values only are TurboQuant's (an auto:<bits> plan's k=q5_0,v=turboquant4), read as it is
// stored (no rotation). words: 8-coordinate words a row; load(row, w): coordinates 8w … 8w + 7 as floats. The passes
// build their reader as a const local from its descriptor (TQPartDesc, RowPagesDesc): one built by the caller and
// passed in kept the centroids in memory, not registers (TurboQuant 3.5 at 8k: 0.26 → 0.36 ms a layer).
template <int B>
struct CodeRows {
    const uint8_t* idx;
    const uint16_t* norm;
    long row, words;
    Centroids<B> cb;
    CodeRows(const TQPartDesc& P, long)
        : idx(P.idx), norm(P.norm), row(P.dim * B / 8), words(P.dim / 8), cb(P.codebook) {}
    const uint8_t* at(long r) const { return idx + r * row; }
    float scale(long r) const { return _cvtsh_ss(norm[r]); }
    __m256 load(const uint8_t* codes, long w) const { return cb(row_codes8<B>(codes, w, row)); }
};

struct RowPagesDesc {  // row or block pages (kv_pages.h) and their row scales (int8, fp8), or null
    const void* pages;
    const void* scales;
};

// The part whose QJL residual (inner-product keys) the score pass adds, or null: from a reader's descriptor.
inline const TQPartDesc* residual_part(const TQPartDesc& P) { return P.signs ? &P : nullptr; }
inline const TQPartDesc* residual_part(const RowPagesDesc&) { return nullptr; }

template <class PG>
struct PageRows {
    const typename PG::T* pages;
    const void* scales;
    long rs, words;
    PageRows(const RowPagesDesc& p, long d)
        : pages(static_cast<const typename PG::T*>(p.pages)), scales(p.scales), rs(PG::row_size(d)), words(d / 8) {}
    const typename PG::T* at(long r) const { return pages + r * rs; }
    float scale(long r) const { return PG::SCALED ? row_scale(scales, r) : 1.0f; }
    __m256 load(const typename PG::T* row, long w) const { return PG::load8(row, 8 * w); }
};

// scores (group, n) += scale · (q·row) over the rows R reads, the query coordinates at `off` of each (group, qw)
// row of qr; for TurboQuant inner-product keys (a part with signs) plus √(π/2)/d_p · ‖r‖ · (S_p R_p q)·sign, the
// sketched coordinates at `off` + d. G: the group size when known at compile time (accumulators in registers).
template <int G, class Rows, class Desc>
void rows_scores(const Desc& desc, long off, const float* qr, long qw, long d, const Span& s, float* scores) {
    const Rows R(desc, d);
    const long words = R.words, group = G ? G : s.group;
    const TQPartDesc* P = residual_part(desc);
    const bool signs = P != nullptr;
    const float coef = P ? static_cast<float>(std::sqrt(M_PI / 2) / static_cast<double>(P->dim)) : 0.0f;
    ScoreFold<G> fold(group, s.hi - s.lo, s.lo, scores);
    for_each_slot(s.table, s.block_size, s.lo, s.hi, [&](long p, long slot) {
        const long r = slot * s.hkv + s.kvh;
        const auto* row = R.at(r);
        __m256 acc[G ? G : kMaxGroup];
        for (long g = 0; g < group; ++g) acc[g] = _mm256_setzero_ps();
        for (long w = 0; w < words; ++w) {
            const __m256 c = R.load(row, w);
            for (long g = 0; g < group; ++g)
                acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qr + g * qw + off + 8 * w), c, acc[g]);
        }
        if (signs) {  // the residual's QJL term: a sign-flipped sum of the sketched query, added to the fold
            const uint8_t* sg = P->signs + r * words;
            const __m256 rn = _mm256_set1_ps(coef * _cvtsh_ss(P->res_norm[r]));
            for (long g = 0; g < group; ++g) {
                __m256 a = _mm256_setzero_ps();
                for (long w = 0; w < words; ++w)
                    a = _mm256_add_ps(a, attention::signed8(_mm256_loadu_ps(qr + g * qw + d + off + 8 * w), sg[w]));
                acc[g] = _mm256_add_ps(acc[g], _mm256_mul_ps(rn, a));
            }
        }
        fold.add(p, R.scale(r), acc);
    });
    if (fold.j) fold.flush();
}

// fn(row, wg) for each position of the span: the row as R reads it and, per head g, its softmax weight times the
// row's scale (TurboQuant: its norm), broadcast (wg[g]).
template <int G, class Rows, class Fn>
inline void for_each_weighted_row(const Rows& R, const float* probs, const Span& s, long group, Fn fn) {
    const long n = s.hi - s.lo;
    for_each_slot(s.table, s.block_size, s.lo, s.hi, [&](long p, long slot) {
        const long r = slot * s.hkv + s.kvh;
        const float scale = R.scale(r);
        __m256 wg[G ? G : kMaxGroup];
        for (long g = 0; g < group; ++g) wg[g] = _mm256_set1_ps(probs[g * n + (p - s.lo)] * scale);
        fn(R.at(r), wg);
    });
}

// acc[g][off …] += p_g · scale · row over the rows R reads (TurboQuant part P: ‖v_p‖ · c[idx], the values summed in
// rotated coordinates; row pages: as stored). With the group known at compile time, WP words (8 coordinates each)
// at a time in registers over all positions, the codes of the other words re-read from L1 on the next sweep —
// accumulating in memory cost a load and a store per multiply-add.
template <int G, class Rows, class Desc>
void rows_values(const Desc& desc, long d, long off, const float* probs, const Span& s, float* const* acc) {
    const Rows R(desc, d);
    const long words = R.words, group = G ? G : s.group;
    if constexpr (G > 0) {
        constexpr long WP = G <= 3 ? 4 : (G <= 6 ? 2 : 1);  // at most 12 accumulators (16 ymm registers)
        for (long w0 = 0; w0 < words; w0 += WP) {
            const long nw = words - w0 < WP ? words - w0 : WP;
            __m256 a[G][WP];
            for (int g = 0; g < G; ++g)
                for (long w = 0; w < WP; ++w)
                    a[g][w] = w < nw ? _mm256_loadu_ps(acc[g] + off + 8 * (w0 + w)) : _mm256_setzero_ps();
            for_each_weighted_row<G>(R, probs, s, G, [&](const auto* row, const __m256* wg) {
#pragma GCC unroll 4
                for (long w = 0; w < WP; ++w) {
                    if (w >= nw) break;
                    const __m256 c = R.load(row, w0 + w);
#pragma GCC unroll 8
                    for (int g = 0; g < G; ++g) a[g][w] = _mm256_fmadd_ps(wg[g], c, a[g][w]);
                }
            });
            for (int g = 0; g < G; ++g)
                for (long w = 0; w < nw; ++w) _mm256_storeu_ps(acc[g] + off + 8 * (w0 + w), a[g][w]);
        }
    } else {
        for_each_weighted_row<G>(R, probs, s, group, [&](const auto* row, const __m256* wg) {
            for (long w = 0; w < words; ++w) {
                const __m256 c = R.load(row, w);
                for (long g = 0; g < group; ++g) {
                    float* a = acc[g] + off + 8 * w;
                    _mm256_storeu_ps(a, _mm256_fmadd_ps(wg[g], c, _mm256_loadu_ps(a)));
                }
            }
        });
    }
}

// fn(bits, group) with both as compile-time constants for the common cases: widths 1–4 (the uncalibrated layouts
// and most parts) × GQA groups 1–8; wider outlier parts and larger groups take the runtime group (G = 0).
template <class Fn>
void with_group(long group, Fn fn) {
    switch (group) {
        case 1: fn(std::integral_constant<int, 1>{}); return;
        case 2: fn(std::integral_constant<int, 2>{}); return;
        case 3: fn(std::integral_constant<int, 3>{}); return;
        case 4: fn(std::integral_constant<int, 4>{}); return;
        case 6: fn(std::integral_constant<int, 6>{}); return;
        case 8: fn(std::integral_constant<int, 8>{}); return;
        default: fn(std::integral_constant<int, 0>{});
    }
}

template <class Fn>
void with_kernel(int bits, long group, Fn fn) {
    with_bits(bits, [&](auto b) {
        if constexpr (decltype(b)::value <= 4)
            with_group(group, [&](auto g) { fn(b, g); });
        else
            fn(b, std::integral_constant<int, 0>{});
    });
}

template <class T>
struct TypeTag {  // a type handed to a generic lambda: TypeTag<T>::type
    using type = T;
};

// fn(TypeTag<PageRows<PG>>, group) for the row or block pages of page_type (the group as with_group gives it).
template <class Fn>
void with_page_rows(int page_type, long group, Fn fn) {
    with_pages(page_type,
               [&](auto pg) { with_group(group, [&](auto g) { fn(TypeTag<PageRows<decltype(pg)>>{}, g); }); });
}

// A query head's q (d,) in the key pages' coordinates: channel order, then per part y_p = R_p · q_p, and for
// inner-product keys their sketch S_p y_p at y + d + offset.
void rotate_query(const TQPagesDesc& K, long kvh, const float* q, float* y, long d) {
    float qc[kMaxHeadDim];
    const int64_t* ch = K.channels ? K.channels + kvh * d : nullptr;
    for (long k = 0; k < d; ++k) qc[k] = q[ch ? ch[k] : k];
    long off = 0;
    for (int i = 0; i < K.num_parts; ++i) {
        const TQPartDesc& P = K.parts[i];
        for (long r = 0; r < P.dim; ++r) y[off + r] = dot(P.rotation + r * P.dim, qc + off, P.dim);
        if (P.signs)
            for (long r = 0; r < P.dim; ++r) y[d + off + r] = dot(P.sketch + r * P.dim, y + off, P.dim);
        off += P.dim;
    }
}

// The merged output in the value pages' rotated coordinates → (d,): per part a_p · R_p, channels put back,
// plus the mean (the softmax weights sum to one).
void rotate_back(const TQPagesDesc& V, long kvh, const float* a, float* out, long d) {
    float t[kMaxHeadDim] = {0};
    long off = 0;
    for (int i = 0; i < V.num_parts; ++i) {
        const TQPartDesc& P = V.parts[i];
        for (long r = 0; r < P.dim; ++r) axpy(a[off + r], P.rotation + r * P.dim, t + off, P.dim);
        off += P.dim;
    }
    const int64_t* ch = V.channels ? V.channels + kvh * d : nullptr;
    const float* mu = V.mean ? V.mean + kvh * d : nullptr;
    for (long k = 0; k < d; ++k) {
        const long c = ch ? ch[k] : k;
        out[c] = t[k] + (mu ? mu[c] : 0.0f);
    }
}

// RoPE(μ, p) of a pre-RoPE mean μ (d,) at position p → r (d,): rotate-half, angles p·θ_i in float32 as the model's
// RotaryEmbedding computes them.
void rotated_mean(const float* mu, const float* inv_freq, long pos, long d, float* r) {
    const long half = d / 2;
    for (long i = 0; i < half; ++i) {
        const float a = static_cast<float>(pos) * inv_freq[i], c = std::cos(a), s = std::sin(a);
        r[i] = mu[i] * c - mu[i + half] * s;
        r[i + half] = mu[i + half] * c + mu[i] * s;
    }
}

constexpr long kRopeAnchor = 32;  // positions between exact cos/sin; the angle-addition recurrence in between

// scores (group, n) += q_g·RoPE(μ, p) for the keys at positions lo … lo + n − 1 (the span's positions): with
// a = q1 μ1 + q2 μ2 and b = q2 μ1 − q1 μ2 per query head (group, d/2), the term is Σ_i a_i cos(p θ_i) + b_i sin(p θ_i).
// cos/sin of p θ_i are exact every kRopeAnchor positions and advanced by one rotation of θ_i in between.
void rope_mean_scores(const float* a, const float* b, long group, long half, const float* inv_freq, long lo, long n,
                      float* scores) {
    alignas(32) float c[kMaxHeadDim / 2], s[kMaxHeadDim / 2], dc[kMaxHeadDim / 2], ds[kMaxHeadDim / 2];
    for (long i = 0; i < half; ++i) {
        dc[i] = std::cos(inv_freq[i]);
        ds[i] = std::sin(inv_freq[i]);
    }
    for (long j = 0; j < n; ++j) {
        if (j % kRopeAnchor == 0) {
            for (long i = 0; i < half; ++i) {
                const float ang = static_cast<float>(lo + j) * inv_freq[i];
                c[i] = std::cos(ang);
                s[i] = std::sin(ang);
            }
        }
        for (long g = 0; g < group; ++g) scores[g * n + j] += dot(a + g * half, c, half) + dot(b + g * half, s, half);
        long i = 0;
        for (; i + 8 <= half; i += 8) {  // (c, s) ← (c·dc − s·ds, s·dc + c·ds): one more position
            const __m256 cv = _mm256_load_ps(c + i), sv = _mm256_load_ps(s + i);
            const __m256 dcv = _mm256_load_ps(dc + i), dsv = _mm256_load_ps(ds + i);
            _mm256_store_ps(c + i, _mm256_fmsub_ps(cv, dcv, _mm256_mul_ps(sv, dsv)));
            _mm256_store_ps(s + i, _mm256_fmadd_ps(sv, dcv, _mm256_mul_ps(cv, dsv)));
        }
        for (; i < half; ++i) {
            const float cn = c[i] * dc[i] - s[i] * ds[i];
            s[i] = s[i] * dc[i] + c[i] * ds[i];
            c[i] = cn;
        }
    }
}

// Softmax numerators of one head's scores in place, after the attention scale → (max, Σ exp).
Partial softmax_row(float* sg, long n, float scale) {
    for (long i = 0; i < n; ++i) sg[i] *= scale;
    return attention::softmax_span(sg, 0, n, n);
}

}  // namespace

void turboquant_write(const TQPagesDesc& pg, const float* x, long slot, long pos, long num_heads, long d) {
    float xc[kMaxHeadDim], xn[kMaxHeadDim], bounds[256], centred[kMaxHeadDim];
    for (long h = 0; h < num_heads; ++h) {
        const float* xh = x + h * d;
        if (pg.rope_mean) {  // keys calibrated with a pre-RoPE mean: x − RoPE(μ, p)
            rotated_mean(pg.rope_mean + h * d, pg.inv_freq, pos, d, centred);
            for (long k = 0; k < d; ++k) centred[k] = xh[k] - centred[k];
            xh = centred;
        }
        const int64_t* ch = pg.channels ? pg.channels + h * d : nullptr;
        const float* mu = pg.mean ? pg.mean + h * d : nullptr;
        for (long k = 0; k < d; ++k) {
            const long c = ch ? ch[k] : k;
            xc[k] = mu ? xh[c] - mu[c] : xh[c];
        }
        long off = 0;
        for (int i = 0; i < pg.num_parts; ++i) {
            const TQPartDesc& P = pg.parts[i];
            const long dp = P.dim, bits = P.bits, levels = 1L << bits;
            float ss = 0.0f;
            for (long j = 0; j < dp; ++j) ss += xc[off + j] * xc[off + j];
            const float nrm = std::sqrt(ss), den = nrm > 1e-12f ? nrm : 1e-12f;
            for (long j = 0; j < dp; ++j) xn[j] = xc[off + j] / den;
            for (long k = 0; k + 1 < levels; ++k) bounds[k] = (P.codebook[k + 1] + P.codebook[k]) / 2.0f;
            uint8_t* dst = P.idx + (slot * num_heads + h) * (dp * bits / 8);
            for (long w = 0; w < dp / 8; ++w) {
                uint64_t word = 0;
                for (long j = 0; j < 8; ++j) {
                    const float u = dot(P.rotation + (8 * w + j) * dp, xn, dp);
                    // the nearest centroid: the number of cell boundaries strictly below u (torch.bucketize)
                    const uint64_t code =
                        static_cast<uint64_t>(std::lower_bound(bounds, bounds + levels - 1, u) - bounds);
                    word |= code << (j * bits);
                }
                std::memcpy(dst + w * bits, &word, bits);  // little-endian: code j in bits j·b … j·b + b − 1
            }
            P.norm[slot * num_heads + h] = _cvtss_sh(nrm, _MM_FROUND_TO_NEAREST_INT);
            off += dp;
        }
    }
}

// The key pass of one item: the scores (group, n) of its token's query heads sharing KV head kvh over the span's n
// positions from lo — on TurboQuant codes (K, the queries qg rotated, qw floats a row), plus the pre-RoPE mean's
// share, or on the row or block key pages beside them (K null).
[[gnu::always_inline]] inline void tq_key_pass(const ModelDesc& m, const LayerDesc& L, const TQPagesDesc* K,
                                               const float* q, const float* qg, long qw, long tok, long kvh,
                                               const Span& span, long lo, long n, float* scores,
                                               std::vector<float>& rope_terms) {
    const long hq = m.num_heads, d = m.head_dim, group = hq / m.num_kv_heads;
    if (K && K->rope_mean && n > 0) {  // the pre-RoPE mean's share of each score, at each key's position
        const long half = d / 2;
        const float* mu = K->rope_mean + kvh * d;
        rope_terms.resize(2 * group * half);
        float* a = rope_terms.data();
        float* bq = a + group * half;
        for (long g = 0; g < group; ++g) {
            const float* qh = q + (tok * hq + kvh * group + g) * d;
            for (long i = 0; i < half; ++i) {
                a[g * half + i] = qh[i] * mu[i] + qh[i + half] * mu[i + half];
                bq[g * half + i] = qh[i + half] * mu[i] - qh[i] * mu[i + half];
            }
        }
        rope_mean_scores(a, bq, group, half, K->inv_freq, lo, n, scores);
    }
    long off = 0;
    for (int i = 0; K && i < K->num_parts; ++i) {
        with_kernel(K->parts[i].bits, group, [&](auto b, auto g) {
            rows_scores<decltype(g)::value, CodeRows<decltype(b)::value>>(K->parts[i], off, qg, qw, d, span, scores);
        });
        off += K->parts[i].dim;
    }
    if (!K)
        with_page_rows(L.k_dtype, group, [&](auto rows, auto g) {
            rows_scores<decltype(g)::value, typename decltype(rows)::type>(RowPagesDesc{L.k_cache, L.k_scale}, 0, qg,
                                                                           qw, d, span, scores);
        });
}

// The value pass of one item: heads[g] (d floats) += its softmax weights p (group, n) times the span's values — on
// TurboQuant codes (V: summed in rotated coordinates) or on the row or block value pages beside them (V null).
[[gnu::always_inline]] inline void tq_value_pass(const ModelDesc& m, const LayerDesc& L, const TQPagesDesc* V,
                                                 const float* p, const Span& span, float* const* heads) {
    const long d = m.head_dim, group = m.num_heads / m.num_kv_heads;
    long off = 0;
    for (int i = 0; V && i < V->num_parts; ++i) {
        with_kernel(V->parts[i].bits, group, [&](auto b, auto g) {
            rows_values<decltype(g)::value, CodeRows<decltype(b)::value>>(V->parts[i], d, off, p, span, heads);
        });
        off += V->parts[i].dim;
    }
    if (!V)
        with_page_rows(L.v_dtype, group, [&](auto rows, auto g) {
            rows_values<decltype(g)::value, typename decltype(rows)::type>(RowPagesDesc{L.v_cache, L.v_scale}, d, 0, p,
                                                                           span, heads);
        });
}

void turboquant_attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T,
                       const int64_t* positions, const int64_t* token_rows, const int64_t* block_tables, long bt_stride,
                       long block_size) {
    // TurboQuant keys, values or both (the other side row or block pages: k_dtype / v_dtype)
    const TQPagesDesc* K = L.k_dtype == kTurboQuantPages ? L.k_tq : nullptr;
    const TQPagesDesc* V = L.v_dtype == kTurboQuantPages ? L.v_tq : nullptr;
    const long hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim, group = hq / hkv;
    // the calling thread's buffers, captured by reference: the pool's threads read and write them (a
    // thread_local named inside the lambda would be each worker's own, empty, instance)
    static thread_local std::vector<float> qr_buf, acc_buf, merged;
    static thread_local std::vector<Partial> parts_buf;
    std::vector<float>& qr = qr_buf;
    std::vector<float>& acc = acc_buf;
    std::vector<Partial>& parts = parts_buf;
    bool sketched = false;  // inner-product keys: each query row holds its rotation, then its sketch
    for (int i = 0; K && i < K->num_parts; ++i) sketched = sketched || K->parts[i].signs;
    const long qw = sketched ? 2 * d : d;
    if (K) {  // the queries in the key pages' coordinates; row keys score q itself
        qr.resize(T * hq * qw);
        for (long th = 0; th < T * hq; ++th) rotate_query(*K, (th % hq) / group, q + th * d, qr.data() + th * qw, d);
    }
    const float* qk = K ? qr.data() : q;
    const int nt = num_threads();
    long longest;
    const long chunks = attention::context_chunks(nt, T * hkv, positions, T, &longest);
    const long chunk_len = (longest + chunks - 1) / chunks;
    acc.resize(T * hq * chunks * d);
    parts.resize(T * hq * chunks);
    parallel_run([&](int t, int nthreads) {
        long b, e;
        split_range(T * hkv * chunks, nthreads, t, 1, &b, &e);
        std::vector<float> scores, rope_terms;
        for (long item = b; item < e; ++item) {
            const long tok = item / (hkv * chunks), kvh = (item / chunks) % hkv, c = item % chunks;
            const long pos = positions[tok];
            const long first_pos = L.window > 0 && pos - L.window + 1 > 0 ? pos - L.window + 1 : 0;
            const long lo = c * chunk_len > first_pos ? c * chunk_len : first_pos;
            const long hi = (c + 1) * chunk_len < pos + 1 ? (c + 1) * chunk_len : pos + 1;
            const long n = hi > lo ? hi - lo : 0;
            const Span span{block_tables + (token_rows ? token_rows[tok] : tok) * bt_stride,
                            block_size,
                            lo,
                            lo + n,
                            hkv,
                            kvh,
                            group};
            const float* qg = qk + (tok * hq + kvh * group) * qw;
            scores.assign(group * n + 8, 0.0f);
            tq_key_pass(m, L, K, q, qg, qw, tok, kvh, span, lo, n, scores.data(), rope_terms);
            float* heads[kMaxGroup];
            for (long g = 0; g < group; ++g) {
                const long slot_index = (tok * hq + kvh * group + g) * chunks + c;
                parts[slot_index] = softmax_row(scores.data() + g * n, n, m.attention_scale);
                heads[g] = acc.data() + slot_index * d;
                std::fill(heads[g], heads[g] + d, 0.0f);
            }
            tq_value_pass(m, L, V, scores.data(), span, heads);
        }
    });
    merged.resize(d);
    for (long th = 0; th < T * hq; ++th) {  // merge the chunks of each (token, head), then rotate back
        attention::merge_chunks(parts.data() + th * chunks, acc.data() + th * chunks * d, chunks, d, merged.data());
        if (V)
            rotate_back(*V, (th % hq) / group, merged.data(), out + th * d, d);
        else
            std::copy(merged.begin(), merged.begin() + d, out + th * d);
    }
}

bool turboquant_reads(const ModelDesc& m, const LayerDesc& L) {
    const long hq = m.num_heads, hkv = m.num_kv_heads, d = m.head_dim;
    if (hkv <= 0 || hq % hkv || hq / hkv > kMaxGroup || d % 8 || d > kMaxHeadDim) return false;
    if (L.k_dtype != kTurboQuantPages && L.v_dtype != kTurboQuantPages) return false;  // bd_paged_attention's
    for (int side = 0; side < 2; ++side) {
        const int dtype = side ? L.v_dtype : L.k_dtype;
        const TQPagesDesc* pg = side ? L.v_tq : L.k_tq;
        if (dtype != kTurboQuantPages) {  // row or block pages beside TurboQuant's
            bool known = false;
            with_pages(dtype, [&](auto p) { known = d % decltype(p)::ALIGN == 0; });
            if (!known || !(side ? L.v_cache : L.k_cache)) return false;
            continue;
        }
        if (!pg || pg->num_parts < 1 || pg->num_parts > 2) return false;
        for (int i = 0; i < pg->num_parts; ++i)
            if (pg->parts[i].bits < 1 || pg->parts[i].bits > 8 || (side && pg->parts[i].signs)) return false;
    }
    return true;
}

}  // namespace bd

extern "C" {

// Attention of T tokens over TurboQuant pages on the module path (prefill chunks; turboquant_prod keys, which the
// decode step does not write): q, out (T, hq, d) float32, token t at positions[t] reading block table row
// token_rows[t]; k, v the TurboQuant pages (values: the MSE variant) of the side whose k_dtype / v_dtype is 5; the
// other side may be row or block pages (k_cache / v_cache with k_scale / v_scale, kv_pages.h's types 0–4, 6–9).
// Returns 0, or -1 for shapes or pages it does not take.
int bd_turboquant_attention(int k_dtype, int v_dtype, const bd::TQPagesDesc* k, const bd::TQPagesDesc* v, void* k_cache,
                            void* v_cache, void* k_scale, void* v_scale, const float* q, float* out, long T, long hq,
                            long hkv, long d, float scale, long window, const int64_t* positions,
                            const int64_t* token_rows, const int64_t* block_tables, long bt_stride, long block_size) {
    bd::ModelDesc m{};
    m.num_heads = hq, m.num_kv_heads = hkv, m.head_dim = d, m.attention_scale = scale;
    bd::LayerDesc L{};
    L.window = window, L.k_tq = k, L.v_tq = v, L.k_dtype = k_dtype, L.v_dtype = v_dtype;
    L.k_cache = k_cache, L.v_cache = v_cache, L.k_scale = k_scale, L.v_scale = v_scale;
    if (!bd::turboquant_reads(m, L)) return -1;
    bd::turboquant_attend(m, L, q, out, T, positions, token_rows, block_tables, bt_stride, block_size);
    return 0;
}

// The write alone, for tests against the codec: x (T, num_heads, head_dim) float32 into slots (T,). Returns 0.
int bd_turboquant_write(const bd::TQPagesDesc* pages, const float* x, long T, const int64_t* slots,
                        const int64_t* positions, long num_heads, long head_dim) {
    for (long t = 0; t < T; ++t)
        bd::turboquant_write(*pages, x + t * num_heads * head_dim, slots[t], positions[t], num_heads, head_dim);
    return 0;
}
}
