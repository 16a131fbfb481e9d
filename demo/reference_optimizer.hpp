#ifndef SUPEROFFLOAD_DEMO_REFERENCE_OPTIMIZER_HPP
#define SUPEROFFLOAD_DEMO_REFERENCE_OPTIMIZER_HPP

#include "model.hpp"
#include "optimizer.hpp"
#include "options.hpp"
#include "superoffload.hpp"

#include <vector>

namespace demo {

namespace so = superoffload;

// The reference: collect every gradient; norm, clip and adam_update per layer at the end.
class ReferenceOptimizer : public Optimizer {
public:
    ReferenceOptimizer(const Options& o, const std::vector<LayerShape>& shapes,
                       std::vector<std::vector<float>>& params);

    void begin_step(int) override {}
    void grad_ready(int layer, const float* grad) override;
    void end_step(int step, StepInfo& info) override;
    double waited_seconds() const override { return waited_; }

private:
    const Options& o_;
    std::vector<LayerShape> shapes_;
    std::vector<std::vector<float>>& params_;
    so::Pool pool_; // empty: the default pool
    std::vector<std::vector<float>> grads_, m_, v_;
    double waited_ = 0;
};

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_REFERENCE_OPTIMIZER_HPP
