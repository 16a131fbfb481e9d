#include "reference_optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace demo {

ReferenceOptimizer::ReferenceOptimizer(const Options& o, const std::vector<LayerShape>& shapes,
                                       std::vector<std::vector<float>>& params)
    : o_(o), shapes_(shapes), params_(params) {
    if (!o.cores.empty()) { // else the default pool
        so::PoolOptions po;
        po.set_cores(o.cores);
        pool_ = so::Pool::create(po);
    }
    for (const auto& s : shapes) {
        grads_.emplace_back(s.numel());
        m_.emplace_back(s.numel(), 0.0f);
        v_.emplace_back(s.numel(), 0.0f);
    }
}

void ReferenceOptimizer::grad_ready(int layer, const float* grad) {
    std::memcpy(grads_[layer].data(), grad, grads_[layer].size() * sizeof(float));
}

void ReferenceOptimizer::end_step(int step, StepInfo& info) {
    auto t0 = Clock::now();
    const so::PoolRef pool = pool_ ? so::PoolRef(pool_) : so::PoolRef();
    const float loss_scale = 1.0f;
    const float unscale = (float)(1.0 / (double)loss_scale);
    // The global norm exactly as the session takes it: the sums of squares of each slice's
    // unscaled gradient (a layer's weight, then its bias), added in registration order.
    double sumsq = 0.0;
    for (size_t k = 0; k < shapes_.size(); ++k) {
        const size_t wn = shapes_[k].weight_numel();
        sumsq += so::grad_sumsq(pool, grads_[k].data(), wn, unscale);
        sumsq += so::grad_sumsq(pool, grads_[k].data() + wn, grads_[k].size() - wn, unscale);
    }
    const double norm = std::sqrt(sumsq);
    const double clip = o_.max_norm > 0 ? std::min(1.0, o_.max_norm / (norm + 1e-6)) : 1.0;
    so::UpdateOptions uo;
    uo.grad_scale = (float)(clip / (double)loss_scale);
    so::Hparams hp; // betas and eps: the AdamW defaults, as the group's
    hp.mode = so::Mode::AdamW;
    hp.lr = lr_at(o_, step);
    hp.weight_decay = o_.weight_decay;
    hp.bias_correction = true;
    hp.step = (uint64_t)step;
    for (size_t k = 0; k < shapes_.size(); ++k)
        so::adam_update(pool, hp, so::make_adam_buffers(params_[k], grads_[k], m_[k], v_[k]), uo);
    info.norm = norm;
    info.clip = clip;
    info.stepped = (uint32_t)shapes_.size();
    waited_ += seconds_since(t0);
}

} // namespace demo
