#include "threads.hpp"

#include <algorithm>
#include <cstdio>

#if defined(__linux__)
#include <pthread.h>
#endif

namespace demo {

void pin_this_thread(uint32_t core) {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
        std::fprintf(stderr, "superoffload-demo: warning: cannot pin a training thread to core %u\n", core);
#else
    (void)core;
#endif
}

ScopedPin::ScopedPin(const std::vector<uint32_t>& cores) {
#if defined(__linux__)
    if (cores.empty()) return;
    CPU_ZERO(&saved_);
    active_ = pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) == 0;
    if (active_) pin_this_thread(cores[0]);
#else
    (void)cores;
#endif
}

ScopedPin::~ScopedPin() {
#if defined(__linux__)
    if (active_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
#endif
}

Workers::Workers(int threads, const std::vector<uint32_t>& cores) : threads_(threads) {
    for (int t = 1; t < threads; ++t) {
        int core = cores.empty() ? -1 : (int)cores[t % cores.size()];
        pool_.emplace_back([this, t, core] {
            if (core >= 0) pin_this_thread((uint32_t)core);
            run(t);
        });
    }
}

Workers::~Workers() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stop_ = true;
    }
    start_.notify_all();
    for (auto& th : pool_) th.join();
}

std::pair<size_t, size_t> Workers::share(int t, size_t n) const {
    size_t per = n / threads_, extra = n % threads_;
    size_t b = t * per + std::min<size_t>(t, extra);
    return {b, b + per + (size_t(t) < extra ? 1 : 0)};
}

void Workers::run(int t) {
    uint64_t seen = 0;
    for (;;) {
        std::function<void(size_t, size_t)>* fn;
        size_t n;
        {
            std::unique_lock<std::mutex> lock(mu_);
            start_.wait(lock, [&] { return stop_ || generation_ != seen; });
            if (stop_) return;
            seen = generation_;
            fn = task_;
            n = n_;
        }
        auto [b, e] = share(t, n);
        if (b < e) (*fn)(b, e);
        {
            std::lock_guard<std::mutex> lock(mu_);
            if (--pending_ == 0) done_.notify_one();
        }
    }
}

} // namespace demo
