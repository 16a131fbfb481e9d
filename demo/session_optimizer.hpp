#ifndef SUPEROFFLOAD_DEMO_SESSION_OPTIMIZER_HPP
#define SUPEROFFLOAD_DEMO_SESSION_OPTIMIZER_HPP

#include "model.hpp"
#include "optimizer.hpp"
#include "options.hpp"
#include "superoffload.hpp"

#include <cstdint>
#include <vector>

namespace demo {

namespace so = superoffload;

// The session: one sub-group per layer.
class SessionOptimizer : public Optimizer {
public:
    SessionOptimizer(const Options& o, const std::vector<LayerShape>& shapes, std::vector<std::vector<float>>& params);

    void before_layer(int layer) override;
    void begin_step(int step) override;
    void grad_ready(int layer, const float* grad) override;
    void end_step(int, StepInfo&) override;
    void collect(StepInfo& info) override;
    double waited_seconds() const override { return waited_; }
    double handoff_seconds() const override { return handoff_; }

private:
    so::GroupHparams group_hparams(int step) const;

    const Options& o_;
    std::vector<LayerShape> shapes_;
    so::Session session_; // destroyed (after its queued work) with the optimizer
    uint32_t group_ = 0;
    std::vector<uint32_t> weight_slice_, bias_slice_;
    std::vector<so::Ticket> final_;
    so::Ticket step_ticket_ = so::no_ticket;
    bool pending_ = false;
    double waited_ = 0, handoff_ = 0, exposed_ = 0;
};

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_SESSION_OPTIMIZER_HPP
