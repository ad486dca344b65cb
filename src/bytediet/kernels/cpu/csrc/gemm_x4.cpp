// Row-interleaved ("x4") layouts of Q4_0, Q4_1, Q5_0 and Q8_0 for batch-1..few decode with int8 activations.
// llama.cpp's repack.cpp idea: four weight rows are stored block by block side by side, so one 32-byte
// vector holds 8 consecutive weights of each of the 4 rows and a broadcast of 8 activation bytes serves all
// four; the per-row scales of a block are converted 4 at a time. Per 4 rows × 32 weights this costs ~28
// instructions where the row-by-row kernel (gemm_blocks.cpp) costs ~76.
// Layout per group of 4 rows (N % 4 == 0), per 32-weight block b, in this order:
//   d[4] f16;  (Q4_1) m[4] f16;  codes: Q4 — 64 bytes, lo = U0 | U1 << 4, hi = U2 | U3 << 4;
//                                       Q5_0 — the Q4 64 bytes of the low 4 bits, then 16 bytes: four
//                                              32-bit masks, bit j of mask k = bit 4 of U_k[j];
//                                       Q8 — 128 bytes, U0 U1 U2 U3;
// where U_k (32 bytes) holds weights 8k..8k+7 of row 0, then of rows 1, 2, 3.
// Sizes equal the source's (4 × block bytes), so the repacked copy costs no more than the original.
#include <cstring>
#include <vector>

#include "block_formats.h"
#include "gemm_blocks.h"
#include "isa.h"
#include "threadpool.h"
#include "x4_lanes.h"

namespace bd {
namespace {

constexpr int kQ4_0 = id(WeightType::Q4_0), kQ4_1 = id(WeightType::Q4_1), kQ5_0 = id(WeightType::Q5_0),
              kQ8_0 = id(WeightType::Q8_0);

int x4_block_bytes(int type) {
    switch (type) {
        case kQ4_0: return 4 * 18;
        case kQ4_1: return 4 * 20;
        case kQ5_0: return 4 * 22;
        case kQ8_0: return 4 * 34;
        default: return 0;
    }
}

// 32 weights of one source block as unsigned/signed codes in element order.
void source_codes(int type, const uint8_t* blk, uint8_t out[32]) {
    __m256i v = type == kQ4_0   ? Q4_0::codes(blk, 0)
                : type == kQ4_1 ? Q4_1::codes(blk, 0)
                : type == kQ5_0 ? Q5_0::codes(blk, 0)
                                : Q8_0::codes(blk, 0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
}

const __m256i kPairIndex = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);

// 4 f16 scales → 8 lanes (row r in lanes 2r, 2r+1).
inline __m256 scales_x4(const uint8_t* p) {
    __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), kPairIndex);
}

// Σ code · activation per lane for one int8 activation block against the four rows' codes u[0..3], added to
// init. AVX2 sums the 4-bit formats' maddubs pairs in int16 (≤ 4 · 2 · 31 · 127 < 2^15 for Q5_0) and takes Q8_0's
// signed codes by the sign trick; VNNI accumulates in int32, Q8_0's codes offset by 128 (init holds −128 · Σ x).
template <int TYPE>
inline __m256i plane_dot(const __m256i u[4], const int8_t* xq, __m256i init) {
    if constexpr (TYPE == kQ8_0 || BD_AVX512) {
        __m256i s32 = init;
        for (int k = 0; k < 4; ++k) {
            long long xb;
            std::memcpy(&xb, xq + 8 * k, 8);
            const __m256i xv = _mm256_set1_epi64x(xb);
#if BD_AVX512
            s32 = _mm256_dpbusd_epi32(s32, u[k], xv);
#else
            s32 = _mm256_add_epi32(s32, dot_s8s8(u[k], xv));
#endif
        }
        return s32;
    } else {
        __m256i s16 = _mm256_setzero_si256();
        for (int k = 0; k < 4; ++k) {
            long long xb;
            std::memcpy(&xb, xq + 8 * k, 8);
            s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[k], _mm256_set1_epi64x(xb)));
        }
        return _mm256_add_epi32(init, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));
    }
}

// VNNI multiplies unsigned by signed bytes: Q8_0's signed codes go in offset by 128 there.
constexpr bool kQ8Offset = BD_AVX512;

// The four rows' codes of one x4 block, unsigned (Q8_0's offset by 128 where kQ8Offset).
template <int TYPE>
inline void block_codes(const uint8_t* g, __m256i u[4]) {
    constexpr int CODES = TYPE == kQ4_1 ? 16 : 8;  // offset of the codes in a group block
    const __m256i low = _mm256_set1_epi8(0x0F);
    if constexpr (TYPE == kQ8_0) {
        for (int k = 0; k < 4; ++k) u[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + CODES + 32 * k));
        if constexpr (kQ8Offset)
            for (int k = 0; k < 4; ++k) u[k] = _mm256_xor_si256(u[k], _mm256_set1_epi8(static_cast<char>(0x80)));
    } else {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + CODES));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + CODES + 32));
        u[0] = _mm256_and_si256(lo, low);
        u[1] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), low);
        u[2] = _mm256_and_si256(hi, low);
        u[3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), low);
        if constexpr (TYPE == kQ5_0) {
            uint32_t masks[4];
            std::memcpy(masks, g + CODES + 64, 16);
            const __m256i bit4 = _mm256_set1_epi8(0x10);
            for (int k = 0; k < 4; ++k) u[k] = _mm256_or_si256(u[k], _mm256_and_si256(bits_to_bytes(masks[k]), bit4));
        }
    }
}

// Per lane (row r in lanes 2r, 2r+1): the coefficient of the block's activation sum in the zero-point term, halved
// (each row has two lanes); Q8_0 has none.
template <int TYPE>
inline __m256 zero_point_coef(const uint8_t* g, __m256 d) {
    if constexpr (TYPE == kQ4_1) return _mm256_mul_ps(scales_x4(g + 8), _mm256_set1_ps(0.5f));
    if constexpr (TYPE == kQ4_0) return _mm256_mul_ps(d, _mm256_set1_ps(-4.0f));
    if constexpr (TYPE == kQ5_0) return _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
    return _mm256_setzero_ps();
}

// corr: offset_corrections(x, 32, 128) where Q8_0's codes go in offset (kQ8Offset), else nullptr. q16 rows (TWO)
// keep each plane's sums apart until the end: AVX-512's paired kernel below computes both planes in one vector.
template <int TYPE, int NC, bool TWO>
void group_q8(const uint8_t* w, long nblocks, const QuantizedRows& x, const __m256i* corr, long m0, float* y, long ldy,
              long n0, const float* bias) {
    constexpr int BB = TYPE == kQ4_0 ? 72 : TYPE == kQ4_1 ? 80 : TYPE == kQ5_0 ? 88 : 136;
    __m256 acc[NC], acc2[TWO ? NC : 1];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int c = 0; c < (TWO ? NC : 1); ++c) acc2[c] = _mm256_setzero_ps();
    for (long b = 0; b < nblocks; ++b) {
        const uint8_t* g = w + b * BB;
        prefetch_weights(g, BB);
        __m256i u[4];
        block_codes<TYPE>(g, u);
        const __m256 d = scales_x4(g), zero_coef = zero_point_coef<TYPE>(g, d);
        for (int c = 0; c < NC; ++c) {
            const long row = m0 + c, at = row * x.k + b * 32;
            constexpr bool offset = TYPE == kQ8_0 && kQ8Offset;
            static_assert(!(offset && TWO), "q16 rows with offset codes (AVX-512) take group_q16_paired");
            const __m256i zero = _mm256_setzero_si256();
            acc[c] = _mm256_fmadd_ps(
                _mm256_mul_ps(d, _mm256_set1_ps(x.d[row * x.nblocks + b])),
                _mm256_cvtepi32_ps(plane_dot<TYPE>(u, x.q + at, offset ? corr[row * nblocks + b] : zero)), acc[c]);
            if constexpr (TYPE != kQ8_0)
                acc[c] = _mm256_fmadd_ps(zero_coef, _mm256_set1_ps(x.s[row * x.nblocks + b]), acc[c]);
            if constexpr (TWO)
                acc2[c] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_set1_ps(x.d2[row * x.nblocks + b])),
                                          _mm256_cvtepi32_ps(plane_dot<TYPE>(u, x.q2 + at, zero)), acc2[c]);
        }
    }
    x4_store<NC, TWO>(acc, acc2, m0, y, ldy, n0, bias);
}

#if BD_AVX512
// group_q8 for q16 rows in 16 lanes (row r, plane p, half h in lane 4r + 2p + h): half the dot instructions and
// activation loads of two 8-lane planes; the same integer sums and float steps per lane, so the same bits.
template <int TYPE, int NC>
void group_q16_paired(const uint8_t* w, long nblocks, const PairedRows& px, const QuantizedRows& x, long m0, float* y,
                      long ldy, long n0, const float* bias) {
    constexpr int BB = TYPE == kQ4_0 ? 72 : TYPE == kQ4_1 ? 80 : TYPE == kQ5_0 ? 88 : 136;
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    for (long b = 0; b < nblocks; ++b) {
        const uint8_t* g = w + b * BB;
        prefetch_weights(g, BB);
        __m256i u[4];
        block_codes<TYPE>(g, u);
        __m512i uu[4];
        for (int k = 0; k < 4; ++k) uu[k] = rows_twice(u[k]);
        const __m256 d8 = scales_x4(g);
        const __m512 d = spread(d8), zero_coef = spread(zero_point_coef<TYPE>(g, d8), kPlaneOne);
        for (int c = 0; c < NC; ++c) {
            const long rb = (m0 + c) * nblocks + b;
            __m512i s = TYPE == kQ8_0 ? paired_corr(px.corr.data() + rb * 4) : _mm512_setzero_si512();
            for (int k = 0; k < 4; ++k) s = _mm512_dpbusd_epi32(s, uu[k], paired_x(px, rb, k));
            acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(d, paired_scales(px, rb)), _mm512_cvtepi32_ps(s), acc[c]);
            if constexpr (TYPE != kQ8_0) acc[c] = _mm512_fmadd_ps(zero_coef, _mm512_set1_ps(x.s[rb]), acc[c]);
        }
    }
    x4_store_paired<NC>(acc, m0, y, ldy, n0, bias);
}
#endif

thread_local std::vector<__m256i> t_q8_corrections;
#if BD_AVX512
thread_local PairedRows t_paired;
#endif

// Rows [b, e) (multiples of 4) of one weight against all M activation rows.
template <int TYPE>
void rows_x4(const uint8_t* w, long K, const QuantizedRows& x, long M, float* y, long ldy, const float* bias, long b,
             long e) {
    const long nb = K / 32, group_bytes = nb * x4_block_bytes(TYPE);
    const bool two = x.q2 != nullptr;
#if BD_AVX512
    if (two) {
        pair_planes(x, M, TYPE == kQ8_0 ? 32 : 0, 128, t_paired);
        for (long n = b; n < e; n += 4)
            for_each_tile(M, kTwoPlaneTile, [&](auto nc, long m) {
                group_q16_paired<TYPE, decltype(nc)::value>(w + (n / 4) * group_bytes, nb, t_paired, x, m, y, ldy, n,
                                                            bias);
            });
        return;
    }
#endif
    const __m256i* corr = nullptr;
    if constexpr (TYPE == kQ8_0 && kQ8Offset) {
        offset_corrections(x, M, 32, 128, t_q8_corrections);
        corr = t_q8_corrections.data();
    }
    const int most = two ? kTwoPlaneTile : kOnePlaneTile;
    for (long n = b; n < e; n += 4) {
        const uint8_t* g = w + (n / 4) * group_bytes;
        for_each_tile(M, most, [&](auto nc, long m) {
            if (!two)
                group_q8<TYPE, decltype(nc)::value, false>(g, nb, x, corr, m, y, ldy, n, bias);
            else if constexpr (!BD_AVX512)  // AVX-512 took q16 rows to the paired kernel above
                group_q8<TYPE, decltype(nc)::value, true>(g, nb, x, corr, m, y, ldy, n, bias);
        });
    }
}

void rows_any(const X4Product& p, const QuantizedRows& x, long M, long b, long e) {
    if (has_kx4(p.ggml_type)) return rows_kx4(p, x, M, b, e);
    switch (p.ggml_type) {
        case kQ4_0: rows_x4<kQ4_0>(p.w, p.k, x, M, p.y, p.n, p.bias, b, e); break;
        case kQ4_1: rows_x4<kQ4_1>(p.w, p.k, x, M, p.y, p.n, p.bias, b, e); break;
        case kQ5_0: rows_x4<kQ5_0>(p.w, p.k, x, M, p.y, p.n, p.bias, b, e); break;
        default: rows_x4<kQ8_0>(p.w, p.k, x, M, p.y, p.n, p.bias, b, e); break;
    }
}

}  // namespace

// Σ of bytes 0–3 and of bytes 4–7 of every 8 in q[0, span): what an x4 dot's even and odd int32 lanes multiply.
inline void even_odd_sums(const int8_t* q, int span, int32_t& even, int32_t& odd) {
    even = odd = 0;
    for (int e = 0; e < span; ++e) (e % 8 < 4 ? even : odd) += q[e];
}

void offset_corrections(const QuantizedRows& x, long M, int span, int32_t offset, std::vector<__m256i>& out) {
    const long runs = x.k / span, planes = x.q2 != nullptr ? 2 : 1;
    out.resize(M * planes * runs);
    for (long m = 0; m < M; ++m)
        for (long p = 0; p < planes; ++p) {
            const int8_t* q = (p == 0 ? x.q : x.q2) + m * x.k;
            __m256i* o = out.data() + (m * planes + p) * runs;
            for (long r = 0; r < runs; ++r) {
                int32_t even, odd;
                even_odd_sums(q + r * span, span, even, odd);
                o[r] = _mm256_set1_epi64x(static_cast<long long>(static_cast<uint32_t>(-offset * even)) |
                                          static_cast<long long>(static_cast<uint32_t>(-offset * odd)) << 32);
            }
        }
}

#if BD_AVX512
void pair_planes(const QuantizedRows& x, long M, int span, int32_t offset, PairedRows& out) {
    const long nb = x.nblocks, halves = span ? 32 / span : 0;
    out.codes.resize(M * nb * 64);
    out.scales.resize(M * nb * 4);
    out.corr.resize(M * nb * 4 * halves);
    for (long m = 0; m < M; ++m)
        for (long b = 0; b < nb; ++b) {
            const long rb = m * nb + b;
            const int8_t* planes[2] = {x.q + m * x.k + b * 32, x.q2 + m * x.k + b * 32};
            for (int k = 0; k < 4; ++k)
                for (int p = 0; p < 2; ++p)
                    std::memcpy(out.codes.data() + rb * 64 + 16 * k + 8 * p, planes[p] + 8 * k, 8);
            float* s = out.scales.data() + rb * 4;
            s[0] = s[1] = x.d[rb];
            s[2] = s[3] = x.d2[rb];
            for (long h = 0; h < halves; ++h)
                for (int p = 0; p < 2; ++p) {
                    int32_t even, odd;
                    even_odd_sums(planes[p] + h * span, span, even, odd);
                    out.corr[(rb * halves + h) * 4 + 2 * p] = -offset * even;
                    out.corr[(rb * halves + h) * 4 + 2 * p + 1] = -offset * odd;
                }
        }
}
#endif

long x4_block_bytes_of(int type) { return x4_block_bytes(type); }

bool has_x4(int type) { return x4_block_bytes(type) != 0 || has_kx4(type); }

void repack_x4(int type, const uint8_t* src, long N, long K, uint8_t* dst) {
    const int sb = type == kQ4_0 ? 18 : type == kQ4_1 ? 20 : type == kQ5_0 ? 22 : 34, scales = type == kQ4_1 ? 2 : 1;
    const long nb = K / 32, row_bytes = nb * sb, bb = x4_block_bytes(type);
    for (long g = 0; g < N / 4; ++g) {
        for (long b = 0; b < nb; ++b) {
            uint8_t* out = dst + (g * nb + b) * bb;
            uint8_t codes[4][32];
            for (int r = 0; r < 4; ++r) {
                const uint8_t* blk = src + (4 * g + r) * row_bytes + b * sb;
                for (int s = 0; s < scales; ++s) std::memcpy(out + 8 * s + 2 * r, blk + 2 * s, 2);
                source_codes(type, blk, codes[r]);
            }
            uint8_t u[4][32];  // U_k[8r + e] = code e + 8k of row r
            for (int k = 0; k < 4; ++k)
                for (int r = 0; r < 4; ++r)
                    for (int e = 0; e < 8; ++e) u[k][8 * r + e] = codes[r][8 * k + e];
            uint8_t* c = out + 8 * scales;
            if (type == kQ8_0) {
                std::memcpy(c, u, 128);
            } else {
                for (int j = 0; j < 32; ++j) {
                    c[j] = static_cast<uint8_t>((u[0][j] & 15) | ((u[1][j] & 15) << 4));
                    c[32 + j] = static_cast<uint8_t>((u[2][j] & 15) | ((u[3][j] & 15) << 4));
                }
                if (type == kQ5_0)
                    for (int k = 0; k < 4; ++k) {
                        uint32_t mask = 0;
                        for (int j = 0; j < 32; ++j) mask |= static_cast<uint32_t>((u[k][j] >> 4) & 1) << j;
                        std::memcpy(c + 64 + 4 * k, &mask, 4);
                    }
            }
        }
    }
}

int gemm_x4_q8(int type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
               const float* bias) {
    if (N % 4 || K % (has_kx4(type) ? 256 : 32)) return -2;
    if (!has_x4(type)) return -1;
    if (ldy != N) return -2;  // outputs are dense (M, N)
    X4Product p{type, w, N, K, y, bias};
    gemm_x4_many(&p, 1, x, M);
    return 0;
}

// Several products of one input (q/k/v, gate/up) in one parallel region: the rows of all of them are split
// over the threads together, so the pool synchronises once instead of once per product.
void gemm_x4_many(const X4Product* products, int count, const QuantizedRows& x, long M) {
    long total = 0;
    for (int i = 0; i < count; ++i) total += products[i].n;
    parallel_run([&](int t, int nt) {
        long b, e;
        split_range(total, nt, t, 4, &b, &e);
        long base = 0;
        for (int i = 0; i < count; ++i) {
            const long lo = b > base ? b - base : 0, hi = e - base < products[i].n ? e - base : products[i].n;
            if (lo < hi) rows_any(products[i], x, M, lo, hi);
            base += products[i].n;
        }
    });
}

}  // namespace bd

extern "C" {

// Row-interleaved copy of a Q4_0/Q4_1/Q5_0/Q8_0 weight (N % 4 == 0, K % 32 == 0) into dst (same byte size),
// or of a Q4_K/Q6_K weight (K % 256 == 0; dst of bd_x4_row_bytes(type, K) bytes per row, gemm_kx4.cpp).
// Returns 0, -1 for another block type, -2 for a shape that does not interleave.
int bd_repack_x4(int ggml_type, const uint8_t* src, long N, long K, uint8_t* dst) {
    if (!bd::has_x4(ggml_type)) return -1;
    if (N % 4 || K % (bd::has_kx4(ggml_type) ? 256 : 32)) return -2;
    if (bd::has_kx4(ggml_type))
        bd::repack_kx4(ggml_type, src, N, K, dst);
    else
        bd::repack_x4(ggml_type, src, N, K, dst);
    return 0;
}

// y = x · Wᵀ (+ bias) for a row-interleaved weight, with q8 activations (see bd_gemm_blocks).
// act_mode: Activations::Q8, or Q16 (two int8 planes).
int bd_gemm_x4(int ggml_type, const uint8_t* w, long N, long K, const float* x, long M, float* y, const float* bias,
               int act_mode) {
    if (!bd::has_x4(ggml_type)) return -1;
    if (N % 4 || K % (bd::has_kx4(ggml_type) ? 256 : 32)) return -2;
    static thread_local bd::QuantizedActivations act;
    return bd::gemm_x4_q8(ggml_type, w, N, K, act.quantize(x, M, K, act_mode == static_cast<int>(bd::Activations::Q16)),
                          M, y, N, bias);
}

// Bytes per row of the interleaved copy of a weight of this type with K weights per row (0: no x4 layout).
long bd_x4_row_bytes(int ggml_type, long K) {
    if (bd::has_kx4(ggml_type)) return K / 256 * bd::kx4_group_bytes(ggml_type) / 4;
    return bd::has_x4(ggml_type) ? K / 32 * bd::x4_block_bytes_of(ggml_type) / 4 : 0;
}
}
