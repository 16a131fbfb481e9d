#include "training_run.hpp"

#include "model.hpp"
#include "text_files.hpp"

#include <superoffload/torch.hpp>

#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <sys/stat.h>
#include <tuple>
#include <utility>

namespace trainer {

namespace so = superoffload;
namespace sot = superoffload::torch;

const char* opt_name(OptKind k) {
    switch (k) {
    case OptKind::Session: return "superoffload::torch::AdamW (speculative)";
    case OptKind::SessionNoSpec: return "superoffload::torch::AdamW (speculation off)";
    case OptKind::TorchAdamW: return "torch::optim::AdamW";
    }
    return "?";
}

namespace {

/** Two param groups: the blocks (weight decay) and the embeddings, final norm and head (none). */
std::vector<torch::optim::OptimizerParamGroup> param_groups(const Config& c, const std::vector<torch::Tensor>& decay,
                                                            const std::vector<torch::Tensor>& no_decay) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (int g = 0; g < 2; g++) {
        auto opts = std::make_unique<torch::optim::AdamWOptions>(lr_at(c, 0));
        opts->betas(std::make_tuple(c.beta1, c.beta2)).eps(c.eps).weight_decay(g == 0 ? c.weight_decay : 0.0);
        groups.emplace_back(g == 0 ? decay : no_decay, std::move(opts));
    }
    return groups;
}

bool in_block(const std::string& name) { return name.rfind("block", 0) == 0; }

void set_lr(torch::optim::Optimizer& opt, double lr) {
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

} // namespace

RunOut train(const Config& c, const MarkovData& data, const RunSpec& spec) {
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Device device = c.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    const torch::Dtype model_dtype = c.bf16 ? torch::kBFloat16 : torch::kFloat32;
    const bool offloaded = spec.kind != OptKind::TorchAdamW;

    GPT model(c);
    init_weights(model, c.layers, spec.init_seed);
    model->to(device, model_dtype);
    std::vector<torch::Tensor> params = model->parameters();

    RunOut out;
    out.loss.assign(static_cast<size_t>(c.steps), std::numeric_limits<double>::quiet_NaN());
    out.norm = out.loss;

    // ---- the optimizer -------------------------------------------------------------------
    std::unique_ptr<sot::AdamW> offload;
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::vector<torch::Tensor> torch_masters; // TorchAdamW: an f32 master per parameter, on `device`
    if (offloaded) {
        std::vector<torch::Tensor> decay, no_decay;
        int64_t block_numel = 0;
        for (auto& np : model->named_parameters()) {
            (in_block(np.key()) ? decay : no_decay).push_back(np.value());
            if (np.key().rfind("block0.", 0) == 0) block_numel += np.value().numel();
        }
        sot::Options o;
        o.max_grad_norm = spec.max_norm;
        o.speculation = spec.kind == OptKind::Session ? so::Speculation::On : so::Speculation::Off;
        o.sub_group_numel = static_cast<size_t>(block_numel); // a sub-group per block
        o.gpu_budget_bytes = 0;                               // placement as the run asks, below
        offload =
            std::make_unique<sot::AdamW>(*model, param_groups(c, decay, no_decay), torch::optim::AdamWOptions(c.lr), o);
        for (size_t k = 0; k < spec.gpu_subgroups; k++) {
            offload->session().set_placement(static_cast<uint32_t>(k), so::Placement::Device);
        }
    } else {
        std::vector<torch::Tensor> decay, no_decay;
        for (auto& np : model->named_parameters()) {
            auto m = np.value().detach().to(torch::kFloat32, false, true);
            m.set_requires_grad(true);
            torch_masters.push_back(m);
            (in_block(np.key()) ? decay : no_decay).push_back(m);
        }
        adamw =
            std::make_unique<torch::optim::AdamW>(param_groups(c, decay, no_decay), torch::optim::AdamWOptions(c.lr));
    }
    torch::optim::Optimizer& opt = offloaded ? static_cast<torch::optim::Optimizer&>(*offload) : *adamw;

    // ---- resume ----------------------------------------------------------------------------
    int64_t first = 0;
    if (!spec.resume_dir.empty()) {
        if (!offloaded) throw std::logic_error("resume is for offloaded runs");
        const std::string fp = read_text(spec.resume_dir + "/trainer.txt");
        std::istringstream in(fp);
        std::string line;
        std::getline(in, line);
        first = std::stoll(line);
        std::getline(in, line);
        if (line != config_fingerprint(c)) {
            throw std::runtime_error("checkpoint " + spec.resume_dir + " was written with another configuration:\n  " +
                                     line + "\nthis run:\n  " + config_fingerprint(c));
        }
        torch::load(*offload, spec.resume_dir + "/optimizer.pt"); // the model's weights too
        if (offload->step_count() != static_cast<uint64_t>(first)) {
            throw std::runtime_error("the optimizer has " + std::to_string(offload->step_count()) +
                                     " steps after loading, the trainer's step counter says " + std::to_string(first));
        }
    }
    out.first_step = first;

    // ---- the loop --------------------------------------------------------------------------
    bool result_pending = false; // the latest offloaded step's result, not read yet
    int64_t pending_step = -1;
    auto resolve = [&]() {
        if (!result_pending) return;
        const so::StepResult r = offload->last_result();
        auto& st = out.stats;
        st.clipped += r.clip_coef < 1.0;
        st.skipped += r.skipped;
        st.speculative += r.speculative;
        st.kept += r.kept;
        st.rescaled += r.rescaled;
        st.redone += r.redone;
        st.rolled_back += r.rolled_back;
        st.stepped += r.stepped;
        st.late += r.late_gradients;
        out.norm[static_cast<size_t>(pending_step)] = r.global_norm;
        if (r.skipped)
            throw std::runtime_error("step " + std::to_string(pending_step) + " was skipped (non-finite gradient?)");
        const auto n = static_cast<uint32_t>(offload->num_subgroups());
        // Each sub-group's step is exact: a speculative step kept (its pass run, preempted or
        // cancelled at step()), or a GPU-resident sub-group stepped on the GPU; never rescaled,
        // redone or rolled back.
        if (!(r.clip_coef == 1.0 && r.kept + r.stepped + r.device_stepped == n && r.rescaled == 0 && r.redone == 0 &&
              r.rolled_back == 0)) {
            out.every_step_kept = false;
        }
        if (r.stepped != n) out.every_step_stepped = false;
        result_pending = false;
    };

    for (int64_t step = first; step < c.steps; step++) {
        const double lr = lr_at(c, step);
        set_lr(opt, lr);
        auto tokens = data.batch(step, c.batch, c.seq, c.data_seed).to(device);
        auto x = tokens.narrow(1, 0, c.seq), y = tokens.narrow(1, 1, c.seq);
        model->zero_grad();

        // Forward: each layer waits for its weights of the previous step.
        auto logits = model->forward(x, offload.get());
        auto loss =
            torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).view({-1, c.vocab}), y.reshape({-1}));
        resolve(); // the previous step's result (its finalization overlapped this forward)

        loss.backward(); // the offloading optimizer's hooks hand the gradients over as they come
        if (offloaded) {
            offload->step();
            result_pending = true;
            pending_step = step;
        } else {
            torch::NoGradGuard ng;
            for (size_t i = 0; i < params.size(); i++) {
                torch_masters[i].mutable_grad() = params[i].grad().to(torch::kFloat32);
            }
            out.norm[static_cast<size_t>(step)] = torch::nn::utils::clip_grad_norm_(torch_masters, spec.max_norm);
            adamw->step();
            for (size_t i = 0; i < params.size(); i++) params[i].copy_(torch_masters[i]); // bf16 (CUDA) or f32 copy
        }
        out.loss[static_cast<size_t>(step)] = loss.item<double>();
        if (!spec.quiet && (step % c.log_every == 0 || step == c.steps - 1)) {
            std::printf("  [%s] step %3" PRId64 "  loss %.5f  lr %.2e\n", spec.label.c_str(), step,
                        out.loss[static_cast<size_t>(step)], lr);
            std::fflush(stdout);
        }
        if (step + 1 == spec.save_at) {
            resolve();
            mkdir(spec.ckpt_dir.c_str(), 0755);
            torch::save(*offload, spec.ckpt_dir + "/optimizer.pt");
            write_text(spec.ckpt_dir + "/trainer.txt", std::to_string(step + 1) + "\n" + config_fingerprint(c) + "\n");
            if (!spec.quiet)
                std::printf("  [%s] saved a checkpoint after step %" PRId64 " to %s\n", spec.label.c_str(), step,
                            spec.ckpt_dir.c_str());
        }
    }
    resolve();

    // ---- results ---------------------------------------------------------------------------
    if (offloaded) offload->wait_all(); // the last step's weights in the model, as the next forward would see them
    if (c.cuda) torch::cuda::synchronize();
    for (size_t i = 0; i < params.size(); i++) {
        out.masters.push_back(offloaded ? offload->master_weights(params[i]).clone() : torch_masters[i].detach().cpu());
        out.model.push_back(params[i].detach().cpu());
    }
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!spec.quiet) {
        const auto& s = out.stats;
        if (offloaded) {
            std::printf("  [%s] %.1f s; steps clipped %d of %" PRId64 "; speculative %" PRIu64 ", kept %" PRIu64
                        ", rescaled %" PRIu64 ", redone %" PRIu64 ", stepped at step() %" PRIu64 "\n",
                        spec.label.c_str(), out.seconds, s.clipped, c.steps - first, s.speculative, s.kept, s.rescaled,
                        s.redone, s.stepped);
        } else {
            int clipped = 0;
            for (int64_t i = first; i < c.steps; i++) clipped += out.norm[static_cast<size_t>(i)] > spec.max_norm;
            std::printf("  [%s] %.1f s; steps clipped %d of %" PRId64 "\n", spec.label.c_str(), out.seconds, clipped,
                        c.steps - first);
        }
        std::fflush(stdout);
    }
    return out;
}

} // namespace trainer
