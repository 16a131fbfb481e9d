/**
 * @file superoffload/session.hpp
 * @brief The owning offload Session (its option, argument and result types are in
 *        superoffload/session_types.hpp, which this header includes).
 *
 * Session's checkpoint calls (save, load, subgroup_state, set_step_count) are defined in
 * superoffload/checkpoint.hpp, its CUDA calls in superoffload/cuda.hpp; this header includes
 * both at its end, so including it is enough.
 */
#ifndef SUPEROFFLOAD_SESSION_HPP
#define SUPEROFFLOAD_SESSION_HPP

#include "error.hpp"
#include "handle.hpp"
#include "pool.hpp"
#include "session_types.hpp"
#include "ticket.hpp"
#include "types.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace superoffload {

struct CudaOptions;   // superoffload/cuda.hpp
struct SubgroupState; // superoffload/checkpoint.hpp

/**
 * An owned offload session (`so_session*`): sub-groups of parameters whose Adam state lives in
 * host memory, stepped speculatively during backward on the session's CPU-Adam thread and
 * made exact at step(). Move-only; destroying it calls `so_session_destroy`, which waits for
 * every queued step, then stops the thread and frees the session's memory. A default-
 * constructed or moved-from Session is empty: destroying, resetting or moving it is safe and
 * does nothing; any other call on it throws Error (`SO_STATUS_NULL_ARGUMENT`).
 *
 * One step: begin_step(); grad_copy() (or grad_written()) for every slice, next_micro_step()
 * between micro-steps; optionally local_grad_sumsq(); step(), which returns at once with a
 * ticket; step_result(ticket). Master weights may be read again once the step's ticket is
 * complete (host sessions: the sub-group's final_ticket() suffices; a CUDA session writes
 * them after publishing the low-precision copy).
 *
 * Borrowed memory: the master weights (and caller gradient buffers) given to add_subgroup
 * are borrowed until the sub-group is removed or the session destroyed (see
 * `so_session_add_subgroup`): they must stay valid, and must not be touched from the
 * hand-off that completes their sub-group until its final ticket of that step.
 *
 * Errors and waiting: see superoffload/ticket.hpp. Every function not marked `noexcept`
 * throws Error when the C call fails.
 *
 * Thread-safety: calls on one session may come from several threads at once (the library
 * serialises them), but the Session object itself must not be moved, reset or destroyed
 * while another thread uses it.
 */
class Session : public detail::OwnedHandle<Session, so_session, so_session_destroy> {
public:
    /** An empty session handle (nothing to destroy). @note Never throws. */
    Session() noexcept = default;

    /**
     * Creates a session and starts its CPU-Adam thread (`so_session_create`).
     * @throws Error `SO_STATUS_UNSUPPORTED` (AMSGrad, f16 moments), `SO_STATUS_INVALID_ARGUMENT`
     *         (a pool and cores both given, bad cores, bad dtypes or loss-scaler settings),
     *         `SO_STATUS_OUT_OF_RESOURCES` (threads cannot start).
     */
    [[nodiscard]] static Session create(const SessionOptions& options = {}) {
        so_session* out = nullptr;
        check(so_session_create(&options, &out));
        return adopt(out, static_cast<DType>(options.grad_dtype), static_cast<DType>(options.accum_dtype));
    }

    /**
     * Creates a CUDA session with the default CudaOptions (`so_session_create_cuda`; see
     * superoffload/cuda.hpp). @throws Error as create, plus the CUDA statuses.
     */
    [[nodiscard]] static Session create_cuda(const SessionOptions& options = {});

    /**
     * Creates a CUDA session (`so_session_create_cuda`): gradients arrive as device pointers
     * (grad_device), updated weights are published into each sub-group's device parameter
     * (add_subgroup_cuda) after step() decides. Uses the device's primary context and its own
     * copy streams.
     * @throws Error as create, plus `SO_STATUS_CUDA_UNAVAILABLE` (no driver or device) and
     *         `SO_STATUS_CUDA_ERROR` (the driver's error name in the message).
     */
    [[nodiscard]] static Session create_cuda(const SessionOptions& options, const CudaOptions& cuda);

    /**
     * Takes ownership of a handle from `so_session_create` (or nullptr, giving an empty
     * Session). `grad_dtype` and `accum_dtype` must be those the session was created with:
     * the typed calls check their element types against them.
     * @note Never throws.
     */
    [[nodiscard]] static Session adopt(so_session* raw, DType grad_dtype, DType accum_dtype) noexcept {
        Session session = OwnedHandle::adopt(raw);
        session.grad_dtype_ = grad_dtype;
        session.accum_dtype_ = accum_dtype;
        return session;
    }

    // operator bool, raw, release (the caller must then `so_session_destroy` the handle) and
    // reset (which waits for the session's queued work) are OwnedHandle's.

    /** The dtype grad_copy expects (SessionOptions::grad_dtype). @note Never throws. */
    [[nodiscard]] DType grad_dtype() const noexcept { return grad_dtype_; }

    /** The dtype of the sub-group gradient buffers (SessionOptions::accum_dtype). @note Never throws. */
    [[nodiscard]] DType accum_dtype() const noexcept { return accum_dtype_; }

    // ---- param groups ----------------------------------------------------------------

    /**
     * Adds a param group (`so_session_add_group`). @return Its id (0, 1, ... in order).
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` for out-of-range values.
     */
    std::uint32_t add_group(const GroupHparams& hparams = {}) {
        std::uint32_t id = 0;
        check(so_session_add_group(raw(), &hparams, &id));
        return id;
    }

    /**
     * Changes a group's hyperparameters, at any time (`so_session_set_group`: speculative
     * steps already taken with other values are rolled back and redone at step()).
     * @throws Error `SO_STATUS_NOT_FOUND` (unknown group), `SO_STATUS_INVALID_ARGUMENT`.
     */
    void set_group(std::uint32_t group, const GroupHparams& hparams) {
        check(so_session_set_group(raw(), group, &hparams));
    }

    /** A group's current hyperparameters (`so_session_get_group`). @throws Error `SO_STATUS_NOT_FOUND`. */
    [[nodiscard]] GroupHparams group(std::uint32_t group) const {
        GroupHparams out;
        check(so_session_get_group(raw(), group, &out));
        return out;
    }

    // ---- sub-groups ------------------------------------------------------------------

    /**
     * Registers a sub-group of `numel` master weights (float: speculates; bf16 or f16:
     * stepped at step()) in `group`, with the slices whose gradients complete it; the session
     * allocates its gradient buffer (`so_session_add_subgroup`). `master` is borrowed (see the
     * class comment). Sub-groups are finalized in registration order: register them in
     * forward order.
     * @return The sub-group id (0, 1, ... in order of registration).
     * @throws Error `SO_STATUS_INVALID_STATE` (during a step), `SO_STATUS_NOT_FOUND` (unknown
     *         group), `SO_STATUS_ALIASING` (overlapping slices or buffers),
     *         `SO_STATUS_INVALID_ARGUMENT` (bad slices or names), `SO_STATUS_OUT_OF_RESOURCES`
     *         (host-memory limit). Nothing is registered on error.
     */
    template <class T, std::enable_if_t<is_element_v<T>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices) {
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, nullptr);
    }

    /**
     * As add_subgroup(group, master, numel, slices), with a caller gradient buffer of
     * `numel` elements of the accumulation dtype, also borrowed, for grad_written().
     * @throws Error as the other form, and `SO_STATUS_INVALID_ARGUMENT` (from the wrapper) if
     *         `A` is not the session's accum_dtype().
     */
    template <class T, class A, std::enable_if_t<is_element_v<T> && is_element_v<A>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices,
                               A* grad) {
        if (raw() && dtype_of<A>::value != accum_dtype_) {
            throw Error(SO_STATUS_INVALID_ARGUMENT, std::string("superoffload::Session::add_subgroup: the gradient "
                                                                "buffer is ") +
                                                        detail::dtype_name(dtype_of<A>::value) +
                                                        " but the session's accum_dtype is " +
                                                        detail::dtype_name(accum_dtype_));
        }
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, grad);
    }

    /**
     * As add_subgroup(group, master.data(), master.size(), slices), for a contiguous container
     * (std::vector, a span, ...) of float, bf16 or f16 that must not be resized while borrowed.
     * @throws Error as the pointer form.
     */
    template <class C, std::enable_if_t<is_element_v<detail::data_element_t<C>>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, C& master, const std::vector<Slice>& slices) {
        return add_subgroup(group, master.data(), master.size(), slices);
    }

    /**
     * As add_subgroup(group, master, slices), with a caller gradient buffer container of the
     * same size (else `SO_STATUS_INVALID_ARGUMENT`, from the wrapper).
     * @throws Error as the pointer form.
     */
    template <
        class C, class GC,
        std::enable_if_t<is_element_v<detail::data_element_t<C>> && is_element_v<detail::data_element_t<GC>>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, C& master, const std::vector<Slice>& slices, GC& grad) {
        if (grad.size() != master.size()) {
            throw Error(SO_STATUS_INVALID_ARGUMENT, "superoffload::Session::add_subgroup: the gradient buffer has " +
                                                        std::to_string(grad.size()) + " elements, the master weights " +
                                                        std::to_string(master.size()));
        }
        return add_subgroup(group, master.data(), master.size(), slices, grad.data());
    }

    /**
     * Registers a sub-group described by a C struct as it is (`so_session_add_subgroup`), for
     * what the typed forms do not set (caller moment buffers, ...). No wrapper checks.
     * @return The sub-group id. @throws Error as the typed forms.
     */
    std::uint32_t add_subgroup(const so_subgroup_desc& desc) {
        std::uint32_t id = 0;
        check(so_session_add_subgroup(raw(), &desc, &id));
        return id;
    }

    /**
     * Unregisters a sub-group between steps, after its outstanding work
     * (`so_session_remove_subgroup`); its slice names become free and its borrowed buffers are
     * not used after this returns.
     * @throws Error `SO_STATUS_NOT_FOUND`, `SO_STATUS_INVALID_STATE` (during a step).
     */
    void remove_subgroup(std::uint32_t subgroup) { check(so_session_remove_subgroup(raw(), subgroup)); }

    /**
     * The id of a slice (`so_session_slice_id`; stable for the session's lifetime: look it up
     * once). @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] std::uint32_t slice_id(const std::string& name) const {
        detail::check_c_string(name, "the slice name", "Session::slice_id");
        std::uint32_t id = 0;
        check(so_session_slice_id(raw(), name.c_str(), &id));
        return id;
    }

    // ---- one step --------------------------------------------------------------------

    /**
     * Starts an optimizer step whose backward uses `loss_scale` (0: the built-in scaler's
     * scale, or 1 without one) and `micro_steps` micro-steps of gradient accumulation
     * (`so_session_begin_step`).
     * @throws Error `SO_STATUS_INVALID_STATE` (the previous step was not given to step()),
     *         `SO_STATUS_INVALID_ARGUMENT` (bad scale, 0 micro-steps).
     */
    void begin_step(float loss_scale = 0.0f, std::uint32_t micro_steps = 1) {
        check(so_session_begin_step(raw(), loss_scale, micro_steps));
    }

    /**
     * Moves to the next micro-step (`so_session_next_micro_step`).
     * @throws Error `SO_STATUS_INVALID_STATE` (beyond the count, or no step).
     */
    void next_micro_step() { check(so_session_next_micro_step(raw())); }

    /**
     * Hands over a slice's gradient by copy (`so_session_grad_copy`): `numel` elements of
     * `G`, which must be the session's grad_dtype(). `grad` may be reused at once.
     * @return The ticket of the work this queued (the sub-group's speculative step, when this
     *         completed it), or no_ticket.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (wrong element type, from the wrapper; wrong
     *         size), `SO_STATUS_INVALID_STATE`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_OUT_OF_RESOURCES`.
     */
    template <class G, std::enable_if_t<is_element_v<G>, int> = 0>
    Ticket grad_copy(std::uint32_t slice, const G* grad, std::size_t numel) {
        return grad_copy(slice, static_cast<const void*>(grad), dtype_of<G>::value, numel);
    }

    /** As grad_copy(slice, grad.data(), grad.size()), for a contiguous container. @throws Error as that. */
    template <class C, std::enable_if_t<is_element_v<std::remove_const_t<detail::data_element_t<const C>>>, int> = 0>
    Ticket grad_copy(std::uint32_t slice, const C& grad) {
        return grad_copy(slice, grad.data(), grad.size());
    }

    /**
     * Untyped form of grad_copy: `numel` elements of `dtype` at `grad` (e.g. a framework
     * tensor's data pointer). @throws Error as the typed form.
     */
    Ticket grad_copy(std::uint32_t slice, const void* grad, DType dtype, std::size_t numel) {
        if (raw() && dtype != grad_dtype_) {
            throw Error(SO_STATUS_INVALID_ARGUMENT,
                        std::string("superoffload::Session::grad_copy: the gradient is ") + detail::dtype_name(dtype) +
                            " but the session's grad_dtype is " + detail::dtype_name(grad_dtype_));
        }
        Ticket ticket = no_ticket;
        check(so_session_grad_copy(raw(), slice, grad, numel, &ticket));
        return ticket;
    }

    /**
     * Records that the slice's gradient of this micro-step is in place in its sub-group's
     * caller gradient buffer (`so_session_grad_written`).
     * @return As grad_copy.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (the session owns the buffer),
     *         `SO_STATUS_INVALID_STATE` (outside backward, or the sub-group already completed),
     *         `SO_STATUS_NOT_FOUND`.
     */
    Ticket grad_written(std::uint32_t slice) {
        Ticket ticket = no_ticket;
        check(so_session_grad_written(raw(), slice, &ticket));
        return ticket;
    }

    /**
     * The sum of squares of this step's unscaled gradient over all sub-groups, waiting
     * forever for the speculative passes (`so_session_local_grad_sumsq`). Ends the backward:
     * only step() may follow.
     * @throws Error `SO_STATUS_INVALID_STATE` (outside a step), or the error of a failed pass.
     */
    [[nodiscard]] double local_grad_sumsq() {
        const std::optional<double> sumsq = local_grad_sumsq(forever);
        if (!sumsq) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::local_grad_sumsq: timed out waiting forever");
        }
        return *sumsq;
    }

    /**
     * As local_grad_sumsq(), waiting at most `timeout`.
     * @return The sum, or std::nullopt if the timeout expired (call again to keep waiting).
     * @throws Error as local_grad_sumsq().
     */
    [[nodiscard]] std::optional<double> local_grad_sumsq(Timeout timeout) {
        double sumsq = 0.0;
        const so_status st = so_session_local_grad_sumsq(raw(), timeout.c_ns(), &sumsq);
        if (st == SO_STATUS_TIMEOUT) {
            return std::nullopt;
        }
        check(st);
        return sumsq;
    }

    /**
     * Ends the step and returns at once (`so_session_step`); the CPU-Adam thread decides
     * (norm, skip, clip) and makes every sub-group exact in registration order.
     * @return The ticket that completes when every sub-group is final (for step_result).
     * @throws Error `SO_STATUS_INVALID_STATE` (no begin_step), `SO_STATUS_INVALID_ARGUMENT`
     *         (bad max_norm).
     */
    Ticket step(const StepArgs& args = {}) {
        Ticket ticket = no_ticket;
        check(so_session_step(raw(), &args, &ticket));
        return ticket;
    }

    /**
     * Waits forever for the step of `ticket` (as returned by step()) and describes it
     * (`so_session_step_result`).
     * @throws Error `SO_STATUS_NOT_FOUND` (not the latest step's ticket), or the step's error.
     */
    [[nodiscard]] StepResult step_result(Ticket ticket) const {
        const std::optional<StepResult> result = step_result(ticket, forever);
        if (!result) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::step_result: timed out waiting forever");
        }
        return *result;
    }

    /**
     * As step_result(ticket), waiting at most `timeout`.
     * @return The result, or std::nullopt if the timeout expired.
     * @throws Error as step_result(ticket).
     */
    [[nodiscard]] std::optional<StepResult> step_result(Ticket ticket, Timeout timeout) const {
        StepResult result;
        const so_status st = so_session_step_result(raw(), ticket, timeout.c_ns(), &result);
        if (st == SO_STATUS_TIMEOUT) {
            return std::nullopt;
        }
        check(st);
        return result;
    }

    // ---- queries ---------------------------------------------------------------------

    /**
     * The ticket that completes when the sub-group's latest step is final (no_ticket before
     * its first step; `so_session_final_ticket`). @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] Ticket final_ticket(std::uint32_t subgroup) const {
        Ticket ticket = no_ticket;
        check(so_session_final_ticket(raw(), subgroup, &ticket));
        return ticket;
    }

    /**
     * Waits forever until the sub-group's latest step wrote its master weights and moments, so
     * its gradient buffer is free for the next step's gradient (`so_session_wait_settled`).
     * @throws Error the final pass's error, or `SO_STATUS_INVALID_ARGUMENT`.
     */
    void wait_settled(std::uint32_t subgroup) const { check(so_session_wait_settled(raw(), subgroup, -1)); }

    /**
     * Waits at most `timeout` for wait_settled(subgroup)'s condition.
     * @return false if the timeout expired. @throws Error as wait_settled(subgroup).
     */
    [[nodiscard]] bool wait_settled(std::uint32_t subgroup, Timeout timeout) const {
        const so_status st = so_session_wait_settled(raw(), subgroup, timeout.c_ns());
        if (st == SO_STATUS_TIMEOUT) {
            return false;
        }
        check(st);
        return true;
    }

    /**
     * Steps the sub-group has taken (skipped steps do not count; `so_session_step_count`);
     * read it after the sub-group's final ticket. @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] std::uint64_t step_count(std::uint32_t subgroup) const {
        std::uint64_t count = 0;
        check(so_session_step_count(raw(), subgroup, &count));
        return count;
    }

    /**
     * The built-in loss scaler's current scale (waiting for the latest step's verdict), or 1
     * without a scaler (`so_session_loss_scale`). @throws Error only for an empty handle.
     */
    [[nodiscard]] float loss_scale() const {
        float scale = 0.0f;
        check(so_session_loss_scale(raw(), &scale));
        return scale;
    }

    /**
     * A number naming this session for the rest of the process, never reused by another
     * (`so_session_id`): the `session` attribute of the `so_xla_*` handlers.
     * @throws Error only for an empty handle.
     */
    [[nodiscard]] std::uint64_t id() const {
        std::uint64_t out = 0;
        check(so_session_id(raw(), &out));
        return out;
    }

    /** Host bytes the session allocated (`so_session_host_bytes`). @throws Error only for an empty handle. */
    [[nodiscard]] std::size_t host_bytes() const {
        std::size_t bytes = 0;
        check(so_session_host_bytes(raw(), &bytes));
        return bytes;
    }

    // ---- tickets ---------------------------------------------------------------------

    /**
     * The state of a ticket, without waiting (`so_ticket_query`): done, pending, or failed
     * with the work's Error.
     * @throws Error `SO_STATUS_NOT_FOUND` for a ticket this session never issued (misuse, not
     *         a state), `SO_STATUS_NULL_ARGUMENT` for an empty handle.
     */
    [[nodiscard]] TicketStatus query(Ticket ticket) const {
        const so_status st = so_ticket_query(raw(), ticket);
        TicketStatus out;
        switch (st) {
        case SO_STATUS_OK: out.state = TicketState::Done; return out;
        case SO_STATUS_PENDING: out.state = TicketState::Pending; return out;
        case SO_STATUS_NOT_FOUND:
        case SO_STATUS_NULL_ARGUMENT: check(st); break;
        default: break;
        }
        std::string message = last_error_message();
        if (message.empty()) {
            message = status_str(st);
        }
        out.state = TicketState::Failed;
        out.error = Error(st, message);
        return out;
    }

    /**
     * Waits forever for a ticket (`so_ticket_wait`; no_ticket is always complete).
     * @throws Error the work's error if it failed; `SO_STATUS_NOT_FOUND` for a ticket never issued.
     */
    void wait(Ticket ticket) const {
        if (!wait(ticket, forever)) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::wait: timed out waiting forever");
        }
    }

    /**
     * Waits at most `timeout` for a ticket (a zero duration polls).
     * @return true if the work completed successfully, false if the timeout expired.
     * @throws Error as wait(ticket).
     */
    [[nodiscard]] bool wait(Ticket ticket, Timeout timeout) const {
        const so_status st = so_ticket_wait(raw(), ticket, timeout.c_ns());
        if (st == SO_STATUS_TIMEOUT) {
            return false;
        }
        check(st);
        return true;
    }

    /**
     * Waits forever for every ticket up to and including `ticket` (`so_ticket_wait_all`).
     * @throws Error the error of the first failed one.
     */
    void wait_all(Ticket ticket) const {
        if (!wait_all(ticket, forever)) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::wait_all: timed out waiting forever");
        }
    }

    /**
     * Waits at most `timeout` for every ticket up to and including `ticket`.
     * @return true if all completed successfully, false if the timeout expired.
     * @throws Error as wait_all(ticket).
     */
    [[nodiscard]] bool wait_all(Ticket ticket, Timeout timeout) const {
        const so_status st = so_ticket_wait_all(raw(), ticket, timeout.c_ns());
        if (st == SO_STATUS_TIMEOUT) {
            return false;
        }
        check(st);
        return true;
    }

    // ---- CUDA sessions (defined in superoffload/cuda.hpp) ------------------------------

    /**
     * As add_subgroup, for a CUDA session (`so_subgroup_desc.device_param`): the model's
     * parameter lives at `device_param` (`numel` elements of `device_dtype` on the GPU,
     * borrowed like the master weights), where updated weights are published after each
     * step() decides. @throws Error as add_subgroup.
     */
    template <class T>
    std::uint32_t add_subgroup_cuda(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices,
                                    so_device_ptr device_param, DType device_dtype,
                                    Placement placement = Placement::Host) {
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, nullptr, device_param, device_dtype,
                                 placement);
    }

    /** Moves a sub-group between host and GPU memory, between steps (`so_session_set_placement`). */
    void set_placement(std::uint32_t subgroup, Placement placement);

    /** GPU bytes the session allocated (`so_session_device_bytes`). */
    [[nodiscard]] std::size_t device_bytes() const;

    /**
     * The budget of the automatic split in bytes (`so_session_gpu_budget`): `gpu_budget_bytes`
     * as given, or with `SO_GPU_BUDGET_AUTO` the budget chosen after the warm-up steps
     * (std::nullopt until then).
     */
    [[nodiscard]] std::optional<std::uint64_t> gpu_budget() const;

    /**
     * Limits the free GPU memory the automatic budget counts on to `limit_bytes`, or lifts the
     * limit (std::nullopt; `so_session_limit_device_memory`): for an allocator that works under
     * a cap the device does not show, give the cap less what it and the session hold.
     */
    void limit_device_memory(std::optional<std::uint64_t> limit_bytes);

    /**
     * Hands over the gradient of `slice` ready at device address `grad` on `stream`
     * (`so_session_grad_device`). @return The ticket of the speculative step this queued, or
     * no_ticket.
     */
    Ticket grad_device(std::uint32_t slice, so_device_ptr grad, std::size_t numel, DType dtype,
                       so_cuda_stream_t stream);

    /** Registers the compute stream (`so_session_set_compute_stream`). */
    void set_compute_stream(so_cuda_stream_t stream);

    /** Makes `stream` wait until `ticket` is complete and published (`so_ticket_enqueue_wait`). */
    void enqueue_wait(Ticket ticket, so_cuda_stream_t stream) const;

    /** The session's first copy stream (`so_session_copy_stream`). */
    [[nodiscard]] so_cuda_stream_t copy_stream() const;

    /** Host bytes the session page-locked (`so_session_pinned_bytes`; 0 for a host session). */
    [[nodiscard]] std::size_t pinned_bytes() const;

    // ---- timeline --------------------------------------------------------------------

    /**
     * Starts (clearing an earlier one) or stops recording a timeline of the session's work
     * (`so_session_trace`).
     */
    void trace(bool enable) { check(so_session_trace(raw(), enable)); }

    /**
     * Writes the recorded timeline as Chrome trace JSON (`so_session_trace_save`).
     * @throws Error `SO_STATUS_IO`.
     */
    void save_trace(const std::string& path) const {
        detail::check_c_string(path, "the path", "Session::save_trace");
        check(so_session_trace_save(raw(), path.c_str()));
    }

    // ---- checkpoints and state (defined in superoffload/checkpoint.hpp) ---------------

    /** Saves a checkpoint between steps, after in-flight work (`so_session_save`). */
    void save(const std::string& path);

    /** Loads a checkpoint into the registered sub-groups, between steps (`so_session_load`). */
    void load(const std::string& path);

    /** A sub-group's state buffers (`so_session_get_subgroup_state`). */
    [[nodiscard]] SubgroupState subgroup_state(std::uint32_t subgroup) const;

    /** Sets a sub-group's step count, between steps (`so_session_set_step_count`). */
    void set_step_count(std::uint32_t subgroup, std::uint64_t count);

private:
    std::uint32_t add_subgroup_impl(std::uint32_t group, void* master, DType master_dtype, std::size_t numel,
                                    const std::vector<Slice>& slices, void* grad, so_device_ptr device_param = 0,
                                    DType device_dtype = DType::None, Placement placement = Placement::Host) {
        std::vector<so_slice_desc> raw_slices;
        raw_slices.reserve(slices.size());
        for (const Slice& s : slices) {
            detail::check_c_string(s.name_string(), "a slice name", "Session::add_subgroup");
            raw_slices.push_back(s);
        }
        so_subgroup_desc desc = so_subgroup_desc_default();
        desc.group = group;
        desc.master = master;
        desc.master_dtype = master_dtype;
        desc.numel = numel;
        desc.grad = grad;
        desc.slices = raw_slices.empty() ? nullptr : raw_slices.data();
        desc.num_slices = raw_slices.size();
        desc.device_param = device_param;
        desc.device_param_dtype = device_dtype;
        desc.placement = placement;
        return add_subgroup(desc);
    }

    DType grad_dtype_ = DType::F32;
    DType accum_dtype_ = DType::F32;
};

} // namespace superoffload

// The definitions of Session's checkpoint and CUDA calls.
#include "checkpoint.hpp"
#include "cuda.hpp"

#endif // SUPEROFFLOAD_SESSION_HPP
