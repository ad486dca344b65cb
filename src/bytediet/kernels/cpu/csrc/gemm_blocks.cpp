// y = x · Wᵀ (+ bias) for W in a GGML block format, read in place (each packed byte once per call).
//   W: (N, K) as N rows of K/32/SUB super-blocks; x: (M, K) float32; y: (M, N) float32 (row stride ldy).
// Two activation modes (a measured accuracy/speed trade, see kernels/reference.py for the exact math):
//   q8  — x is quantized once per call to int8 blocks of 32 (scale d = amax/127, codes round(x/d), the
//         block's d·Σcodes kept for the zero-point term) and dotted with integer instructions
//         (AVX2 maddubs / AVX-512 VNNI vpdpbusd), as llama.cpp's vec_dot_*_q8_*;
//   f32 — codes are widened to float in registers and multiplied with the float activations.
// Tiles of NR weight rows × NC activation rows share every load: a weight block is unpacked once for
// NC activation rows, an activation block loaded once for NR weight rows.
#include <algorithm>
#include <cmath>
#include <vector>

#include "block_formats.h"
#include "gemm_blocks.h"
#include "threadpool.h"

namespace bd {
namespace {

// The scale of each int32 lane of a sub-block's dot product times the activation block's scale xd.
template <class F>
inline __m256 lane_scale(const SubScales& s, int j, float xd) {
    if constexpr (F::SPLIT)
        return _mm256_set_m128(_mm_set1_ps(s.d_hi[j] * xd), _mm_set1_ps(s.d_lo[j] * xd));
    else
        return _mm256_set1_ps(s.d_lo[j] * xd);
}

template <class F>
inline __m256i dot_codes(__m256i codes, __m256i xq) {
    if constexpr (F::SIGNED)
        return dot_s8s8(codes, xq);
    else
        return dot_u8s8(codes, xq);
}

// y[c][n0 + r] = row_scale_r · (Σ lanes + zero term) + bias.
template <class F, int NR, int NC>
inline void store_tile(const __m256 (&acc)[NR][NC], const float (&zero_term)[NR][NC], const uint8_t* w, long row_bytes,
                       float* y, long ldy, long n0, const float* bias) {
    for (int r = 0; r < NR; ++r) {
        const float rs = F::row_scale(w + r * row_bytes);
        for (int c = 0; c < NC; ++c) {
            float v = hsum(acc[r][c]) + zero_term[r][c];
            if constexpr (F::HEADER != 0) v *= rs;
            y[c * ldy + n0 + r] = v + (bias ? bias[n0 + r] : 0.0f);
        }
    }
}

template <class F, int NR, int NC, bool TWO = false>
void tile_q8(const uint8_t* w, long row_bytes, long nsuper, const QuantizedRows& x, long m0, float* y, long ldy,
             long n0, const float* bias) {
    __m256 acc[NR][NC];
    float zero_term[NR][NC];
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NC; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            zero_term[r][c] = 0.0f;
        }
    SubScales sc[NR];
    for (long i = 0; i < nsuper; ++i) {
        for (int r = 0; r < NR; ++r) prefetch_weights(w + r * row_bytes + F::HEADER + i * F::BYTES, F::BYTES);
        for (int r = 0; r < NR; ++r) F::scales(w + r * row_bytes + F::HEADER + i * F::BYTES, sc[r]);
        for (int j = 0; j < F::SUB; ++j) {
            const long blk = i * F::SUB + j;
            __m256i xq[NC], xq2[NC];
            float xd[NC], xd2[NC], xs[NC];
            for (int c = 0; c < NC; ++c) {
                xq[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (m0 + c) * x.k + blk * 32));
                xd[c] = x.d[(m0 + c) * x.nblocks + blk];
                xs[c] = x.s[(m0 + c) * x.nblocks + blk];
                if constexpr (TWO) {
                    xq2[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q2 + (m0 + c) * x.k + blk * 32));
                    xd2[c] = x.d2[(m0 + c) * x.nblocks + blk];
                }
            }
            for (int r = 0; r < NR; ++r) {
                const __m256i codes = F::codes(w + r * row_bytes + F::HEADER + i * F::BYTES, j);
                for (int c = 0; c < NC; ++c) {
                    __m256 p = _mm256_cvtepi32_ps(dot_codes<F>(codes, xq[c]));
                    acc[r][c] = _mm256_fmadd_ps(lane_scale<F>(sc[r], j, xd[c]), p, acc[r][c]);
                    if constexpr (TWO)  // the second plane against the same unpacked codes
                        acc[r][c] = _mm256_fmadd_ps(lane_scale<F>(sc[r], j, xd2[c]),
                                                    _mm256_cvtepi32_ps(dot_codes<F>(codes, xq2[c])), acc[r][c]);
                    zero_term[r][c] += sc[r].m[j] * xs[c];
                }
            }
        }
    }
    store_tile<F, NR, NC>(acc, zero_term, w, row_bytes, y + m0 * ldy, ldy, n0, bias);
}

template <class F>
inline void widen_codes(__m256i codes, __m256 out[4]) {
    alignas(32) uint8_t bytes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), codes);
    for (int k = 0; k < 4; ++k) out[k] = F::SIGNED ? load_s8_as_f32(bytes + 8 * k) : load_u8_as_f32(bytes + 8 * k);
}

// Sub-block j of the block at b as 32 floats before its scales: integer codes widened, or a FLOAT format's values.
template <class F>
inline void weights_f32(const uint8_t* b, int j, __m256 out[4]) {
    if constexpr (is_float_format<F>::value)
        F::values(b, j, out);
    else
        widen_codes<F>(F::codes(b, j), out);
}

template <class F, int NR, int NC>
void tile_f32(const uint8_t* w, long row_bytes, long nsuper, const FloatRows& x, long m0, float* y, long ldy, long n0,
              const float* bias) {
    __m256 acc[NR][NC];
    float zero_term[NR][NC];
    for (int r = 0; r < NR; ++r)
        for (int c = 0; c < NC; ++c) {
            acc[r][c] = _mm256_setzero_ps();
            zero_term[r][c] = 0.0f;
        }
    SubScales sc[NR];
    for (long i = 0; i < nsuper; ++i) {
        for (int r = 0; r < NR; ++r) F::scales(w + r * row_bytes + F::HEADER + i * F::BYTES, sc[r]);
        for (int j = 0; j < F::SUB; ++j) {
            const long blk = i * F::SUB + j;
            for (int r = 0; r < NR; ++r) {
                if constexpr (is_gather_format<F>::value) {  // products of the stored values only (2:4)
                    const auto p = F::prepare(w + r * row_bytes + F::HEADER + i * F::BYTES, j);
                    for (int c = 0; c < NC; ++c) {
                        const __m256 d = F::dot(p, x.x + (m0 + c) * x.k + blk * 32);
                        acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r].d_lo[j]), d, acc[r][c]);
                        zero_term[r][c] += sc[r].m[j] * x.s[(m0 + c) * x.nblocks + blk];
                    }
                    continue;
                }
                __m256 q[4];
                weights_f32<F>(w + r * row_bytes + F::HEADER + i * F::BYTES, j, q);
                for (int c = 0; c < NC; ++c) {
                    const float* xp = x.x + (m0 + c) * x.k + blk * 32;
                    __m256 lo =
                        _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), _mm256_mul_ps(q[0], _mm256_loadu_ps(xp)));
                    __m256 hi =
                        _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), _mm256_mul_ps(q[2], _mm256_loadu_ps(xp + 16)));
                    acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r].d_lo[j]), lo, acc[r][c]);
                    acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(sc[r].d_hi[j]), hi, acc[r][c]);
                    zero_term[r][c] += sc[r].m[j] * x.s[(m0 + c) * x.nblocks + blk];
                }
            }
        }
    }
    store_tile<F, NR, NC>(acc, zero_term, w, row_bytes, y + m0 * ldy, ldy, n0, bias);
}

// One thread's share: weight rows [n_begin, n_end) against all M activation rows.
template <class F, class Rows, int NR, int NC, class Tile, class TileTail, class Tile1, class Tile1Tail>
void rows_range(const uint8_t* w, long row_bytes, long nsuper, const Rows& x, long M, float* y, long ldy,
                const float* bias, long n_begin, long n_end, Tile tile, TileTail tile_tail, Tile1 tile1,
                Tile1Tail tile1_tail) {
    long n = n_begin;
    for (; n + NR <= n_end; n += NR) {
        long m = 0;
        for (; m + NC <= M; m += NC) tile(w + n * row_bytes, row_bytes, nsuper, x, m, y, ldy, n, bias);
        for (; m < M; ++m) tile_tail(w + n * row_bytes, row_bytes, nsuper, x, m, y, ldy, n, bias);
    }
    for (; n < n_end; ++n) {
        long m = 0;
        for (; m + NC <= M; m += NC) tile1(w + n * row_bytes, row_bytes, nsuper, x, m, y, ldy, n, bias);
        for (; m < M; ++m) tile1_tail(w + n * row_bytes, row_bytes, nsuper, x, m, y, ldy, n, bias);
    }
}

// The pool splits the weight rows; decode (M = 1) uses NR×1 tiles, batches NR×2, tails narrower tiles.
template <class F, class Rows, int NR, template <class, int, int> class Tile>
void gemm_rows(const uint8_t* w, long N, long K, const Rows& x, long M, float* y, long ldy, const float* bias) {
    const long nsuper = K / (32 * F::SUB), row_bytes = F::HEADER + nsuper * F::BYTES;
    parallel_run([&](int t, int nt) {
        long b, e;
        split_range(N, nt, t, 4, &b, &e);
        if (M == 1)
            rows_range<F, Rows, 4, 1>(w, row_bytes, nsuper, x, M, y, ldy, bias, b, e, Tile<F, 4, 1>::run,
                                      Tile<F, 4, 1>::run, Tile<F, 1, 1>::run, Tile<F, 1, 1>::run);
        else
            rows_range<F, Rows, NR, 2>(w, row_bytes, nsuper, x, M, y, ldy, bias, b, e, Tile<F, NR, 2>::run,
                                       Tile<F, NR, 1>::run, Tile<F, 1, 2>::run, Tile<F, 1, 1>::run);
    });
}

template <class F, int NR, int NC>
struct TileQ8 {
    static constexpr auto run = tile_q8<F, NR, NC, false>;
};

template <class F, int NR, int NC>
struct TileQ16 {
    static constexpr auto run = tile_q8<F, NR, NC, true>;
};

template <class F, int NR, int NC>
struct TileF32 {
    static constexpr auto run = tile_f32<F, NR, NC>;
};

template <class F>
void gemm_q8(const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy, const float* bias) {
    if (x.q2 != nullptr)
        gemm_rows<F, QuantizedRows, 4, TileQ16>(w, N, K, x, M, y, ldy, bias);
    else
        gemm_rows<F, QuantizedRows, 4, TileQ8>(w, N, K, x, M, y, ldy, bias);
}

template <class F>
void gemm_f32(const uint8_t* w, long N, long K, const FloatRows& x, long M, float* y, long ldy, const float* bias) {
    gemm_rows<F, FloatRows, 2, TileF32>(w, N, K, x, M, y, ldy, bias);
}

}  // namespace

// One block of 32: d = amax/127, codes = round-half-even(x · (1/d)); returns Σ codes.
inline int quantize_block(const __m256 v[4], int8_t* q, float* d) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 amax = _mm256_setzero_ps();
    for (int k = 0; k < 4; ++k) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[k]));
    const float dv = hmax(amax) / 127.0f;
    const float id = dv != 0.0f ? 1.0f / dv : 0.0f;
    __m256i qi[4];
    for (int k = 0; k < 4; ++k)
        qi[k] = _mm256_cvtps_epi32(
            _mm256_round_ps(_mm256_mul_ps(v[k], _mm256_set1_ps(id)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));  // undo the lane interleave
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *d = dv;
    return _mm_cvtsi128_si32(s4);
}

// Fewer activation blocks than this are quantized on the caller's thread: a decode row (20–64 blocks, ~1 µs)
// costs less than one parallel region's synchronisation, and a decode step quantizes four rows per layer.
constexpr long kParallelQuantizeBlocks = 256;

void quantize_rows_q8(const float* x, long M, long K, int8_t* q, float* d, float* s) {
    const long nb = K / 32;
    (M * nb >= kParallelQuantizeBlocks ? parallel_run : run_here)([&](int t, int nt) {
        long b, e;
        split_range(M * nb, nt, t, 1, &b, &e);
        for (long blk = b; blk < e; ++blk) {  // rows are contiguous, so block index = row * nb + block
            __m256 v[4];
            for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + blk * 32 + 8 * k);
            const int sum = quantize_block(v, q + blk * 32, d + blk);
            s[blk] = d[blk] * static_cast<float>(sum);
        }
    });
}

// Two int8 planes: x ≈ d·q + d2·q2, q2 the codes of the rounding error x − d·q (computed as a product, then a
// difference: two float32 roundings, as the reference). The error left is ≤ amax/64516 per block, int16-like.
void quantize_rows_q16(const float* x, long M, long K, int8_t* q, float* d, int8_t* q2, float* d2, float* s) {
    const long nb = K / 32;
    (M * nb >= kParallelQuantizeBlocks ? parallel_run : run_here)([&](int t, int nt) {
        long b, e;
        split_range(M * nb, nt, t, 1, &b, &e);
        for (long blk = b; blk < e; ++blk) {
            __m256 v[4], r[4];
            for (int k = 0; k < 4; ++k) v[k] = _mm256_loadu_ps(x + blk * 32 + 8 * k);
            const int sum1 = quantize_block(v, q + blk * 32, d + blk);
            const __m256 dv = _mm256_set1_ps(d[blk]);
            for (int k = 0; k < 4; ++k) {
                const __m256 qf = _mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + blk * 32 + 8 * k))));
                r[k] = _mm256_sub_ps(v[k], _mm256_mul_ps(qf, dv));
            }
            const int sum2 = quantize_block(r, q2 + blk * 32, d2 + blk);
            s[blk] = d[blk] * static_cast<float>(sum1) + d2[blk] * static_cast<float>(sum2);
        }
    });
}

// One scale per row (SmoothQuant's per-token W8A8): d = amax(row)/127, codes = round-half-even(x · (1/d)) for the
// whole row, and every block of the row carries that d (so the block kernels multiply it unchanged).
void quantize_rows_per_token(const float* x, long M, long K, int8_t* q, float* d, float* s) {
    const long nb = K / 32;
    parallel_run([&](int t, int nt) {
        long b, e;
        split_range(M, nt, t, 1, &b, &e);
        const __m256 sign = _mm256_set1_ps(-0.0f);
        for (long m = b; m < e; ++m) {
            const float* xr = x + m * K;
            __m256 amax = _mm256_setzero_ps();
            for (long i = 0; i < K; i += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(xr + i)));
            const float dv = hmax(amax) / 127.0f;
            const __m256 id = _mm256_set1_ps(dv != 0.0f ? 1.0f / dv : 0.0f);
            for (long blk = 0; blk < nb; ++blk) {
                __m256i qi[4];
                for (int k = 0; k < 4; ++k)
                    qi[k] =
                        _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + blk * 32 + 8 * k), id),
                                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
                __m256i sum = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
                __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
                p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + m * K + blk * 32), p);
                __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
                s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
                d[m * nb + blk] = dv;
                s[m * nb + blk] = dv * static_cast<float>(_mm_cvtsi128_si32(s4));
            }
        }
    });
}

QuantizedRows QuantizedActivations::quantize_per_token(const float* x, long M, long K) {
    const long nb = K / 32;
    q.resize(M * K);
    d.resize(M * nb);
    s.resize(M * nb);
    quantize_rows_per_token(x, M, K, q.data(), d.data(), s.data());
    return QuantizedRows{q.data(), d.data(), s.data(), K, nb};
}

QuantizedRows QuantizedActivations::quantize(const float* x, long M, long K, bool two_planes) {
    const long nb = K / 32, planes = two_planes ? 2 : 1;
    q.resize(planes * M * K);
    d.resize(planes * M * nb);
    s.resize(M * nb);
    QuantizedRows rows{q.data(), d.data(), s.data(), K, nb};
    if (two_planes) {
        rows.q2 = q.data() + M * K;
        rows.d2 = d.data() + M * nb;
        quantize_rows_q16(x, M, K, q.data(), d.data(), q.data() + M * K, d.data() + M * nb, s.data());
    } else {
        quantize_rows_q8(x, M, K, q.data(), d.data(), s.data());
    }
    return rows;
}

void block_sums(const float* x, long M, long K, float* s) {
    const long nb = M * (K / 32);
    for (long blk = 0; blk < nb; ++blk) {
        const float* xp = x + blk * 32;
        __m256 a = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xp), _mm256_loadu_ps(xp + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(xp + 16), _mm256_loadu_ps(xp + 24)));
        s[blk] = hsum(a);
    }
}

// Returns 0, -1 for an unknown type, -3 for a FLOAT format (no integer kernel: multiply it with f32 activations).
int gemm_blocks_q8(int ggml_type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
                   const float* bias) {
    int rc = 0;
    const int found = with_format(ggml_type, [&](auto f) {
        using F = decltype(f);
        if constexpr (is_float_format<F>::value)
            rc = -3;
        else
            gemm_q8<F>(w, N, K, x, M, y, ldy, bias);
    });
    return found != 0 ? found : rc;
}

int gemm_blocks_f32(int ggml_type, const uint8_t* w, long N, long K, const FloatRows& x, long M, float* y, long ldy,
                    const float* bias) {
    return with_format(ggml_type, [&](auto f) { gemm_f32<decltype(f)>(w, N, K, x, M, y, ldy, bias); });
}

// Rows [0, N) of W decoded to float32 (N, K): codes widened, times the sub-block scale, plus its term, times
// the row scale — the reference decoders' values, for the compute-bound path (large batches) that multiplies
// with a float GEMM.
// 8 floats stored as float32, or as bfloat16 rounded to nearest even (torch's .to(torch.bfloat16) for finite values).
inline void store8(float* o, __m256 v) { _mm256_storeu_ps(o, v); }

inline void store8(uint16_t* o, __m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(o),
                     _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

template <class F, class Out>
void dequantize_rows(const uint8_t* w, long N, long K, Out* out) {
    const long nsuper = K / (32 * F::SUB), row_bytes = F::HEADER + nsuper * F::BYTES;
    parallel_run([&](int t, int nt) {
        long b, e;
        split_range(N, nt, t, 1, &b, &e);
        SubScales sc;
        for (long n = b; n < e; ++n) {
            const uint8_t* row = w + n * row_bytes;
            const float rs = F::row_scale(row);
            Out* o = out + n * K;
            for (long i = 0; i < nsuper; ++i) {
                const uint8_t* blk = row + F::HEADER + i * F::BYTES;
                F::scales(blk, sc);
                for (int j = 0; j < F::SUB; ++j) {
                    __m256 q[4];
                    weights_f32<F>(blk, j, q);
                    const __m256 m = _mm256_set1_ps(sc.m[j]);
                    for (int k = 0; k < 4; ++k) {
                        const __m256 d = _mm256_set1_ps(k < 2 ? sc.d_lo[j] : sc.d_hi[j]);
                        __m256 v = _mm256_fmadd_ps(q[k], d, m);
                        if constexpr (F::HEADER != 0) v = _mm256_mul_ps(v, _mm256_set1_ps(rs));
                        store8(o + (i * F::SUB + j) * 32 + 8 * k, v);
                    }
                }
            }
        }
    });
}

int dequantize_blocks(int ggml_type, const uint8_t* w, long N, long K, float* out) {
    return with_format(ggml_type, [&](auto f) { dequantize_rows<decltype(f)>(w, N, K, out); });
}

int dequantize_blocks_bf16(int ggml_type, const uint8_t* w, long N, long K, uint16_t* out) {
    return with_format(ggml_type, [&](auto f) { dequantize_rows<decltype(f)>(w, N, K, out); });
}

int super_block_weights(int ggml_type) {
    int n = 0;
    with_format(ggml_type, [&](auto f) { n = 32 * decltype(f)::SUB; });
    return n;
}

}  // namespace bd

namespace {
thread_local bd::QuantizedActivations t_act;
thread_local std::vector<float> t_sums;
}  // namespace

extern "C" {

// act_mode: an Activations (types.h): Q8, F32, Q16, Q8_TOKEN (int8 per token). Returns 0, or -1 for a block type
// without a kernel, -2 for K not a multiple of the super-block, -3 for integer activations on a FLOAT format (fp8,
// sparse24 fp16).
int bd_gemm_blocks(int ggml_type, const uint8_t* w, long N, long K, const float* x, long M, float* y, const float* bias,
                   int act_mode) {
    const int sb = bd::super_block_weights(ggml_type);
    if (sb == 0) return -1;
    if (K % sb) return -2;
    const long nb = K / 32;
    const auto mode = static_cast<bd::Activations>(act_mode);
    if (mode == bd::Activations::Q8 || mode == bd::Activations::Q16)
        return bd::gemm_blocks_q8(ggml_type, w, N, K, t_act.quantize(x, M, K, mode == bd::Activations::Q16), M, y, N,
                                  bias);
    if (mode == bd::Activations::Q8_TOKEN)  // int8 per token (int8-w8a8)
        return bd::gemm_blocks_q8(ggml_type, w, N, K, t_act.quantize_per_token(x, M, K), M, y, N, bias);
    t_sums.resize(M * nb);
    bd::block_sums(x, M, K, t_sums.data());
    bd::FloatRows rows{x, t_sums.data(), K, nb};
    return bd::gemm_blocks_f32(ggml_type, w, N, K, rows, M, y, N, bias);
}

// W (N, K) in a block layout → float32 out (N, K). Returns 0, -1 for an unknown type, -2 for K not whole blocks.
int bd_dequantize_blocks(int ggml_type, const uint8_t* w, long N, long K, float* out) {
    const int sb = bd::super_block_weights(ggml_type);
    if (sb == 0) return -1;
    if (K % sb) return -2;
    return bd::dequantize_blocks(ggml_type, w, N, K, out);
}

// The same values rounded to bfloat16 (for a bf16 GEMM on CPUs that multiply bf16 fast).
int bd_dequantize_blocks_bf16(int ggml_type, const uint8_t* w, long N, long K, uint16_t* out) {
    const int sb = bd::super_block_weights(ggml_type);
    if (sb == 0) return -1;
    if (K % sb) return -2;
    return bd::dequantize_blocks_bf16(ggml_type, w, N, K, out);
}

void bd_quantize_rows_q8(const float* x, long M, long K, int8_t* q, float* d, float* s) {
    bd::quantize_rows_q8(x, M, K, q, d, s);
}

void bd_quantize_rows_per_token(const float* x, long M, long K, int8_t* q, float* d, float* s) {
    bd::quantize_rows_per_token(x, M, K, q, d, s);
}

void bd_quantize_rows_q16(const float* x, long M, long K, int8_t* q, float* d, int8_t* q2, float* d2, float* s) {
    bd::quantize_rows_q16(x, M, K, q, d, q2, d2, s);
}
}
