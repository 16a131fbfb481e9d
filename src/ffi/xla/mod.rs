//! `so_xla_*`: XLA FFI handlers over a session, so that a compiled XLA program (a jitted JAX
//! train step) hands its gradients to the session as backward produces them and reads the
//! updated weights back, with no compiler, XLA header or extension module on the user's
//! machine: the functions are the library's own exports, registered with XLA by address
//! (`jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(address), platform=...)`), for XLA's
//! CPU platform (a host session) and its CUDA platform (a CUDA session; `device.rs`: the
//! operands are device buffers, the work is queued on the stream XLA gives the call). The
//! call frame is decoded against XLA's C API (`c_api.rs` declares its layout, `call_frame.rs`
//! decodes it); each handler then does what one C call of the session API does.
//!
//! One step of a compiled program, in data-dependency order (XLA may run independent calls
//! concurrently; the session serialises them):
//!
//! ```text
//! so_xla_begin_step(lr, loss_scale, previous ticket, weights) -> loss scale S
//!   forward (loss * S), backward: so_xla_hand_over(grad_k, S) -> grad_k   (each slice k)
//! so_xla_step(every hand_over result)                          -> the step's ticket
//! so_xla_read_weights(ticket)                                  -> slice k's weights (each k)
//! ```
//!
//! Attributes are scalars: `session` (the session's `so_session_id`, unsigned 64-bit: never
//! reused, so a program that outlives its session is refused instead of reaching another),
//! `group`, `slice`, `subgroup` (unsigned 32-bit), `offset` (unsigned 64-bit), `max_norm` (a
//! float). A handler that fails returns an
//! XLA error with the library's message (also the thread's last error) and changes nothing
//! beyond what its session call would have on failure.

mod c_api;
mod call_frame;
mod device;
#[cfg(test)]
mod tests;

pub use c_api::{XLA_FFI_CallFrame, XLA_FFI_Error};

use super::boundary::{LAST_ERROR, ffi_boundary};
use super::session::session_by_id;
use crate::cuda::{self, CudaTransport};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, FloatsMut};
use crate::session::{NormSource, Session, StepArgs};
use c_api::XlaType;
use call_frame::{Frame, Request};
use device::Direction;

/// XLA's call frame (`XLA_FFI_CallFrame*` of `xla/ffi/api/c_api.h`); the header declares it
/// in build.rs's preamble as `struct XLA_FFI_CallFrame *`, so no XLA header is needed.
pub type so_xla_call_frame_t = *mut XLA_FFI_CallFrame;

/// XLA's error (`XLA_FFI_Error*`); NULL is success.
pub type so_xla_error_t = *mut XLA_FFI_Error;

/// The session named by the call's `session` attribute (its `so_session_id`).
fn session<'a>(frame: &Frame<'_>) -> Result<&'a Session> {
    let id = frame.attr_u64("session")?;
    // SAFETY: a live session's id; a session is not destroyed while a program that uses it
    // runs (the handlers' contract, as every call's).
    unsafe { session_by_id(id, "attribute session") }
}

/// Where a call runs: a host session's on XLA's CPU platform, or a CUDA session's on the GPU
/// stream XLA gives the call.
enum Place<'a> {
    Host,
    Cuda(&'a CudaTransport, cuda::Stream),
}

/// The place of a call, from its session and whether XLA gives it a GPU stream: a host
/// session must not take device addresses for host memory, nor a CUDA session the reverse.
fn place<'a>(s: &'a Session, frame: &Frame<'_>) -> Result<Place<'a>> {
    match (s.transport_as::<CudaTransport>(), frame.gpu_stream()) {
        (None, None) => Ok(Place::Host),
        (Some(t), Some(stream)) => Ok(Place::Cuda(t, stream.cast())),
        (None, Some(_)) => Err(Error::unsupported(
            "this call runs on a GPU and its session is a host session (parameters on JAX's CPU platform at init): \
             initialise the optimizer with the parameters on the device the step runs on",
        )),
        (Some(_), None) => Err(Error::unsupported(
            "this call has no GPU stream (it runs on XLA's CPU platform) and its session is a CUDA session \
             (parameters on a GPU at init): initialise the optimizer with the parameters on the device the step \
             runs on",
        )),
    }
}

/// Runs a handler: answers XLA's metadata request, or executes `body` on the checked frame.
///
/// # Safety
/// `call_frame` is NULL or XLA's call frame for this call.
unsafe fn handle(call_frame: so_xla_call_frame_t, body: impl FnOnce(&Frame<'_>) -> Result<()>) -> Result<()> {
    // SAFETY: the caller's contract, passed on.
    match unsafe { call_frame::open(call_frame)? } {
        Request::Metadata => Ok(()),
        Request::Execute(frame) => body(&frame),
    }
}

/// What a handler returns for the status of its body: NULL, or an XLA error carrying the
/// message the boundary stored as the thread's last error.
///
/// # Safety
/// `call_frame` is NULL or XLA's call frame for this call.
unsafe fn outcome(call_frame: so_xla_call_frame_t, status: Status) -> so_xla_error_t {
    if status == Status::Ok {
        return std::ptr::null_mut();
    }
    let message = LAST_ERROR.with(|m| m.borrow().clone());
    // SAFETY: the caller's contract, passed on.
    unsafe { call_frame::make_error(call_frame, status, &message) }
}

fn begin_step(frame: &Frame<'_>) -> Result<()> {
    let s = session(frame)?;
    let group = frame.attr_u32("group")?;
    let args = frame.args()?;
    if args.len() < 2 {
        return Err(Error::invalid(
            "so_xla_begin_step takes the learning rate and the loss scale as its first operands",
        ));
    }
    let rets = frame.rets_exactly(1, "so_xla_begin_step (the loss scale)")?;
    let place = place(s, frame)?;
    let (lr, loss_scale) = match place {
        // SAFETY: XLA's operand buffers, read during the call.
        Place::Host => unsafe { (args[0].scalar_f64()?, args[1].scalar_f64()?) },
        Place::Cuda(t, stream) => {
            (device::read_scalar(t, &args[0], stream)?, device::read_scalar(t, &args[1], stream)?)
        }
    };
    let loss_scale = loss_scale as f32;
    if s.step_in_progress() {
        // A step a failed execution left unfinished (begun, never given to so_xla_step):
        // its gradients are incomplete, so it is skipped, its speculative steps rolled back.
        s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: true })?;
    }
    let mut hparams = s.group_hparams(group)?;
    hparams.lr = lr;
    s.set_group_hparams(group, hparams)?;
    s.begin_step((loss_scale != 0.0).then_some(loss_scale), 1)?;
    let used = if loss_scale != 0.0 { loss_scale } else { s.loss_scale() };
    match place {
        // SAFETY: XLA's result buffer, ours during the call.
        Place::Host => unsafe { rets[0].write_f32(used) },
        Place::Cuda(t, stream) => device::write(t, &rets[0], XlaType::F32, 1, &used.to_ne_bytes(), stream),
    }
}

fn hand_over(frame: &Frame<'_>) -> Result<()> {
    let s = session(frame)?;
    let slice = frame.attr_u32("slice")?;
    let args = frame.args()?;
    let Some(grad) = args.first() else {
        return Err(Error::invalid("so_xla_hand_over takes the gradient as its first operand"));
    };
    let rets = frame.rets_exactly(1, "so_xla_hand_over (the gradient, passed through)")?;
    if let Place::Cuda(t, stream) = place(s, frame)? {
        return device::hand_over(s, t, stream, slice, grad, &rets[0]);
    }
    // SAFETY: XLA's operand, read during the call; the result is ours. They are the same
    // buffer when XLA aliases them (`input_output_aliases={0: 0}`), so the gradient is read
    // (handed over) before the result is written, and only written when they differ.
    unsafe {
        let src = grad.floats()?;
        if rets[0].element_count()? != src.len() {
            return Err(Error::invalid("so_xla_hand_over's result must have the gradient's shape"));
        }
        s.grad_copy(slice, src)?;
        if rets[0].data() != grad.data() {
            let dst = rets[0].floats_mut()?;
            if dst.dtype() != src.dtype() {
                return Err(Error::invalid("so_xla_hand_over's result must have the gradient's type"));
            }
            kernels::copy_into(dst, src, false, None)?;
        }
    }
    Ok(())
}

fn step(frame: &Frame<'_>) -> Result<()> {
    let s = session(frame)?;
    let max_norm = frame.attr_f64("max_norm")?;
    let rets = frame.rets_exactly(1, "so_xla_step (the step's ticket)")?;
    let place = place(s, frame)?;
    if let Place::Cuda(t, stream) = place {
        // The step's publication follows what XLA queued before this call (the backward,
        // and the previous step's reads of the published weights); the gradients the
        // hand-overs lent become XLA's again once their copies have passed.
        t.wait_for_gradient_copies(stream)?;
        t.set_compute_stream(stream)?;
    }
    let ticket = s.step(StepArgs { max_norm, norm: NormSource::Local, overflow: false })?;
    let words = [ticket as u32, (ticket >> 32) as u32];
    match place {
        // SAFETY: XLA's result buffer, ours during the call.
        Place::Host => unsafe { rets[0].write_u32(&words) },
        Place::Cuda(t, stream) => {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
            device::write(t, &rets[0], XlaType::U32, words.len(), &bytes, stream)
        }
    }
}

fn read_weights(frame: &Frame<'_>) -> Result<()> {
    let s = session(frame)?;
    let slice = frame.attr_u32("slice")?;
    let rets = frame.rets_exactly(1, "so_xla_read_weights (the slice's weights)")?;
    if let Place::Cuda(t, stream) = place(s, frame)? {
        let sg = frame.attr_u32("subgroup")?;
        return device::copy_weights(s, t, stream, sg, frame.attr_u64("offset")?, &rets[0], Direction::Read);
    }
    // SAFETY: XLA's result buffer, ours during the call.
    let out: FloatsMut<'_> = unsafe { rets[0].floats_mut()? };
    s.read_slice_weights(slice, out)
}

fn write_weights(frame: &Frame<'_>) -> Result<()> {
    let s = session(frame)?;
    let args = frame.args()?;
    let Some(weights) = args.first() else {
        return Err(Error::invalid("so_xla_write_weights takes the weights as its first operand"));
    };
    let rets = frame.rets_exactly(1, "so_xla_write_weights (a uint32 scalar)")?;
    let Place::Cuda(t, stream) = place(s, frame)? else {
        return Err(Error::unsupported(
            "so_xla_write_weights writes the device parameter of a CUDA session; a host session has none",
        ));
    };
    let sg = frame.attr_u32("subgroup")?;
    device::copy_weights(s, t, stream, sg, frame.attr_u64("offset")?, weights, Direction::Write)?;
    device::write(t, &rets[0], XlaType::U32, 1, &0u32.to_ne_bytes(), stream)
}

/// @brief XLA FFI handler that begins a step of a session: sets the learning rate of
/// a param group (`so_session_set_group`, its other hyperparameters unchanged), then
/// `so_session_begin_step` with one micro-step.
///
/// Attributes: `session` (the session's `so_session_id`, unsigned 64-bit), `group`.
/// Operands: the learning rate (a float32 or float64 scalar), the loss scale (a float32 or
/// float64 scalar; 0 for the built-in scaler's current scale), then any buffers that order the
/// call after the previous step (its `so_xla_step` result and the weights its
/// `so_xla_read_weights` calls returned, so that no read of the previous step comes after
/// this step's gradients). Result: a float32 scalar,
/// the loss scale this step's backward must use (multiply the loss by it). A step of the
/// session left unfinished by a failed execution (begun, never ended by `so_xla_step`) is
/// first ended as skipped, its speculative steps rolled back.
///
/// Register it with XLA for the execute stage (the handler answers XLA's metadata request
/// with FFI API version 0.1), e.g. `jax.ffi.register_ffi_target(name,
/// jax.ffi.pycapsule(address), platform="cpu")`: on XLA's CPU platform for a host session,
/// on its CUDA platform (`platform="CUDA"`) for a CUDA session, whose operands and results
/// are then device buffers and whose work is queued on the call's stream
/// (`XLA_FFI_Stream_Get`); here the learning rate and loss scale are read once the stream has
/// computed them (the host waits for it). A call whose session does not match its platform
/// is refused (`SO_STATUS_UNSUPPORTED`). Errors come back as XLA errors with the library's
/// message (also `so_last_error_message` on the calling thread).
/// @note Thread-safety: as the session's calls; the session must outlive every execution of
///       a program that names it (a destroyed one is refused with `SO_STATUS_NOT_FOUND`).
///
/// # Safety
/// `call_frame` is NULL or the call frame XLA passes to a handler, valid until it returns.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_xla_begin_step(call_frame: so_xla_call_frame_t) -> so_xla_error_t {
    // SAFETY: the frame is XLA's (this function's contract).
    let status: Status = ffi_boundary!({ unsafe { handle(call_frame, begin_step) } });
    // SAFETY: as above.
    unsafe { outcome(call_frame, status) }
}

/// @brief XLA FFI handler that hands a slice's gradient to a session
/// (`so_session_grad_copy`; on the CUDA platform `so_session_grad_device` on the call's
/// stream): a sub-group whose slices are complete may be stepped speculatively from here on,
/// while the rest of the backward runs. On the CUDA platform the gradient is lent to the
/// session's copy streams until `so_xla_step`, which consumes it.
///
/// Attributes: `session`, `slice` (the slice id). Operands: the gradient (float32, bfloat16
/// or float16 as the session's gradient dtype, the slice's element count in any shape), then
/// any buffers that order the call (the `so_xla_begin_step` result). Result: the gradient
/// again (alias it to operand 0; otherwise it is copied), for `so_xla_step` to consume.
/// Registration and errors as `so_xla_begin_step`.
/// @note Thread-safety: as `so_xla_begin_step`.
///
/// # Safety
/// As `so_xla_begin_step`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_xla_hand_over(call_frame: so_xla_call_frame_t) -> so_xla_error_t {
    // SAFETY: the frame is XLA's (this function's contract).
    let status: Status = ffi_boundary!({ unsafe { handle(call_frame, hand_over) } });
    // SAFETY: as above.
    unsafe { outcome(call_frame, status) }
}

/// @brief XLA FFI handler that ends a step of a session (`so_session_step` with the
/// local norm): returns at once; the CPU-Adam thread clips by the global norm, skips on an
/// inf or NaN gradient, and makes each sub-group final in registration order. On the CUDA
/// platform the call's stream becomes the session's compute stream
/// (`so_session_set_compute_stream`: the step publishes after what XLA queued before this
/// call) and waits for the gradient copies, so that XLA may reuse the gradients' memory.
///
/// Attributes: `session`, `max_norm` (float; 0 for no clipping). Operands: any buffers that
/// order the call after every hand-over (their results). Result: a `uint32[2]` buffer, the
/// step's ticket (low word, high word) for `so_session_step_result`. Registration and
/// errors as `so_xla_begin_step`.
/// @note Thread-safety: as `so_xla_begin_step`.
///
/// # Safety
/// As `so_xla_begin_step`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_xla_step(call_frame: so_xla_call_frame_t) -> so_xla_error_t {
    // SAFETY: the frame is XLA's (this function's contract).
    let status: Status = ffi_boundary!({ unsafe { handle(call_frame, step) } });
    // SAFETY: as above.
    unsafe { outcome(call_frame, status) }
}

/// @brief XLA FFI handler that reads a slice's updated weights from a session: waits for its
/// sub-group's final ticket alone (`so_session_final_ticket`; the sub-groups after it may
/// still be stepping), then copies the slice's master weights, rounded to nearest even where
/// the result is narrower. On the CUDA platform the call's stream then waits for the
/// sub-group's publication (`so_ticket_enqueue_wait`) and the slice is copied, on the GPU,
/// from the device parameter the sub-group publishes into (`so_subgroup_desc.device_param`).
///
/// Attributes: `session`, `slice`; on the CUDA platform also `subgroup` (the slice's
/// sub-group) and `offset` (the slice's first element in it). Operands: any buffers that
/// order the call (the `so_xla_step` result). Result: the weights (float32, bfloat16 or
/// float16, the slice's element count in any shape; on the CUDA platform the device
/// parameter's dtype). Registration and errors as `so_xla_begin_step`.
/// @note Thread-safety: as `so_xla_begin_step`.
///
/// # Safety
/// As `so_xla_begin_step`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_xla_read_weights(call_frame: so_xla_call_frame_t) -> so_xla_error_t {
    // SAFETY: the frame is XLA's (this function's contract).
    let status: Status = ffi_boundary!({ unsafe { handle(call_frame, read_weights) } });
    // SAFETY: as above.
    unsafe { outcome(call_frame, status) }
}

/// @brief XLA FFI handler that writes weights into the device parameter a sub-group of a CUDA
/// session publishes into (`so_subgroup_desc.device_param`), between steps, once its latest
/// publication has landed: what the next `so_xla_read_weights` returns where the next step
/// publishes nothing (a skipped step), e.g. after master weights were loaded from a
/// checkpoint.
///
/// Attributes: `session`, `subgroup`, `offset` (the first element written). Operands: the
/// weights (the device parameter's dtype, any shape), then any buffers that order the call.
/// Result: a uint32 scalar, 0. XLA's CUDA platform only (a host session has no device
/// parameter: `SO_STATUS_UNSUPPORTED`); during a step `SO_STATUS_INVALID_STATE`.
/// Registration and errors as `so_xla_begin_step`.
/// @note Thread-safety: as `so_xla_begin_step`.
///
/// # Safety
/// As `so_xla_begin_step`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_xla_write_weights(call_frame: so_xla_call_frame_t) -> so_xla_error_t {
    // SAFETY: the frame is XLA's (this function's contract).
    let status: Status = ffi_boundary!({ unsafe { handle(call_frame, write_weights) } });
    // SAFETY: as above.
    unsafe { outcome(call_frame, status) }
}
