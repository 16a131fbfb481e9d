/**
 * @file superoffload/session_types.hpp
 * @brief The values a Session takes and gives: SessionOptions, LossScalerOptions,
 *        GroupHparams, Slice, StepArgs, StepResult, and HostMemory / host_memory().
 *
 * The option, argument and result types are the C structs themselves (each derives from its
 * `so_*` struct, initialised by the C `_default()` function, `struct_size` set): their fields
 * are documented in `superoffload.h`. What C expresses with a pointer (a core list, the
 * loss scaler's settings, a slice name) these types can own, through their set_* functions.
 */
#ifndef SUPEROFFLOAD_SESSION_TYPES_HPP
#define SUPEROFFLOAD_SESSION_TYPES_HPP

#include "error.hpp"
#include "pool.hpp"
#include "types.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace superoffload {

/**
 * Settings of the built-in dynamic loss scaler: `so_loss_scaler_options` (documented there),
 * initialised by `so_loss_scaler_options_default()` (torch GradScaler's: scale 65536, growth
 * 2, backoff 0.5, interval 2000, hysteresis 1, minimum 1). Give it to
 * SessionOptions::set_loss_scaler. Ownership: a plain value.
 */
struct LossScalerOptions : detail::CStruct<so_loss_scaler_options, so_loss_scaler_options_default> {
    using CStruct::CStruct;
};

/**
 * How to create a Session: `so_session_options` (each field is documented there),
 * initialised by `so_session_options_default()`: the default pool, AdamW with bias
 * correction, f32 moments, gradients and accumulation, automatic speculation, no memory
 * limit, no loss scaler, no master-weight copy, no automatic split.
 *
 * The enumeration fields take the C++ enumerations (`options.grad_dtype = DType::Bf16`,
 * `options.speculation = Speculation::On`). The pointer fields are set with set_pool,
 * set_cores and set_loss_scaler (or, borrowing, directly as in C).
 *
 * Ownership: a value. The session takes its own reference to the pool, so the Pool may be
 * destroyed once Session::create has returned; the core list and the loss scaler's settings
 * given to the setters are owned by these options (shared by their copies).
 */
struct SessionOptions : detail::CStruct<so_session_options, so_session_options_default> {
    using CStruct::CStruct;

    /**
     * The pool for the optimizer passes (`pool`); nullptr (the default) for the default
     * pool or, with cores, a pool of the session's own.
     * @return *this. @note Never throws (an empty Pool is refused by its conversion to PoolRef).
     */
    SessionOptions& set_pool(PoolRef ref) noexcept {
        pool = ref.raw();
        return *this;
    }

    /**
     * Cores for a pool of the session's own, one pinned thread each (`cores`, `num_cores`;
     * not with a pool): copied into memory these options own. An empty list: none.
     * @return *this. @throws std::bad_alloc only.
     */
    SessionOptions& set_cores(std::vector<std::uint32_t> core_list) {
        owned_cores_ = detail::Shared<std::vector<std::uint32_t>>(std::move(core_list));
        cores = owned_cores_.get()->empty() ? nullptr : owned_cores_.get()->data();
        num_cores = owned_cores_.get()->size();
        return *this;
    }

    /**
     * Turns on the built-in loss scaler with `settings` (`loss_scaler`), copied into memory
     * these options own. @return *this. @throws std::bad_alloc only.
     */
    SessionOptions& set_loss_scaler(const LossScalerOptions& settings = {}) {
        owned_scaler_ = detail::Shared<LossScalerOptions>(settings);
        loss_scaler = owned_scaler_.get();
        return *this;
    }

    /** Turns the built-in loss scaler off (`loss_scaler` NULL). @return *this. @note Never throws. */
    SessionOptions& clear_loss_scaler() noexcept {
        loss_scaler = nullptr;
        return *this;
    }

private:
    detail::Shared<std::vector<std::uint32_t>> owned_cores_;
    detail::Shared<LossScalerOptions> owned_scaler_;
};

/**
 * Hyperparameters of a param group: `so_group_hparams` (documented there), initialised by
 * `so_group_hparams_default()` (torch.optim.AdamW's: lr 1e-3, betas 0.9 and 0.999, eps 1e-8,
 * weight decay 0.01). Ownership: a plain value.
 */
struct GroupHparams : detail::CStruct<so_group_hparams, so_group_hparams_default> {
    using CStruct::CStruct;

    /** Field-wise equality (exact, as the session compares hyperparameters). */
    friend bool operator==(const GroupHparams& a, const GroupHparams& b) noexcept {
        return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
               a.weight_decay == b.weight_decay;
    }
    /** Field-wise inequality. */
    friend bool operator!=(const GroupHparams& a, const GroupHparams& b) noexcept { return !(a == b); }
};

/**
 * One named param slice of a sub-group: `so_slice_desc` (`name`, `offset`, `numel`;
 * documented there) whose name points into a string the slice owns (shared by its copies),
 * so that `{{"w", 0, 1000}, {"b", 1000, 10}}` is a list of slices. Session::add_subgroup
 * copies them. Ownership: a value.
 */
struct Slice : so_slice_desc {
    /** `count` elements from `first` within the sub-group, named `slice_name`. @throws std::bad_alloc only. */
    Slice(std::string slice_name, std::size_t first, std::size_t count)
        : so_slice_desc{}, owned_name_(std::move(slice_name)) {
        name = owned_name_.get()->c_str();
        offset = first;
        numel = count;
    }

    /** The name as given (it may hold a NUL character, which add_subgroup refuses). @note Never throws. */
    [[nodiscard]] const std::string& name_string() const noexcept { return *owned_name_.get(); }

private:
    detail::Shared<std::string> owned_name_;
};

/**
 * What Session::step is told: `so_step_args` (documented there), initialised by
 * `so_step_args_default()`: no clipping, the session's own (local) norm, no overflow.
 * `max_norm` and `overflow` are set directly; a caller-computed norm (`norm_source` and
 * `global_norm` together) through set_global_norm. Ownership: a plain value.
 */
struct StepArgs : detail::CStruct<so_step_args, so_step_args_default> {
    using CStruct::CStruct;

    /**
     * The global norm of the unscaled gradient computed by the caller (e.g. all-reduced
     * across ranks from Session::local_grad_sumsq; inf or NaN skips the step), or
     * std::nullopt for the session's own norm. Sets `norm_source` and `global_norm`.
     * @return *this. @note Never throws.
     */
    StepArgs& set_global_norm(std::optional<double> norm) noexcept {
        norm_source = norm ? NormSource::Given : NormSource::Local;
        so_step_args::global_norm = norm.value_or(0.0);
        return *this;
    }

    /** The caller's global norm (set_global_norm), or std::nullopt for the session's own. @note Never throws. */
    [[nodiscard]] std::optional<double> global_norm() const noexcept {
        if (norm_source == NormSource::Given) {
            return so_step_args::global_norm;
        }
        return std::nullopt;
    }
};

/**
 * The outcome of one step: `so_step_result` (each field is documented there), filled by
 * Session::step_result. Ownership: a plain value.
 */
struct StepResult : so_step_result {
    /** All zero but `clip_coef` 1, `struct_size` set. @note Never throws. */
    StepResult() noexcept : so_step_result{} {
        struct_size = sizeof(so_step_result);
        clip_coef = 1.0;
    }

    /** The values of a C struct (`struct_size` is set to this header's). @note Never throws. */
    explicit StepResult(const so_step_result& raw) noexcept : so_step_result(raw) {
        struct_size = sizeof(so_step_result);
    }
};

/** What this host can give a session now, in bytes (`so_host_memory`). Ownership: a plain value. */
struct HostMemory {
    std::size_t available = 0; ///< `MemAvailable`, within the process's memory-cgroup limit.
    std::size_t total = 0;     ///< The host's memory.
};

/**
 * What this host can give a session now (`so_host_memory`): what a session checks its
 * allocations against, and what a caller lending it master weights and moments can check
 * them against. @throws Error (`SO_STATUS_UNSUPPORTED` where the system does not say).
 */
[[nodiscard]] inline HostMemory host_memory() {
    HostMemory m;
    check(so_host_memory(&m.available, &m.total));
    return m;
}

} // namespace superoffload

#endif // SUPEROFFLOAD_SESSION_TYPES_HPP
