//! The CUDA transport under the session's speculation logic (which it does not change):
//! gradients arrive as device pointers on the caller's streams, updated weights go back to
//! the model's parameters on the GPU, tickets become waits on the caller's streams.
//!
//! cudarc with dynamic loading: the crate builds and its host-mode tests pass without CUDA;
//! at run time a missing driver gives `Status::CudaUnavailable`.

mod driver;
mod ptx;
mod transport;

use std::sync::{Arc, Mutex};

pub use driver::available;
pub use transport::{CudaOptions, CudaTransport};

use crate::error::Result;
use crate::kernels::DType;
use crate::session::{Session, SessionOptions, StepArgs, SubGroupDesc, Ticket, Transport};
use transport::Raw;

/// A CUDA stream handle (`cudaStream_t`), borrowed from the caller.
pub type Stream = driver::CUstream;
/// A device address.
pub type DevicePtr = u64;

/// An offload session whose gradients come from, and whose weights go back to, one GPU.
/// (Fields drop in order: the session, with its queued work and pinned buffers, goes
/// before the transport it uses.)
pub struct CudaSession {
    session: Session,
    transport: Arc<CudaTransport>,
    compute_stream: Mutex<Option<Raw<Stream>>>,
}

impl CudaSession {
    pub fn new(options: SessionOptions, cuda: CudaOptions) -> Result<CudaSession> {
        let transport = Arc::new(CudaTransport::new(&cuda)?);
        let dynamic: Arc<dyn Transport> = transport.clone();
        let session = Session::with_transport(options, Some(dynamic))?;
        Ok(CudaSession { session, transport, compute_stream: Mutex::new(None) })
    }

    /// The host-side session (groups, steps, tickets, checkpoints).
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Registers the caller's compute stream (borrowed): publication of updated weights
    /// waits for the work queued on it before `step()`, so the backward still running on
    /// the GPU never sees weights change under it.
    pub fn set_compute_stream(&self, stream: Stream) -> Result<()> {
        driver::refuse_capturing(stream)?;
        *self.compute_stream.lock().unwrap() = Some(Raw(stream));
        Ok(())
    }

    /// Registers a sub-group whose model parameter lives at `device_param` (`param_dtype`,
    /// same number of elements as the master weights).
    pub fn add_subgroup(&self, desc: SubGroupDesc, device_param: DevicePtr, param_dtype: DType) -> Result<u32> {
        let numel = desc_numel(&desc);
        let sg = self.session.add_subgroup(desc)?;
        let staging = self.session.options().copy_dtype.unwrap_or(DType::F32);
        if let Err(e) = self.transport.attach(sg, device_param, param_dtype, numel, staging) {
            self.session.remove_subgroup(sg)?;
            return Err(e);
        }
        Ok(sg)
    }

    /// "The gradient of `slice` is ready at `grad` (`numel` elements of `dtype`) on
    /// `stream`": queues its copy to the host (in pieces, on the session's copy streams);
    /// returns at once. The device gradient must stay valid until the copy stream
    /// (`copy_stream`) has passed the copy: with PyTorch's caching allocator,
    /// `grad.record_stream(copy_stream)`.
    pub fn gradient_from_device(
        &self,
        slice: u32,
        grad: DevicePtr,
        numel: usize,
        dtype: DType,
        stream: Stream,
    ) -> Result<Option<Ticket>> {
        let transport = &self.transport;
        self.session
            .hand_off(slice, numel, "gradient_from_device", |h| transport.gradient_from_device(h, grad, dtype, stream))
    }

    /// Ends the step (see [`Session::step`]); publication waits for the compute stream.
    pub fn step(&self, args: StepArgs) -> Result<Ticket> {
        if let Some(stream) = *self.compute_stream.lock().unwrap() {
            self.transport.after_compute(stream.0)?;
        }
        self.session.step(args)
    }

    /// Loads a checkpoint (see [`Session::load`]) and publishes the loaded weights into the
    /// model: after the work queued on the compute stream (which may still read the old
    /// weights), and completely before this returns, so work queued afterwards on any stream
    /// sees them.
    pub fn load(&self, path: &std::path::Path) -> Result<()> {
        if let Some(stream) = *self.compute_stream.lock().unwrap() {
            self.transport.after_compute(stream.0)?;
        }
        self.session.load(path)?;
        self.transport.wait_published()
    }

    /// Makes `stream` wait, on the GPU and without blocking the host, until `ticket` is
    /// complete (e.g. a sub-group's final ticket before the forward of its layer).
    pub fn enqueue_wait(&self, ticket: Ticket, stream: Stream) -> Result<()> {
        self.transport.enqueue_wait(ticket, stream)
    }

    pub fn copy_stream(&self) -> Stream {
        self.transport.copy_stream()
    }

    pub fn pinned_bytes(&self) -> usize {
        self.transport.pinned_bytes()
    }
}

fn desc_numel(desc: &SubGroupDesc) -> usize {
    desc.master.len()
}
