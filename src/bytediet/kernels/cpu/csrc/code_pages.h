// Code pages of the native attention (decoder.cpp: attend; ids: types.h's KVPage, PageKind.CODE in types.py):
// pages whose codecs quantize groups of tokens or keep per-layer transforms, so the decode step neither reads nor
// writes them. Their scales, zero points, norms, open (staged) tokens and transforms live beside the pages, not per
// row: a row is read from its slot and KV head (SIDE: P::widen_at) with CodePagesDesc, mirrored by kernels/ops.py's
// _CodePages. Codes are packed as kvcache/bitpack.py (code k in bits (k·b) mod 8 … of byte ⌊k·b/8⌋).
//
// Layouts: KIVI's and HF QuantizedCache's per-channel keys, per-token asymmetric codes in groups of 32 or 64 channels
// (KIVI's, QJL's and HF's values) — widened row by row as the codec's own read rounds, x = code · scale, then
// + zero; QJL keys (a query sketched once per call, each key scored on its sign bits: ON_CODES); PolarQuant (keys
// scored against the query rotated once, rows widened in the rotated basis; values summed there and rotated back
// once per head: QUERY, FINISH).
#pragma once
#include <cmath>
#include <cstring>

#include "attention.h"
#include "kv_pages.h"

namespace bd {

struct CodePagesDesc {
    const uint16_t* scale;    // fp16: per-channel keys (slots / group, hkv, d); per-token codes (slots, hkv, d / G);
                            // QJL keys (slots, hkv) ‖k − μ‖; PolarQuant (slots, hkv, d / 16) the final radii
    const uint16_t* zero;  // fp16, scale's shape (per-channel keys, per-token codes); else null
    const int32_t* stage_of;  // (slots / window,) the staging page of a window still open, or −1; null: none
    const uint16_t* stage;  // (pages, window, hkv, d) fp16: an open window's tokens as written
    int64_t group;  // per-channel keys: tokens per group (a slot's group is slot / group)
    int64_t window;  // tokens per staging window (slot / window indexes stage_of): KIVI's group, HF's residual
    const float* transform;  // (rows, d) float32: QJL's sketch S (R·d rows); PolarQuant's rotation R (d rows)
    const float* table;  // PolarQuant: cos then sin of each level's centroids (16, 16, then 4, 4 per level)
};

template <int BITS>  // codes j … j + 7 of a packed row as floats (j a multiple of 8: BITS whole bytes)
inline __m256 codes8(const uint8_t* r, long j) {
    uint32_t w = 0;
    std::memcpy(&w, r + j * BITS / 8, BITS);
    const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(BITS));
    const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), shifts),
                                       _mm256_set1_epi32((1 << BITS) - 1));
    return _mm256_cvtepi32_ps(c);
}

inline __m256 load8_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The row of slot, head kvh from its fp16 staging page while its window is open (→ out), else null.
inline const float* staged_row(const CodePagesDesc& s, long slot, long kvh, long hkv, long d, float* out) {
    if (!s.stage_of) return nullptr;
    const long page = s.stage_of[slot / s.window];
    if (page < 0) return nullptr;
    const uint16_t* x = s.stage + ((page * s.window + slot % s.window) * hkv + kvh) * d;
    for (long j = 0; j < d; j += 8) _mm256_storeu_ps(out + j, load8_f16(x + j));
    return out;
}

// out[j … j + 8) = codes · scale + zero (two roundings, as the codecs' reads), scale and zero 8 fp16 or broadcast.
template <int BITS>
inline void widen8(const uint8_t* r, long j, __m256 scale, __m256 zero, float* out) {
    _mm256_storeu_ps(out + j, _mm256_add_ps(_mm256_mul_ps(codes8<BITS>(r, j), scale), zero));
}

struct SidePages : PageTraits {
    using T = uint8_t;
    static constexpr bool SIDE = true;
    // the factor of a key row's score (QJL: its norm and the estimator's constant); 1 for rows widened in full
    static float row_scale_at(const CodePagesDesc&, long, long, long, long) { return 1.0f; }
};

// Per-channel keys over groups of G tokens, fp16 scale and zero per (group, head, channel): KIVI's
// (kvcache/kivi.py, arXiv 2402.02750; open group = its staging window) and HF QuantizedCache's (kvcache/hfquant.py:
// G = 64 behind a full-precision window of R tokens, kvcache/window.py). Rows of an open window: from staging.
template <int BITS>
struct PagesChannelKeys : SidePages {
    static long row_size(long d) { return d * BITS / 8; }
    static const float* widen_at(const CodePagesDesc& s, const T* pages, long slot, long kvh, long hkv, long d,
                                 float* out) {
        if (const float* x = staged_row(s, slot, kvh, hkv, d, out)) return x;
        const T* r = pages + (slot * hkv + kvh) * row_size(d);
        const long g = (slot / s.group * hkv + kvh) * d;
        for (long j = 0; j < d; j += 8) widen8<BITS>(r, j, load8_f16(s.scale + g + j), load8_f16(s.zero + g + j), out);
        return out;
    }
};

// Per-token asymmetric codes in groups of G channels (kvcache/tokenwise.py): fp16 scale and zero per (slot, head,
// group). KIVI's and QJL's values (G = 32), HF QuantizedCache's (G = 64, behind its staging window).
template <int BITS, int G>
struct PagesTokenCodes : SidePages {
    static constexpr long ALIGN = G;
    static long row_size(long d) { return d * BITS / 8; }
    static const float* widen_at(const CodePagesDesc& s, const T* pages, long slot, long kvh, long hkv, long d,
                                 float* out) {
        if (const float* x = staged_row(s, slot, kvh, hkv, d, out)) return x;
        const long idx = slot * hkv + kvh;
        const T* r = pages + idx * row_size(d);
        for (long b = 0; b < d / G; ++b) {
            const __m256 sc = _mm256_set1_ps(_cvtsh_ss(s.scale[idx * (d / G) + b]));
            const __m256 zp = _mm256_set1_ps(_cvtsh_ss(s.zero[idx * (d / G) + b]));
            for (long j = G * b; j < G * b + G; j += 8) widen8<BITS>(r, j, sc, zp, out);
        }
        return out;
    }
};

// y (rows) = M x for a row-major (rows, d) M: the query's transform, once per (token, head) and call.
inline void transform_query(const float* m, long rows, const float* x, long d, float* y) {
    for (long i = 0; i < rows; ++i) y[i] = attention::dot(m + i * d, x, d);
}

// QJL keys (kvcache/qjl.py, arXiv 2406.03482): m = R·d sign bits of S(k − μ) and ‖k − μ‖ (fp16). Scored on the codes:
// ⟨q, k⟩ ≈ √(π/2)/m · ‖k − μ‖ · ⟨S q, sign⟩ (+ q·μ, the same for every key of a query, which the softmax ignores):
// the query is sketched once per call (prepare), each key costs a sign-flipped sum of S q (dot8), and the row's
// factor √(π/2)/m · ‖k − μ‖ multiplies its score (row_scale_at).
template <int R>
struct PagesQJLKeys : SidePages {
    static constexpr bool QUERY = true, ON_CODES = true;
    static long row_size(long d) { return R * d / 8; }
    static long query_size(long d) { return R * d; }
    static void prepare(const CodePagesDesc& s, const float* q, long d, float* out) {
        transform_query(s.transform, R * d, q, d, out);
    }
    static float row_scale_at(const CodePagesDesc& s, long slot, long kvh, long hkv, long d) {
        return static_cast<float>(std::sqrt(M_PI / 2) / static_cast<double>(R * d)) *
               _cvtsh_ss(s.scale[slot * hkv + kvh]);
    }
    // Σ_j ±sq_j of 8 keys (their sign rows k[0..7], m bits each): sq_j with its sign flipped where bit j is 0.
    static __m256 dot8(const float* sq, const uint8_t* const* k, long m) {
        __m256 a[8];
        for (int r = 0; r < 8; ++r) a[r] = _mm256_setzero_ps();
        for (long i = 0; i < m / 8; ++i) {
            const __m256 qi = _mm256_loadu_ps(sq + 8 * i);
            for (int r = 0; r < 8; ++r) a[r] = _mm256_add_ps(a[r], attention::signed8(qi, k[r][i]));
        }
        return attention::hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
    }
};

// PolarQuant (kvcache/polarquant.py, arXiv 2502.02617): y = R x cut by 4 recursive polar levels into d/16 radii
// (fp16, side scale) and angle codes — level 1: d/2 codes of 4 bits, levels 2–4: d/4, d/8, d/16 codes of 2 bits,
// stored one after the other in a row (23·d/64 bytes). A row is widened in the rotated basis from the top level
// down, r ← (r·cos ψ, r·sin ψ) per pair (cos, sin of the centroids: side table, as the codec computes them); keys
// are scored against R q (prepare), values summed in the rotated basis and rotated back, o ← o R (finish).
struct PagesPolar : SidePages {
    static constexpr bool QUERY = true, FINISH = true;
    static constexpr long ALIGN = 64, MAX_DIM = 512;
    static long row_size(long d) { return d / 4 + d / 16 + d / 32 + d / 64; }
    static long query_size(long d) { return d; }
    static void prepare(const CodePagesDesc& s, const float* q, long d, float* out) {
        transform_query(s.transform, d, q, d, out);
    }
    static void finish(const CodePagesDesc& s, long d, float* o) {
        float t[MAX_DIM] = {0};
        for (long i = 0; i < d; ++i) attention::axpy(o[i], s.transform + i * d, t, d);
        std::memcpy(o, t, sizeof(float) * d);
    }
    static const float* widen_at(const CodePagesDesc& s, const T* pages, long slot, long kvh, long hkv, long d,
                                 float* out) {
        const long idx = slot * hkv + kvh;
        const T* row = pages + idx * row_size(d);
        const long offset[4] = {0, d / 4, d / 4 + d / 16, d / 4 + d / 16 + d / 32};  // each level's codes
        const long table[4] = {0, 32, 40, 48};  // each level's cos, sin
        float buf[2][MAX_DIM / 2];
        float* r = buf[0];
        long n = d / 16;
        for (long i = 0; i < n; ++i) r[i] = _cvtsh_ss(s.scale[idx * n + i]);
        for (int lvl = 3; lvl >= 0; --lvl, n *= 2) {
            const int bits = lvl ? 2 : 4, size = 1 << bits;
            const float* cs = s.table + table[lvl];
            float* next = lvl ? buf[lvl & 1] : out;  // levels alternate buffers; level 1 writes the row
            const uint8_t* c = row + offset[lvl];
            for (long i = 0; i < n; ++i) {
                const int code = (c[i * bits / 8] >> ((i * bits) % 8)) & (size - 1);
                next[2 * i] = r[i] * cs[code];
                next[2 * i + 1] = r[i] * cs[size + code];
            }
            r = next;
        }
        return out;
    }
};

// fn(P{}) for any page type the native attention reads (row, block and code pages); false for another id.
template <class Fn>
bool with_attention_pages(int page_type, Fn fn) {
    switch (static_cast<KVPage>(page_type)) {
        case KVPage::KIVI2_KEYS: fn(PagesChannelKeys<2>{}); return true;
        case KVPage::KIVI4_KEYS: fn(PagesChannelKeys<4>{}); return true;
        case KVPage::INT2_TOKEN_G32: fn(PagesTokenCodes<2, 32>{}); return true;
        case KVPage::INT4_TOKEN_G32: fn(PagesTokenCodes<4, 32>{}); return true;
        case KVPage::INT2_TOKEN_G64: fn(PagesTokenCodes<2, 64>{}); return true;
        case KVPage::INT4_TOKEN_G64: fn(PagesTokenCodes<4, 64>{}); return true;
        case KVPage::QJL1_KEYS: fn(PagesQJLKeys<1>{}); return true;
        case KVPage::QJL2_KEYS: fn(PagesQJLKeys<2>{}); return true;
        case KVPage::QJL3_KEYS: fn(PagesQJLKeys<3>{}); return true;
        case KVPage::QJL4_KEYS: fn(PagesQJLKeys<4>{}); return true;
        case KVPage::POLARQUANT: fn(PagesPolar{}); return true;
        default: return with_pages(page_type, fn);
    }
}

// Whether pages of this type are read with side data (code pages: CodePagesDesc), from the type's traits.
inline bool has_side_data(int page_type) {
    bool side = false;
    with_attention_pages(page_type, [&](auto p) { side = decltype(p)::SIDE; });
    return side;
}

}  // namespace bd
