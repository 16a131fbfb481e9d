//! Checkpoints: `so_session_save`, `so_session_load`, and the speculation history a state
//! dict kept elsewhere carries (`so_session_get_speculation_history`, `..._set_...`).

use std::ffi::c_char;

use super::handle::{session_ref, so_session};
use crate::error::Status;
use crate::ffi::args::{non_null, path_arg, write_out};
use crate::ffi::boundary::ffi_boundary;

/// @brief Saves a checkpoint (safetensors; see the README for the layout), between steps,
/// after in-flight work. Atomic: the file at `path` is either the old one or the new one.
/// @return `SO_STATUS_OK`, `SO_STATUS_IO`, or `SO_STATUS_INVALID_STATE` during a step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `path` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_save(session: *mut so_session, path: *const c_char) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `path` is NULL or a NUL-terminated string (this function's contract).
        s.save(&unsafe { path_arg(path)? })
    })
}

/// @brief Loads a checkpoint into the registered sub-groups (which may be partitioned
/// differently from the saved session), between steps: master weights (written into the
/// borrowed buffers), moments, step counts, group hyperparameters, loss-scaler state. A CUDA
/// session also publishes the loaded weights into the sub-groups' device parameters, after
/// the work queued on the compute stream, and returns once they have landed.
/// @return `SO_STATUS_OK`; `SO_STATUS_BAD_CHECKPOINT` for a truncated, corrupt or
///         mismatched file (then nothing changed); `SO_STATUS_IO`; `SO_STATUS_INVALID_STATE`.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `path` is NULL or a NUL-terminated string;
/// the borrowed master buffers of the sub-groups are valid and left alone during the call.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_load(session: *mut so_session, path: *const c_char) -> Status {
    ffi_boundary!({
        // The path is checked first, before any change to the session.
        // SAFETY: `path` is NULL or a NUL-terminated string (this function's contract).
        let path = unsafe { path_arg(path)? };
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.load(&path)
    })
}

/// @brief The clip history `SO_SPECULATION_AUTO` decides from (it fixes which sub-groups
/// speculate, so a resumed run needs it to continue bit for bit): bit `i` of `*out_history` is
/// 1 when the `i`-th of the last `*out_steps` steps (oldest first, at most 8) kept its
/// speculative factor (not clipped, not skipped). `so_session_save` keeps it in the file; a
/// caller that keeps state elsewhere (a framework's state dict) keeps these two numbers.
/// @return `SO_STATUS_OK`, or `SO_STATUS_INVALID_ARGUMENT` for a NULL pointer.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_history` and `out_steps` are NULL or
/// writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_get_speculation_history(
    session: *const so_session,
    out_history: *mut u32,
    out_steps: *mut u32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let (history, steps) = unsafe { session_ref(session)? }.speculation_history();
        // Both pointers are checked before either is written.
        non_null(out_steps.cast_const(), "out_steps")?;
        // SAFETY: both are NULL or writable (this function's contract).
        unsafe {
            write_out(out_history, "out_history", history)?;
            write_out(out_steps, "out_steps", steps)
        }
    })
}

/// @brief Restores a history of `so_session_get_speculation_history`, between steps.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_ARGUMENT` for more than 8 steps or a bit set
///         beyond `steps` (nothing changes); `SO_STATUS_INVALID_STATE` during a step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_speculation_history(
    session: *mut so_session,
    history: u32,
    steps: u32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.set_speculation_history(history, steps)
    })
}
