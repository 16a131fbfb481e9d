//! The CUDA transport under the session's scheduling (which it does not change): gradients
//! arrive as device pointers on the caller's streams, updated weights go back to the model's
//! parameters on the GPU, device-placed sub-groups are stepped there, tickets become waits
//! on the caller's streams.
//!
//! cudarc with dynamic loading: the crate builds and its host-mode tests pass without CUDA;
//! at run time a missing driver gives `Status::CudaUnavailable`.

mod attached;
mod device_state;
mod driver;
mod events;
mod faults;
mod gradients;
mod memory;
mod partials;
mod ptx;
mod slots;
mod transport;

use std::sync::Arc;

pub use driver::available;
pub use transport::{CudaOptions, CudaTransport};

use crate::error::{Error, Result, Status};
use crate::kernels::DType;
use crate::session::{Session, SessionOptions, Ticket, Transport};

/// A CUDA stream handle (`cudaStream_t`), borrowed from the caller.
pub type Stream = driver::CUstream;
/// A device address.
pub type DevicePtr = u64;

/// A session whose gradients come from, and whose weights go back to, one GPU.
pub fn create_session(options: SessionOptions, cuda: CudaOptions) -> Result<Session> {
    available()?;
    let transport = Arc::new(CudaTransport::new(&cuda, options.accum_dtype, options.copy_dtype)?);
    Session::with_transport(options, Some(transport as Arc<dyn Transport>))
}

/// The CUDA transport of a session, or why there is none.
pub fn transport_of<'a>(session: &'a Session, what: &str) -> Result<&'a CudaTransport> {
    session.transport_as::<CudaTransport>().ok_or_else(|| {
        Error::new(
            Status::InvalidState,
            format!("{what} needs a CUDA session (so_session_create_cuda); this one is a host session"),
        )
    })
}

/// Host bytes the session page-locked; 0 for a host session.
pub fn pinned_bytes(session: &Session) -> usize {
    session.transport_as::<CudaTransport>().map_or(0, CudaTransport::pinned_bytes)
}

/// "The gradient of `slice` is ready at `grad` (`numel` elements of `dtype`) on `stream`":
/// queues its sum of squares and its copy to the host (in pieces, on the session's copy
/// streams); returns at once. The device gradient must stay valid until the copy stream
/// (`copy_stream`) has passed the copy: with PyTorch's caching allocator,
/// `grad.record_stream(copy_stream)`.
pub fn gradient_from_device(
    session: &Session,
    slice: u32,
    grad: DevicePtr,
    numel: usize,
    dtype: DType,
    stream: Stream,
) -> Result<Option<Ticket>> {
    let transport = transport_of(session, "a device gradient")?;
    session.hand_off(slice, numel, "gradient_from_device", |h| transport.gradient_from_device(h, grad, dtype, stream))
}

/// Makes `stream` wait until `ticket` is complete and its weights are published (e.g. a
/// sub-group's final ticket before the forward of its layer). A ticket still pending is
/// waited for on the calling thread first; the stream then waits for that sub-group's
/// publication where `ticket` is a sub-group's latest final ticket, else for everything the
/// session has queued; never for work the session has yet to queue: a stream waiting on the
/// GPU for a CUDA call the CPU-Adam thread has still to make was seen to deadlock once another
/// thread of the process blocked inside the driver meanwhile (a launch into a full queue, a
/// synchronous copy). A failed ticket is waited for like a completed one: its failure is
/// reported on the host (`wait`).
pub fn enqueue_wait(session: &Session, ticket: Ticket, stream: Stream) -> Result<()> {
    let transport = transport_of(session, "so_ticket_enqueue_wait")?;
    if ticket == 0 {
        return Ok(());
    }
    session.ticket_state(ticket)?;
    transport.enqueue_wait(stream, || {
        session.wait_for_stream(ticket);
        session.final_ticket_of(ticket)
    })
}
