// The training loop, the same for both optimizers: a fresh batch each step, the forward,
// softmax cross-entropy and the backward, which hands each layer's gradient to the optimizer.

#ifndef SUPEROFFLOAD_DEMO_TRAINING_HPP
#define SUPEROFFLOAD_DEMO_TRAINING_HPP

#include "model.hpp"
#include "optimizer.hpp"
#include "options.hpp"
#include "threads.hpp"

#include <vector>

namespace demo {

struct RunResult {
    std::vector<StepInfo> steps;
    double seconds = 0, waited = 0, handoff = 0, forward = 0, backward = 0;
};

// Trains `params` (the layers' [weight | bias], updated in place) for o.steps steps with
// `opt`; with `print`, prints a line per --print-every steps.
RunResult train(const Options& o, const std::vector<LayerShape>& shapes, std::vector<std::vector<float>>& params,
                Optimizer& opt, Workers& workers, bool print);

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_TRAINING_HPP
