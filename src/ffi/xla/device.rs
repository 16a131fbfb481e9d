//! The handlers' work on XLA's CUDA platform, for a CUDA session: operands and results are
//! device buffers, every copy is queued on the stream XLA gives the call, and the session's
//! own streams are joined to it by events. The host waits only where a value must reach the
//! session before the call returns (the learning rate and loss scale) and, as on the CPU
//! platform, for a sub-group's final ticket before its weights are read.

use super::c_api::XlaType;
use super::call_frame::BufferRef;
use crate::cuda::{self, CudaTransport, Stream};
use crate::error::{Error, Result, Status};
use crate::kernels::DType;
use crate::session::Session;

/// The value of a one-element f32 or f64 device buffer, once `stream` has computed it.
pub(super) fn read_scalar(t: &CudaTransport, buf: &BufferRef<'_>, stream: Stream) -> Result<f64> {
    let (kind, ptr) = buf.float_scalar()?;
    let mut bytes = [0u8; 8];
    t.read_on_stream(&mut bytes[..kind.size()], ptr as u64, stream)?;
    Ok(match kind {
        XlaType::F64 => f64::from_ne_bytes(bytes),
        _ => f64::from(f32::from_ne_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
    })
}

/// Writes `count` elements of `kind` (their bytes in `bytes`) into a device result, in the
/// order of `stream`.
pub(super) fn write(
    t: &CudaTransport,
    buf: &BufferRef<'_>,
    kind: XlaType,
    count: usize,
    bytes: &[u8],
    stream: Stream,
) -> Result<()> {
    let dst = buf.destination(kind, count)?;
    t.write_on_stream(dst as u64, bytes, stream)
}

/// Hands a device gradient to the session (`so_session_grad_device` on XLA's stream: the
/// copy waits for the backward that produced it, on the session's copy streams) and passes it
/// through as the result. XLA may reuse the gradient's memory once the call that consumes the
/// result (`so_xla_step`) has made its stream wait for the copies.
pub(super) fn hand_over(
    s: &Session,
    t: &CudaTransport,
    stream: Stream,
    slice: u32,
    grad: &BufferRef<'_>,
    result: &BufferRef<'_>,
) -> Result<()> {
    let (src, numel, dtype) = grad.device_floats()?;
    let (dst, out_numel, out_dtype) = result.device_floats()?;
    if out_numel != numel || out_dtype != dtype {
        return Err(Error::invalid("so_xla_hand_over's result must have the gradient's shape and type"));
    }
    cuda::gradient_from_device(s, slice, src, numel, dtype, stream)?;
    if dst != src && numel > 0 {
        t.copy_on_stream(dst, src, numel * dtype.size(), stream)?;
    }
    Ok(())
}

/// The device address of elements `offset..offset + numel` of the parameter sub-group `sg`
/// publishes into, checked to lie within it and to have `dtype`.
fn published_range(t: &CudaTransport, sg: u32, offset: u64, numel: usize, dtype: DType) -> Result<u64> {
    let (param, param_dtype, param_numel) = t.published_param(sg)?;
    if dtype != param_dtype {
        return Err(Error::invalid(format!("the weights are {dtype:?}; sub-group {sg} publishes {param_dtype:?}")));
    }
    let offset = usize::try_from(offset).map_err(|_| Error::invalid("attribute offset is out of range"))?;
    if offset.checked_add(numel).is_none_or(|end| end > param_numel) {
        return Err(Error::invalid(format!(
            "elements {offset}..+{numel} are beyond sub-group {sg}'s {param_numel} elements"
        )));
    }
    Ok(param + (offset * dtype.size()) as u64)
}

/// Waits until sub-group `sg`'s latest step is final (on the host, for its final ticket
/// alone) and makes `stream` wait for its publication.
fn after_publication(s: &Session, sg: u32, stream: Stream) -> Result<()> {
    let ticket = s.final_ticket(sg)?;
    s.wait(ticket, None)?;
    cuda::enqueue_wait(s, ticket, stream)
}

/// Which way `copy_weights` copies, between an XLA buffer and the device parameter a
/// sub-group publishes into.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Direction {
    /// Into the buffer (a result), once the sub-group's latest step is final and published.
    /// The session publishes the next step only after the work XLA queued before that step's
    /// `so_xla_step` (the compute stream), so this copy is never overwritten under it.
    Read,
    /// From the buffer (an operand), between steps, after the latest publication: what the
    /// next read returns where the next step publishes nothing (a skipped step), e.g. weights
    /// just loaded.
    Write,
}

/// Copies slice weights between `buffer` and the device parameter sub-group `sg` publishes
/// into (`offset` elements in), in `direction`, on `stream` after the sub-group's latest
/// publication.
pub(super) fn copy_weights(
    s: &Session,
    t: &CudaTransport,
    stream: Stream,
    sg: u32,
    offset: u64,
    buffer: &BufferRef<'_>,
    direction: Direction,
) -> Result<()> {
    if direction == Direction::Write && s.step_in_progress() {
        return Err(Error::new(Status::InvalidState, "the weights are written between steps; a step is in progress"));
    }
    let (buffer_address, numel, dtype) = buffer.device_floats()?;
    let published = published_range(t, sg, offset, numel, dtype)?;
    after_publication(s, sg, stream)?;
    let (dst, src) = match direction {
        Direction::Read => (buffer_address, published),
        Direction::Write => (published, buffer_address),
    };
    if numel > 0 {
        t.copy_on_stream(dst, src, numel * dtype.size(), stream)?;
    }
    Ok(())
}
