#include "training_run.hpp"

#include "gradient_hooks.hpp"
#include "model.hpp"
#include "subgroup_layout.hpp"
#include "text_files.hpp"

#if SO_TRAINER_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "superoffload.h"
#include "superoffload.hpp"

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

const char* opt_name(OptKind k) {
    switch (k) {
    case OptKind::Session: return "superoffload session (speculative)";
    case OptKind::SessionNoSpec: return "superoffload session (speculation off)";
    case OptKind::TorchAdamW: return "torch::optim::AdamW";
    }
    return "?";
}

#if SO_TRAINER_CUDA
namespace {

so_cuda_stream_t current_stream(const torch::Device& d) { return at::cuda::getCurrentCUDAStream(d.index()).stream(); }

} // namespace
#endif

RunOut train(const Config& c, const MarkovData& data, const RunSpec& spec) {
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Device device = c.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    const torch::Dtype model_dtype = c.bf16 ? torch::kBFloat16 : torch::kFloat32;
    const bool use_session = spec.kind != OptKind::TorchAdamW;

    GPT model(c);
    init_weights(model, c.layers, spec.init_seed);
    std::vector<SubGroupLayout> sgs = build_layout(model, c, device, model_dtype);

    RunOut out;
    out.loss.assign(static_cast<size_t>(c.steps), std::numeric_limits<double>::quiet_NaN());
    out.norm = out.loss;

    // ---- the optimizer -------------------------------------------------------------------
    so::Session session; // RAII owner of the so_session (host or CUDA)
    auto hooks = std::make_shared<HookState>();
    std::vector<torch::Tensor> torch_masters; // TorchAdamW: one f32 master per parameter, on `device`
    std::vector<std::pair<torch::Tensor, torch::Tensor>> torch_pairs; // (model param, its master)
    std::unique_ptr<torch::optim::AdamW> adamw;

    so::GroupHparams ghp[2];
    for (int g = 0; g < 2; g++) {
        ghp[g].lr = lr_at(c, 0);
        ghp[g].beta1 = c.beta1;
        ghp[g].beta2 = c.beta2;
        ghp[g].eps = c.eps;
        ghp[g].weight_decay = g == 0 ? c.weight_decay : 0.0;
    }

    if (use_session) {
        so::SessionOptions o;
        o.speculation = spec.kind == OptKind::Session ? so::Speculation::On : so::Speculation::Off;
        o.grad_dtype = o.accum_dtype = c.bf16 ? so::DType::Bf16 : so::DType::F32; // the model's
        if (c.cuda) {
            so::CudaOptions co;
            co.device = device.index();
            session = so::Session::create_cuda(o, co);
        } else {
            session = so::Session::create(o);
        }
        for (int g = 0; g < 2; g++) {
            if (session.add_group(ghp[g]) != static_cast<uint32_t>(g)) throw std::logic_error("unexpected group id");
        }
        for (size_t k = 0; k < sgs.size(); k++) {
            auto& sg = sgs[k];
            std::vector<so::Slice> slices;
            for (auto& p : sg.params)
                slices.push_back({p.name, static_cast<size_t>(p.offset), static_cast<size_t>(p.numel)});
            float* master = sg.master.data_ptr<float>();
            const size_t n = static_cast<size_t>(sg.numel);
            const so_device_ptr flat = reinterpret_cast<so_device_ptr>(sg.flat.data_ptr());
            const uint32_t id =
                c.cuda ? session.add_subgroup_cuda(sg.group, master, n, slices, flat, session.accum_dtype(),
                                                   k < spec.gpu_subgroups ? so::Placement::Device : so::Placement::Host)
                       : session.add_subgroup(sg.group, master, n, slices);
            if (id != k) throw std::logic_error("unexpected sub-group id");
            for (auto& p : sg.params) p.slice = session.slice_id(p.name);
        }
        hooks->session = &session;
        hooks->cuda = c.cuda;
        hooks->dtype = session.accum_dtype();
        hooks->torch_dtype = model_dtype;
        if (c.cuda) {
#if SO_TRAINER_CUDA
            // Publication of each step's weights waits for what the compute stream queued
            // before so_session_step (the backward).
            session.set_compute_stream(current_stream(device));
            hooks->copy_stream = at::cuda::getStreamFromExternal(session.copy_stream(), device.index()).unwrap();
#endif
        }
        // A gradient hook per parameter: hand the gradient over as soon as autograd has it.
        for (auto& sg : sgs) {
            for (auto& p : sg.params) {
                auto h = hooks;
                const uint32_t slice = p.slice;
                const std::string name = p.name;
                p.param.register_hook([h, slice, name](torch::Tensor grad) { hand_over(*h, slice, name, grad); });
            }
        }
    } else {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        std::vector<torch::Tensor> gp[2];
        for (auto& sg : sgs) {
            for (auto& p : sg.params) {
                auto m = sg.master.narrow(0, p.offset, p.numel)
                             .view(p.param.sizes())
                             .to(device, torch::kFloat32, false, true);
                m.set_requires_grad(true);
                torch_masters.push_back(m);
                torch_pairs.emplace_back(p.param, m);
                gp[sg.group].push_back(m);
            }
        }
        for (int g = 0; g < 2; g++) {
            auto opts = std::make_unique<torch::optim::AdamWOptions>(ghp[g].lr);
            opts->betas(std::make_tuple(c.beta1, c.beta2)).eps(c.eps).weight_decay(ghp[g].weight_decay).amsgrad(false);
            groups.emplace_back(gp[g], std::move(opts));
        }
        adamw = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(c.lr));
    }

    // ---- resume ----------------------------------------------------------------------------
    int64_t first = 0;
    if (!spec.resume_dir.empty()) {
        if (!use_session) throw std::logic_error("resume is for session runs");
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
        session.load(spec.resume_dir + "/session.safetensors");
        // The model follows the loaded master weights. (The library may publish them itself
        // on its own stream: wait for the whole device first, then write the same values.)
        if (c.cuda) torch::cuda::synchronize();
        torch::NoGradGuard ng;
        for (auto& sg : sgs) sg.flat.copy_(sg.master);
        if (c.cuda) torch::cuda::synchronize();
        for (size_t k = 0; k < sgs.size(); k++) {
            if (session.step_count(static_cast<uint32_t>(k)) != static_cast<uint64_t>(first)) {
                throw std::runtime_error("sub-group " + sgs[k].name + " has " +
                                         std::to_string(session.step_count(static_cast<uint32_t>(k))) +
                                         " steps after loading, the trainer's step counter says " +
                                         std::to_string(first));
            }
        }
    }
    out.first_step = first;

    // ---- the loop --------------------------------------------------------------------------
    std::vector<torch::Tensor> params = model->parameters();
    so::Ticket pending = so::no_ticket; // the latest step's ticket whose result is not read yet
    int64_t pending_step = -1;
    auto resolve = [&]() {
        if (pending == so::no_ticket) return;
        const so::StepResult r = session.step_result(pending);
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
        const uint32_t n = static_cast<uint32_t>(sgs.size());
        // Each sub-group's step is exact: a speculative step kept (its pass run, preempted or
        // cancelled at step()), or a GPU-resident sub-group stepped on the GPU; never rescaled,
        // redone or rolled back.
        if (!(r.clip_coef == 1.0 && r.kept + r.stepped + r.device_stepped == n && r.rescaled == 0 && r.redone == 0 &&
              r.rolled_back == 0)) {
            out.every_step_kept = false;
        }
        if (r.stepped != n) out.every_step_stepped = false;
        pending = so::no_ticket;
    };

    for (int64_t step = first; step < c.steps; step++) {
        const double lr = lr_at(c, step);
        if (use_session) {
            for (uint32_t g = 0; g < 2; g++) {
                ghp[g].lr = lr;
                session.set_group(g, ghp[g]);
            }
        } else {
            for (auto& g : adamw->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
        }
        auto tokens = data.batch(step, c.batch, c.seq, c.data_seed).to(device);
        auto x = tokens.narrow(1, 0, c.seq), y = tokens.narrow(1, 1, c.seq);
        for (auto& p : params) p.mutable_grad().reset();

        // Forward: sub-group k's weights are needed from here on.
        auto before = [&](size_t k) {
            if (!use_session) return;
            const so::Ticket fin = session.final_ticket(static_cast<uint32_t>(k));
            if (c.cuda) {
#if SO_TRAINER_CUDA
                session.enqueue_wait(fin, current_stream(device));
#endif
            } else {
                session.wait(fin);
                torch::NoGradGuard ng;
                sgs[k].flat.copy_(sgs[k].master); // "publication" in CPU mode
            }
        };
        auto logits = model->forward(x, before);
        auto loss =
            torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).view({-1, c.vocab}), y.reshape({-1}));
        resolve(); // the previous step's result (its finalization overlapped this forward)

        if (use_session) {
            session.begin_step(1.0f, 1);
            hooks->handed = 0;
        }
        loss.backward();
        if (use_session) {
            if (hooks->handed.load() != static_cast<int>(params.size())) {
                throw std::runtime_error("only " + std::to_string(hooks->handed.load()) + " of " +
                                         std::to_string(params.size()) + " gradients were handed to the session");
            }
            so::StepArgs a;
            a.max_norm = spec.max_norm;
            pending = session.step(a);
            pending_step = step;
        } else {
            torch::NoGradGuard ng;
            for (auto& pm : torch_pairs) pm.second.mutable_grad() = pm.first.grad().to(torch::kFloat32);
            out.norm[static_cast<size_t>(step)] = torch::nn::utils::clip_grad_norm_(torch_masters, spec.max_norm);
            adamw->step();
            for (auto& pm : torch_pairs) pm.first.copy_(pm.second); // bf16 (CUDA) or f32 model copy
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
            session.save(spec.ckpt_dir + "/session.safetensors");
            write_text(spec.ckpt_dir + "/trainer.txt", std::to_string(step + 1) + "\n" + config_fingerprint(c) + "\n");
            if (!spec.quiet)
                std::printf("  [%s] saved a checkpoint after step %" PRId64 " to %s\n", spec.label.c_str(), step,
                            spec.ckpt_dir.c_str());
        }
    }
    resolve();

    // ---- results ---------------------------------------------------------------------------
    if (use_session) {
        for (size_t k = 0; k < sgs.size(); k++) session.wait(session.final_ticket(static_cast<uint32_t>(k)));
        if (c.cuda) torch::cuda::synchronize();
        for (size_t k = 0; k < spec.gpu_subgroups; k++) {
            // A GPU-resident sub-group's master lives on the GPU: bring it into its host buffer.
            (void)session.subgroup_state(static_cast<uint32_t>(k));
        }
        for (auto& sg : sgs) out.masters.push_back(sg.master.clone());
        if (!c.cuda) { // the last step's weights into the model, as the next forward would
            torch::NoGradGuard ng;
            for (auto& sg : sgs) sg.flat.copy_(sg.master);
        }
    } else {
        size_t i = 0;
        for (auto& sg : sgs) {
            auto m = torch::empty({sg.numel}, torch::kFloat32);
            for (auto& p : sg.params)
                m.narrow(0, p.offset, p.numel).copy_(torch_masters[i++].detach().reshape({-1}).cpu());
            out.masters.push_back(m);
        }
    }
    if (c.cuda) torch::cuda::synchronize();
    for (auto& sg : sgs) out.model.push_back(sg.flat.cpu());
    session.reset(); // destroy the session before the buffers it borrows
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!spec.quiet) {
        const auto& s = out.stats;
        if (use_session) {
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
