// A persistent pool of worker threads: one parallel region costs a few atomic operations, not an
// OpenMP fork/join (4–12 µs on these VMs). Workers spin for a while after each region (the next one
// usually follows within microseconds in a decode step), then sleep on a condition variable so an
// idle engine does not burn a core.
#pragma once
#include <functional>

namespace bd {

// Run fn(thread_index, num_threads) on every thread of the pool (the caller is thread 0) and wait for all.
void parallel_run(const std::function<void(int, int)>& fn);
// fn(0, 1) on the caller's thread alone (with the regions' float mode): for work smaller than a region's cost.
void run_here(const std::function<void(int, int)>& fn);
int num_threads();
void set_num_threads(int n);
void set_spin_us(int us);

// Split [0, n) into num_threads contiguous parts of multiples of `align`: part i is [begin, end).
inline void split_range(long n, int parts, int i, long align, long* begin, long* end) {
    long units = (n + align - 1) / align;
    long per = units / parts, extra = units % parts;
    long b = i * per + (i < extra ? i : extra);
    long e = b + per + (i < extra ? 1 : 0);
    *begin = b * align < n ? b * align : n;
    *end = e * align < n ? e * align : n;
}

}  // namespace bd
