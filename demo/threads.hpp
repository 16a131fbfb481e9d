// The training threads: pinning them to cores, and the fork-join pool of the forward and backward.

#ifndef SUPEROFFLOAD_DEMO_THREADS_HPP
#define SUPEROFFLOAD_DEMO_THREADS_HPP

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif

namespace demo {

// Pins the calling thread to one core; prints a warning if that fails.
void pin_this_thread(uint32_t core);

// Pins the calling thread for the lifetime of the object, then restores its mask. The main
// thread is pinned only while it trains: the library checks the cores of a pool against
// the *calling thread's* affinity mask, and the session's CPU-Adam thread inherits the
// mask of the thread that creates the session, so sessions and pools are created unpinned.
class ScopedPin {
public:
    explicit ScopedPin(const std::vector<uint32_t>& cores);
    ~ScopedPin();
    ScopedPin(const ScopedPin&) = delete;
    ScopedPin& operator=(const ScopedPin&) = delete;

private:
#if defined(__linux__)
    cpu_set_t saved_;
    bool active_ = false;
#endif
};

// Training threads: a tiny fork-join pool. parallel_for splits [0, n) into one contiguous
// range per thread; callers make every output element depend on one index only.
class Workers {
public:
    // Thread 0 is the caller (pinned by ScopedPin while it trains); thread t to cores[t].
    Workers(int threads, const std::vector<uint32_t>& cores);
    ~Workers();

    template <class F>
    void parallel_for(size_t n, F&& body) {
        if (threads_ == 1 || n < 2) {
            body(size_t(0), n);
            return;
        }
        std::function<void(size_t, size_t)> fn = body;
        {
            std::lock_guard<std::mutex> lock(mu_);
            task_ = &fn;
            n_ = n;
            pending_ = threads_ - 1;
            ++generation_;
        }
        start_.notify_all();
        auto [b, e] = share(0, n);
        fn(b, e);
        std::unique_lock<std::mutex> lock(mu_);
        done_.wait(lock, [&] { return pending_ == 0; });
        task_ = nullptr;
    }

private:
    std::pair<size_t, size_t> share(int t, size_t n) const;
    void run(int t);

    int threads_;
    std::vector<std::thread> pool_;
    std::mutex mu_;
    std::condition_variable start_, done_;
    std::function<void(size_t, size_t)>* task_ = nullptr;
    size_t n_ = 0;
    int pending_ = 0;
    uint64_t generation_ = 0;
    bool stop_ = false;
};

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_THREADS_HPP
