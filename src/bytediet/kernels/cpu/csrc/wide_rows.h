// How the streaming attention passes (decoder.cpp) hold a KV row of page type P: the stored row itself where P's
// load8/load16 read it in registers (row and block pages), else floats widened from side data (code pages).
#pragma once
#include <type_traits>

#include "kv_pages.h"

namespace bd {
namespace {  // decoder.cpp's alone: internal linkage, as when they were written there

inline void prefetch_bytes(const char* p, long bytes) {  // the cache lines of [p, p + bytes)
    for (long i = 0; i < bytes; i += 64) _mm_prefetch(p + i, _MM_HINT_T0);
}

template <class P>
constexpr bool kRowsInRegisters = !P::SIDE && !P::ON_CODES;

// A row of KV head kvh at one slot as the streaming passes read it, with its scale (int8/fp8, else 1): the stored
// row itself (row and block pages), or for code pages floats widened into tile from their side data (scales, zero
// points, staging pages). Keys scored on their codes (ON_CODES) have their own pass and never come here.
template <class P>
using WideRow = std::conditional_t<kRowsInRegisters<P>, const typename P::T*, const float*>;

}  // namespace
}  // namespace bd
