//! One optimizer step: its start, the gradient hand-offs, `so_session_step` and its result.

use std::ffi::c_void;

use super::handle::{session_ref, so_session};
use crate::error::Status;
use crate::ffi::args::{
    RawBuf, check_out_struct, non_null, read_struct_or, timeout, with_struct_size, write_opt, write_out,
};
use crate::ffi::boundary::ffi_boundary;
use crate::ffi::convert::{Field, abi_struct};
use crate::ffi::tickets::so_ticket;
use crate::ffi::types::so_norm_source;
use crate::session::{NormSource, StepArgs, StepResult};

/// What `so_session_step` is told. Initialise with `so_step_args_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_step_args {
    /// `sizeof(so_step_args)`.
    pub struct_size: usize,
    /// Clip the global norm to this (torch's `clip_grad_norm_`: coefficient
    /// `min(1, max_norm / (norm + 1e-6))`); 0 disables clipping.
    pub max_norm: f64,
    /// One of `so_norm_source`.
    pub norm_source: u32,
    /// With `SO_NORM_SOURCE_GIVEN`: the global norm of the unscaled gradient.
    pub global_norm: f64,
    /// The caller saw an overflow (e.g. on another rank): skip the step.
    pub overflow: bool,
}

abi_struct! {
    so_step_args <=> StepArgs { max_norm, overflow }
    to_core |raw, arg| {
        norm: match so_norm_source::parse(raw.norm_source, Field::member(arg, "norm_source"))? {
            so_norm_source::Local => NormSource::Local,
            so_norm_source::Given => NormSource::Given(raw.global_norm),
        },
    }
    to_c |args| {
        norm_source: match args.norm {
            NormSource::Local => so_norm_source::Local,
            NormSource::Given(_) => so_norm_source::Given,
        } as u32,
        global_norm: match args.norm {
            NormSource::Local => 0.0,
            NormSource::Given(norm) => norm,
        },
    }
}

/// No clipping, the local norm, no overflow.
const DEFAULT_STEP_ARGS: StepArgs = StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: false };

/// The outcome of one step (filled by `so_session_step_result`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_step_result {
    /// Set by the caller to `sizeof(so_step_result)` before the call.
    pub struct_size: usize,
    /// 1 for the session's first step, then one more per `so_session_begin_step`.
    pub serial: u64,
    /// The step was skipped (see `skip_reason`): every speculative step was rolled back,
    /// step counts are unchanged.
    pub skipped: bool,
    /// Global norm of the unscaled gradient (inf or NaN when a gradient element was; the
    /// caller's value with `SO_NORM_SOURCE_GIVEN`).
    pub global_norm: f64,
    /// Clip coefficient applied (1 when not clipped or skipped).
    pub clip_coef: f64,
    /// The factor the gradients were finally stepped with: `clip_coef / loss_scale`.
    pub grad_factor: f32,
    /// The loss scale this step's backward used.
    pub loss_scale: f32,
    /// The loss scale of the next step (the built-in scaler's verdict, else unchanged).
    pub next_loss_scale: f32,
    /// Speculative steps submitted during backward.
    pub speculative: u32,
    /// Gradients that arrived for a sub-group after it was complete (whether or not it
    /// speculated).
    pub late_gradients: u32,
    /// Speculative steps kept as taken (same factor and hyperparameters); the final pass
    /// steps what the speculative pass had not reached (all of it, where it was cancelled).
    /// Each of `kept`, `rescaled`, `rolled_back` and `redone` counts a speculative step
    /// alike whether its pass ran, was preempted or was cancelled: the three write the same
    /// bits.
    pub kept: u32,
    /// Speculative steps rescaled to the final factor (one pass each).
    pub rescaled: u32,
    /// Speculative steps undone (skipped step).
    pub rolled_back: u32,
    /// Speculative steps undone and taken again (late gradient, changed hyperparameters).
    pub redone: u32,
    /// Sub-groups stepped at step() that did not speculate.
    pub stepped: u32,
    /// Why the step was skipped: one of `so_skip_reason` (`SO_SKIP_REASON_NONE` when it was not).
    pub skip_reason: u32,
    /// Speculative passes that had not started at `so_session_step`: cancelled, their work
    /// done by the final pass (also counted in `kept`, `rescaled`, `rolled_back` or `redone`).
    pub cancelled: u32,
    /// Sub-groups stepped on the GPU (`SO_PLACEMENT_DEVICE`).
    pub device_stepped: u32,
    /// Sub-groups placed on the GPU during this step.
    pub device_subgroups: u32,
    /// Elements the optimizer passes touched after `so_session_step` was called (a pass over
    /// a sub-group counts its elements): the work left after backward before the weights
    /// are final. (The pass that writes a sub-group's master weights and moments after the
    /// copy of its weights was published, in CUDA sessions, is not counted.)
    pub final_pass_elements: u64,
    /// Seconds the compute stream (CUDA sessions, through `so_ticket_enqueue_wait`, timed on
    /// the GPU) or the calling threads (`so_ticket_wait` and the other host waits) waited on
    /// this session's tickets between the previous `so_session_step` and this one: the
    /// optimizer time the previous step left exposed. The host wait inside
    /// `so_ticket_enqueue_wait` is not counted: the host runs ahead of the GPU there.
    pub forward_wait_s: f64,
}

abi_struct!(
    so_step_result
        <= StepResult {
            serial,
            skipped,
            global_norm,
            clip_coef,
            grad_factor,
            loss_scale,
            next_loss_scale,
            speculative,
            late_gradients,
            kept,
            rescaled,
            rolled_back,
            redone,
            stepped,
            skip_reason,
            cancelled,
            device_stepped,
            device_subgroups,
            final_pass_elements,
            forward_wait_s,
        }
);

// SAFETY: both are `#[repr(C)]`, `struct_size` first, the other fields numbers and bools.
with_struct_size!(unsafe so_step_args, so_step_result);

/// Returns step arguments: no clipping, local norm, no overflow; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_step_args_default() -> so_step_args {
    ffi_boundary!({ Ok(so_step_args::from_core(&DEFAULT_STEP_ARGS)) })
}

/// @brief Starts an optimizer step.
///
/// @param loss_scale The loss scale this backward uses (gradients arrive multiplied by it
///        and are unscaled by `1 / loss_scale`), or 0 for the built-in scaler's current
///        scale (which waits for the previous step's verdict) or 1 without a scaler.
/// @param micro_steps Micro-steps of gradient accumulation, >= 1; speculation happens
///        only in the last.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` if the previous step was not given to
///         `so_session_step`; `SO_STATUS_INVALID_ARGUMENT`, changing nothing, for
///         `micro_steps` 0 or a loss scale that is not finite and > 0 or whose reciprocal is
///         not finite in f32 (below about 2.9e-39; the built-in scaler's `init_scale` and
///         `min_scale` are refused likewise at `so_session_create`).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_begin_step(session: *mut so_session, loss_scale: f32, micro_steps: u32) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        s.begin_step((loss_scale != 0.0).then_some(loss_scale), micro_steps)
    })
}

/// @brief Moves to the next micro-step of the current step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_next_micro_step(session: *mut so_session) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.next_micro_step()
    })
}

/// @brief Hands over a slice's gradient by copy (into the sub-group's gradient buffer, in
/// the accumulation dtype; the first gradient of the step overwrites, later ones add).
///
/// When the slice's gradient of the last micro-step completes its sub-group, the session
/// queues the sub-group's speculative step (scale `1 / loss_scale`; or, for a sub-group
/// that cannot speculate, the measurement of its sum of squares) and returns its ticket. A
/// gradient for a sub-group that already completed this step is kept aside (allocating a
/// buffer of the sub-group's size, once) and the sub-group is rolled back and redone at
/// `so_session_step`. The copy is done before this returns: `grad` may be reused at once.
/// No allocation on the normal path.
///
/// The speculative step's ticket fails with `SO_STATUS_NON_FINITE` if the gradient it was
/// planned with has an inf or NaN element, whether its pass ran or not: every ticket's status,
/// like the bits, depends on the inputs alone, never on the timing. A speculative step that
/// does not run otherwise completes its ticket with `SO_STATUS_OK`, and the sub-group is
/// stepped once at `so_session_step`: one cancelled at `so_session_step` (ticket complete
/// with the sub-group's final pass), one cancelled or undone after a late gradient by
/// `so_session_local_grad_sumsq` (complete there, before `so_session_step`), or one declined
/// because the sum of squares of its unscaled gradient exceeds `FLT_MAX` (`exp_avg_sq` would
/// overflow, which no rollback can undo).
///
/// @param slice From `so_session_slice_id`.
/// @param grad `numel` elements of the session's `grad_dtype`.
/// @param numel Must equal the slice's.
/// @param out_ticket NULL, or receives the ticket of the work this queued (0 if none).
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` outside a step's backward;
///         `SO_STATUS_NOT_FOUND` for an unknown slice; `SO_STATUS_INVALID_ARGUMENT` for a
///         wrong size; `SO_STATUS_OUT_OF_RESOURCES` if a late gradient exceeds the memory
///         limit.
/// @note Thread-safety: see `so_session`. Hand-offs of one slice must not race.
///
/// # Safety
/// `session` is NULL or a live session handle; `grad` is NULL or holds `numel` readable
/// elements of the session's `grad_dtype`, not written during the call; `out_ticket` is
/// NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_copy(
    session: *mut so_session,
    slice: u32,
    grad: *const c_void,
    numel: usize,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        let grad = RawBuf::new("grad", "numel", grad, numel, s.options().grad_dtype)?;
        // SAFETY: `grad` holds `numel` readable elements of the session's grad_dtype, not written
        // during the call (this function's contract); the session reads it only during the call.
        let ticket = s.grad_copy(slice, unsafe { grad.floats() })?;
        // SAFETY: `out_ticket` is NULL or writable (this function's contract).
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief Records that the slice's gradient of this micro-step is in place in the
/// sub-group's caller-provided gradient buffer (accumulated by the caller over
/// micro-steps, as torch accumulates `.grad`). Completion and tickets as
/// `so_session_grad_copy`. A late gradient cannot be written in place (the buffer is in
/// use): hand it over with `so_session_grad_copy`.
/// @return As `so_session_grad_copy`; `SO_STATUS_INVALID_ARGUMENT` for a sub-group whose
///         gradient buffer the session owns; `SO_STATUS_INVALID_STATE` for a sub-group that
///         already completed this step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_ticket` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_written(
    session: *mut so_session,
    slice: u32,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let ticket = unsafe { session_ref(session)? }.grad_written(slice)?;
        // SAFETY: `out_ticket` is NULL or writable (this function's contract).
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief The sum of squares of this step's unscaled gradient over all sub-groups (zeros
/// for slices that got none, late gradients merged): what an all-reduce across ranks needs.
/// Waits for the speculative passes (up to `timeout_ns`; negative waits forever). Ends the
/// backward: only `so_session_step` may follow. Not finite iff an element is inf or NaN.
/// @return `SO_STATUS_OK`, `SO_STATUS_TIMEOUT` (call again to keep waiting), or
///         `SO_STATUS_INVALID_STATE` outside a step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_sumsq` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_local_grad_sumsq(
    session: *mut so_session,
    timeout_ns: i64,
    out_sumsq: *mut f64,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        non_null(out_sumsq, "out_sumsq")?;
        let sumsq = s.local_grad_sumsq(timeout(timeout_ns))?;
        // SAFETY: `out_sumsq` is NULL or writable (this function's contract).
        unsafe { write_out(out_sumsq, "out_sumsq", sumsq) }
    })
}

/// @brief Ends the step and returns at once: the CPU-Adam thread takes the norm (local or
/// given), decides whether to skip (caller overflow, non-finite gradient or norm, or a factor
/// that is 0 or inf in f32: `so_step_result.skip_reason`) and the clip factor
/// `f = min(1, max_norm / (norm + 1e-6)) / loss_scale`, then makes every
/// sub-group exact in registration order: a speculative step with the same factor is kept,
/// with another factor rescaled in one pass, after a late gradient or a change of
/// hyperparameters rolled back and redone, on a skipped step rolled back; sub-groups that
/// did not speculate are stepped. Each sub-group's final ticket completes as it is done
/// (`so_session_final_ticket`), so the next forward can start on the first layers.
///
/// @param args NULL for `so_step_args_default()`.
/// @param out_ticket Receives the ticket that completes when every sub-group is final;
///        pass it to `so_session_step_result`.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` without `so_session_begin_step`;
///         `SO_STATUS_INVALID_ARGUMENT` for a bad `max_norm`, norm source or a negative
///         given norm (nothing changes then; the step can be given to step() again).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `args` is NULL or points to a
/// `so_step_args`; `out_ticket` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step(
    session: *mut so_session,
    args: *const so_step_args,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        non_null(out_ticket, "out_ticket")?;
        // SAFETY: `args` is NULL or points to a readable struct of its type (this function's
        // contract).
        let args = unsafe { read_struct_or(args, "args", || so_step_args::from_core(&DEFAULT_STEP_ARGS))? };
        let ticket = s.step(args.to_core("args")?)?;
        // SAFETY: `out_ticket` is NULL or writable (this function's contract).
        unsafe { write_out(out_ticket, "out_ticket", ticket) }
    })
}

/// @brief Waits up to `timeout_ns` (negative: forever) for the step of `ticket` (as
/// returned by `so_session_step`) and describes it. Only the latest step's result is kept.
/// @param out_result Caller-provided with `struct_size = sizeof(so_step_result)`.
/// @return `SO_STATUS_OK`, `SO_STATUS_TIMEOUT`, or `SO_STATUS_NOT_FOUND` at once, without
///         waiting, for any ticket but the one the latest `so_session_step` returned.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_result` is NULL or points to a writable
/// `so_step_result`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step_result(
    session: *const so_session,
    ticket: so_ticket,
    timeout_ns: i64,
    out_result: *mut so_step_result,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `out_result` is NULL or points to a writable struct of its type (this
        // function's contract).
        unsafe { check_out_struct(out_result, "out_result")? };
        let result = s.step_result(ticket, timeout(timeout_ns))?;
        // SAFETY: `out_result` is NULL or writable (this function's contract).
        unsafe { write_out(out_result, "out_result", so_step_result::from_core(&result)) }
    })
}

/// @brief The built-in loss scaler's current scale (after the latest step's verdict, which
/// this waits for), or 1 without a scaler: multiply the loss by it before backward.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_scale` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_loss_scale(session: *const so_session, out_scale: *mut f32) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let scale = unsafe { session_ref(session)? }.loss_scale();
        // SAFETY: `out_scale` is NULL or writable (this function's contract).
        unsafe { write_out(out_scale, "out_scale", scale) }
    })
}
