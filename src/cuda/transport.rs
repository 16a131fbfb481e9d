//! The CUDA transport: device gradients to pinned host buffers in pieces on two copy
//! streams, or kept on the device and read back in bounded pieces, their sums of squares
//! taken on the GPU as they arrive (`gradients.rs`); updated weights copied from host memory
//! straight into the model's parameters once `step()` has decided, behind the caller's
//! backward, piece by piece as the final passes write them (from the session's copy, the
//! master weights, or bounded slots, `slots.rs`); device-placed sub-groups stepped by the
//! library's own GPU kernel (`device_state.rs`); stream waits for published weights. Device
//! memory, host registrations (`memory.rs`) and events (`events.rs`) are owners: dropped,
//! they release what they hold.

use std::any::Any;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};

use super::attached::{SgDevice, State, not_device_placed};
use super::device_state::DeviceState;
use super::driver::{self, CUdeviceptr, CUstream, Context, Kernels, Raw};
use super::events::{self, Event, EventPool, WaitTimes};
use super::gradients::GradientCopies;
use super::memory::{HostRegistration, floats_ptr};
use super::partials::SumsqPartials;
use super::slots::{SLOTS, Slots};
use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats, FloatsMut};
use crate::session::{DeviceParam, DevicePass, HandOff, HandedSumsq, HostState, Placement, Transport};

/// How a CUDA session moves data. Fields as
/// [`so_cuda_options`](crate::ffi::cuda::so_cuda_options) documents them, in Rust types.
#[derive(Clone, Copy, Debug)]
pub struct CudaOptions {
    pub device: i32,
    pub piece_bytes: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        CudaOptions { device: 0, piece_bytes: 16 << 20 }
    }
}

pub struct CudaTransport {
    device: i32,
    ctx: Context,
    kernels: Kernels,
    /// Device steps and publication; a step's publications follow the caller's backward.
    h2d: Raw<CUstream>,
    /// Gradients to the host or onto the device, and their sums of squares (`gradients.rs`).
    gradients: GradientCopies,
    /// The dtype of the low-precision copy the session keeps, if any (what 16-bit parameters
    /// are published from).
    copy_dtype: Option<DType>,
    /// Pieces of weights on their way to the device where the session keeps no copy.
    publish_slots: Mutex<Slots>,
    /// The first failure of queued work (a copy, a kernel): CUDA reports those errors on
    /// every later call of the context, so the transport refuses from then on.
    fault: OnceLock<Error>,
    events: Arc<EventPool>,
    /// The GPU's idle time at ticket waits, not yet accounted.
    waits: Mutex<WaitTimes>,
    state: Mutex<State>,
}

impl CudaTransport {
    /// A transport for a session that accumulates gradients in `accum_dtype` and keeps a
    /// `copy_dtype` copy of its master weights.
    pub fn new(options: &CudaOptions, accum_dtype: DType, copy_dtype: Option<DType>) -> Result<CudaTransport> {
        if options.piece_bytes < 4096 {
            return Err(Error::invalid(format!("piece_bytes = {} must be at least 4096", options.piece_bytes)));
        }
        let ctx = Context::primary(options.device)?;
        let kernels = Kernels::load()?;
        let [a, b, c, d] = take_streams(options.device)?;
        let events: Arc<EventPool> = Arc::default();
        let transport = CudaTransport {
            device: options.device,
            ctx,
            kernels,
            h2d: c,
            gradients: GradientCopies::new([a, b], d, options.piece_bytes, accum_dtype, events.clone()),
            copy_dtype,
            publish_slots: Mutex::new(Slots::new(SLOTS)),
            fault: OnceLock::new(),
            events,
            waits: Mutex::default(),
            state: Mutex::default(),
        };
        Ok(transport)
    }

    /// Makes the context current for a call, or refuses with the first fault of queued
    /// work: a sub-group must not be stepped or published from a gradient that never
    /// arrived.
    fn enter(&self) -> Result<()> {
        if let Some(fault) = self.fault.get() {
            return Err(fault.clone());
        }
        self.ctx.bind()
    }

    /// Remembers a failure of queued work (see `fault`).
    fn noted<T>(&self, outcome: Result<T>) -> Result<T> {
        if let Err(e) = &outcome {
            let _ = self.fault.set(e.clone());
        }
        outcome
    }

    /// The stream every gradient copy ends on: a device gradient may be reused once this
    /// stream has passed the copy (with PyTorch: `grad.record_stream(copy_stream)`).
    pub fn copy_stream(&self) -> CUstream {
        self.gradients.copy_stream()
    }

    /// Host bytes this transport page-locked: the session's buffers and its own slots.
    pub fn pinned_bytes(&self) -> usize {
        let slots = self.publish_slots.lock().unwrap().bytes() + self.gradients.slot_bytes();
        slots + self.state.lock().unwrap().pinned_bytes()
    }

    /// Queues the copy of a device gradient into the host place the session gave it (or, for
    /// a device-placed sub-group, into its device gradient), and its sum of squares on the
    /// GPU when the session asks for one. The caller's `stream` is where it was produced.
    pub fn gradient_from_device(
        &self,
        h: HandOff<'_>,
        src: CUdeviceptr,
        dtype: DType,
        stream: CUstream,
    ) -> Result<Option<HandedSumsq>> {
        if h.accumulate {
            return Err(Error::unsupported(
                "a CUDA session takes each slice's gradient once per step, at the last micro-step (accumulate \
                 micro-steps on the GPU, as PyTorch does in .grad); only a late gradient may follow",
            ));
        }
        if src == 0 {
            return Err(Error::new(Status::NullArgument, "the device gradient is NULL"));
        }
        self.enter()?;
        driver::refuse_capturing(stream)?;
        let mut state = self.state.lock().unwrap();
        let dev = state.attached_mut(h.sg)?;
        self.gradients.land(&self.kernels, dev, h, src, dtype, stream)
    }

    /// Registers the caller's compute stream (borrowed): publication of updated weights
    /// waits for the work queued on it before `step()`, so the backward still running on the
    /// GPU never sees weights change under it.
    pub fn set_compute_stream(&self, stream: CUstream) -> Result<()> {
        driver::refuse_capturing(stream)?;
        self.state.lock().unwrap().set_compute_stream(stream);
        Ok(())
    }

    /// Waits until everything published so far has landed in the model's parameters.
    pub fn wait_published(&self) -> Result<()> {
        self.enter()?;
        self.noted(driver::stream_synchronize(self.h2d.0))
    }

    /// Makes `stream` wait, once `host_wait` returns (the caller's wait for a ticket on the
    /// host, which names the sub-group whose final ticket it was, if any), for that
    /// sub-group's latest publication, or without one for everything the session has queued.
    /// Where the CPU-Adam thread runs ahead (device steps are queued in a moment), a wait for
    /// all of it would hold the first layer's forward until the last sub-group's step. The
    /// wait is timed on the GPU from the point the stream reached before the host wait: the
    /// idle time it caused.
    pub fn enqueue_wait(&self, stream: CUstream, host_wait: impl FnOnce() -> Option<u32>) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        let before = self.events.record_timing(stream)?;
        // Without the state lock: the CPU-Adam thread publishes through it meanwhile.
        let subgroup = host_wait();
        {
            let state = self.state.lock().unwrap();
            match subgroup.and_then(|sg| state.get(sg)).and_then(SgDevice::published) {
                Some(published) => published.wait_in(stream)?,
                None => self.events.record(self.h2d.0)?.wait_in(stream)?,
            }
        }
        let after = self.events.record_timing(stream)?;
        self.waits.lock().unwrap().push(before, after);
        Ok(())
    }

    /// The device parameter sub-group `sg` publishes into: (address, dtype, elements).
    pub fn published_param(&self, sg: u32) -> Result<(CUdeviceptr, DType, usize)> {
        let state = self.state.lock().unwrap();
        let dev = state.attached(sg)?;
        Ok((dev.param_at(0), dev.param_dtype(), dev.numel()))
    }

    /// Makes `stream` wait for every gradient copy queued so far, so that the work queued on it
    /// afterwards may reuse the device gradients those copies read (a caller whose allocator
    /// cannot `record_stream`, such as XLA's buffer assignment).
    pub fn wait_for_gradient_copies(&self, stream: CUstream) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        self.events.record(self.copy_stream())?.wait_in(stream)
    }

    /// Copies `dst.len()` bytes from device address `src` into `dst` in the order of `stream`,
    /// and waits for it on the host (small values a caller's stream computed, e.g. a learning
    /// rate).
    pub fn read_on_stream(&self, dst: &mut [u8], src: CUdeviceptr, stream: CUstream) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        driver::memcpy_dtoh_async(dst.as_mut_ptr(), src, dst.len(), stream)?;
        driver::stream_synchronize(stream)
    }

    /// Copies `src` to device address `dst` in the order of `stream`. `src` is pageable: the
    /// driver stages it before returning, so it may be dropped at once.
    pub fn write_on_stream(&self, dst: CUdeviceptr, src: &[u8], stream: CUstream) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        driver::memcpy_htod_async(dst, src.as_ptr(), src.len(), stream)
    }

    /// Copies `bytes` between device addresses in the order of `stream`.
    pub fn copy_on_stream(&self, dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        driver::memcpy_dtod_async(dst, src, bytes, stream)
    }

    /// Waits for `events`, which then go back to the pool. Called without the state lock: a
    /// host thread waiting for a copy must not block the training thread's hand-offs.
    fn wait_and_free(&self, events: Vec<Event>) -> Result<()> {
        self.noted(events::synchronize_all(events))
    }

    /// Queues the copy of `bytes` at host `src` into `sg`'s parameter, `offset` elements in,
    /// on the publish stream behind the caller's backward; the event recorded after it.
    fn publish_copy(&self, sg: u32, offset: usize, src: *const u8, bytes: usize) -> Result<Event> {
        let mut state = self.state.lock().unwrap();
        state.publication_follows_backward(self.h2d.0)?;
        let dst = state.attached(sg)?.param_at(offset);
        driver::memcpy_htod_async(dst, src, bytes, self.h2d.0)?;
        self.events.record(self.h2d.0)
    }

    /// A device state of `numel` elements holding `host`'s (complete on return; freed again
    /// if the upload fails).
    fn uploaded(&self, numel: usize, host: &mut HostState<'_>) -> Result<DeviceState> {
        let dev = self.queued_upload(numel, host)?;
        self.noted(driver::stream_synchronize(self.h2d.0))?;
        Ok(dev)
    }

    /// A device state of `numel` elements that `host`'s is copied into on the publish stream,
    /// not waited for: the sub-group's device steps, the publications of its weights and every
    /// later copy of its state run on that stream after it. From the page-locked buffers of a
    /// sub-group registered as one the split may place, the copies overlap the step; `host`
    /// is not written before they end (its device-placed state is only written by a load,
    /// which copies it up again behind them).
    fn queued_upload(&self, numel: usize, host: &mut HostState<'_>) -> Result<DeviceState> {
        let dev = DeviceState::alloc(numel, host.exp_avg.dtype(), self.gradients.accum_dtype())?;
        dev.upload(host, self.h2d.0)?;
        Ok(dev)
    }

    /// Copies host state to a device state (on the publish stream, complete on return).
    fn upload(&self, dev: &DeviceState, host: &mut HostState<'_>) -> Result<()> {
        dev.upload(host, self.h2d.0)?;
        self.noted(driver::stream_synchronize(self.h2d.0))
    }

    /// Copies a device state to host state (on the publish stream, complete on return).
    fn download(&self, dev: &DeviceState, host: &mut HostState<'_>) -> Result<()> {
        dev.download(host, self.h2d.0)?;
        self.noted(driver::stream_synchronize(self.h2d.0))
    }
}

/// Copy streams outlive the sessions that used them: callers `record_stream` them into
/// PyTorch's caching allocator, which records events on them whenever it later frees such
/// memory. So they are never destroyed; a later session on the same device reuses them.
static SPARE_STREAMS: Mutex<Vec<(i32, [Raw<CUstream>; 4])>> = Mutex::new(Vec::new());

fn take_streams(device: i32) -> Result<[Raw<CUstream>; 4]> {
    let mut spare = SPARE_STREAMS.lock().unwrap();
    if let Some(i) = spare.iter().position(|(d, _)| *d == device) {
        return Ok(spare.swap_remove(i).1);
    }
    Ok([
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
    ])
}

fn give_back_streams(device: i32, streams: [Raw<CUstream>; 4]) {
    SPARE_STREAMS.lock().unwrap().push((device, streams));
}

impl Transport for CudaTransport {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn pin(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.enter()?;
        let registration = HostRegistration::register(ptr, bytes)?;
        self.state.lock().unwrap().keep_pin(ptr as usize, registration);
        Ok(())
    }

    fn unpin(&self, ptr: *mut u8) {
        let removed = self.state.lock().unwrap().take_pin(ptr as usize);
        if removed.is_some() {
            // Dropping the registration unregisters the range if it was ours.
            let _ = self.ctx.bind();
        }
    }

    fn attach(
        &self,
        sg: u32,
        device: Option<DeviceParam>,
        slices: &[Range<usize>],
        placement: Placement,
        mut state: HostState<'_>,
    ) -> Result<()> {
        let device = device.ok_or_else(|| Error::new(Status::NullArgument, "the device parameter is NULL"))?;
        if device.ptr == 0 {
            return Err(Error::new(Status::NullArgument, "the device parameter is NULL"));
        }
        let numel = state.master.len();
        if let Some(copy) = self.copy_dtype.filter(|&c| c != device.dtype) {
            return Err(Error::unsupported(format!(
                "the session keeps {} copies of the weights, which can only be published into {} parameters (this \
                 one is {})",
                copy.name(),
                copy.name(),
                device.dtype.name()
            )));
        }
        self.enter()?;
        // Each owner releases what it took if a later one fails.
        let partials = SumsqPartials::new(slices)?;
        let on_device = (placement == Placement::Device).then(|| self.uploaded(numel, &mut state)).transpose()?;
        self.state.lock().unwrap().attach(sg, SgDevice::new(device, numel, partials, on_device));
        Ok(())
    }

    fn detach(&self, sg: u32) {
        let _ = self.ctx.bind();
        let removed = self.state.lock().unwrap().detach(sg);
        if let Some(mut d) = removed {
            let _ = self.wait_and_free(d.take_events());
            let [_, second_copy, side] = self.gradients.streams();
            for s in [side, self.h2d, second_copy] {
                let _ = driver::stream_synchronize(s.0);
            }
            // Nothing queued uses `d` any more: dropping it frees its buffers.
        }
    }

    fn gradient_ready(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let copies = {
            let mut state = self.state.lock().unwrap();
            state.get_mut(sg).map(SgDevice::take_copies).unwrap_or_default()
        };
        self.wait_and_free(copies)
    }

    fn gradient_landed(&self, sg: u32) -> bool {
        if self.enter().is_err() {
            return true;
        }
        let state = self.state.lock().unwrap();
        state.get(sg).is_none_or(SgDevice::gradient_landed)
    }

    /// The sum of squares of a slice whose hand-off deferred it, once its partials landed.
    fn gradient_sumsq(&self, sg: u32, slice: usize) -> Result<f64> {
        self.enter()?;
        let ready = self.state.lock().unwrap().attached_mut(sg)?.partials_mut().take_ready(slice).ok_or_else(|| {
            Error::new(Status::Panic, format!("sub-group {sg} slice {slice}: no sum of squares queued"))
        })?;
        self.wait_and_free(vec![ready])?;
        Ok(self.state.lock().unwrap().attached(sg)?.partials().slice_sum(slice))
    }

    fn master_write(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let publishing = self.state.lock().unwrap().get_mut(sg).and_then(SgDevice::take_publishing);
        self.wait_and_free(publishing.into_iter().collect())
    }

    fn publish_piece(&self, sg: u32, offset: usize, src: Floats<'_>) -> Result<()> {
        self.enter()?;
        {
            let state = self.state.lock().unwrap();
            let d = state.attached(sg)?;
            d.check_piece(sg, offset, src.len(), src.dtype())?;
        }
        // The session leaves `src` (its pinned copy or master weights) unchanged until
        // `master_write`, which waits for this copy.
        let copied = self.publish_copy(sg, offset, floats_ptr(&src), src.len() * src.dtype().size())?;
        if let Some(d) = self.state.lock().unwrap().get_mut(sg) {
            d.set_publishing(copied);
        }
        Ok(())
    }

    fn publish_filled(
        &self,
        sg: u32,
        offset: usize,
        len: usize,
        dtype: DType,
        fill: &mut dyn FnMut(FloatsMut<'_>) -> Result<()>,
    ) -> Result<()> {
        self.enter()?;
        {
            let state = self.state.lock().unwrap();
            let d = state.attached(sg)?;
            d.check_piece(sg, offset, len, dtype)?;
        }
        // Without the state lock while the slot frees up and `fill` runs: hand-offs go on.
        let mut slots = self.publish_slots.lock().unwrap();
        let slot = self.noted(slots.next_ready(len * dtype.size()))?;
        fill(slot.floats_mut(dtype, len))?;
        let copied = self.publish_copy(sg, offset, slot.ptr(), len * dtype.size())?;
        slot.used_by(copied);
        Ok(())
    }

    fn publish(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        state.publication_follows_backward(self.h2d.0)?;
        state.attached_mut(sg)?.set_published(self.events.record(self.h2d.0)?);
        Ok(())
    }

    fn before_step(&self) -> Result<()> {
        self.enter()?;
        self.state.lock().unwrap().backward_queued(&self.events)
    }

    fn exposed_wait_s(&self) -> f64 {
        if self.ctx.bind().is_err() {
            return 0.0;
        }
        self.waits.lock().unwrap().take_elapsed_s()
    }

    fn after_load(&self) -> Result<()> {
        self.wait_published()
    }

    fn device_step(&self, sg: u32, passes: &[DevicePass], publish: bool) -> Result<()> {
        self.enter()?;
        let copies = self.state.lock().unwrap().attached_mut(sg)?.take_copies();
        let mut state = self.state.lock().unwrap();
        for e in &copies {
            e.wait_in(self.h2d.0)?;
        }
        if publish {
            state.publication_follows_backward(self.h2d.0)?;
        }
        let d = state.attached_mut(sg)?;
        let dev = d.device().ok_or_else(not_device_placed)?;
        for (i, pass) in passes.iter().enumerate() {
            // Only the last pass writes the model's parameter, and only when it is published.
            let publish_here = publish && i + 1 == passes.len();
            dev.step(&self.kernels, self.h2d.0, &d.param(), self.gradients.accum_dtype(), pass, publish_here)?;
        }
        if publish && passes.is_empty() {
            // The speculative update stands: its master weights, rounded as the step kernel
            // rounds them, are the parameter.
            d.publish_from(&self.kernels, dev.master(), DType::F32, self.h2d.0)?;
        }
        d.set_stepped(self.events.record(self.h2d.0)?);
        if publish {
            d.set_published(self.events.record(self.h2d.0)?);
        }
        Ok(())
    }

    fn keep_gradient_on_device(&self, sg: u32) -> Result<()> {
        self.enter()?;
        self.state.lock().unwrap().attached_mut(sg)?.keep_gradient(self.gradients.accum_dtype())
    }

    fn gradient_pieces(
        &self,
        sg: u32,
        range: Range<usize>,
        piece: usize,
        f: &mut dyn FnMut(usize, Floats<'_>) -> Result<()>,
    ) -> Result<()> {
        self.enter()?;
        let src = {
            let state = self.state.lock().unwrap();
            state.attached(sg)?.device_gradient_at(0).ok_or_else(|| {
                Error::new(Status::InvalidState, format!("sub-group {sg} keeps no gradient on the device"))
            })?
        };
        let note = |e: &Error| {
            let _ = self.fault.set(e.clone());
        };
        self.gradients.read_kept(src, range, piece, &note, f)
    }

    fn device_zero_gradient(&self, sg: u32, range: Range<usize>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let d = state.attached_mut(sg)?;
        let size = self.gradients.accum_dtype().size();
        let dst = d.device_gradient_at(range.start * size).ok_or_else(not_device_placed)?;
        if let Some(stepped) = d.stepped() {
            stepped.wait_in(self.gradients.side_stream())?;
        }
        driver::memset_async(dst, range.len() * size, self.gradients.side_stream())?;
        d.copy_queued(self.events.record(self.gradients.side_stream())?);
        Ok(())
    }

    fn set_placement(&self, sg: u32, placement: Placement, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let d = state.attached_mut(sg)?;
        match (placement, d.device()) {
            (Placement::Device, None) => {
                let queued = self.queued_upload(d.numel(), &mut host)?;
                d.placed_on_device(queued);
            }
            (Placement::Host, Some(dev)) => {
                // The kept gradient first, and the device state freed only once the host holds it.
                let kept = d.gradient_buffer_to_keep(self.gradients.accum_dtype())?;
                self.download(dev, &mut host)?;
                d.placed_on_host(kept);
            }
            _ => {}
        }
        Ok(())
    }

    fn download_state(&self, sg: u32, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let state = self.state.lock().unwrap();
        match state.attached(sg)?.device() {
            Some(dev) => self.download(dev, &mut host),
            None => Ok(()),
        }
    }

    fn load_state(&self, sg: u32, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        state.publication_follows_backward(self.h2d.0)?;
        let d = state.attached(sg)?;
        let dev = d.device().ok_or_else(not_device_placed)?;
        self.upload(dev, &mut host)?;
        d.publish_from(&self.kernels, dev.master(), DType::F32, self.h2d.0)
    }

    fn device_bytes(&self) -> usize {
        self.state.lock().unwrap().device_bytes()
    }

    fn device_memory(&self) -> Result<(usize, usize)> {
        self.enter()?;
        driver::mem_info()
    }
}

impl Drop for CudaTransport {
    fn drop(&mut self) {
        let state = std::mem::take(&mut *self.state.lock().unwrap());
        if self.ctx.bind().is_err() {
            // No driver call can release them without the context.
            std::mem::forget(state);
            return;
        }
        let [first_copy, second_copy, side] = self.gradients.streams();
        for s in [first_copy, second_copy, self.h2d, side] {
            let _ = driver::stream_synchronize(s.0);
        }
        // Nothing queued is left: the sub-groups' buffers are freed, the pins undone and
        // every event is back in the pool, whose events are then destroyed.
        drop(state);
        std::mem::take(&mut *self.waits.lock().unwrap());
        self.events.destroy_free();
        give_back_streams(self.device, [first_copy, second_copy, self.h2d, side]);
    }
}
