#include "markov_data.hpp"

#include <cmath>
#include <cstddef>

namespace trainer {

namespace {

uint64_t splitmix64(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

} // namespace

MarkovData::MarkovData(int64_t v, uint64_t seed, int order_)
    : vocab(v), succ(static_cast<size_t>(v * v * 4)), order(order_) {
    uint64_t s = seed;
    for (auto& x : succ) x = static_cast<int32_t>(splitmix64(s) % static_cast<uint64_t>(v));
}

double MarkovData::entropy() {
    const double p[4] = {0.55, 0.25, 0.12, 0.08};
    double h = 0;
    for (double q : p) h -= q * std::log(q);
    return h;
}

torch::Tensor MarkovData::batch(int64_t step, int64_t b, int64_t t, uint64_t seed) const {
    auto out = torch::empty({b, t + 1}, torch::kInt64);
    auto* p = out.data_ptr<int64_t>();
    uint64_t s = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(step + 1));
    for (int64_t i = 0; i < b; i++) {
        int64_t a = static_cast<int64_t>(splitmix64(s) % vocab), c = static_cast<int64_t>(splitmix64(s) % vocab);
        p[i * (t + 1)] = a;
        p[i * (t + 1) + 1] = c;
        for (int64_t j = 2; j <= t; j++) {
            const double u = static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;
            const int k = u < 0.55 ? 0 : u < 0.80 ? 1 : u < 0.92 ? 2 : 3;
            const int64_t n = succ[static_cast<size_t>(context(a, c) * 4 + k)];
            p[i * (t + 1) + j] = n;
            a = c;
            c = n;
        }
    }
    return out;
}

} // namespace trainer
