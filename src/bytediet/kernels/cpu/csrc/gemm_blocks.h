// Block-format matrix products (see gemm_blocks.cpp).
#pragma once
#include <cstdint>
#include <type_traits>
#include <vector>

#include "isa.h"

namespace bd {

// How far ahead of the weight bytes being multiplied the row kernels prefetch: the hardware's stream prefetcher
// stops at each 4 KiB page, and a decode step's weights are short streams, so without it a batch-1 product waits on
// memory latency, not bandwidth (bench/RESULTS.md, Recording 19: SmolLM2's decode 78 → 123 tok/s on Intel).
constexpr long kWeightPrefetchBytes = 4096;

// Prefetch the cache lines of [p, p + bytes) kWeightPrefetchBytes ahead (reading past the weight's end is harmless).
inline void prefetch_weights(const uint8_t* p, long bytes) {
    const char* ahead = reinterpret_cast<const char*>(p) + kWeightPrefetchBytes;
    for (long i = 0; i < bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
}

struct QuantizedRows {  // M activation rows as int8 blocks of 32: q (M, k), d and s (M, nblocks)
    const int8_t* q;
    const float* d;
    const float* s;  // d · Σ codes of each block (of both planes when there are two)
    long k, nblocks;
    const int8_t* q2 = nullptr;  // q16: a second plane, the int8 codes of the first plane's rounding error
    const float* d2 = nullptr;
};

struct FloatRows {  // M float activation rows: x (M, k), s (M, nblocks) the sum of each 32-block
    const float* x;
    const float* s;
    long k, nblocks;
};

// Owned buffers for M activation rows quantized to one int8 plane (q8) or two (q16), reused across calls.
struct QuantizedActivations {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    QuantizedRows quantize(const float* x, long M, long K, bool two_planes);
    QuantizedRows quantize_per_token(const float* x, long M, long K);  // one scale per row (int8-w8a8)
};

void quantize_rows_q8(const float* x, long M, long K, int8_t* q, float* d, float* s);
void quantize_rows_per_token(const float* x, long M, long K, int8_t* q, float* d, float* s);
void quantize_rows_q16(const float* x, long M, long K, int8_t* q, float* d, int8_t* q2, float* d2, float* s);
void block_sums(const float* x, long M, long K, float* s);
int gemm_blocks_q8(int ggml_type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
                   const float* bias);
int gemm_blocks_f32(int ggml_type, const uint8_t* w, long N, long K, const FloatRows& x, long M, float* y, long ldy,
                    const float* bias);
int super_block_weights(int ggml_type);
// y = x · Wᵀ (+ bias) by the panel GEMM (gemm_panel.cpp) for q16 rows x (two planes); 0, or -1 unknown type,
// -3 a FLOAT format, -4 no AVX-512 VNNI in this build (the caller keeps its own kernel).
int gemm_panel_q16(int ggml_type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
                   const float* bias);
int dequantize_blocks(int ggml_type, const uint8_t* w, long N, long K, float* out);
int dequantize_blocks_bf16(int ggml_type, const uint8_t* w, long N, long K, uint16_t* out);

}  // namespace bd

namespace bd {
struct X4Product {  // one row-interleaved weight (n % 4 == 0) and where its product goes: y (M, n)
    int ggml_type;
    const uint8_t* w;
    long n, k;
    float* y;
    const float* bias;
};
void gemm_x4_many(const X4Product* products, int count, const QuantizedRows& x, long M);
// The most activation rows an x4 kernel takes per decoded weight block, for q16 (two planes) and q8 rows: AVX2's
// 16 vector registers hold 2 (q16) or 4 (q8) rows' accumulators beside the block's codes; AVX-512VL's 32 hold 5
// q16 rows — a 4-draft verify step in one tile (tiles of 6–8 ran the Q6_K kernel 1.4–1.5× slower on a Zen 4).
// A tile's rows never wait on each other, so even tiles beat a full tile and a latency-bound tail.
constexpr int kTwoPlaneTile = BD_AVX512 ? 5 : 2, kOnePlaneTile = 4;

// The next tile of the M − m rows left: tiles as even as the most rows per tile allows (9 → 5 + 4, not 8 + 1).
inline int next_tile(long left, int most) {
    const long tiles = (left + most - 1) / most;
    return static_cast<int>((left + tiles - 1) / tiles);
}

// fn(std::integral_constant<int, n>) for a run-time n in 1..N: one instantiation per tile height.
template <int N, class Fn>
inline void with_tile(int n, Fn&& fn) {
    if constexpr (N > 1)
        if (n < N) return with_tile<N - 1>(n, fn);
    fn(std::integral_constant<int, N>{});
}

// fn(nc, m) for each tile of M activation rows (nc: its height, a std::integral_constant; m: its first row), as
// even as `most` (kTwoPlaneTile or kOnePlaneTile) rows a tile allows.
template <class Fn>
inline void for_each_tile(long M, int most, Fn&& fn) {
    constexpr int kMostTile = kTwoPlaneTile > kOnePlaneTile ? kTwoPlaneTile : kOnePlaneTile;
    for (long m = 0; m < M;) {
        const int rows = next_tile(M - m, most);
        with_tile<kMostTile>(rows, [&](auto nc) { fn(nc, m); });
        m += rows;
    }
}

// Σ (code + offset) · x = Σ code · x + offset · Σ x, lane by lane: per row, plane and run of `span` activation
// codes, the vector an x4 dot product's int32 lanes start from — −offset · Σ of bytes 0–3 of every 8 (what each
// row's even lane multiplies) on the even lanes, of bytes 4–7 on the odd; out[(row · planes + plane) · runs + run].
void offset_corrections(const QuantizedRows& x, long M, int span, int32_t offset, std::vector<__m256i>& out);
#if BD_AVX512
// q16 rows laid out for one 512-bit dot over both planes (the x4 kernels' paired form): per row and 32-block, the
// codes 8 bytes of each plane at a time (k = 0..3: plane 1's bytes 8k..8k+7, then plane 2's), the scales (d, d, d2,
// d2) and, where the weight's codes go in offset, per run of `span` codes the corrections (−offset · plane 1's even
// and odd sums, then plane 2's): one 16-byte broadcast feeds both planes, lane 4r + 2p + h of row r, plane p.
struct PairedRows {
    std::vector<int8_t> codes;  // (M, nblocks, 64)
    std::vector<float> scales;  // (M, nblocks, 4)
    std::vector<int32_t> corr;  // (M, nblocks, 32 / span, 4); empty when span is 0
};
void pair_planes(const QuantizedRows& x, long M, int span, int32_t offset, PairedRows& out);
#endif
bool has_x4(int ggml_type);
long x4_block_bytes_of(int ggml_type);  // the 32-weight formats: bytes per 4 rows × 32 weights
// The K-quant interleaved layouts (gemm_kx4.cpp): bytes per group of 4 rows and super-block, 0 for another type.
bool has_kx4(int ggml_type);
long kx4_group_bytes(int ggml_type);
void repack_kx4(int ggml_type, const uint8_t* src, long N, long K, uint8_t* dst);
void rows_kx4(const X4Product& p, const QuantizedRows& x, long M, long b, long e);
int gemm_x4_q8(int ggml_type, const uint8_t* w, long N, long K, const QuantizedRows& x, long M, float* y, long ldy,
               const float* bias);
}  // namespace bd
