// The two optimizers behind one interface: the session (session_optimizer.hpp) and the
// reference (reference_optimizer.hpp), with the learning-rate schedule they share.

#ifndef SUPEROFFLOAD_DEMO_OPTIMIZER_HPP
#define SUPEROFFLOAD_DEMO_OPTIMIZER_HPP

#include "options.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>

namespace demo {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

struct StepInfo {
    double loss = 0, accuracy = 0; // of this step's forward
    double norm = 0, clip = 1;
    uint32_t speculative = 0, kept = 0, rescaled = 0, rolled_back = 0, redone = 0, stepped = 0;
    bool skipped = false;
    double exposed_ms = 0; // how long the next forward waited for this step's optimizer
};

// Linear warmup to the peak, then cosine decay to a tenth of it at the last step. The
// session's group is updated before each step's backward, so no step is redone for it.
inline double lr_at(const Options& o, int step) { // step counts from 1
    if (step <= o.warmup) return o.lr * (double)step / o.warmup;
    const int decay = o.steps - o.warmup;
    const double x = decay > 1 ? (double)(step - o.warmup - 1) / (decay - 1) : 1.0;
    return o.lr * (0.1 + 0.45 * (1.0 + std::cos(3.141592653589793 * x)));
}

class Optimizer {
public:
    virtual ~Optimizer() = default;
    // Before the forward of `layer` reads its weights.
    virtual void before_layer(int layer) { (void)layer; }
    virtual void begin_step(int step) = 0;
    // The layer's gradient [dW | db] is complete; the buffer may be reused after the call.
    virtual void grad_ready(int layer, const float* grad) = 0;
    // After backward. Fills info now, or (session) later through collect().
    virtual void end_step(int step, StepInfo& info) = 0;
    // After the forward of the next step (or at the end): completes the previous step's info.
    virtual void collect(StepInfo& info) { (void)info; }
    virtual double waited_seconds() const { return 0.0; }
    virtual double handoff_seconds() const { return 0.0; }
};

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_OPTIMIZER_HPP
