// The decode step of a llama/qwen2/gemma3 decoder as one native call (see decoder.cpp). The structs are
// mirrored field by field by ctypes Structures in bytediet/kernels/ops.py: change both together.
#pragma once
#include <cstdint>

#include "turboquant_pages.h"

namespace bd {

struct LinearDesc {
    const uint8_t* blocks;  // (n, k) weight in GGML blocks of ggml_type
    const float* bias;      // (n,) or null
    int64_t n, k;
    int32_t ggml_type;
    int32_t interleaved;   // 1: blocks are in the row-interleaved x4 layout (gemm_x4.cpp)
    const uint8_t* source;  // the GGML blocks themselves when `blocks` is the x4 copy (the panel GEMM reads
                            // them for steps of many rows), or null
};

struct LayerDesc {
    const float* attn_norm;     // (hidden,) input_layernorm
    const float* post_attn_norm;  // (hidden,) post_attention_layernorm: before the MLP, or (sandwich) after attention
    const float* pre_ffn_norm;  // (hidden,) sandwich only: before the MLP
    const float* post_ffn_norm;  // (hidden,) sandwich only: after the MLP
    const float* q_norm;  // (head_dim,) or null
    const float* k_norm;  // (head_dim,) or null
    const float* inv_freq;  // (head_dim / 2,) RoPE frequencies of this layer
    void* k_cache;  // (slots, num_kv_heads, row_size(head_dim)) pages of k_dtype (kv_pages.h)
    void* v_cache;  // the same of v_dtype
    LinearDesc q, k, v, o, gate, up, down;
    int64_t window;  // sliding window in tokens, 0 = full causal attention
    void* k_scale;  // int8 and fp8 pages: (slots, num_kv_heads) fp16 scales; null otherwise
    void* v_scale;
    int32_t k_dtype;  // a KVPage (types.h): row or block pages (kv_pages.h), or TURBOQUANT (k_tq; k_cache
                      // unused); not code pages (bd_paged_attention only, with side data)
    int32_t v_dtype;  // the value pages' KVPage, any of k_dtype's (TURBOQUANT: v_tq), either side alone
    const TQPagesDesc* k_tq;  // TurboQuant pages (turboquant_pages.h), null otherwise
    const TQPagesDesc* v_tq;
    const float* k_rot;  // (head_dim, head_dim) R, or null: the key pages hold R·k (kvcache/rotated.py), so q
                         // and k are rotated after RoPE; v_rot: the value pages hold R·v, the output gets Rᵀ
    const float* v_rot;
};

struct ModelDesc {
    const LayerDesc* layers;
    int64_t num_layers, hidden, intermediate, num_heads, num_kv_heads, head_dim;
    float eps, attention_scale;
    int32_t gelu;  // 0: SiLU, 1: GELU (tanh)
    int32_t sandwich;  // gemma3's norms after attention and after the MLP
    int32_t activations;  // an Activations (types.h; see gemm_blocks.cpp)
    int32_t pad;
};

}  // namespace bd
