// What the library reports about its own boundary, so Python checks it instead of trusting a copy:
// bd_type_ids, every id of types.h by name (tests/kernels/test_types.py compares them with kernels/types.py);
// bd_struct_layout, the size and field offsets of every struct Python builds (kernels/cpu/structs.py checks its
// ctypes mirrors against it when the library loads).
#include <cstddef>
#include <string>

#include "code_pages.h"
#include "decoder.h"
#include "turboquant_pages.h"
#include "types.h"

namespace {

void add(std::string& out, const char* family, const char* name, int value) {
    out += std::string(family) + "." + name + "=" + std::to_string(value) + "\n";
}

std::string type_ids() {
    std::string out;
#define BD_KV(name, value) add(out, "KVPage", #name, value);
#define BD_ACT(name, value) add(out, "Activations", #name, value);
#define BD_WT(name, value) add(out, "WeightType", #name, value);
#define BD_ST(name, value) add(out, "Status", #name, value);
    BD_KV_PAGES(BD_KV)
    BD_ACTIVATIONS(BD_ACT)
    BD_WEIGHT_TYPES(BD_WT)
    BD_STATUS(BD_ST)
#undef BD_KV
#undef BD_ACT
#undef BD_WT
#undef BD_ST
    return out;
}

void field(std::string& out, const char* s, const char* name, size_t value) {
    out += std::string(s) + "." + name + "=" + std::to_string(value) + "\n";
}

// one struct field a line
// clang-format off
std::string struct_layout() {
    std::string out;
#define BD_SIZE(S) field(out, #S, "sizeof", sizeof(bd::S));
#define BD_FIELD(S, f) field(out, #S, #f, offsetof(bd::S, f));
    BD_SIZE(LinearDesc)
    BD_FIELD(LinearDesc, blocks) BD_FIELD(LinearDesc, bias) BD_FIELD(LinearDesc, n) BD_FIELD(LinearDesc, k)
    BD_FIELD(LinearDesc, ggml_type) BD_FIELD(LinearDesc, interleaved) BD_FIELD(LinearDesc, source)
    BD_SIZE(LayerDesc)
    BD_FIELD(LayerDesc, attn_norm) BD_FIELD(LayerDesc, post_attn_norm) BD_FIELD(LayerDesc, pre_ffn_norm)
    BD_FIELD(LayerDesc, post_ffn_norm) BD_FIELD(LayerDesc, q_norm) BD_FIELD(LayerDesc, k_norm)
    BD_FIELD(LayerDesc, inv_freq) BD_FIELD(LayerDesc, k_cache) BD_FIELD(LayerDesc, v_cache) BD_FIELD(LayerDesc, q)
    BD_FIELD(LayerDesc, k) BD_FIELD(LayerDesc, v) BD_FIELD(LayerDesc, o) BD_FIELD(LayerDesc, gate)
    BD_FIELD(LayerDesc, up) BD_FIELD(LayerDesc, down) BD_FIELD(LayerDesc, window) BD_FIELD(LayerDesc, k_scale)
    BD_FIELD(LayerDesc, v_scale) BD_FIELD(LayerDesc, k_dtype) BD_FIELD(LayerDesc, v_dtype) BD_FIELD(LayerDesc, k_tq)
    BD_FIELD(LayerDesc, v_tq) BD_FIELD(LayerDesc, k_rot) BD_FIELD(LayerDesc, v_rot)
    BD_SIZE(ModelDesc)
    BD_FIELD(ModelDesc, layers) BD_FIELD(ModelDesc, num_layers) BD_FIELD(ModelDesc, hidden)
    BD_FIELD(ModelDesc, intermediate) BD_FIELD(ModelDesc, num_heads) BD_FIELD(ModelDesc, num_kv_heads)
    BD_FIELD(ModelDesc, head_dim) BD_FIELD(ModelDesc, eps) BD_FIELD(ModelDesc, attention_scale)
    BD_FIELD(ModelDesc, gelu) BD_FIELD(ModelDesc, sandwich) BD_FIELD(ModelDesc, activations) BD_FIELD(ModelDesc, pad)
    BD_SIZE(TQPartDesc)
    BD_FIELD(TQPartDesc, rotation) BD_FIELD(TQPartDesc, codebook) BD_FIELD(TQPartDesc, norm) BD_FIELD(TQPartDesc, idx)
    BD_FIELD(TQPartDesc, dim) BD_FIELD(TQPartDesc, bits) BD_FIELD(TQPartDesc, pad) BD_FIELD(TQPartDesc, signs)
    BD_FIELD(TQPartDesc, res_norm) BD_FIELD(TQPartDesc, sketch)
    BD_SIZE(TQPagesDesc)
    BD_FIELD(TQPagesDesc, parts) BD_FIELD(TQPagesDesc, channels) BD_FIELD(TQPagesDesc, mean)
    BD_FIELD(TQPagesDesc, rope_mean) BD_FIELD(TQPagesDesc, inv_freq) BD_FIELD(TQPagesDesc, num_parts)
    BD_FIELD(TQPagesDesc, pad)
    BD_SIZE(CodePagesDesc)
    BD_FIELD(CodePagesDesc, scale) BD_FIELD(CodePagesDesc, zero) BD_FIELD(CodePagesDesc, stage_of)
    BD_FIELD(CodePagesDesc, stage) BD_FIELD(CodePagesDesc, group) BD_FIELD(CodePagesDesc, window)
    BD_FIELD(CodePagesDesc, transform) BD_FIELD(CodePagesDesc, table)
#undef BD_SIZE
#undef BD_FIELD
    return out;
}
// clang-format on

}  // namespace

extern "C" {

// "Struct.sizeof=bytes" and "Struct.field=offset" lines, one per boundary struct and field.
const char* bd_struct_layout() {
    static const std::string layout = struct_layout();
    return layout.c_str();
}

// "Family.NAME=value" lines, one per id of types.h.
const char* bd_type_ids() {
    static const std::string ids = type_ids();
    return ids.c_str();
}
}
