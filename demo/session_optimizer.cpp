#include "session_optimizer.hpp"

#include <stdexcept>
#include <string>

namespace demo {

SessionOptimizer::SessionOptimizer(const Options& o, const std::vector<LayerShape>& shapes,
                                   std::vector<std::vector<float>>& params)
    : o_(o), shapes_(shapes) {
    so::SessionOptions options;
    options.set_cores(o.cores); // empty: the default pool
    options.speculation = o.speculation ? so::Speculation::Auto : so::Speculation::Off;
    session_ = so::Session::create(options);
    group_ = session_.add_group(group_hparams(1));
    for (size_t k = 0; k < shapes.size(); ++k) {
        const std::string wname = "layer" + std::to_string(k) + ".weight";
        const std::string bname = "layer" + std::to_string(k) + ".bias";
        const size_t wn = shapes[k].weight_numel();
        const uint32_t sg =
            session_.add_subgroup(group_, params[k], {{wname, 0, wn}, {bname, wn, (size_t)shapes[k].out}});
        if (sg != k) throw std::logic_error("unexpected sub-group id " + std::to_string(sg));
        weight_slice_.push_back(session_.slice_id(wname));
        bias_slice_.push_back(session_.slice_id(bname));
    }
    final_.assign(shapes.size(), so::no_ticket);
}

void SessionOptimizer::before_layer(int layer) {
    auto t0 = Clock::now();
    session_.wait(final_[layer]);
    double dt = seconds_since(t0);
    waited_ += dt;
    if (pending_) exposed_ += dt;
}

void SessionOptimizer::begin_step(int step) {
    session_.set_group(group_, group_hparams(step));
    session_.begin_step(1.0f, 1);
}

void SessionOptimizer::grad_ready(int layer, const float* grad) {
    auto t0 = Clock::now();
    const LayerShape& s = shapes_[layer];
    session_.grad_copy(weight_slice_[layer], grad, s.weight_numel());
    session_.grad_copy(bias_slice_[layer], grad + s.weight_numel(), (size_t)s.out);
    handoff_ += seconds_since(t0);
}

void SessionOptimizer::end_step(int, StepInfo&) {
    so::StepArgs args;
    args.max_norm = o_.max_norm;
    step_ticket_ = session_.step(args);
    for (size_t k = 0; k < shapes_.size(); ++k) final_[k] = session_.final_ticket((uint32_t)k);
    pending_ = true;
    exposed_ = 0;
}

void SessionOptimizer::collect(StepInfo& info) {
    if (!pending_) return;
    auto t0 = Clock::now();
    const so::StepResult r = session_.step_result(step_ticket_);
    double dt = seconds_since(t0);
    waited_ += dt;
    info.exposed_ms = (exposed_ + dt) * 1e3;
    info.norm = r.global_norm;
    info.clip = r.clip_coef;
    info.skipped = r.skipped;
    info.speculative = r.speculative;
    info.kept = r.kept;
    info.rescaled = r.rescaled;
    info.rolled_back = r.rolled_back;
    info.redone = r.redone;
    info.stepped = r.stepped;
    pending_ = false;
}

so::GroupHparams SessionOptimizer::group_hparams(int step) const {
    so::GroupHparams gh; // betas and eps: the AdamW defaults
    gh.lr = lr_at(o_, step);
    gh.weight_decay = o_.weight_decay;
    return gh;
}

} // namespace demo
