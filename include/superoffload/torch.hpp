/**
 * @file superoffload/torch.hpp
 * @brief superoffload::torch::AdamW, a libtorch optimizer whose AdamW runs in a superoffload
 *        session on the CPU (the CMake component `torch`: target SuperOffload::torch, library
 *        libsuperoffload_torch.so). Not part of the umbrella header superoffload.hpp: include
 *        it where libtorch is used.
 *
 * The optimizer keeps f32 master weights and both Adam moments in host memory, owned by a
 * session; the model's parameters stay where they are:
 *
 * - CPU parameters (f32): a host session. Each parameter becomes a view into its sub-group's
 *   f32 master buffer, which the session updates in place.
 * - CUDA parameters (bf16, f16 or f32, one GPU): a CUDA session. Each parameter becomes a view
 *   into one flat device buffer per sub-group, where the session publishes the updated weights
 *   after each step (in bf16 or f16 from a copy the CPU writes in the same pass as the update);
 *   the session's automatic GPU budget keeps the first sub-groups' state on the GPU where free
 *   memory allows (Options::gpu_budget_bytes).
 *
 * Sub-groups: the trainable parameters in forward order (the model's registration order when a
 * model is given, else the order of the param groups), consecutive parameters of one param
 * group packed up to Options::sub_group_numel elements. A gradient hook on every parameter hands
 * its gradient to the session as backward produces it; a sub-group whose gradients are all in
 * is stepped speculatively on the session's CPU-Adam thread while backward goes on. step()
 * makes every step exact (clipping by the global norm, a skipped step rolled back) and returns
 * at once; the next forward of a module waits, through wait_for(module), only for the
 * sub-groups that hold its parameters.
 *
 * A training step:
 * @code
 *   namespace sot = superoffload::torch;
 *   sot::Options options;
 *   options.max_grad_norm = 1.0;
 *   sot::AdamW opt(*model, torch::optim::AdamWOptions(1e-3).weight_decay(0.1), options);
 *   for (...) {
 *       auto loss = model->forward(x, opt);  // each layer calls opt.wait_for(*layer) first
 *       loss.backward();                      // gradients go to the session as they come
 *       opt.step();                           // returns at once
 *   }
 * @endcode
 *
 * Differences from torch::optim::AdamW: the layout is fixed at construction (add_param_group
 * afterwards is refused at the next step); every trainable parameter must get a gradient in
 * every backward (step() throws naming one that did not); one backward per step (no gradient
 * accumulation across backward passes); no AMSGrad; the optimizer's `state()` is empty (the
 * state lives in the session: save() / load(), session().subgroup_state()).
 *
 * Errors: every function documented as "Throws" raises superoffload::Error with the session's
 * status and message (or, for the optimizer's own checks, `SO_STATUS_INVALID_ARGUMENT` /
 * `SO_STATUS_INVALID_STATE` and a message naming the parameter or call).
 *
 * Thread-safety: one training thread. The gradient hooks may run on autograd's device threads.
 */
#ifndef SUPEROFFLOAD_TORCH_HPP
#define SUPEROFFLOAD_TORCH_HPP

#include "../superoffload.hpp"

#include <torch/nn/module.h>
#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace superoffload {
namespace torch {

/**
 * What the optimizer adds to torch's AdamW hyperparameters (which come, per param group, from
 * `::torch::optim::AdamWOptions`: lr, betas, eps, weight_decay; `amsgrad` must stay false).
 * Ownership: a plain value.
 */
struct Options {
    /** Clip the global gradient norm to this at every step, as torch::nn::utils::clip_grad_norm_
     *  does (coefficient min(1, max_norm / (norm + 1e-6))); 0: no clipping. */
    double max_grad_norm = 0.0;
    /** Pack consecutive parameters of one param group into sub-groups of up to this many
     *  elements; 0: one sub-group per parameter. */
    std::size_t sub_group_numel = std::size_t{1} << 25;
    /** Whether sub-groups are stepped during backward (SessionOptions::speculation). */
    Speculation speculation = Speculation::Auto;
    /** The moments' dtype: DType::F32 or DType::Bf16 (SessionOptions::moment_dtype). */
    DType moment_dtype = DType::F32;
    /** CUDA parameters: device bytes for the session's automatic CPU/GPU split; the default,
     *  SO_GPU_BUDGET_AUTO, lets the session measure the free GPU memory after its warm-up
     *  steps; 0 offloads everything. Ignored with CPU parameters. */
    std::uint64_t gpu_budget_bytes = SO_GPU_BUDGET_AUTO;
    /** The built-in dynamic loss scaler (for f16 training), or none: multiply the loss by
     *  AdamW::loss_scale() before backward. */
    std::optional<LossScalerOptions> loss_scaler;
    /** CPU cores for a pinned pool of the session's own; empty: the library's default pool. */
    std::vector<std::uint32_t> cores;
    /** CUDA parameters: the size of the pieces gradients and weights are copied in
     *  (CudaOptions::piece_bytes); 0: the library's default. */
    std::size_t piece_bytes = 0;
};

/**
 * AdamW with f32 master weights and state in a superoffload session (see the file comment).
 * A `::torch::optim::Optimizer`: param_groups() hold `::torch::optim::AdamWOptions`, so LR
 * schedulers and `torch::save(opt, ...)` / `torch::load(opt, ...)` work as with torch's AdamW.
 * Not copyable or movable (the gradient hooks refer to it); destroying it removes the hooks and
 * destroys the session, after its queued work; the parameters keep their storage and values.
 */
class AdamW : public ::torch::optim::Optimizer {
public:
    /**
     * An optimizer over the trainable parameters of `model`, in one param group with
     * `defaults`; the parameters' names (model.named_parameters()) name the session's slices.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (no trainable parameter; parameters on several
     *         devices or of several dtypes; CPU parameters not f32; amsgrad), and the session's
     *         errors (e.g. `SO_STATUS_CUDA_UNAVAILABLE`, `SO_STATUS_OUT_OF_RESOURCES`).
     */
    explicit AdamW(const ::torch::nn::Module& model, const ::torch::optim::AdamWOptions& defaults = {},
                   const Options& options = {});

    /**
     * An optimizer over `param_groups` (a group without options takes `defaults`), laid out in
     * the forward order `model` registers its parameters in, named after them. Every trainable
     * parameter of the groups must be one of the model's.
     * @throws Error as AdamW(model, defaults, options), and `SO_STATUS_INVALID_ARGUMENT` for a
     *         parameter that is not the model's or is in two groups.
     */
    AdamW(const ::torch::nn::Module& model, std::vector<::torch::optim::OptimizerParamGroup> param_groups,
          const ::torch::optim::AdamWOptions& defaults = {}, const Options& options = {});

    /**
     * An optimizer over `param_groups` without a model: the parameters are laid out in the
     * order the groups list them (list them in forward order) and named `param<k>`.
     * @throws Error as AdamW(model, param_groups, defaults, options).
     */
    explicit AdamW(std::vector<::torch::optim::OptimizerParamGroup> param_groups,
                   const ::torch::optim::AdamWOptions& defaults = {}, const Options& options = {});

    /** Removes the gradient hooks and destroys the session (waiting for its queued work). */
    ~AdamW() override;

    AdamW(const AdamW&) = delete;
    AdamW& operator=(const AdamW&) = delete;

    /**
     * Makes the weights of `module`'s parameters (its own and its children's) final for the
     * coming forward: a CPU optimizer waits on the host for their sub-groups' latest step; a
     * CUDA one makes the current CUDA stream wait for it (waiting on the host only while the
     * step is not yet decided). Call it at the start of each layer's forward (libtorch modules
     * have no forward pre-hooks); parameters of no sub-group are ignored.
     * @throws Error the step's error if it failed.
     */
    void wait_for(const ::torch::nn::Module& module);

    /**
     * As wait_for, for every sub-group: before reading or writing parameters outside a
     * forward (evaluation, an EMA, saving the model).
     * @throws Error as wait_for.
     */
    void wait_all();

    /**
     * Ends the step: runs `closure` first if given (its loss is returned), sets each param
     * group's hyperparameters in the session (so LR schedules apply), and hands the step to the
     * session (clipping at Options::max_grad_norm), which makes every sub-group exact in forward
     * order and, for CUDA parameters, publishes their weights. Returns without waiting. Drops
     * every parameter's `grad` (the session holds its copy).
     * @return The closure's loss, or an undefined tensor.
     * @throws Error `SO_STATUS_INVALID_STATE` (no backward since the last step, or a trainable
     *         parameter that got no gradient, named; param groups changed since construction),
     *         `SO_STATUS_INVALID_ARGUMENT` (a bad hyperparameter), and the session's errors.
     */
    ::torch::Tensor step(LossClosure closure = nullptr) override;

    /**
     * Waits for the latest step and describes it (global norm, clip coefficient, whether it
     * was skipped, how its sub-groups were made final: Session::step_result).
     * @throws Error `SO_STATUS_INVALID_STATE` before the first step, or the step's error.
     */
    [[nodiscard]] StepResult last_result() const;

    /**
     * The loss scale the coming backward must multiply the loss by: the built-in scaler's
     * current scale (Options::loss_scaler; waits for the latest step's verdict), else 1.
     * @throws Error the latest step's error.
     */
    [[nodiscard]] float loss_scale() const;

    /**
     * Steps taken so far (skipped ones do not count): the first sub-group's step count after
     * the latest step. @throws Error the latest step's error.
     */
    [[nodiscard]] std::uint64_t step_count() const;

    /**
     * Writes the optimizer's state into `archive` (what `torch::save(opt, path)` calls): the
     * session's checkpoint (master weights, moments, step counts, loss scaler) as one byte
     * tensor, the layout it was written with and each param group's hyperparameters. Waits for
     * the latest step first; call it between steps.
     * @throws Error `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE` (during a step).
     */
    void save(::torch::serialize::OutputArchive& archive) const override;

    /**
     * Restores what save() wrote into this optimizer (what `torch::load(opt, path)` calls):
     * master weights, moments, step counts and each param group's hyperparameters, and writes
     * the loaded weights into the model's parameters. A run resumed this way continues bit for
     * bit as the one that saved. Call it between steps.
     * @throws Error `SO_STATUS_BAD_CHECKPOINT` (not written by this optimizer, or with another
     *         layout: nothing changed), `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE`.
     */
    void load(::torch::serialize::InputArchive& archive) override;

    /**
     * The f32 master weights of `param` (one of the optimizer's parameters) after the latest
     * step: a CPU tensor of its shape viewing the session's buffer (for a sub-group the session
     * keeps on the GPU, brought into that buffer first). Read it between steps. With CPU
     * parameters it shares their storage.
     * @throws Error `SO_STATUS_NOT_FOUND` (not one of its parameters), the latest step's error.
     */
    [[nodiscard]] ::torch::Tensor master_weights(const ::torch::Tensor& param) const;

    /** Whether the parameters are CUDA tensors (a CUDA session). @note Never throws. */
    [[nodiscard]] bool is_cuda() const noexcept;

    /** The number of sub-groups (their ids are 0, 1, ... in forward order). @note Never throws. */
    [[nodiscard]] std::size_t num_subgroups() const noexcept;

    /**
     * The session, for what this class does not wrap (device_bytes(), gpu_budget(),
     * host_bytes(), subgroup_state(), trace(), ...). Do not register sub-groups, begin or end
     * steps through it. @note Never throws.
     */
    [[nodiscard]] Session& session() noexcept;

private:
    struct State;

    /** Lays out the parameters of param_groups() (in `model`'s order where given), creates the
     *  session and registers the hooks. */
    void init(const ::torch::nn::Module* model, const Options& options);

    std::unique_ptr<State> state_; // the gradient hooks point to it until the destructor removes them
};

} // namespace torch
} // namespace superoffload

#endif // SUPEROFFLOAD_TORCH_HPP
