//! Sub-groups: registration, the slices they are made of, their state, placement and step
//! counts.

use std::ffi::{c_char, c_void};

use super::handle::{session_ref, so_session};
use crate::error::{Error, Result, Status};
use crate::ffi::args::{
    RawBuf, c_str, check_out_struct, non_null, read_struct, required_array, timeout, with_struct_size, write_out,
};
use crate::ffi::boundary::ffi_boundary;
use crate::ffi::convert::{Field, FromC, abi_struct};
use crate::ffi::tickets::so_ticket;
use crate::ffi::types::{so_device_ptr, so_dtype, so_placement};
use crate::kernels::DType;
use crate::session::{Borrowed, DeviceParam, Placement, SessionOptions, SliceDesc, SubGroupDesc, SubGroupState};

/// One named param slice of a sub-group (an element of `so_subgroup_desc.slices`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_slice_desc {
    /// NUL-terminated, unique in the session; copied.
    pub name: *const c_char,
    /// First element within the sub-group.
    pub offset: usize,
    /// Elements, >= 1.
    pub numel: usize,
}

abi_struct! {
    so_slice_desc => SliceDesc { offset, numel }
    to_core (unsafe) |raw, arg| {
        // SAFETY: `to_core` is unsafe: `name` is NULL or a NUL-terminated string.
        name: unsafe { c_str(raw.name, &format!("{arg}.name"))? }.to_string(),
    }
}

/// A sub-group to register. Initialise with `so_subgroup_desc_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_subgroup_desc {
    /// `sizeof(so_subgroup_desc)`.
    pub struct_size: usize,
    /// The param group, from `so_session_add_group`.
    pub group: u32,
    /// Flat master weights, `numel` elements of `master_dtype`; borrowed (see
    /// `so_session_add_subgroup`).
    pub master: *mut c_void,
    /// `SO_DTYPE_F32` (speculates), or `SO_DTYPE_BF16` / `SO_DTYPE_F16` (stepped at step()).
    pub master_dtype: u32,
    /// Elements of the sub-group.
    pub numel: usize,
    /// NULL (the session allocates the gradient buffer) or a caller buffer of `numel`
    /// elements of the accumulation dtype, borrowed like `master`, for `so_session_grad_written`.
    pub grad: *mut c_void,
    /// The slices whose gradients complete this sub-group; copied. They need not cover the
    /// sub-group: elements outside every slice are padding (e.g. for alignment), set to 0
    /// in `master`, the moments and the gradient buffer at registration; they stay 0 (no
    /// gradient lands there: keep a caller gradient buffer's padding 0) and are in no
    /// checkpoint.
    pub slices: *const so_slice_desc,
    /// Entries in `slices`, >= 1.
    pub num_slices: usize,
    /// CUDA sessions: the model's parameter on the device (`numel` elements of
    /// `device_param_dtype`), where updated weights are published; borrowed like `master`.
    /// 0 in host sessions.
    pub device_param: so_device_ptr,
    /// `SO_DTYPE_F32`, `SO_DTYPE_BF16` or `SO_DTYPE_F16` (CUDA sessions).
    pub device_param_dtype: u32,
    /// NULL (the session allocates it) or a caller buffer of `numel` elements of the
    /// session's moment dtype, borrowed like `master`: the first moment.
    pub exp_avg: *mut c_void,
    /// As `exp_avg`, for the second moment.
    pub exp_avg_sq: *mut c_void,
    /// One of `so_placement`. `SO_PLACEMENT_DEVICE` (CUDA sessions, f32 master) keeps the
    /// master weights and moments in GPU memory (`master` gives their initial values and
    /// receives them back when the sub-group moves to the host); its gradient is copied on
    /// the GPU, never to the host.
    pub placement: u32,
    /// NULL (the session allocates the copy, where it keeps one) or, in host sessions with a
    /// `copy_dtype`, a caller buffer of `numel` elements of `copy_dtype`, borrowed like
    /// `master`, where the session keeps the weights' copy: written from `master` at
    /// registration and by every pass that changes the weights (e.g. the low-precision
    /// shards a framework reads its weights from). The copy is final with the sub-group's
    /// final ticket; its master weights and moments may be written after it, so a caller
    /// gradient buffer (`grad`) must then be left alone until the step's ticket.
    pub copy: *mut c_void,
}

impl so_subgroup_desc {
    /// The core description: every buffer checked (`RawBuf`) and lent to the session, the
    /// slices copied. Buffers the caller gives instead of the session's allocations take the
    /// session's dtypes (`options`).
    ///
    /// # Safety
    /// The struct's buffers must be valid as `so_session_add_subgroup` documents (for as
    /// long as the session borrows them), `slices` must hold `num_slices` entries and each
    /// name must be NULL or NUL-terminated.
    unsafe fn to_core(self, options: &SessionOptions) -> Result<SubGroupDesc> {
        let field = |name| Field::member("desc", name);
        let n = self.numel;
        let buf =
            |name: &'static str, ptr: *mut c_void, dtype| RawBuf::new(name, "desc->numel", ptr.cast_const(), n, dtype);
        let optional = |name: &'static str, ptr: *mut c_void, dtype| -> Result<Option<Borrowed>> {
            // SAFETY: a caller buffer stays valid, and is left alone while the session may use
            // it, until the sub-group is removed (the caller's contract).
            (!ptr.is_null()).then(|| unsafe { buf(name, ptr, dtype)?.borrowed() }).transpose()
        };
        let master_dtype = DType::from_c(self.master_dtype, field("master_dtype"))?;
        // SAFETY: as for `optional`.
        let master = unsafe { buf("desc->master", self.master, master_dtype)?.borrowed()? };
        let grad = optional("desc->grad", self.grad, options.accum_dtype)?;
        let exp_avg = optional("desc->exp_avg", self.exp_avg, options.moment_dtype)?;
        let exp_avg_sq = optional("desc->exp_avg_sq", self.exp_avg_sq, options.moment_dtype)?;
        let copy = match options.copy_dtype {
            Some(dtype) => optional("desc->copy", self.copy, dtype)?,
            None if self.copy.is_null() => None,
            None => return Err(Error::invalid("desc->copy is set but the session keeps no copy (copy_dtype NONE)")),
        };
        let placement = Placement::from_c(self.placement, field("placement"))?;
        let device = match self.device_param {
            0 => None,
            ptr => {
                Some(DeviceParam { ptr, dtype: DType::from_c(self.device_param_dtype, field("device_param_dtype"))? })
            }
        };
        // SAFETY: `slices` holds `num_slices` entries (the caller's contract).
        let raw_slices = unsafe { required_array(self.slices, self.num_slices, "desc->slices", "num_slices")? };
        let slices = raw_slices
            .iter()
            .enumerate()
            // SAFETY: each name is NULL or NUL-terminated (the caller's contract).
            .map(|(i, s)| unsafe { s.to_core(&format!("desc->slices[{i}]")) })
            .collect::<Result<Vec<_>>>()?;
        Ok(SubGroupDesc { group: self.group, master, grad, exp_avg, exp_avg_sq, copy, slices, device, placement })
    }
}

/// Where a sub-group's state lives (filled by `so_session_get_subgroup_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_subgroup_state {
    /// Set by the caller to `sizeof(so_subgroup_state)` before the call.
    pub struct_size: usize,
    /// One of `so_placement`: where the sub-group is stepped.
    pub placement: u32,
    /// Elements of the sub-group.
    pub numel: usize,
    /// Host buffer of the master weights (the caller's `so_subgroup_desc.master`). For a
    /// device-placed sub-group it was brought up to date by the call.
    pub master: *mut c_void,
    /// Host buffer of the first moment (the caller's borrowed buffer, or the session's
    /// own); brought up to date as `master`.
    pub exp_avg: *mut c_void,
    /// Host buffer of the second moment, as `exp_avg`.
    pub exp_avg_sq: *mut c_void,
    /// `SO_DTYPE_*` of `master`.
    pub master_dtype: u32,
    /// `SO_DTYPE_*` of both moments.
    pub moment_dtype: u32,
    /// Steps the sub-group has taken.
    pub step_count: u64,
}

abi_struct!(
    so_subgroup_state
        <= SubGroupState { placement, numel, master, exp_avg, exp_avg_sq, master_dtype, moment_dtype, step_count }
);

// SAFETY: both are `#[repr(C)]`, `struct_size` first, the other fields numbers and raw
// pointers.
with_struct_size!(unsafe so_subgroup_desc, so_subgroup_state);

/// Returns an empty sub-group description (group 0, no buffers, f32 master, no slices);
/// `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_subgroup_desc_default() -> so_subgroup_desc {
    ffi_boundary!({
        Ok(so_subgroup_desc {
            struct_size: size_of::<so_subgroup_desc>(),
            group: 0,
            master: std::ptr::null_mut(),
            master_dtype: so_dtype::F32 as u32,
            numel: 0,
            grad: std::ptr::null_mut(),
            slices: std::ptr::null(),
            num_slices: 0,
            device_param: 0,
            device_param_dtype: so_dtype::None as u32,
            exp_avg: std::ptr::null_mut(),
            exp_avg_sq: std::ptr::null_mut(),
            placement: so_placement::Host as u32,
            copy: std::ptr::null_mut(),
        })
    })
}

/// @brief Registers a sub-group, between steps.
///
/// The session allocates its moments (and its gradient buffer unless `desc->grad` is
/// given). `desc->master` (and `desc->grad`, `desc->exp_avg`, `desc->exp_avg_sq`,
/// `desc->copy` where given) are **borrowed** until the sub-group is
/// removed or the session destroyed: the memory must stay valid, and the caller must not
/// access it from the moment a gradient hand-off completes the sub-group until that step's
/// ticket (`so_session_step`'s) is complete. Reading the master weights between steps, after
/// the step's ticket, is the normal use; in a host session (no CUDA transport) the
/// sub-group's final ticket (`so_session_final_ticket`) suffices. A CUDA session that
/// publishes a low-precision copy writes the copy first and the master weights and moments
/// after it, before the step's ticket completes. A host session's copy (`desc->copy`) is
/// final with the sub-group's final ticket, and may be written by a speculative step from
/// the moment the sub-group's gradient is complete.
/// Sub-groups are finalized at `so_session_step` in the order they were registered:
/// register them in forward order.
///
/// @param out_subgroup Receives the sub-group id (0, 1, ... in order of registration).
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` during a step; `SO_STATUS_NOT_FOUND`
///         for an unknown group; `SO_STATUS_ALIASING` for overlapping slices or buffers
///         that overlap another sub-group's; `SO_STATUS_INVALID_ARGUMENT` for slices
///         outside the sub-group, empty or duplicate names, a gradient buffer of the wrong
///         dtype, a copy buffer without `copy_dtype`; `SO_STATUS_UNSUPPORTED` for a copy
///         buffer in a CUDA session; `SO_STATUS_OUT_OF_RESOURCES` beyond the host-memory limit. Nothing is
///         registered on error.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `desc` is NULL or points to a
/// `so_subgroup_desc` whose `master` (and `grad`, `exp_avg`, `exp_avg_sq`, `copy` when not NULL)
/// holds `numel` elements of its dtype and stays valid, and is left alone while the session
/// may use it, as described above; whose `slices` holds `num_slices` entries, each `name`
/// NULL or NUL-terminated; `out_subgroup` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_add_subgroup(
    session: *mut so_session,
    desc: *const so_subgroup_desc,
    out_subgroup: *mut u32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        non_null(out_subgroup, "out_subgroup")?;
        // SAFETY: `desc` is NULL or points to a readable `so_subgroup_desc` whose buffers, slices
        // and names are valid as `to_core` requires (this function's contract).
        let desc = unsafe { read_struct(desc, "desc")?.to_core(s.options())? };
        let id = s.add_subgroup(desc)?;
        // SAFETY: `out_subgroup` is NULL or writable (this function's contract).
        unsafe { write_out(out_subgroup, "out_subgroup", id) }
    })
}

/// @brief Unregisters a sub-group between steps, after its outstanding work; its slices'
/// names become free, its borrowed buffers are not used after this returns.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_remove_subgroup(session: *mut so_session, subgroup: u32) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.remove_subgroup(subgroup)
    })
}

/// @brief Looks up the id of a slice by name (ids are stable for the session's lifetime;
/// look them up once, not per gradient).
/// @return `SO_STATUS_OK` or `SO_STATUS_NOT_FOUND`.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `name` is NULL or a NUL-terminated string;
/// `out_slice` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_slice_id(
    session: *const so_session,
    name: *const c_char,
    out_slice: *mut u32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `name` is NULL or a NUL-terminated string (this function's contract).
        let id = s.slice_id(unsafe { c_str(name, "name")? })?;
        // SAFETY: `out_slice` is NULL or writable (this function's contract).
        unsafe { write_out(out_slice, "out_slice", id) }
    })
}

/// @brief The ticket that completes when the sub-group's latest step is final (0 before
/// its first step): the weights it publishes to the device are final, and in a host
/// session its master weights may be read. A CUDA session that publishes a low-precision
/// copy writes the master weights and moments after it: read them after the step's ticket.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_ticket` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_final_ticket(
    session: *const so_session,
    subgroup: u32,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let t = unsafe { session_ref(session)? }.final_ticket(subgroup)?;
        // SAFETY: `out_ticket` is NULL or writable (this function's contract).
        unsafe { write_out(out_ticket, "out_ticket", t) }
    })
}

/// @brief Waits up to `timeout_ns` (negative: forever, 0: poll) until the sub-group's latest
/// decided step has written its master weights and moments: its final ticket, then the
/// state pass that step left for after the final ticket (a session that writes a lent
/// `so_subgroup_desc.copy`, or a CUDA session publishing a low-precision copy, writes the
/// copy first). From then on the session no longer reads the sub-group's gradient buffer:
/// a caller that lent it (`so_subgroup_desc.grad`, `so_session_grad_written`) waits here
/// before writing the next step's gradient into it, which lets each sub-group's gradient
/// wait for its own state pass instead of the whole step's ticket.
/// @return `SO_STATUS_OK`, `SO_STATUS_TIMEOUT`, the final pass's error status if it failed,
///         or `SO_STATUS_INVALID_ARGUMENT` for an unknown sub-group.
/// @note Thread-safety: see `so_session`; any thread may wait.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_wait_settled(session: *const so_session, subgroup: u32, timeout_ns: i64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.wait_settled(subgroup, timeout(timeout_ns))
    })
}

/// @brief Steps the sub-group has taken (skipped steps do not count); read it after the
/// sub-group's final ticket for the count after a step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_count` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step_count(
    session: *const so_session,
    subgroup: u32,
    out_count: *mut u64,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let n = unsafe { session_ref(session)? }.step_count(subgroup)?;
        // SAFETY: `out_count` is NULL or writable (this function's contract).
        unsafe { write_out(out_count, "out_count", n) }
    })
}

/// @brief Describes a sub-group's state buffers, after its outstanding work, so that a caller
/// can read (or, between steps, write) its master weights and moments in place — e.g. to
/// build a torch-style optimizer state dict. The pointers stay valid until the sub-group is
/// removed or the session destroyed. A device-placed sub-group's host buffers are updated
/// by this call; writes to them reach the device only through `so_session_set_placement`
/// or a checkpoint load.
/// @param out_state Caller-provided with `struct_size = sizeof(so_subgroup_state)`.
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_CUDA_ERROR`.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_state` is NULL or points to a writable
/// `so_subgroup_state`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_get_subgroup_state(
    session: *const so_session,
    subgroup: u32,
    out_state: *mut so_subgroup_state,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `out_state` is NULL or points to a writable struct of its type (this
        // function's contract).
        unsafe { check_out_struct(out_state, "out_state")? };
        let out = so_subgroup_state::from_core(&s.subgroup_state(subgroup)?);
        // SAFETY: `out_state` is NULL or writable (this function's contract).
        unsafe { write_out(out_state, "out_state", out) }
    })
}

/// @brief Sets a sub-group's step count, between steps (after writing its state in place,
/// e.g. from a torch optimizer state dict).
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_INVALID_STATE` during a step.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_step_count(session: *mut so_session, subgroup: u32, count: u64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.set_step_count(subgroup, count)
    })
}

/// @brief Moves a sub-group's master weights and moments between host and GPU memory
/// (`so_placement`), between steps, bit for bit. On the GPU it is stepped by the library's
/// kernel after each decision (never speculatively); back on the host its borrowed master
/// buffer holds the current weights again.
/// @return `SO_STATUS_OK`; `SO_STATUS_UNSUPPORTED` in a host session or for non-f32 master
///         weights; `SO_STATUS_INVALID_STATE` during a step; `SO_STATUS_NOT_FOUND`;
///         `SO_STATUS_CUDA_ERROR` (then nothing changed).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_placement(session: *mut so_session, subgroup: u32, placement: u32) -> Status {
    ffi_boundary!({
        let placement = Placement::from_c(placement, Field::arg("placement"))?;
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.set_placement(subgroup, placement)
    })
}
