//! `so_session_*`: the offload session. This file holds its options, creation and
//! session-wide queries; the submodules hold the handle, param groups, sub-groups, the step
//! and checkpoints. The CUDA exports are in `ffi/cuda.rs`, tickets in `ffi/tickets.rs`.

mod handle;

// In the order of the header (cbindgen follows it; rustfmt sorts only within a group).
mod group;

mod subgroup;

mod step;

mod checkpoint;

use std::ffi::c_char;

pub use checkpoint::*;
pub use group::*;
use handle::live_sessions;
pub use handle::so_session;
pub(crate) use handle::{new_session_handle, session_by_id, session_ref};
pub use step::*;
pub use subgroup::*;

use super::args::{core_list, non_null, path_arg, read_struct, read_struct_or, with_struct_size, write_out};
use super::boundary::ffi_boundary;
use super::convert::{Field, FromC, abi_struct};
use super::handle::free_handle;
use super::pool::{pool_arg, so_pool};
use crate::error::Error;
use crate::error::{Result, Status};
use crate::session::{HostMemory, LossScalerOptions, Session, SessionOptions};

/// Built-in dynamic loss scaler (fp16). Initialise with `so_loss_scaler_options_default()`
/// (torch GradScaler's defaults).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_loss_scaler_options {
    /// `sizeof(so_loss_scaler_options)`.
    pub struct_size: usize,
    /// Scale of the first step.
    pub init_scale: f32,
    /// Multiplies the scale after `growth_interval` consecutive steps without overflow; > 1.
    pub growth_factor: f32,
    /// Multiplies the scale after an overflow exhausts the hysteresis; in (0, 1).
    pub backoff_factor: f32,
    /// Consecutive steps without overflow before the scale grows; >= 1.
    pub growth_interval: u32,
    /// Overflowing steps tolerated before backing off; 1 backs off at once (torch).
    pub hysteresis: u32,
    /// The scale never goes below this.
    pub min_scale: f32,
}

abi_struct!(so_loss_scaler_options <=> LossScalerOptions {
    init_scale,
    growth_factor,
    backoff_factor,
    growth_interval,
    hysteresis,
    min_scale,
});

/// How to create a session. Initialise with `so_session_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_session_options {
    /// `sizeof(so_session_options)`.
    pub struct_size: usize,
    /// Pool for the optimizer passes (the session keeps a reference); NULL to build one
    /// pinned to `cores`, or with no cores to use the default pool.
    pub pool: *const so_pool,
    /// CPU cores for a pool of the session's own (one pinned thread each); copied.
    pub cores: *const u32,
    /// Entries in `cores`.
    pub num_cores: usize,
    /// One of `so_adam_mode`.
    pub mode: u32,
    /// Divide the moments by `1 - beta^t`.
    pub bias_correction: bool,
    /// dtype of both moments: `SO_DTYPE_F32` or `SO_DTYPE_BF16` (bf16 moments cannot be
    /// rolled back: with a `copy_dtype`, their speculative step writes the copy alone, the
    /// rest after the decision).
    pub moment_dtype: u32,
    /// dtype of the gradients handed to `so_session_grad_copy`.
    pub grad_dtype: u32,
    /// dtype of the sub-group gradient buffers, in which micro-steps accumulate.
    pub accum_dtype: u32,
    /// One of `so_speculation`: whether sub-groups are stepped during backward.
    pub speculation: u32,
    /// Host bytes the session may allocate (moments, gradient buffers, the low-precision copy,
    /// late-gradient buffers); 0 for no limit.
    pub host_memory_limit: u64,
    /// Must be false: AMSGrad cannot be rolled back, so sessions refuse it.
    pub amsgrad: bool,
    /// NULL for no built-in loss scaler (the loss scale is given to each
    /// `so_session_begin_step`, or 1).
    pub loss_scaler: *const so_loss_scaler_options,
    /// `SO_DTYPE_NONE`, or `SO_DTYPE_BF16` / `SO_DTYPE_F16` to keep a low-precision copy of
    /// each sub-group's master weights, written in the same pass as every update (CUDA
    /// sessions then send the copy to the GPU instead of f32).
    pub copy_dtype: u32,
    /// CUDA sessions: device bytes for the automatic split, which places the first
    /// sub-groups in forward order on the GPU after a few measured steps (see
    /// docs/library.md); `SO_GPU_BUDGET_AUTO` for a budget the session measures itself; 0
    /// (the default) turns it off. A host session refuses any other value than 0. With a
    /// budget, the moments of the sub-groups it may place (the first ones in forward order
    /// within the budget, or the GPU's total memory for `SO_GPU_BUDGET_AUTO`) are page-locked
    /// at registration, so that a placement copies them to the GPU beside the step.
    pub gpu_budget_bytes: u64,
    /// One of `so_host_copy`: whether a CUDA session keeps a full host copy of the weights in
    /// `copy_dtype` (default `SO_HOST_COPY_AUTO`: where host memory allows).
    pub host_copy: u32,
    /// One of `so_gradient_home`: where a CUDA session's host-stepped sub-groups keep their
    /// gradients (default `SO_GRADIENT_HOME_AUTO`: on the host where its memory allows, else on
    /// the GPU).
    pub gradient_home: u32,
}

/// `so_session_options.gpu_budget_bytes` for a budget the session measures itself: after 3
/// steps (when the caller's allocator holds a step's peak) it takes the GPU's free memory less
/// a headroom of max(1 GiB, 5 % of the GPU's memory), and the automatic split places the
/// first sub-groups in forward order within it as with an explicit budget: as many as the
/// exposed optimizer time asks for (all that fit when clipping every step; fewer where the
/// CPU's speculative steps hide in the backward, since a GPU-stepped parameter costs the GPU
/// its step). `so_session_gpu_budget` reports the budget chosen; the trace names what was
/// measured and placed.
pub const SO_GPU_BUDGET_AUTO: u64 = u64::MAX;

/// The core's `gpu_budget_bytes` of a C value (the sentinel maps to the core's).
fn gpu_budget_from_c(raw: u64, arg: &str) -> Result<usize> {
    match raw {
        SO_GPU_BUDGET_AUTO => Ok(SessionOptions::GPU_BUDGET_AUTO),
        bytes => usize::from_c(bytes, Field::member(arg, "gpu_budget_bytes")),
    }
}

fn gpu_budget_to_c(bytes: usize) -> u64 {
    match bytes {
        SessionOptions::GPU_BUDGET_AUTO => SO_GPU_BUDGET_AUTO,
        bytes => bytes as u64,
    }
}

abi_struct! {
    so_session_options <=> SessionOptions {
        mode,
        bias_correction,
        moment_dtype,
        grad_dtype,
        accum_dtype,
        speculation,
        host_memory_limit,
        amsgrad,
        copy_dtype,
        host_copy,
        gradient_home,
    }
    to_core (unsafe) |raw, arg| {
        gpu_budget_bytes: gpu_budget_from_c(raw.gpu_budget_bytes, arg)?,
        // SAFETY: `to_core` is unsafe: `pool` is NULL or a live pool.
        pool: if raw.pool.is_null() { None } else { Some(unsafe { pool_arg(raw.pool)? }) },
        // SAFETY: as above, `cores` is NULL or holds `num_cores` entries.
        cores: unsafe { core_list(raw.cores, raw.num_cores, &format!("{arg}->cores"), "num_cores")? },
        loss_scaler: if raw.loss_scaler.is_null() {
            None
        } else {
            let name = format!("{arg}->loss_scaler");
            // SAFETY: as above, a non-NULL `loss_scaler` points to a `so_loss_scaler_options`.
            Some(unsafe { read_struct(raw.loss_scaler, &name)? }.to_core(&name)?)
        },
    }
    // The defaults borrow nothing.
    to_c |o| {
        pool: std::ptr::null(),
        cores: std::ptr::null(),
        num_cores: 0,
        loss_scaler: std::ptr::null(),
        gpu_budget_bytes: gpu_budget_to_c(o.gpu_budget_bytes),
    }
}

// SAFETY: both are `#[repr(C)]`, `struct_size` first, the other fields numbers, bools and raw
// pointers.
with_struct_size!(unsafe so_loss_scaler_options, so_session_options);

/// Reads and converts the caller's session options (NULL for the defaults).
///
/// # Safety
/// `options` must be NULL or point to a `so_session_options` whose pointers are NULL or
/// valid as the header documents.
pub(crate) unsafe fn session_options(options: *const so_session_options) -> Result<SessionOptions> {
    // SAFETY: the caller's contract, passed on.
    unsafe {
        read_struct_or(options, "options", || so_session_options::from_core(&SessionOptions::default()))?
            .to_core("options")
    }
}

/// Returns the built-in loss scaler's defaults (torch GradScaler's: scale 65536, growth 2,
/// backoff 0.5, interval 2000, hysteresis 1, minimum 1); `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_loss_scaler_options_default() -> so_loss_scaler_options {
    ffi_boundary!({ Ok(so_loss_scaler_options::from_core(&LossScalerOptions::default())) })
}

/// Returns session options: default pool, AdamW with bias correction, f32 moments,
/// gradients and accumulation, automatic speculation (`SO_SPECULATION_AUTO`), no memory
/// limit, no loss scaler, no GPU budget; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_session_options_default() -> so_session_options {
    ffi_boundary!({ Ok(so_session_options::from_core(&SessionOptions::default())) })
}

/// @brief Creates a session and starts its CPU-Adam thread.
///
/// @param options NULL for `so_session_options_default()`.
/// @param out_session Receives the session; the caller owns it (`so_session_destroy`).
/// @return `SO_STATUS_OK`; `SO_STATUS_UNSUPPORTED` for AMSGrad or f16 moments;
///         `SO_STATUS_INVALID_ARGUMENT` for bad options (a pool and cores both given, bad
///         cores, bad loss-scaler settings); `SO_STATUS_OUT_OF_RESOURCES` if threads cannot
///         start.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `options` is NULL or points to a `so_session_options` whose `pool` is NULL or a live
/// pool, whose `cores` is NULL or holds `num_cores` entries and whose `loss_scaler` is NULL
/// or points to a `so_loss_scaler_options`; `out_session` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_create(
    options: *const so_session_options,
    out_session: *mut *mut so_session,
) -> Status {
    ffi_boundary!({
        non_null(out_session, "out_session")?;
        // SAFETY: `options` is NULL or valid as documented.
        let options = unsafe { session_options(options)? };
        let session = Box::new(Session::new(options)?);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { write_out(out_session, "out_session", new_session_handle(session)) }
    })
}

/// @brief Destroys a session: waits for every queued step to finish, stops the CPU-Adam
/// thread, frees the session's memory and releases its pool reference. NULL is a no-op.
/// Borrowed buffers are not used after this returns. A CUDA session's copy streams are not
/// destroyed (an allocator may still record events on them, after `record_stream`): a later
/// CUDA session on the same device reuses them. Its events and staging buffers are freed, so
/// no stream may still be waiting for one of its tickets (`so_ticket_enqueue_wait`).
///
/// @note Thread-safety: must not race with other calls on the session.
///
/// # Safety
/// `session` is NULL or a live session, not used again after this call, and no other call
/// on it is running.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_session_destroy(session: *mut so_session) {
    ffi_boundary!({
        live_sessions().remove(&(session as usize));
        // SAFETY: `session` is NULL or a live handle that the caller gives up here, with no
        // other call on it running (this function's contract).
        unsafe { free_handle(session) };
        Ok(())
    })
}

/// @brief What this host can give a session now: the memory available (`MemAvailable`, within
/// the limit of the process's memory cgroup where it sets one) and the host's total memory, in
/// bytes. A session measures the same before it allocates (its sub-groups' moments, gradient
/// buffers and copies) and refuses with `SO_STATUS_OUT_OF_RESOURCES` what would not fit; a
/// caller allocating the master weights and moments it lends a session can check them the
/// same way.
/// @return `SO_STATUS_UNSUPPORTED` where the system does not say (not Linux).
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `out_available` and `out_total` are NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_host_memory(out_available: *mut usize, out_total: *mut usize) -> Status {
    ffi_boundary!({
        // Both outputs are checked before either is written: a failed call writes nothing.
        non_null(out_available, "out_available")?;
        non_null(out_total, "out_total")?;
        let m = HostMemory::measure().ok_or_else(|| Error::unsupported("this system does not report its memory"))?;
        // SAFETY: both are NULL or writable (this function's contract), and not NULL.
        unsafe {
            write_out(out_available, "out_available", m.available)?;
            write_out(out_total, "out_total", m.total)
        }
    })
}

/// @brief A number that names the session for the rest of the process: never 0, and never
/// reused by another session (unlike the handle's address, which a later session may get).
/// The `so_xla_*` handlers take it as their `session` attribute, so that a compiled program
/// that outlives the session is refused instead of reaching another one.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_id` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_id(session: *const so_session, out_id: *mut u64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? };
        let id = live_sessions().get(&(session as usize)).copied();
        let id = id.ok_or_else(|| Error::new(Status::NotFound, "the session is not live"))?;
        // SAFETY: `out_id` is NULL or writable (this function's contract).
        unsafe { write_out(out_id, "out_id", id) }
    })
}

/// @brief Host bytes the session allocated (moments, gradient buffers, late gradients).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_bytes` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_host_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let n = unsafe { session_ref(session)? }.host_bytes();
        // SAFETY: `out_bytes` is NULL or writable (this function's contract).
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}

/// @brief GPU bytes the session allocated (device-placed state, the staging buffers of
/// host-placed sub-groups, sums of squares); 0 for a host session.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_bytes` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_device_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let n = unsafe { session_ref(session)? }.device_bytes();
        // SAFETY: `out_bytes` is NULL or writable (this function's contract).
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}

/// @brief The budget of the automatic split in bytes: `gpu_budget_bytes` as the session was
/// created with, or with `SO_GPU_BUDGET_AUTO` the budget it chose after the warm-up steps
/// (`SO_GPU_BUDGET_AUTO` until then).
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_bytes` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_gpu_budget(session: *const so_session, out_bytes: *mut u64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let budget = unsafe { session_ref(session)? }.gpu_budget().map_or(SO_GPU_BUDGET_AUTO, gpu_budget_to_c);
        // SAFETY: `out_bytes` is NULL or writable (this function's contract).
        unsafe { write_out(out_bytes, "out_bytes", budget) }
    })
}

/// `so_session_limit_device_memory`'s value for no limit: the automatic budget counts on the
/// device's free memory (the default).
pub const SO_DEVICE_MEMORY_UNLIMITED: u64 = u64::MAX;

/// @brief Limits the free device memory the automatic budget (`SO_GPU_BUDGET_AUTO`) counts on
/// to `limit_bytes`, or lifts the limit (`SO_DEVICE_MEMORY_UNLIMITED`). For a caller whose
/// allocator works under a cap the device's free memory does not show (PyTorch's
/// `set_per_process_memory_fraction`): give the cap less what the caller's allocator and this
/// session (`so_session_device_bytes`) hold on the device. The budget is then at most the
/// limit less a headroom of max(1 GiB, 5 % of the limit). It takes effect when the budget is
/// measured, after the warm-up steps; a budget already chosen stays. No effect in a host
/// session.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_limit_device_memory(session: *mut so_session, limit_bytes: u64) -> Status {
    ffi_boundary!({
        let limit = match limit_bytes {
            SO_DEVICE_MEMORY_UNLIMITED => None,
            bytes => Some(usize::from_c(bytes, Field::arg("limit_bytes"))?),
        };
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.limit_device_memory(limit);
        Ok(())
    })
}

/// @brief Starts recording a timeline of the session's work (clearing an earlier one) when
/// `enable`, or stops recording: gradient hand-offs and waits of the calling threads, and
/// the CPU-Adam thread's speculative steps, sums of squares, decisions and per-sub-group
/// finalization (kept, rescaled, rolled back, redone, stepped), and its waits for gradient
/// copies. Costs one clock read per event while on, nothing while off.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_trace(session: *mut so_session, enable: bool) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.trace(enable);
        Ok(())
    })
}

/// @brief Writes the recorded timeline to `path` as Chrome trace-event JSON (open it in
/// Perfetto or chrome://tracing, or render it with `bench/trace_plot.py`).
/// @return `SO_STATUS_OK` or `SO_STATUS_IO`.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `path` is NULL or a NUL-terminated string.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_trace_save(session: *const so_session, path: *const c_char) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        // SAFETY: `path` is NULL or a NUL-terminated string (this function's contract).
        s.save_trace(&unsafe { path_arg(path)? })
    })
}
