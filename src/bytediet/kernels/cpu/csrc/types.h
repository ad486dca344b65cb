// The ids shared with Python (bytediet/kernels/types.py), each named once with its value: KV page types,
// activation modes, weight layouts and the status codes of the entry points. bd_type_ids (abi.cpp) reports
// every one by name, and tests/kernels/test_types.py checks them against the Python enums.
#pragma once
#include <cstdint>

namespace bd {

// one id a line, as in ggml.h
// clang-format off
#define BD_KV_PAGES(X)                                                                            \
    X(FP32, 0) X(BF16, 1) X(FP16, 2) X(INT8, 3) X(FP8, 4) /* row pages (kv_pages.h) */             \
    X(TURBOQUANT, 5)                                      /* turboquant_pages.h */                \
    X(Q8_0, 6) X(Q5_0, 7) X(Q4_1, 8) X(Q4_0, 9)           /* GGML block pages (kv_pages.h) */     \
    X(KIVI2_KEYS, 10)                                     /* code pages (code_pages.h) */         \
    X(KIVI4_KEYS, 11)                                                                             \
    X(INT2_TOKEN_G32, 12)                                                                         \
    X(INT4_TOKEN_G32, 13)                                                                         \
    X(INT2_TOKEN_G64, 14)                                                                         \
    X(INT4_TOKEN_G64, 15)                                                                         \
    X(QJL1_KEYS, 16)                                                                              \
    X(QJL2_KEYS, 17)                                                                              \
    X(QJL3_KEYS, 18)                                                                              \
    X(QJL4_KEYS, 19)                                                                              \
    X(POLARQUANT, 20)                                                                             \
    X(Q5_1, 21)                                           /* GGML block pages (kv_pages.h) */

#define BD_ACTIVATIONS(X) X(Q8, 0) X(F32, 1) X(Q16, 2) X(Q8_TOKEN, 3)

#define BD_WEIGHT_TYPES(X)                                                                        \
    X(Q4_0, 2) X(Q4_1, 3) X(Q5_0, 6) X(Q5_1, 7) X(Q8_0, 8) X(Q4_K, 12) X(Q5_K, 13) X(Q6_K, 14)     \
    X(INT8_ROW, 100)                                                                              \
    X(INT4_G32_ASYM, 101) X(INT4_G64_ASYM, 102) X(INT4_G128_ASYM, 103)                            \
    X(INT4_G32_SYM, 104) X(INT4_G64_SYM, 105) X(INT4_G128_SYM, 106)                               \
    X(MXFP4_BLOCKS, 107)                                                                          \
    X(NVFP4_BLOCKS, 108)                                                                          \
    X(SPARSE24_INT8, 109)                                                                         \
    X(FP8_ROW, 110)                                                                               \
    X(SPARSE24_F16, 111)

#define BD_STATUS(X) X(OK, 0) X(UNSUPPORTED_PAGES, 1) X(MISSING_PAGES, 2)
// clang-format on

#define BD_ENUMERATOR(name, value) name = value,
enum class KVPage : int32_t { BD_KV_PAGES(BD_ENUMERATOR) };
enum class Activations : int32_t { BD_ACTIVATIONS(BD_ENUMERATOR) };
enum class WeightType : int32_t { BD_WEIGHT_TYPES(BD_ENUMERATOR) };
enum class Status : int32_t { BD_STATUS(BD_ENUMERATOR) };
#undef BD_ENUMERATOR

constexpr int id(KVPage p) { return static_cast<int>(p); }
constexpr int id(WeightType t) { return static_cast<int>(t); }
constexpr int id(Status s) { return static_cast<int>(s); }

}  // namespace bd
