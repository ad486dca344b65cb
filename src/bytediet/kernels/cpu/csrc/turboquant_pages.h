// TurboQuant KV pages (arXiv 2504.19874) read and written inside the native decode step (the MSE variant), and read
// by the module path's attention (bd_turboquant_attention: prefill chunks, and turboquant_prod's keys, which the step
// does not write): attention computed on the stored codes, no float key or value is materialised. The torch codec
// that owns these pages is kvcache/turboquant.py; its twin here is kernels/turboquant_pages.py.
//
// One token's K (or V) of one KV head, x (D,), is stored as: x − mean (a calibrated constant, optional; for keys
// calibrated with a pre-RoPE mean μ, x − RoPE(μ, p) at the token's position p instead), its
// channels reordered (outliers first, optional), cut in 1 or 2 parts; each part p of d_p channels keeps
//   norm_p = ‖x_p‖ (fp16) and idx_p = nearest centroid of u = R_p · x_p / ‖x_p‖ per coordinate,
// b_p bits per code, packed little-endian (kvcache/bitpack.py: code j of a word of 8 codes in bits j·b…j·b+b−1).
// Inner-product keys (turboquant_prod) add a 1-bit QJL sketch of the residual r = u − c[idx]: signs of S_p r and
// ‖r‖ (fp16), scored as norm_p · √(π/2)/d_p · ‖r‖ · ⟨S_p R_p q_p, sign⟩ — the query sketched once beside its rotation.
// Attention on codes: q·x_p = norm_p · (R_p q_p)·c[idx_p], so the query is rotated once per head and part;
// values are summed in rotated coordinates, Σ w·norm·c[idx], and rotated back (· R_p) once per head. A constant
// key mean adds q·μ to every score of a head (softmax ignores it); a pre-RoPE mean adds
// q·RoPE(μ, p) = Σ_i cos(p θ_i)(q1 μ1 + q2 μ2)_i + sin(p θ_i)(q2 μ1 − q1 μ2)_i, computed per key position.
#pragma once
#include <cstdint>

#include "types.h"

namespace bd {

constexpr int32_t kTurboQuantPages = id(KVPage::TURBOQUANT);  // LayerDesc::k_dtype / v_dtype of k_tq / v_tq pages

struct TQPartDesc {
    const float* rotation;  // (dim, dim) R, row-major: the stored unit vector is u = R · x / ‖x‖
    const float* codebook;  // (2^bits,) sorted centroids
    uint16_t* norm;         // (slots, num_kv_heads) fp16 norms ‖x_p‖
    uint8_t* idx;           // (slots, num_kv_heads, dim · bits / 8) packed codes
    int64_t dim;            // channels in this part, a multiple of 8
    int32_t bits;           // 1 … 8 (the MSE codes' bits; inner-product keys: the part's bits − 1)
    int32_t pad;
    const uint8_t* signs;     // inner-product keys: (slots, num_kv_heads, dim / 8) QJL signs of S r, else null
    const uint16_t* res_norm;  // inner-product keys: (slots, num_kv_heads) fp16 ‖r‖
    const float* sketch;      // inner-product keys: (dim, dim) S, row-major
};

struct TQPagesDesc {
    TQPartDesc parts[2];
    const int64_t* channels;  // (num_kv_heads, head_dim) stored channel order, null = identity
    const float* mean;        // (num_kv_heads, head_dim) subtracted before quantizing, null = none
    const float* rope_mean;   // (num_kv_heads, head_dim) pre-RoPE mean: RoPE(μ, p) subtracted, null = none
    const float* inv_freq;    // (head_dim / 2) the layer's RoPE frequencies θ_i (with rope_mean)
    int32_t num_parts;        // 1 or 2
    int32_t pad;
};

struct ModelDesc;
struct LayerDesc;

// Quantize one token's (num_heads, head_dim) rows x, at position ``pos``, into slot ``slot`` of the pages.
void turboquant_write(const TQPagesDesc& pages, const float* x, long slot, long pos, long num_heads, long head_dim);

// Whether turboquant_attend reads layer L's pages at m's shapes: TurboQuant on one side or both (1 or 2 parts of
// 1…8 bits; values without inner-product signs), the other side row or block pages that fit head_dim.
bool turboquant_reads(const ModelDesc& m, const LayerDesc& L);

// The attention of decoder.cpp on TurboQuant pages: keys (L.k_dtype TURBOQUANT: L.k_tq), values (L.v_tq) or both,
// the other side row or block pages (L.k_cache / L.v_cache of kv_pages.h); q, out (T, Hq, D); token t reads block
// table row token_rows[t] (null: row t).
void turboquant_attend(const ModelDesc& m, const LayerDesc& L, const float* q, float* out, long T,
                       const int64_t* positions, const int64_t* token_rows, const int64_t* block_tables, long bt_stride,
                       long block_size);

}  // namespace bd
