#include "model.hpp"

#include <cmath>

namespace demo {

namespace {

// Deterministic random numbers (splitmix64, Box-Muller)
class Rng {
public:
    explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
    uint64_t next() {
        uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return ((next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); } // (0, 1)
    double normal() {
        double u = uniform(), v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
    }

private:
    uint64_t state_;
};

} // namespace

std::vector<LayerShape> shapes_of(const Options& o) {
    std::vector<LayerShape> s;
    for (int k = 0; k < o.layers; ++k)
        s.push_back({k == 0 ? o.input : o.width, k == o.layers - 1 ? o.classes : o.width});
    return s;
}

std::vector<std::vector<float>> init_params(const std::vector<LayerShape>& shapes, uint64_t seed) {
    std::vector<std::vector<float>> params;
    for (size_t k = 0; k < shapes.size(); ++k) {
        Rng rng(seed * 1000 + k + 17);
        std::vector<float> p(shapes[k].numel(), 0.0f);
        const double sd = 1.0 / std::sqrt((double)shapes[k].in);
        for (size_t i = 0; i < shapes[k].weight_numel(); ++i) p[i] = (float)(rng.normal() * sd);
        params.push_back(std::move(p));
    }
    return params;
}

Teacher::Teacher(int input_, int classes_, uint64_t seed) : input(input_), classes(classes_) {
    Rng rng(seed * 7919 + 3);
    w1.resize((size_t)input * hidden);
    w2.resize((size_t)hidden * classes);
    for (auto& x : w1) x = (float)(rng.normal() * 1.0 / std::sqrt((double)input));
    for (auto& x : w2) x = (float)(rng.normal() / std::sqrt((double)hidden));
}

int Teacher::label(const float* x) const {
    std::vector<float> h(hidden, 0.0f);
    for (int i = 0; i < input; ++i)
        for (int j = 0; j < hidden; ++j) h[j] += x[i] * w1[(size_t)i * hidden + j];
    int best = 0;
    float best_v = -1e30f;
    for (int c = 0; c < classes; ++c) {
        float v = 0.0f;
        for (int j = 0; j < hidden; ++j) v += std::tanh(h[j]) * w2[(size_t)j * classes + c];
        if (v > best_v) best_v = v, best = c;
    }
    return best;
}

Batch make_batch(const Options& o, const Teacher& teacher, int step) {
    Batch b;
    Rng rng(o.seed * 1000003 + (uint64_t)step);
    b.x.resize((size_t)o.batch * o.input);
    for (auto& v : b.x) v = (float)rng.normal();
    for (int i = 0; i < o.batch; ++i) b.labels.push_back(teacher.label(&b.x[(size_t)i * o.input]));
    return b;
}

} // namespace demo
