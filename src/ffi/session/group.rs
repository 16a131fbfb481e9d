//! `so_session_*_group`: param groups and their hyperparameters.

use super::handle::{session_ref, so_session};
use crate::error::Status;
use crate::ffi::args::{check_out_struct, non_null, read_struct, with_struct_size, write_out};
use crate::ffi::boundary::ffi_boundary;
use crate::ffi::convert::abi_struct;
use crate::session::GroupHparams;

/// Hyperparameters of a param group. Initialise with `so_group_hparams_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_group_hparams {
    /// `sizeof(so_group_hparams)`.
    pub struct_size: usize,
    /// Learning rate, finite and >= 0.
    pub lr: f64,
    /// In [0, 1); 0 disables speculation for the group's sub-groups.
    pub beta1: f64,
    /// In [0, 1); 0 disables speculation for the group's sub-groups.
    pub beta2: f64,
    /// Finite and >= 0.
    pub eps: f64,
    /// Finite and >= 0.
    pub weight_decay: f64,
}

abi_struct!(so_group_hparams <=> GroupHparams { lr, beta1, beta2, eps, weight_decay });

// SAFETY: `#[repr(C)]`, `struct_size` first, the other fields doubles.
with_struct_size!(unsafe so_group_hparams);

/// Returns `torch.optim.AdamW`'s hyperparameters (lr 1e-3, betas 0.9 and 0.999, eps 1e-8,
/// weight decay 0.01); `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_group_hparams_default() -> so_group_hparams {
    ffi_boundary!({ Ok(so_group_hparams::from_core(&GroupHparams::default())) })
}

/// @brief Adds a param group.
/// @param out_group Receives its id (0, 1, ... in order of addition).
/// @return `SO_STATUS_OK` or `SO_STATUS_INVALID_ARGUMENT` for out-of-range values.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `hparams` is NULL or points to a
/// `so_group_hparams`; `out_group` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_add_group(
    session: *mut so_session,
    hparams: *const so_group_hparams,
    out_group: *mut u32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        non_null(out_group, "out_group")?;
        // SAFETY: `hparams` is NULL or points to a readable struct of its type (this function's
        // contract).
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_core("hparams")?;
        let id = s.add_group(hp)?;
        // SAFETY: `out_group` is NULL or writable (this function's contract).
        unsafe { write_out(out_group, "out_group", id) }
    })
}

/// @brief Changes a group's hyperparameters, at any time (LR and momentum schedules).
/// Speculative steps submitted afterwards use them; at the next `so_session_step`, every
/// sub-group is finalized with the values current when `so_session_step` is called
/// (speculative steps taken with other values are rolled back and redone).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `hparams` is NULL or points to a
/// `so_group_hparams`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_group(
    session: *mut so_session,
    group: u32,
    hparams: *const so_group_hparams,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `hparams` is NULL or points to a readable struct of its type (this function's
        // contract).
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_core("hparams")?;
        s.set_group_hparams(group, hp)
    })
}

/// @brief Reads a group's current hyperparameters into `out_hparams` (whose `struct_size`
/// the caller sets).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_hparams` is NULL or points to a
/// writable `so_group_hparams`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_get_group(
    session: *const so_session,
    group: u32,
    out_hparams: *mut so_group_hparams,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `out_hparams` is NULL or points to a writable struct of its type (this
        // function's contract).
        unsafe { check_out_struct(out_hparams, "out_hparams")? };
        let g = s.group_hparams(group)?;
        // SAFETY: `out_hparams` is NULL or writable (this function's contract).
        unsafe { write_out(out_hparams, "out_hparams", so_group_hparams::from_core(&g)) }
    })
}
