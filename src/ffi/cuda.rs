//! The CUDA surface: CUDA sessions, device gradients, streams and device-side ticket waits.
//! Everything here goes through `crate::cuda`; in a host session these calls are refused
//! there (`SO_STATUS_INVALID_STATE`).

use super::args::{non_null, read_struct_or, with_struct_size, write_opt, write_out};
use super::boundary::ffi_boundary;
use super::convert::{Field, FromC, abi_struct};
use super::session::{new_session_handle, session_options, session_ref, so_session, so_session_options};
use super::tickets::so_ticket;
// The Rust API has named it here since before it moved to `types.rs`.
pub use super::types::so_device_ptr;
use crate::cuda::{self, CudaOptions};
use crate::error::Status;
use crate::kernels::DType;

/// A CUDA stream (`cudaStream_t` and `CUstream` are this same type); the header declares
/// it in build.rs's preamble as `struct CUstream_st *`, so no CUDA header is needed.
pub type so_cuda_stream_t = *mut CUstream_st;

/// CUDA's opaque stream type.
pub struct CUstream_st {
    _private: [u8; 0],
}

/// How a CUDA session moves data. Initialise with `so_cuda_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_cuda_options {
    /// `sizeof(so_cuda_options)`.
    pub struct_size: usize,
    /// Device ordinal (as the driver numbers them, i.e. after `CUDA_VISIBLE_DEVICES`).
    pub device: i32,
    /// Gradients larger than this go to the host in pieces of this size, alternating two
    /// copy streams, each waiting for the one before (so that other streams' copies, such
    /// as a `.item()`, get in between); >= 4096. Default 16 MiB.
    pub piece_bytes: usize,
}

abi_struct!(so_cuda_options <=> CudaOptions { device, piece_bytes });

// SAFETY: `#[repr(C)]`, `struct_size` first, the other fields numbers.
with_struct_size!(unsafe so_cuda_options);

/// Our name for CUDA's stream type is CUDA's own; NULL (the legacy default stream) is valid.
fn stream_arg(stream: so_cuda_stream_t) -> cuda::Stream {
    stream.cast()
}

/// Returns CUDA options: device 0, 16 MiB pieces; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_cuda_options_default() -> so_cuda_options {
    ffi_boundary!({ Ok(so_cuda_options::from_core(&CudaOptions::default())) })
}

/// @brief Whether CUDA can be used: the driver library loads, initialises and reports a
/// device. Never aborts on a machine without CUDA.
/// @return `SO_STATUS_OK` or `SO_STATUS_CUDA_UNAVAILABLE` (the message says why).
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
#[must_use]
pub extern "C" fn so_cuda_available() -> Status {
    ffi_boundary!({ cuda::available() })
}

/// @brief Creates a CUDA session: as `so_session_create`, with gradients handed over as
/// device pointers (`so_session_grad_device`) and updated weights published into each
/// sub-group's device parameter (`so_subgroup_desc.device_param`) after `so_session_step`
/// decides. Uses the device's primary context (the one PyTorch and JAX use) and creates its
/// own copy streams; nothing the caller owns is ever freed or destroyed. Session-allocated
/// host buffers and the borrowed master weights are page-locked (`cuMemHostRegister`, in
/// place; buffers the caller already pinned are used as they are and never unregistered).
///
/// @param cuda NULL for `so_cuda_options_default()`.
/// @return As `so_session_create`; `SO_STATUS_CUDA_UNAVAILABLE` without a driver or device;
///         `SO_STATUS_CUDA_ERROR` (with the driver's error name) if setup fails.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// As `so_session_create`; `cuda` is NULL or points to a `so_cuda_options`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_create_cuda(
    options: *const so_session_options,
    cuda: *const so_cuda_options,
    out_session: *mut *mut so_session,
) -> Status {
    ffi_boundary!({
        non_null(out_session, "out_session")?;
        // SAFETY: `options` is NULL or points to a `so_session_options` whose pointers are valid
        // (this function's contract, as so_session_create's).
        let options = unsafe { session_options(options)? };
        // SAFETY: `cuda` is NULL or points to a readable struct of its type (this function's
        // contract).
        let cuda = unsafe { read_struct_or(cuda, "cuda", || so_cuda_options::from_core(&CudaOptions::default()))? };
        let session = Box::new(cuda::create_session(options, cuda.to_core("cuda")?)?);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { write_out(out_session, "out_session", new_session_handle(session)) }
    })
}

/// @brief "The gradient of `slice` is ready at device address `grad` (`numel` elements of
/// `dtype`) on `stream`": queues its copy into the sub-group's pinned host gradient buffer
/// and returns at once; the training thread never waits for copies (the CPU-Adam thread
/// does, before it steps the sub-group).
///
/// The session records an event on `stream` and copies on its own copy stream: a gradient
/// larger than `piece_bytes` goes in pieces alternating two copy streams, each waiting for
/// the one before, the first copy stream ending with a wait on the last piece. `dtype` must
/// be the session's accumulation dtype (bf16 gradients of f32 master weights cross the link
/// once, in bf16). Each slice is handed over once per step, at the last micro-step
/// (accumulate micro-steps on the GPU); a second hand-off after its sub-group completed is a
/// late gradient (redone at `so_session_step`).
///
/// **Lifetime rule:** the device gradient must stay valid until the session's copy stream
/// (`so_session_copy_stream`) has passed the copy: with PyTorch's caching allocator call
/// `grad.record_stream(copy_stream)`; otherwise keep the buffer alive until the returned
/// ticket or the step's ticket is complete.
///
/// @param out_ticket NULL, or the ticket of the speculative step this queued (0 if none; a
///        device-placed sub-group queues one only with `SO_SPECULATION_ON`).
/// @return As `so_session_grad_copy`; `SO_STATUS_INVALID_STATE` for a host session;
///         `SO_STATUS_STREAM_CAPTURING` for a stream in graph capture; `SO_STATUS_UNSUPPORTED`
///         for a dtype other than the accumulation dtype or a second hand-off in one step
///         before completion; `SO_STATUS_CUDA_ERROR`.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `grad` is a device address of `numel`
/// elements of `dtype`, valid as described above; `stream` is NULL or a live stream of the
/// session's device; `out_ticket` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_device(
    session: *mut so_session,
    slice: u32,
    grad: so_device_ptr,
    numel: usize,
    dtype: u32,
    stream: so_cuda_stream_t,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        let dtype = DType::from_c(dtype, Field::arg("dtype"))?;
        let ticket = cuda::gradient_from_device(s, slice, grad, numel, dtype, stream_arg(stream))?;
        // SAFETY: `out_ticket` is NULL or writable (this function's contract).
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief Registers the caller's compute stream (borrowed; NULL is the legacy default
/// stream): each `so_session_step` records an event on it, and updated weights are published
/// only after that point, so a backward still running on the GPU never sees its weights
/// change. Call it once, and again if the compute stream changes.
/// @return `SO_STATUS_OK`, `SO_STATUS_STREAM_CAPTURING`, `SO_STATUS_INVALID_STATE` for a host
///         session.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `stream` is NULL or a stream of the
/// session's device that outlives its use by the session.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_compute_stream(session: *mut so_session, stream: so_cuda_stream_t) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        cuda::transport_of(s, "so_session_set_compute_stream")?.set_compute_stream(stream_arg(stream))
    })
}

/// @brief Makes `stream` wait until `ticket` is complete and what it published has landed —
/// e.g. a sub-group's final ticket before the forward of its layer reads the published
/// weights. A ticket still pending is first waited for on the calling thread (that work
/// alone, as `so_ticket_wait`); the stream then waits, for a sub-group's latest final
/// ticket, for that sub-group's publication alone (the first layer's forward does not wait
/// for the later sub-groups' steps the session has already queued), and for any other ticket
/// for everything the session has queued. The stream never waits on the GPU for work the
/// session has yet to queue: such a wait was seen to deadlock once another thread of the
/// process blocked inside the CUDA driver meanwhile (a launch into a full queue, a
/// synchronous copy), holding up the driver calls that would have released it. Call it where the host runs ahead of the GPU (a forward pre-hook): the
/// host waits while the GPU still works through what was queued before. The GPU's idle time
/// at the wait, from the point the stream had reached when this was called, is timed on the
/// GPU: the total is the next step result's `forward_wait_s`. The outcome of failed work is
/// reported on the host (`so_ticket_wait`); the stream's wait ends either way.
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND` for a ticket never issued,
///         `SO_STATUS_STREAM_CAPTURING`, `SO_STATUS_INVALID_STATE` for a host session.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `stream` is NULL or a live stream of the
/// session's device.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_enqueue_wait(
    session: *const so_session,
    ticket: so_ticket,
    stream: so_cuda_stream_t,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        cuda::enqueue_wait(unsafe { session_ref(session)? }, ticket, stream_arg(stream))
    })
}

/// @brief The session's first copy stream, on which every gradient copy ends (for
/// `record_stream`); owned by the session, valid until it is destroyed.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_stream` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_copy_stream(
    session: *const so_session,
    out_stream: *mut so_cuda_stream_t,
) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let s = unsafe { session_ref(session)? };
        let stream = cuda::transport_of(s, "so_session_copy_stream")?.copy_stream();
        // SAFETY: `out_stream` is NULL or writable (this function's contract).
        unsafe { write_out(out_stream, "out_stream", stream.cast()) }
    })
}

/// @brief Host bytes the session page-locked (0 for a host session). Buffers the caller
/// had already pinned are not counted; nothing is rounded up to powers of two.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle; `out_bytes` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_pinned_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        let n = cuda::pinned_bytes(unsafe { session_ref(session)? });
        // SAFETY: `out_bytes` is NULL or writable (this function's contract).
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}
