#include "threadpool.h"
#include "isa.h"

#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace bd {
namespace {

// Flush-to-zero and denormals-are-zero while alive: an exp() far below the row's maximum yields subnormal
// weights, and every multiply-add with a subnormal costs ~100 cycles on x86 (attention ran 10× slower).
class DenormalsAreZero {
  public:
    DenormalsAreZero() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040); }
    ~DenormalsAreZero() { _mm_setcsr(saved_); }

  private:
    unsigned saved_;
};

class Pool {
  public:
    ~Pool() { resize(1); }

    void resize(int n) {
        if (n < 1) n = 1;
        if (n == size_) return;
        stop_workers();
        size_ = n;
        stop_.store(false);
        const unsigned long start = generation_.load();  // read here: a worker that started late would miss region 1
        for (int i = 1; i < n; ++i) workers_.emplace_back([this, i, start] { loop(i, start); });
    }

    int size() const { return size_; }
    void set_spin(int us) { spin_us_ = us < 0 ? 0 : us; }

    void run(const std::function<void(int, int)>& fn) {
        DenormalsAreZero ftz;  // the caller's thread, for this region only (Python's own numbers keep IEEE subnormals)
        if (size_ == 1) {
            fn(0, 1);
            return;
        }
        // One region at a time: a second caller (another Python thread, e.g. tensor-parallel ranks run as
        // threads, or a region started inside a region) runs its region alone on its own thread.
        if (busy_.exchange(true, std::memory_order_acquire)) {
            fn(0, 1);
            return;
        }
        struct Release {
            std::atomic<bool>& flag;
            ~Release() { flag.store(false, std::memory_order_release); }
        } release{busy_};
        job_ = &fn;
        pending_.store(size_ - 1, std::memory_order_relaxed);
        generation_.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers_.load(std::memory_order_seq_cst) > 0) {
            { std::lock_guard<std::mutex> lock(mutex_); }
            wake_.notify_all();
        }
        fn(0, size_);
        while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
        job_ = nullptr;
    }

  private:
    void loop(int index, unsigned long seen) {
        DenormalsAreZero ftz;  // workers run kernels only: flush subnormals for their whole life
        for (;;) {
            if (!wait_for_work(seen)) return;
            seen = generation_.load(std::memory_order_acquire);
            (*job_)(index, size_);
            pending_.fetch_sub(1, std::memory_order_release);
        }
    }

    bool wait_for_work(unsigned long seen) {
        auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(spin_us_);
        for (int i = 0;; ++i) {
            if (stop_.load(std::memory_order_acquire)) return false;
            if (generation_.load(std::memory_order_acquire) != seen) return true;
            _mm_pause();
            if ((i & 255) == 255 && std::chrono::steady_clock::now() > deadline) break;
        }
        std::unique_lock<std::mutex> lock(mutex_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return stop_.load() || generation_.load(std::memory_order_seq_cst) != seen; });
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        return !stop_.load();
    }

    void stop_workers() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_.store(true);
        }
        wake_.notify_all();
        for (auto& t : workers_) t.join();
        workers_.clear();
    }

    int size_ = 1;
    std::atomic<bool> busy_{false};
    int spin_us_ = 200;
    std::vector<std::thread> workers_;
    std::atomic<unsigned long> generation_{0};
    std::atomic<int> pending_{0};
    std::atomic<int> sleepers_{0};
    std::atomic<bool> stop_{false};
    const std::function<void(int, int)>* job_ = nullptr;
    std::mutex mutex_;
    std::condition_variable wake_;
};

Pool& pool() {
    static Pool p;
    return p;
}

}  // namespace

void parallel_run(const std::function<void(int, int)>& fn) { pool().run(fn); }

void run_here(const std::function<void(int, int)>& fn) {
    DenormalsAreZero ftz;
    fn(0, 1);
}
int num_threads() { return pool().size(); }
void set_num_threads(int n) { pool().resize(n); }
void set_spin_us(int us) { pool().set_spin(us); }

}  // namespace bd

extern "C" {
void bd_set_num_threads(int n) { bd::set_num_threads(n); }
int bd_num_threads() { return bd::num_threads(); }
void bd_set_spin_us(int us) { bd::set_spin_us(us); }
const char* bd_isa() { return bd::kIsa; }
}
