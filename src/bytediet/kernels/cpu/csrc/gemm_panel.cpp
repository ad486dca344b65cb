// The compute-bound product of a prefill chunk: y = x · Wᵀ (+ bias) with x (M, K) float32 quantized to the
// q16 activation mode (two int8 planes per block of 32, kernels/reference.py quantize_rows_q16) and W (N, K) in
// any integer-code block format of block_formats.h, on AVX-512 VNNI (vpdpbusd, 64 byte products per
// instruction). The same numbers as the q16 row kernels of gemm_blocks.cpp (Σ_k w_k · x̂_k, x̂ the two planes'
// value), at the rate of a register-blocked GEMM:
//   * the weight is unpacked once per call, a panel of 32 rows at a time, into a scratch layout that the
//     inner loop reads with one 64-byte load per 16 rows × 4 weights: codes as unsigned bytes (signed formats
//     shifted by 128, the shift moved into the block's additive term), per 32-weight block (16 for Q6_K's
//     split scales) one float scale s and one float term c per row, so that weight = s · u + c exactly;
//   * a tile of MR activation rows × 32 weight rows keeps 2·MR·2 int32 accumulators (both planes) and MR·2
//     float accumulators in registers; per block it adds s·(d·Σu·q + d2·Σu·q2) + c·Σx̂ (Σx̂ the block's sum).
// Why: the fp32 GEMM (MKL) runs ~95 GFLOP/s per core on the Zen 5 VMs; a byte dot product does 4× the multiply-
// adds per instruction of an fp32 FMA, and q16's two planes keep the accuracy of the decode path (int16-like
// activations, bench/RESULTS.md "Activation precision") at half of that. Only the avx512vnni variant has it;
// the avx2 variant answers -4 and the caller keeps the float GEMM.
#include <vector>

#include "block_formats.h"
#include "gemm_blocks.h"
#include "threadpool.h"

namespace bd {

#if BD_AVX512
namespace {

constexpr int kPanel = 32;  // weight rows per panel: two zmm vectors of 16 int32 lanes

// One panel's unpacked weight: for block b (32 weights along K), codes[b][quad][row][4 bytes], then
// s[b][row], c[b][row] (and s_hi/c_hi for SPLIT formats: the scale and term of weights 16..31).
struct Panel {
    std::vector<uint8_t> codes;
    std::vector<float> s, c, s_hi, c_hi;
    void resize(long nblocks, bool split) {
        codes.resize(nblocks * 8 * kPanel * 4);
        s.resize(nblocks * kPanel);
        c.resize(nblocks * kPanel);
        if (split) {
            s_hi.resize(nblocks * kPanel);
            c_hi.resize(nblocks * kPanel);
        }
    }
};

template <class F>
void unpack_panel(const uint8_t* w, long row_bytes, long n0, long rows, long nsuper, Panel& p) {
    const long nblocks = nsuper * F::SUB;
    SubScales sc;
    alignas(32) uint32_t dw[8];
    for (long r = 0; r < kPanel; ++r) {
        if (r >= rows) {  // rows past N: zero weights
            for (long b = 0; b < nblocks; ++b) {
                for (int q = 0; q < 8; ++q) std::memset(&p.codes[((b * 8 + q) * kPanel + r) * 4], 0, 4);
                p.s[b * kPanel + r] = p.c[b * kPanel + r] = 0.0f;
                if constexpr (F::SPLIT) p.s_hi[b * kPanel + r] = p.c_hi[b * kPanel + r] = 0.0f;
            }
            continue;
        }
        const uint8_t* row = w + (n0 + r) * row_bytes;
        const float rs = F::row_scale(row);
        for (long i = 0; i < nsuper; ++i) {
            const uint8_t* blk = row + F::HEADER + i * F::BYTES;
            F::scales(blk, sc);
            for (int j = 0; j < F::SUB; ++j) {
                const long b = i * F::SUB + j;
                __m256i u = F::codes(blk, j);
                if constexpr (F::SIGNED) u = _mm256_xor_si256(u, _mm256_set1_epi8(static_cast<char>(0x80)));
                _mm256_store_si256(reinterpret_cast<__m256i*>(dw), u);
                for (int q = 0; q < 8; ++q) std::memcpy(&p.codes[((b * 8 + q) * kPanel + r) * 4], &dw[q], 4);
                // weight = d · code + m, code = u − 128 for a signed format; then times the row scale
                const float s_lo = sc.d_lo[j] * rs, s_hi = sc.d_hi[j] * rs, m = sc.m[j] * rs;
                p.s[b * kPanel + r] = s_lo;
                p.c[b * kPanel + r] = F::SIGNED ? m - 128.0f * s_lo : m;
                if constexpr (F::SPLIT) {
                    p.s_hi[b * kPanel + r] = s_hi;
                    p.c_hi[b * kPanel + r] = F::SIGNED ? m - 128.0f * s_hi : m;
                }
            }
        }
    }
}

inline __m512i bcast4(const int8_t* p) {
    int v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Σ over quads [q0, q1) of one block: acc[r][v] (plane 1) and acc2[r][v] (plane 2) for MR rows, 2 vectors.
template <int MR>
inline void dot_quads(const uint8_t* codes, const int8_t* x1, const int8_t* x2, long K, int q0, int q1,
                      __m512i acc[MR][2], __m512i acc2[MR][2]) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < 2; ++v) acc[r][v] = acc2[r][v] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int q = q0; q < q1; ++q) {
        const __m512i w0 = _mm512_loadu_si512(codes + q * kPanel * 4);
        const __m512i w1 = _mm512_loadu_si512(codes + q * kPanel * 4 + 64);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m512i a = bcast4(x1 + r * K + 4 * q), b = bcast4(x2 + r * K + 4 * q);
            acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, a);
            acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, a);
            acc2[r][0] = _mm512_dpbusd_epi32(acc2[r][0], w0, b);
            acc2[r][1] = _mm512_dpbusd_epi32(acc2[r][1], w1, b);
        }
    }
}

// f[r][v] += s[v] · (d[r] · acc[r][v] + d2[r] · acc2[r][v])
template <int MR>
inline void fold(const float* s, const float* d, const float* d2, long nb, __m512i acc[MR][2], __m512i acc2[MR][2],
                 __m512 f[MR][2]) {
    const __m512 s0 = _mm512_loadu_ps(s), s1 = _mm512_loadu_ps(s + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m512 dr = _mm512_set1_ps(d[r * nb]), d2r = _mm512_set1_ps(d2[r * nb]);
        const __m512 t0 =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc2[r][0]), d2r, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][0]), dr));
        const __m512 t1 =
            _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc2[r][1]), d2r, _mm512_mul_ps(_mm512_cvtepi32_ps(acc[r][1]), dr));
        f[r][0] = _mm512_fmadd_ps(t0, s0, f[r][0]);
        f[r][1] = _mm512_fmadd_ps(t1, s1, f[r][1]);
    }
}

// f[r][v] += c[v] · xs[r]
template <int MR>
inline void add_term(const float* c, const float* xs, long nb, __m512 f[MR][2]) {
    const __m512 c0 = _mm512_loadu_ps(c), c1 = _mm512_loadu_ps(c + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        const __m512 x = _mm512_set1_ps(xs[r * nb]);
        f[r][0] = _mm512_fmadd_ps(c0, x, f[r][0]);
        f[r][1] = _mm512_fmadd_ps(c1, x, f[r][1]);
    }
}

// Rows m0..m0+MR of y, columns n0..n0+cols (cols ≤ 32) from one unpacked panel.
// xs: the blocks' sums Σx̂ (M, nb); for SPLIT formats xs_lo/xs_hi the sums of each block's two halves.
template <int MR, bool SPLIT>
void panel_tile(const Panel& p, const QuantizedRows& x, const float* xs_lo, const float* xs_hi, long m0, float* y,
                long ldy, long n0, long cols, const float* bias) {
    const long K = x.k, nb = x.nblocks;
    __m512 f[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) f[r][0] = f[r][1] = _mm512_setzero_ps();
    __m512i acc[MR][2], acc2[MR][2];
    const int8_t* x1 = x.q + m0 * K;
    const int8_t* x2 = x.q2 + m0 * K;
    const float* d = x.d + m0 * nb;
    const float* d2 = x.d2 + m0 * nb;
    for (long b = 0; b < nb; ++b) {
        const uint8_t* codes = p.codes.data() + b * 8 * kPanel * 4;
        if constexpr (SPLIT) {
            dot_quads<MR>(codes, x1 + 32 * b, x2 + 32 * b, K, 0, 4, acc, acc2);
            fold<MR>(p.s.data() + b * kPanel, d + b, d2 + b, nb, acc, acc2, f);
            dot_quads<MR>(codes, x1 + 32 * b, x2 + 32 * b, K, 4, 8, acc, acc2);
            fold<MR>(p.s_hi.data() + b * kPanel, d + b, d2 + b, nb, acc, acc2, f);
            add_term<MR>(p.c.data() + b * kPanel, xs_lo + m0 * nb + b, nb, f);
            add_term<MR>(p.c_hi.data() + b * kPanel, xs_hi + m0 * nb + b, nb, f);
        } else {
            dot_quads<MR>(codes, x1 + 32 * b, x2 + 32 * b, K, 0, 8, acc, acc2);
            fold<MR>(p.s.data() + b * kPanel, d + b, d2 + b, nb, acc, acc2, f);
            add_term<MR>(p.c.data() + b * kPanel, x.s + m0 * nb + b, nb, f);
        }
    }
    for (int v = 0; v < 2; ++v) {
        const long c0 = 16 * v;
        if (c0 >= cols) break;
        const long n = cols - c0 < 16 ? cols - c0 : 16;
        const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1u);
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(mask, bias + n0 + c0) : _mm512_setzero_ps();
        for (int r = 0; r < MR; ++r)
            _mm512_mask_storeu_ps(y + (m0 + r) * ldy + n0 + c0, mask, _mm512_add_ps(f[r][v], bv));
    }
}

// The sums of each block's halves (weights 0..15 and 16..31) of the quantized activation, for Q6_K's split scales.
void half_sums(const QuantizedRows& x, long M, std::vector<float>& lo, std::vector<float>& hi) {
    const long nb = x.nblocks;
    lo.resize(M * nb);
    hi.resize(M * nb);
    for (long i = 0; i < M * nb; ++i) {
        const int8_t* q1 = x.q + i * 32;
        const int8_t* q2 = x.q2 + i * 32;
        int a1 = 0, a2 = 0, b1 = 0, b2 = 0;
        for (int e = 0; e < 16; ++e) {
            a1 += q1[e], a2 += q2[e];
            b1 += q1[16 + e], b2 += q2[16 + e];
        }
        lo[i] = x.d[i] * static_cast<float>(a1) + x.d2[i] * static_cast<float>(a2);
        hi[i] = x.d[i] * static_cast<float>(b1) + x.d2[i] * static_cast<float>(b2);
    }
}

constexpr int kMR = 4;  // activation rows per register tile (2·4·2 int32 + 4·2 float accumulators)

template <class F>
void gemm_panel(const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
                const float* bias) {
    const long nsuper = K / (32 * F::SUB), row_bytes = F::HEADER + nsuper * F::BYTES;
    const long npanels = (N + kPanel - 1) / kPanel;
    static thread_local std::vector<float> xs_lo, xs_hi;
    if constexpr (F::SPLIT) half_sums(x, M, xs_lo, xs_hi);
    const float* lo = xs_lo.data();  // the caller's buffers (a thread_local named inside the region is the worker's)
    const float* hi = xs_hi.data();
    parallel_run([&](int t, int nt) {
        static thread_local Panel panel;
        panel.resize(nsuper * F::SUB, F::SPLIT);
        long pb, pe;
        split_range(npanels, nt, t, 1, &pb, &pe);
        for (long pi = pb; pi < pe; ++pi) {
            const long n0 = pi * kPanel, cols = N - n0 < kPanel ? N - n0 : kPanel;
            unpack_panel<F>(w, row_bytes, n0, cols, nsuper, panel);
            long m = 0;
            for (; m + kMR <= M; m += kMR) panel_tile<kMR, F::SPLIT>(panel, x, lo, hi, m, y, ldy, n0, cols, bias);
            for (; m < M; ++m) panel_tile<1, F::SPLIT>(panel, x, lo, hi, m, y, ldy, n0, cols, bias);
        }
    });
}

}  // namespace
#endif

int gemm_panel_q16(int ggml_type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
                   const float* bias) {
#if BD_AVX512
    if (x.q2 == nullptr) return -4;
    int rc = 0;
    const int found = with_format(ggml_type, [&](auto f) {
        using F = decltype(f);
        if constexpr (is_float_format<F>::value)
            rc = -3;
        else
            gemm_panel<F>(w, N, K, x, M, y, ldy, bias);
    });
    return found != 0 ? found : rc;
#else
    (void)ggml_type, (void)w, (void)N, (void)K, (void)x, (void)M, (void)y, (void)ldy, (void)bias;
    return -4;
#endif
}

}  // namespace bd

extern "C" {

// Whether this variant has the panel GEMM for this type: 1, or 0 (no VNNI in this build, a FLOAT format, an
// unknown type).
int bd_has_gemm_panel(int ggml_type) {
#if BD_AVX512
    int ok = 0;
    if (bd::with_format(ggml_type, [&](auto f) { ok = !bd::is_float_format<decltype(f)>::value; }) != 0) return 0;
    return ok;
#else
    (void)ggml_type;
    return 0;
#endif
}

// y (M, N) = x (M, K) · Wᵀ (+ bias) with q16 activations, W in the block format ggml_type (K a multiple of its
// super-block). Returns 0, -1 for an unknown type, -3 for a FLOAT format, -4 where this variant has no VNNI.
int bd_gemm_panel(int ggml_type, const uint8_t* w, long N, long K, const float* x, long M, float* y,
                  const float* bias) {
#if BD_AVX512
    if (!bd_has_gemm_panel(ggml_type)) return bd::with_format(ggml_type, [](auto) {}) != 0 ? -1 : -3;
    static thread_local bd::QuantizedActivations act;
    return bd::gemm_panel_q16(ggml_type, w, N, K, act.quantize(x, M, K, true), M, y, N, bias);
#else
    (void)ggml_type, (void)w, (void)N, (void)K, (void)x, (void)M, (void)y, (void)bias;
    return -4;
#endif
}

}  // extern "C"
