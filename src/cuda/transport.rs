//! The CUDA transport: device gradients to pinned host buffers in pieces on two copy
//! streams; updated weights to per-sub-group GPU staging buffers, published into the
//! model's parameters only once `step()` has decided; tickets the GPU can wait on.

use std::collections::HashMap;
use std::sync::Mutex;

use super::driver::{self, CUdeviceptr, CUevent, CUstream, Context, Kernels};
use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats};
use crate::session::{HandOff, Ticket, Transport};

/// How a CUDA session moves data.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    /// Device ordinal.
    pub device: i32,
    /// Gradients larger than this go to the host in pieces of this size, alternating two
    /// copy streams, so that other streams' copies get in between.
    pub piece_bytes: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { device: 0, piece_bytes: 16 << 20 }
    }
}

/// Fault injection for the tests that prove the piece protocol matters
/// (`SUPEROFFLOAD_DEBUG_COPY=drop-last-piece` or `=no-final-wait`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct CopyFaults {
    drop_last_piece: bool,
    no_final_wait: bool,
}

impl CopyFaults {
    fn from_env() -> CopyFaults {
        match std::env::var("SUPEROFFLOAD_DEBUG_COPY").as_deref() {
            Ok("drop-last-piece") => CopyFaults { drop_last_piece: true, ..Default::default() },
            Ok("no-final-wait") => CopyFaults { no_final_wait: true, ..Default::default() },
            _ => CopyFaults::default(),
        }
    }
}

/// A raw driver handle that may cross threads (the driver allows it; we serialise use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Raw<T>(pub T);
// SAFETY: CUDA stream and event handles are usable from any thread.
unsafe impl<T> Send for Raw<T> {}
unsafe impl<T> Sync for Raw<T> {}

struct SgDevice {
    /// The model's parameter (caller-owned device memory).
    param: CUdeviceptr,
    param_dtype: DType,
    /// Where updated weights wait until `publish`.
    staging: CUdeviceptr,
    staging_dtype: DType,
    numel: usize,
    /// Recorded on the first copy stream after each gradient copy of this step.
    copies: Vec<Raw<CUevent>>,
    /// Recorded after the latest staging copy, which reads the host master (or copy).
    staged: Option<Raw<CUevent>>,
}

#[derive(Default)]
struct State {
    subgroups: HashMap<u32, SgDevice>,
    /// Host ranges we page-locked (start -> bytes), and those the caller had already pinned.
    ours: HashMap<usize, usize>,
    theirs: HashMap<usize, usize>,
    free_events: Vec<Raw<CUevent>>,
}

pub struct CudaTransport {
    device: i32,
    ctx: Context,
    kernels: Kernels,
    /// Gradient copies; the first also carries the end of every copy sequence.
    d2h: [Raw<CUstream>; 2],
    /// Staging copies, publication, ticket flag writes.
    h2d: Raw<CUstream>,
    /// Device word: the highest completed ticket.
    flag: CUdeviceptr,
    piece_bytes: usize,
    faults: CopyFaults,
    state: Mutex<State>,
}

impl CudaTransport {
    pub fn new(options: &CudaOptions) -> Result<CudaTransport> {
        if options.piece_bytes < 4096 {
            return Err(Error::invalid(format!("piece_bytes = {} must be at least 4096", options.piece_bytes)));
        }
        let ctx = Context::primary(options.device)?;
        let kernels = Kernels::load()?;
        let [a, b, c] = take_streams(options.device)?;
        let (d2h, h2d) = ([a, b], c);
        let flag = driver::mem_alloc(8)?;
        let zero = 0u64;
        driver::memcpy_htod_async(flag, (&zero as *const u64).cast(), 8, h2d.0)?;
        driver::stream_synchronize(h2d.0)?;
        Ok(CudaTransport {
            device: options.device,
            ctx,
            kernels,
            d2h,
            h2d,
            flag,
            piece_bytes: options.piece_bytes,
            faults: CopyFaults::from_env(),
            state: Mutex::new(State::default()),
        })
    }

    /// The stream every gradient copy ends on: a device gradient may be reused once this
    /// stream has passed the copy (with PyTorch: `grad.record_stream(copy_stream)`).
    pub fn copy_stream(&self) -> CUstream {
        self.d2h[0].0
    }

    /// Host bytes this transport page-locked.
    pub fn pinned_bytes(&self) -> usize {
        self.state.lock().unwrap().ours.values().sum()
    }

    fn event(&self, state: &mut State) -> Result<Raw<CUevent>> {
        match state.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(Raw(driver::event_create()?)),
        }
    }

    /// Connects sub-group `sg` to the model's parameter on the device and allocates its
    /// staging buffer (in `staging_dtype`: f32, or the session's low-precision copy dtype).
    pub fn attach(
        &self,
        sg: u32,
        param: CUdeviceptr,
        param_dtype: DType,
        numel: usize,
        staging_dtype: DType,
    ) -> Result<()> {
        if param == 0 {
            return Err(Error::new(Status::NullArgument, "the device parameter is NULL"));
        }
        if staging_dtype != DType::F32 && staging_dtype != param_dtype {
            return Err(Error::unsupported(format!(
                "the session sends {} copies of the weights, which can only be published into {} parameters (this one is {})",
                staging_dtype.name(),
                staging_dtype.name(),
                param_dtype.name()
            )));
        }
        self.ctx.bind()?;
        let staging = driver::mem_alloc(numel * staging_dtype.size())?;
        let dev = SgDevice { param, param_dtype, staging, staging_dtype, numel, copies: Vec::new(), staged: None };
        self.state.lock().unwrap().subgroups.insert(sg, dev);
        Ok(())
    }

    /// Queues the copy of a device gradient into the host place the session gave it.
    /// The caller's `stream` is where the gradient was produced.
    pub fn gradient_from_device(&self, h: HandOff<'_>, src: CUdeviceptr, dtype: DType, stream: CUstream) -> Result<()> {
        if h.accumulate {
            return Err(Error::unsupported(
                "a CUDA session takes each slice's gradient once per step, at the last micro-step (accumulate \
                 micro-steps on the GPU, as PyTorch does in .grad); only a late gradient may follow",
            ));
        }
        let (dst, bytes, dst_dtype) = match h.dst {
            crate::kernels::FloatsMut::F32(s) => (s.as_mut_ptr().cast::<u8>(), s.len() * 4, DType::F32),
            crate::kernels::FloatsMut::Bf16(s) => (s.as_mut_ptr().cast::<u8>(), s.len() * 2, DType::Bf16),
            crate::kernels::FloatsMut::F16(s) => (s.as_mut_ptr().cast::<u8>(), s.len() * 2, DType::F16),
        };
        if dtype != dst_dtype {
            return Err(Error::unsupported(format!(
                "a {} device gradient cannot land in a {} host buffer: in CUDA sessions the gradient dtype is the \
                 accumulation dtype (bf16 gradients of f32 master weights cross the link once, in bf16)",
                dtype.name(),
                dst_dtype.name()
            )));
        }
        if src == 0 {
            return Err(Error::new(Status::NullArgument, "the device gradient is NULL"));
        }
        self.ctx.bind()?;
        driver::refuse_capturing(stream)?;
        let mut state = self.state.lock().unwrap();
        let ready = self.event(&mut state)?;
        driver::event_record(ready.0, stream)?;
        driver::stream_wait_event(self.d2h[0].0, ready.0)?;
        state.free_events.push(ready);
        let pieces = bytes.div_ceil(self.piece_bytes).max(1);
        let mut previous: Option<Raw<CUevent>> = None;
        for i in 0..pieces {
            let stream = self.d2h[i % 2].0;
            if let Some(p) = previous.take() {
                driver::stream_wait_event(stream, p.0)?;
                state.free_events.push(p);
            }
            let offset = i * self.piece_bytes;
            let len = self.piece_bytes.min(bytes - offset);
            let dropped = self.faults.drop_last_piece && pieces > 1 && i == pieces - 1;
            if !dropped {
                // SAFETY-relevant contract: the session keeps `dst` alive and untouched until
                // `gradient_ready` has waited for this copy.
                driver::memcpy_dtoh_async(dst.wrapping_add(offset), src + offset as u64, len, stream)?;
            }
            let done = self.event(&mut state)?;
            driver::event_record(done.0, stream)?;
            previous = Some(done);
        }
        let last = previous.expect("at least one piece");
        if pieces > 1 && !self.faults.no_final_wait {
            driver::stream_wait_event(self.d2h[0].0, last.0)?;
        }
        state.free_events.push(last);
        let end = self.event(&mut state)?;
        driver::event_record(end.0, self.d2h[0].0)?;
        let dev = state.subgroups.get_mut(&h.sg).ok_or_else(|| not_attached(h.sg))?;
        dev.copies.push(end);
        Ok(())
    }

    /// Orders everything published from now on after the work queued on `stream`.
    pub fn after_compute(&self, stream: CUstream) -> Result<()> {
        self.ctx.bind()?;
        let mut state = self.state.lock().unwrap();
        let event = self.event(&mut state)?;
        driver::event_record(event.0, stream)?;
        driver::stream_wait_event(self.h2d.0, event.0)?;
        state.free_events.push(event);
        Ok(())
    }

    /// Waits until everything published so far has landed in the model's parameters.
    pub fn wait_published(&self) -> Result<()> {
        self.ctx.bind()?;
        driver::stream_synchronize(self.h2d.0)
    }

    /// Makes `stream` wait, on the GPU, until `ticket` is complete.
    pub fn enqueue_wait(&self, ticket: Ticket, stream: CUstream) -> Result<()> {
        self.ctx.bind()?;
        driver::refuse_capturing(stream)?;
        driver::stream_wait_value(stream, self.flag, ticket)
    }

    /// Waits for `events` and returns them to the free list. Called without the state lock:
    /// a host thread waiting for a copy must not block the training thread's hand-offs.
    fn wait_and_free(&self, events: Vec<Raw<CUevent>>) -> Result<()> {
        let mut outcome = Ok(());
        for e in &events {
            if outcome.is_ok() {
                outcome = driver::event_synchronize(e.0);
            }
        }
        self.state.lock().unwrap().free_events.extend(events);
        outcome
    }
}

/// Copy streams outlive the sessions that used them: callers `record_stream` them into
/// PyTorch's caching allocator, which records events on them whenever it later frees such
/// memory. So they are never destroyed; a later session on the same device reuses them.
static SPARE_STREAMS: Mutex<Vec<(i32, [Raw<CUstream>; 3])>> = Mutex::new(Vec::new());

fn take_streams(device: i32) -> Result<[Raw<CUstream>; 3]> {
    let mut spare = SPARE_STREAMS.lock().unwrap();
    if let Some(i) = spare.iter().position(|(d, _)| *d == device) {
        return Ok(spare.swap_remove(i).1);
    }
    Ok([Raw(driver::stream_create()?), Raw(driver::stream_create()?), Raw(driver::stream_create()?)])
}

fn give_back_streams(device: i32, streams: [Raw<CUstream>; 3]) {
    SPARE_STREAMS.lock().unwrap().push((device, streams));
}

fn not_attached(sg: u32) -> Error {
    Error::new(Status::InvalidState, format!("sub-group {sg} has no device parameter attached"))
}

impl Transport for CudaTransport {
    fn pin(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.ctx.bind()?;
        let ours = driver::host_register(ptr, bytes)?;
        let mut state = self.state.lock().unwrap();
        if ours {
            state.ours.insert(ptr as usize, bytes)
        } else {
            state.theirs.insert(ptr as usize, bytes)
        };
        Ok(())
    }

    fn unpin(&self, ptr: *mut u8) {
        let mut state = self.state.lock().unwrap();
        if state.ours.remove(&(ptr as usize)).is_some() {
            let _ = self.ctx.bind();
            driver::host_unregister(ptr);
        } else {
            state.theirs.remove(&(ptr as usize));
        }
    }

    fn gradient_ready(&self, sg: u32) -> Result<()> {
        self.ctx.bind()?;
        let copies = {
            let mut state = self.state.lock().unwrap();
            state.subgroups.get_mut(&sg).map(|d| std::mem::take(&mut d.copies)).unwrap_or_default()
        };
        self.wait_and_free(copies)
    }

    fn master_write(&self, sg: u32) -> Result<()> {
        self.ctx.bind()?;
        let staged = self.state.lock().unwrap().subgroups.get_mut(&sg).and_then(|d| d.staged.take());
        self.wait_and_free(staged.into_iter().collect())
    }

    fn weights_updated(&self, sg: u32, master: Floats<'_>, copy: Option<Floats<'_>>) -> Result<()> {
        self.ctx.bind()?;
        let mut state = self.state.lock().unwrap();
        let (staging, staging_dtype, numel) = {
            let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
            (d.staging, d.staging_dtype, d.numel)
        };
        let source = if staging_dtype == DType::F32 { master } else { copy.expect("the session keeps the copy") };
        let ptr = match source {
            Floats::F32(s) => s.as_ptr().cast::<u8>(),
            Floats::Bf16(s) => s.as_ptr().cast::<u8>(),
            Floats::F16(s) => s.as_ptr().cast::<u8>(),
        };
        driver::memcpy_htod_async(staging, ptr, numel * staging_dtype.size(), self.h2d.0)?;
        let event = self.event(&mut state)?;
        driver::event_record(event.0, self.h2d.0)?;
        // The staging copies of a sub-group run in order on one stream: the newest event
        // covers the earlier ones, which can be reused at once.
        if let Some(previous) = state.subgroups.get_mut(&sg).expect("checked").staged.replace(event) {
            state.free_events.push(previous);
        }
        Ok(())
    }

    fn publish(&self, sg: u32) -> Result<()> {
        self.ctx.bind()?;
        let state = self.state.lock().unwrap();
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        let stream = self.h2d.0;
        match (d.staging_dtype, d.param_dtype) {
            (s, p) if s == p => driver::memcpy_dtod_async(d.param, d.staging, d.numel * s.size(), stream),
            (DType::F32, DType::Bf16) => {
                self.kernels.convert(self.kernels.to_bf16, d.staging, d.param, d.numel, stream)
            }
            (DType::F32, DType::F16) => self.kernels.convert(self.kernels.to_f16, d.staging, d.param, d.numel, stream),
            (s, p) => {
                Err(Error::unsupported(format!("cannot publish {} staging into {} parameters", s.name(), p.name())))
            }
        }
    }

    fn ticket_done(&self, ticket: Ticket) {
        // A failure here would leave GPU waiters waiting; the ticket's own outcome is
        // reported on the host either way.
        if self.ctx.bind().is_ok() {
            let _ = driver::stream_write_value(self.h2d.0, self.flag, ticket);
        }
    }

    fn subgroup_removed(&self, sg: u32) {
        let _ = self.ctx.bind();
        let removed = self.state.lock().unwrap().subgroups.remove(&sg);
        if let Some(d) = removed {
            let mut events = d.copies;
            events.extend(d.staged);
            let _ = self.wait_and_free(events);
            let _ = driver::stream_synchronize(self.h2d.0);
            driver::mem_free(d.staging);
        }
    }
}

impl Drop for CudaTransport {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        for s in self.d2h.iter().chain([&self.h2d]) {
            let _ = driver::stream_synchronize(s.0);
        }
        let state = std::mem::take(&mut *self.state.lock().unwrap());
        for (_, d) in state.subgroups {
            driver::mem_free(d.staging);
            for e in d.copies.into_iter().chain(d.staged) {
                driver::event_destroy(e.0);
            }
        }
        for ptr in state.ours.keys() {
            driver::host_unregister(*ptr as *mut u8);
        }
        for e in state.free_events {
            driver::event_destroy(e.0);
        }
        give_back_streams(self.device, [self.d2h[0], self.d2h[1], self.h2d]);
        driver::mem_free(self.flag);
    }
}
