// The model and its data: the shapes of the linear layers, their initial weights, and the
// fresh synthetic batches labelled by a fixed random teacher network.

#ifndef SUPEROFFLOAD_DEMO_MODEL_HPP
#define SUPEROFFLOAD_DEMO_MODEL_HPP

#include "options.hpp"

#include <cstddef>
#include <cstdint>
#include <vector>

namespace demo {

struct LayerShape {
    int in, out;
    size_t weight_numel() const { return (size_t)in * out; }
    size_t numel() const { return weight_numel() + out; } // [weight (in x out) | bias (out)]
};

// input -> width x (layers - 1) -> classes
std::vector<LayerShape> shapes_of(const Options& o);

// Weights ~ N(0, 1/in) (tanh-friendly), biases 0.
std::vector<std::vector<float>> init_params(const std::vector<LayerShape>& shapes, uint64_t seed);

// The teacher: a fixed random network input -> 64 (tanh) -> classes; labels are its argmax.
struct Teacher {
    int input, hidden = 64, classes;
    std::vector<float> w1, w2;
    Teacher(int input_, int classes_, uint64_t seed);
    int label(const float* x) const;
};

struct Batch {
    std::vector<float> x;    // B x input
    std::vector<int> labels; // B
};

// The batch of a step (B x input, from the seed and the step), labelled by the teacher.
Batch make_batch(const Options& o, const Teacher& teacher, int step);

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_MODEL_HPP
