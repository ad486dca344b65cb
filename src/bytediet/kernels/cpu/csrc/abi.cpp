// What the library reports about its own boundary, so Python checks it instead of trusting a copy:
// bd_type_ids, every id of types.h by name (tests/kernels/test_types.py compares them with kernels/types.py).
#include <string>

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

}  // namespace

extern "C" {

// "Family.NAME=value" lines, one per id of types.h.
const char* bd_type_ids() {
    static const std::string ids = type_ids();
    return ids.c_str();
}
}
