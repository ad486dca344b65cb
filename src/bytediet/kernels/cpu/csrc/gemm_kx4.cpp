// Row-interleaved ("x4") layouts of the K-quants Q4_K and Q6_K (gemm_x4.cpp holds the 32-weight formats):
// four weight rows stored super-block by super-block side by side, so one 32-byte vector holds 8 consecutive
// weights of each of the 4 rows and a broadcast of 8 activation bytes serves all four (llama.cpp repack.cpp's
// idea; its q4_K 8x8 layout goes further with Q8_K activations). The row kernel (gemm_blocks.cpp) decodes
// each row's 6-bit scales with scalar code and multiplies one row per vector; here the scales are decoded
// once at load time to bytes and converted 4 rows at a time. Per group of 4 rows and super-block of 256:
//   Q4_K (592 bytes, the source's 576 plus 16 — its 12-byte packed 6-bit scales and mins become bytes):
//     d[4] f16, dmin[4] f16, sc[8][4] u8, mn[8][4] u8, then per sub-block j (32 weights) 64 bytes of
//     nibbles: lo = U0 | U1 << 4, hi = U2 | U3 << 4;
//   Q6_K (840 bytes, = 4 × 210): d[4] f16, sc[16][4] i8 (scale of elements 16h..16h+15 of row r), then per
//     sub-block j: 64 bytes of the codes' low 4 bits (as Q4_K) and 32 bytes of their high 2 bits,
//     hb = U0 >> 4 | (U1 >> 4) << 2 | (U2 >> 4) << 4 | (U3 >> 4) << 6,
// where U_k[8r + e] is the code of weight 8k + e of the sub-block in row r (Q6_K codes unsigned 0..63, the
// weight d·sc·(code − 32)). The twins are reference.repack_x4 / unpack_x4.
#include <cstring>
#include <vector>

#include "block_formats.h"
#include "gemm_blocks.h"
#include "isa.h"
#include "x4_lanes.h"

namespace bd {
namespace {

constexpr int kQ4_K = id(WeightType::Q4_K), kQ6_K = id(WeightType::Q6_K);
constexpr long kQ4KBytes = 592, kQ6KBytes = 840;

inline __m256 pairs_f16(const uint8_t* p) {  // 4 f16 (one per row) → 8 lanes r0 r0 r1 r1 r2 r2 r3 r3
    __m128 s = _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(s), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

template <bool SIGNED>
inline __m256 pairs_u8(const uint8_t* p) {  // 4 bytes (one per row) → 8 float lanes in row pairs
    int32_t v;
    std::memcpy(&v, p, 4);
    const __m128i b =
        _mm_shuffle_epi8(_mm_cvtsi32_si128(v), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, -1, -1, -1, -1, -1, -1, -1, -1));
    return _mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
}

inline long long bytes8(const int8_t* p) {
    long long v;
    std::memcpy(&v, p, 8);
    return v;
}

// Σ code · activation per lane over one plane's 32 activation bytes at xq (Q4_K: codes ≤ 15, so AVX2's int16
// sum of 4 maddubs pairs holds; VNNI accumulates in int32 directly).
inline __m256i dot4(const __m256i u[4], const int8_t* xq) {
#if BD_AVX512
    __m256i s32 = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k) s32 = _mm256_dpbusd_epi32(s32, u[k], _mm256_set1_epi64x(bytes8(xq + 8 * k)));
    return s32;
#else
    __m256i s16 = _mm256_setzero_si256();
    for (int k = 0; k < 4; ++k)
        s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(u[k], _mm256_set1_epi64x(bytes8(xq + 8 * k))));
    return _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
#endif
}

inline void nibbles4(const uint8_t* c, __m256i u[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
    u[0] = _mm256_and_si256(lo, low);
    u[1] = _mm256_and_si256(_mm256_srli_epi16(lo, 4), low);
    u[2] = _mm256_and_si256(hi, low);
    u[3] = _mm256_and_si256(_mm256_srli_epi16(hi, 4), low);
}

// q16 rows (TWO) keep each plane's sums apart until the end, as the AVX-512 paired kernels below do in one vector.
template <int NC, bool TWO>
void group_q4k(const uint8_t* w, long nsuper, const QuantizedRows& x, long m0, float* y, long ldy, long n0,
               const float* bias) {
    __m256 acc[NC], acc2[TWO ? NC : 1];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int c = 0; c < (TWO ? NC : 1); ++c) acc2[c] = _mm256_setzero_ps();
    const __m256 minus_half = _mm256_set1_ps(-0.5f);
    for (long i = 0; i < nsuper; ++i) {
        const uint8_t* g = w + i * kQ4KBytes;
        prefetch_weights(g, kQ4KBytes);
        const __m256 d = pairs_f16(g), dmin = _mm256_mul_ps(pairs_f16(g + 8), minus_half);
        for (int j = 0; j < 8; ++j) {
            const __m256 sc = _mm256_mul_ps(d, pairs_u8<false>(g + 16 + 4 * j));
            const __m256 mn = _mm256_mul_ps(dmin, pairs_u8<false>(g + 48 + 4 * j));  // −dmin·mn / 2 per lane
            __m256i u[4];
            nibbles4(g + 80 + 64 * j, u);
            const long blk = i * 8 + j;
            for (int c = 0; c < NC; ++c) {
                const long row = m0 + c, at = row * x.k + blk * 32;
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(sc, _mm256_set1_ps(x.d[row * x.nblocks + blk])),
                                         _mm256_cvtepi32_ps(dot4(u, x.q + at)), acc[c]);
                acc[c] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.s[row * x.nblocks + blk]), acc[c]);
                if constexpr (TWO)
                    acc2[c] = _mm256_fmadd_ps(_mm256_mul_ps(sc, _mm256_set1_ps(x.d2[row * x.nblocks + blk])),
                                              _mm256_cvtepi32_ps(dot4(u, x.q2 + at)), acc2[c]);
            }
        }
    }
    x4_store<NC, TWO>(acc, acc2, m0, y, ldy, n0, bias);
}

// One plane's two half-block sums (elements 0..15 and 16..31) per lane, each started from its offset
// correction (Q6_K's codes are stored + 32: offset_corrections(x, 16, 32)). Codes ≤ 63: AVX2's two maddubs pairs
// sum to ≤ 2 · 2 · 63 · 127 < 2^15; VNNI accumulates in int32.
inline void dot6(const __m256i u[4], const int8_t* xq, const __m256i* corr, __m256i& lo, __m256i& hi) {
#if BD_AVX512
    lo = _mm256_dpbusd_epi32(corr[0], u[0], _mm256_set1_epi64x(bytes8(xq)));
    lo = _mm256_dpbusd_epi32(lo, u[1], _mm256_set1_epi64x(bytes8(xq + 8)));
    hi = _mm256_dpbusd_epi32(corr[1], u[2], _mm256_set1_epi64x(bytes8(xq + 16)));
    hi = _mm256_dpbusd_epi32(hi, u[3], _mm256_set1_epi64x(bytes8(xq + 24)));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i s_lo = _mm256_add_epi16(_mm256_maddubs_epi16(u[0], _mm256_set1_epi64x(bytes8(xq))),
                                          _mm256_maddubs_epi16(u[1], _mm256_set1_epi64x(bytes8(xq + 8))));
    const __m256i s_hi = _mm256_add_epi16(_mm256_maddubs_epi16(u[2], _mm256_set1_epi64x(bytes8(xq + 16))),
                                          _mm256_maddubs_epi16(u[3], _mm256_set1_epi64x(bytes8(xq + 24))));
    lo = _mm256_add_epi32(_mm256_madd_epi16(s_lo, ones), corr[0]);
    hi = _mm256_add_epi32(_mm256_madd_epi16(s_hi, ones), corr[1]);
#endif
}

// Q6_K's codes of sub-block j of a group super-block g, unsigned 0..63.
inline void codes6(const uint8_t* g, int j, __m256i u[4]) {
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const uint8_t* c = g + 72 + 96 * j;
    const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
    const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 64));
    u[0] = _mm256_or_si256(_mm256_and_si256(lo, low), _mm256_and_si256(_mm256_slli_epi16(hb, 4), top));
    u[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low),
                           _mm256_and_si256(_mm256_slli_epi16(hb, 2), top));
    u[2] = _mm256_or_si256(_mm256_and_si256(hi, low), _mm256_and_si256(hb, top));
    u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(hi, 4), low),
                           _mm256_and_si256(_mm256_srli_epi16(hb, 2), top));
}

template <int NC, bool TWO>
void group_q6k(const uint8_t* w, long nsuper, const QuantizedRows& x, const __m256i* corr, long m0, float* y, long ldy,
               long n0, const float* bias) {
    __m256 acc[NC], acc2[TWO ? NC : 1];
    for (int c = 0; c < NC; ++c) acc[c] = _mm256_setzero_ps();
    for (int c = 0; c < (TWO ? NC : 1); ++c) acc2[c] = _mm256_setzero_ps();
    const long halves = x.k / 16;  // per activation row and plane, in corr
    for (long i = 0; i < nsuper; ++i) {
        const uint8_t* g = w + i * kQ6KBytes;
        prefetch_weights(g, kQ6KBytes);
        const __m256 d = pairs_f16(g);
        for (int j = 0; j < 8; ++j) {
            const __m256 s_lo = _mm256_mul_ps(d, pairs_u8<true>(g + 8 + 8 * j));
            const __m256 s_hi = _mm256_mul_ps(d, pairs_u8<true>(g + 12 + 8 * j));
            __m256i u[4];
            codes6(g, j, u);
            const long blk = i * 8 + j;
            for (int c2 = 0; c2 < NC; ++c2) {
                const long row = m0 + c2, at = row * x.k + blk * 32;
                __m256i p_lo, p_hi;
                dot6(u, x.q + at, corr + row * (TWO ? 2 : 1) * halves + 2 * blk, p_lo, p_hi);
                const __m256 xd = _mm256_set1_ps(x.d[row * x.nblocks + blk]);
                acc[c2] = _mm256_fmadd_ps(_mm256_mul_ps(s_lo, xd), _mm256_cvtepi32_ps(p_lo), acc[c2]);
                acc[c2] = _mm256_fmadd_ps(_mm256_mul_ps(s_hi, xd), _mm256_cvtepi32_ps(p_hi), acc[c2]);
                if constexpr (TWO) {
                    dot6(u, x.q2 + at, corr + (row * 2 + 1) * halves + 2 * blk, p_lo, p_hi);
                    const __m256 xd2 = _mm256_set1_ps(x.d2[row * x.nblocks + blk]);
                    acc2[c2] = _mm256_fmadd_ps(_mm256_mul_ps(s_lo, xd2), _mm256_cvtepi32_ps(p_lo), acc2[c2]);
                    acc2[c2] = _mm256_fmadd_ps(_mm256_mul_ps(s_hi, xd2), _mm256_cvtepi32_ps(p_hi), acc2[c2]);
                }
            }
        }
    }
    x4_store<NC, TWO>(acc, acc2, m0, y, ldy, n0, bias);
}

#if BD_AVX512
// group_q4k<NC, true> in 16 lanes: half the dot instructions and activation loads, the same bits.
template <int NC>
void group_q4k_paired(const uint8_t* w, long nsuper, const PairedRows& px, const QuantizedRows& x, long m0, float* y,
                      long ldy, long n0, const float* bias) {
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    const __m256 minus_half = _mm256_set1_ps(-0.5f);
    for (long i = 0; i < nsuper; ++i) {
        const uint8_t* g = w + i * kQ4KBytes;
        prefetch_weights(g, kQ4KBytes);
        const __m256 d = pairs_f16(g), dmin = _mm256_mul_ps(pairs_f16(g + 8), minus_half);
        for (int j = 0; j < 8; ++j) {
            const __m512 sc = spread(_mm256_mul_ps(d, pairs_u8<false>(g + 16 + 4 * j)));
            const __m512 mn = spread(_mm256_mul_ps(dmin, pairs_u8<false>(g + 48 + 4 * j)), kPlaneOne);
            __m256i u[4];
            nibbles4(g + 80 + 64 * j, u);
            __m512i uu[4];
            for (int k = 0; k < 4; ++k) uu[k] = rows_twice(u[k]);
            const long blk = i * 8 + j;
            for (int c = 0; c < NC; ++c) {
                const long rb = (m0 + c) * x.nblocks + blk;
                __m512i s = _mm512_setzero_si512();
                for (int k = 0; k < 4; ++k) s = _mm512_dpbusd_epi32(s, uu[k], paired_x(px, rb, k));
                const __m512 xs = paired_scales(px, rb);
                acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(sc, xs), _mm512_cvtepi32_ps(s), acc[c]);
                acc[c] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.s[rb]), acc[c]);
            }
        }
    }
    x4_store_paired<NC>(acc, m0, y, ldy, n0, bias);
}

// group_q6k<NC, true> in 16 lanes; px.corr: pair_planes(x, M, 16, 32), two runs of 16 codes per block.
template <int NC>
void group_q6k_paired(const uint8_t* w, long nsuper, const PairedRows& px, const QuantizedRows& x, long m0, float* y,
                      long ldy, long n0, const float* bias) {
    __m512 acc[NC];
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
    for (long i = 0; i < nsuper; ++i) {
        const uint8_t* g = w + i * kQ6KBytes;
        prefetch_weights(g, kQ6KBytes);
        const __m256 d = pairs_f16(g);
        for (int j = 0; j < 8; ++j) {
            const __m512 s_lo = spread(_mm256_mul_ps(d, pairs_u8<true>(g + 8 + 8 * j)));
            const __m512 s_hi = spread(_mm256_mul_ps(d, pairs_u8<true>(g + 12 + 8 * j)));
            __m256i u[4];
            codes6(g, j, u);
            __m512i uu[4];
            for (int k = 0; k < 4; ++k) uu[k] = rows_twice(u[k]);
            const long blk = i * 8 + j;
            for (int c = 0; c < NC; ++c) {
                const long rb = (m0 + c) * x.nblocks + blk;
                const int32_t* corr = px.corr.data() + rb * 8;
                __m512i lo = paired_corr(corr), hi = paired_corr(corr + 4);
                lo = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(lo, uu[0], paired_x(px, rb, 0)), uu[1],
                                         paired_x(px, rb, 1));
                hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(hi, uu[2], paired_x(px, rb, 2)), uu[3],
                                         paired_x(px, rb, 3));
                const __m512 xs = paired_scales(px, rb);
                acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(s_lo, xs), _mm512_cvtepi32_ps(lo), acc[c]);
                acc[c] = _mm512_fmadd_ps(_mm512_mul_ps(s_hi, xs), _mm512_cvtepi32_ps(hi), acc[c]);
            }
        }
    }
    x4_store_paired<NC>(acc, m0, y, ldy, n0, bias);
}

thread_local PairedRows t_kx4_paired;
#endif

thread_local std::vector<__m256i> t_q6k_corrections;

// 32 codes of sub-block j of a source super-block, unsigned, in element order (Q6_K: 0..63, before − 32).
void source_codes(int type, const uint8_t* sb, int j, uint8_t out[32]) {
    __m256i v = type == kQ4_K ? Q4_K::codes(sb, j) : _mm256_add_epi8(Q6_K::codes(sb, j), _mm256_set1_epi8(32));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), v);
}

void q4k_scale_bytes(const uint8_t* sb, uint8_t sc[8], uint8_t mn[8]) {  // the 6-bit values of k_scales_mins
    const uint8_t* q = sb + 4;
    for (int j = 0; j < 8; ++j) {
        if (j < 4) {
            sc[j] = q[j] & 63;
            mn[j] = q[j + 4] & 63;
        } else {
            sc[j] = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
            mn[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
        }
    }
}

}  // namespace

bool has_kx4(int type) { return type == kQ4_K || type == kQ6_K; }

long kx4_group_bytes(int type) { return type == kQ4_K ? kQ4KBytes : type == kQ6_K ? kQ6KBytes : 0; }

void repack_kx4(int type, const uint8_t* src, long N, long K, uint8_t* dst) {
    const long nsuper = K / 256, sb_bytes = type == kQ4_K ? 144 : 210, row_bytes = nsuper * sb_bytes;
    const long gb = kx4_group_bytes(type);
    for (long g = 0; g < N / 4; ++g)
        for (long i = 0; i < nsuper; ++i) {
            uint8_t* out = dst + (g * nsuper + i) * gb;
            const uint8_t* sb[4];
            for (int r = 0; r < 4; ++r) sb[r] = src + (4 * g + r) * row_bytes + i * sb_bytes;
            uint8_t* codes_at;
            if (type == kQ4_K) {
                for (int r = 0; r < 4; ++r) {
                    std::memcpy(out + 2 * r, sb[r], 2);
                    std::memcpy(out + 8 + 2 * r, sb[r] + 2, 2);
                    uint8_t sc[8], mn[8];
                    q4k_scale_bytes(sb[r], sc, mn);
                    for (int j = 0; j < 8; ++j) {
                        out[16 + 4 * j + r] = sc[j];
                        out[48 + 4 * j + r] = mn[j];
                    }
                }
                codes_at = out + 80;
            } else {
                for (int r = 0; r < 4; ++r) {
                    std::memcpy(out + 2 * r, sb[r] + 208, 2);
                    for (int h = 0; h < 16; ++h) out[8 + 4 * h + r] = sb[r][192 + h];
                }
                codes_at = out + 72;
            }
            const long step = type == kQ4_K ? 64 : 96;
            for (int j = 0; j < 8; ++j) {
                uint8_t codes[4][32], u[4][32];
                for (int r = 0; r < 4; ++r) source_codes(type, sb[r], j, codes[r]);
                for (int k = 0; k < 4; ++k)
                    for (int r = 0; r < 4; ++r)
                        for (int e = 0; e < 8; ++e) u[k][8 * r + e] = codes[r][8 * k + e];
                uint8_t* c = codes_at + step * j;
                for (int b = 0; b < 32; ++b) {
                    c[b] = static_cast<uint8_t>((u[0][b] & 15) | ((u[1][b] & 15) << 4));
                    c[32 + b] = static_cast<uint8_t>((u[2][b] & 15) | ((u[3][b] & 15) << 4));
                    if (type == kQ6_K)
                        c[64 + b] = static_cast<uint8_t>((u[0][b] >> 4) | ((u[1][b] >> 4) << 2) |
                                                         ((u[2][b] >> 4) << 4) | ((u[3][b] >> 4) << 6));
                }
            }
        }
}

// Rows [b, e) (multiples of 4) of one interleaved K-quant weight against all M activation rows.
void rows_kx4(const X4Product& p, const QuantizedRows& x, long M, long b, long e) {
    const long nsuper = p.k / 256, group_bytes = nsuper * kx4_group_bytes(p.ggml_type);
    const bool two = x.q2 != nullptr;
#if BD_AVX512
    if (two) {
        pair_planes(x, M, p.ggml_type == kQ6_K ? 16 : 0, 32, t_kx4_paired);
        for (long n = b; n < e; n += 4) {
            const uint8_t* g = p.w + (n / 4) * group_bytes;
            for_each_tile(M, kTwoPlaneTile, [&](auto nc, long m) {
                constexpr int NC = decltype(nc)::value;
                if (p.ggml_type == kQ4_K)
                    group_q4k_paired<NC>(g, nsuper, t_kx4_paired, x, m, p.y, p.n, n, p.bias);
                else
                    group_q6k_paired<NC>(g, nsuper, t_kx4_paired, x, m, p.y, p.n, n, p.bias);
            });
        }
        return;
    }
#endif
    if (p.ggml_type == kQ6_K) offset_corrections(x, M, 16, 32, t_q6k_corrections);
    const __m256i* corr = t_q6k_corrections.data();
    const int most = two ? kTwoPlaneTile : kOnePlaneTile;
    for (long n = b; n < e; n += 4) {
        const uint8_t* g = p.w + (n / 4) * group_bytes;
        for_each_tile(M, most, [&](auto nc, long m) {
            constexpr int NC = decltype(nc)::value;
            if (!two) {
                if (p.ggml_type == kQ4_K)
                    group_q4k<NC, false>(g, nsuper, x, m, p.y, p.n, n, p.bias);
                else
                    group_q6k<NC, false>(g, nsuper, x, corr, m, p.y, p.n, n, p.bias);
            } else if constexpr (!BD_AVX512) {  // AVX-512 took q16 rows to the paired kernels above
                if (p.ggml_type == kQ4_K)
                    group_q4k<NC, true>(g, nsuper, x, m, p.y, p.n, n, p.bias);
                else
                    group_q6k<NC, true>(g, nsuper, x, corr, m, p.y, p.n, n, p.bias);
            }
        });
    }
}

}  // namespace bd
