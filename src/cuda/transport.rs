//! The CUDA transport: device gradients to pinned host buffers in pieces on two copy
//! streams, their sums of squares taken on the GPU as they arrive; updated weights to
//! per-sub-group GPU staging buffers, published into the model's parameters once `step()`
//! has decided; device-placed sub-groups stepped by the library's own GPU kernel; stream
//! waits for published weights.

use std::any::Any;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Mutex, OnceLock};

use super::driver::{self, CUdeviceptr, CUevent, CUstream, Context, Kernels};
use crate::error::{Error, Result, Status};
use crate::kernels::{AdamHyper, DType, Floats, FloatsMut};
use crate::session::{DeviceParam, HandOff, HandedSumsq, HostState, Placement, Transport};

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
// SAFETY: CUDA stream and event handles are usable from any thread. `Raw` is crate-private and
// wraps nothing else (`CUstream`, `CUevent`: pointers to driver objects, never dereferenced here).
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as for `Send`: sharing a `Raw` only copies the handle, and the driver accepts the
// same stream or event from several threads.
unsafe impl<T> Sync for Raw<T> {}

/// Elements per partial of a sum of squares (the CPU kernels' block).
const SUMSQ_BLOCK: usize = 8192;

/// The master weights, moments and gradient of a device-placed sub-group.
struct DeviceState {
    moment_dtype: DType,
    master: CUdeviceptr,
    exp_avg: CUdeviceptr,
    exp_avg_sq: CUdeviceptr,
    grad: CUdeviceptr,
    bytes: usize,
}

struct SgDevice {
    /// The model's parameter (caller-owned device memory).
    param: CUdeviceptr,
    param_dtype: DType,
    /// Where updated weights wait until `publish`.
    staging: CUdeviceptr,
    staging_dtype: DType,
    numel: usize,
    slices: Vec<Range<usize>>,
    /// Per slice: its first partial in the sum-of-squares buffers.
    partial_offsets: Vec<usize>,
    /// Device partials and their pinned host copy.
    partials_dev: CUdeviceptr,
    partials_host: Box<[f64]>,
    /// Per slice: recorded after its partials' copy to the host, until consumed.
    sumsq_ready: Vec<Option<Raw<CUevent>>>,
    /// Recorded after each gradient copy of this step (to the host, or into `device.grad`).
    copies: Vec<Raw<CUevent>>,
    /// Recorded after the latest staging copy, which reads the host master (or copy).
    staged: Option<Raw<CUevent>>,
    /// Recorded after the latest publication from `staging`, which reads it.
    published: Option<Raw<CUevent>>,
    device: Option<DeviceState>,
}

impl SgDevice {
    fn bytes(&self) -> usize {
        self.numel * self.staging_dtype.size()
            + self.partials_host.len() * 8
            + self.device.as_ref().map_or(0, |d| d.bytes)
    }
}

#[derive(Default)]
struct State {
    subgroups: HashMap<u32, SgDevice>,
    /// Host ranges we page-locked (start -> bytes), and those the caller had already pinned.
    ours: HashMap<usize, usize>,
    theirs: HashMap<usize, usize>,
    free_events: Vec<Raw<CUevent>>,
    free_timing: Vec<Raw<CUevent>>,
    /// Timing events around each GPU-side ticket wait not yet accounted.
    waits: Vec<(Raw<CUevent>, Raw<CUevent>)>,
    compute: Option<Raw<CUstream>>,
}

pub struct CudaTransport {
    device: i32,
    ctx: Context,
    kernels: Kernels,
    /// Gradient copies; the first also carries the end of every copy sequence.
    d2h: [Raw<CUstream>; 2],
    /// Publication, device steps: behind each step's wait for the caller's backward.
    h2d: Raw<CUstream>,
    /// Staging copies of updated weights (host to `staging`). Not behind that wait: the
    /// weights of speculative steps taken during backward reach the device while backward
    /// runs, and the first layer's publication after it does not queue behind them.
    stage: Raw<CUstream>,
    /// Sums of squares and device-placed gradients.
    side: Raw<CUstream>,
    piece_bytes: usize,
    /// The session's accumulation dtype (of device-placed gradients) and the dtype of the
    /// low-precision copy it keeps, if any (what is staged for 16-bit parameters).
    accum_dtype: DType,
    copy_dtype: Option<DType>,
    faults: CopyFaults,
    /// The first failure of queued work (a copy, a kernel): CUDA reports those errors on
    /// every later call of the context, so the transport refuses from then on.
    fault: OnceLock<Error>,
    state: Mutex<State>,
}

fn dtype_code(d: Option<DType>) -> u32 {
    match d {
        None => 0,
        Some(DType::F32) => 1,
        Some(DType::Bf16) => 2,
        Some(DType::F16) => 3,
    }
}

fn floats_ptr(f: &Floats<'_>) -> *const u8 {
    match f {
        Floats::F32(s) => s.as_ptr().cast(),
        Floats::Bf16(s) => s.as_ptr().cast(),
        Floats::F16(s) => s.as_ptr().cast(),
    }
}

fn floats_mut_ptr(f: &mut FloatsMut<'_>) -> (*mut u8, usize) {
    match f {
        FloatsMut::F32(s) => (s.as_mut_ptr().cast(), s.len() * 4),
        FloatsMut::Bf16(s) => (s.as_mut_ptr().cast(), s.len() * 2),
        FloatsMut::F16(s) => (s.as_mut_ptr().cast(), s.len() * 2),
    }
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
        let [a, b, c, d, e] = take_streams(options.device)?;
        let transport = CudaTransport {
            device: options.device,
            ctx,
            kernels,
            d2h: [a, b],
            h2d: c,
            side: d,
            stage: e,
            piece_bytes: options.piece_bytes,
            accum_dtype,
            copy_dtype,
            faults: CopyFaults::from_env(),
            fault: OnceLock::new(),
            state: Mutex::new(State::default()),
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
        self.d2h[0].0
    }

    /// Host bytes this transport page-locked.
    pub fn pinned_bytes(&self) -> usize {
        self.state.lock().unwrap().ours.values().sum()
    }

    /// Registers the caller's compute stream (borrowed): publication of updated weights
    /// waits for the work queued on it before `step()`, so the backward still running on the
    /// GPU never sees weights change under it.
    pub fn set_compute_stream(&self, stream: CUstream) -> Result<()> {
        driver::refuse_capturing(stream)?;
        self.state.lock().unwrap().compute = Some(Raw(stream));
        Ok(())
    }

    fn event(state: &mut State) -> Result<Raw<CUevent>> {
        match state.free_events.pop() {
            Some(e) => Ok(e),
            None => Ok(Raw(driver::event_create(false)?)),
        }
    }

    fn timing_event(state: &mut State) -> Result<Raw<CUevent>> {
        match state.free_timing.pop() {
            Some(e) => Ok(e),
            None => Ok(Raw(driver::event_create(true)?)),
        }
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
        let mut dst = h.dst;
        if dst.dtype() != dtype {
            return Err(Error::unsupported(format!(
                "a {} device gradient cannot land in a {} host buffer: in CUDA sessions the gradient dtype is the \
                 accumulation dtype (bf16 gradients of f32 master weights cross the link once, in bf16)",
                dtype.name(),
                dst.dtype().name()
            )));
        }
        let (dst, bytes) = floats_mut_ptr(&mut dst);
        if src == 0 {
            return Err(Error::new(Status::NullArgument, "the device gradient is NULL"));
        }
        self.enter()?;
        driver::refuse_capturing(stream)?;
        let mut state = self.state.lock().unwrap();
        let on_device = state.subgroups.get(&h.sg).ok_or_else(|| not_attached(h.sg))?.device.is_some();
        if on_device && (h.late || h.sumsq_scale.is_none()) {
            return Err(Error::unsupported(
                "a device-placed sub-group takes each slice's gradient once per step, at the last micro-step \
                 (no late gradients)",
            ));
        }
        let ready = Self::event(&mut state)?;
        driver::event_record(ready.0, stream)?;
        driver::stream_wait_event(self.d2h[0].0, ready.0)?;
        let side_used = h.sumsq_scale.is_some() || on_device;
        if side_used {
            driver::stream_wait_event(self.side.0, ready.0)?;
        }
        state.free_events.push(ready);
        let dev = state.subgroups.get(&h.sg).expect("checked");
        let handed = match h.sumsq_scale {
            Some(scale) => {
                let offset = dev.partial_offsets[h.slice];
                let count = h.range.len().div_ceil(SUMSQ_BLOCK);
                let (mut g, mut n, mut code, mut scale) = (src, h.range.len() as u64, dtype_code(Some(dtype)), scale);
                let (mut out, mut blocks) = (dev.partials_dev + (offset * 8) as u64, count as u64);
                let threads = count * 8;
                self.kernels.launch(
                    self.kernels.sumsq,
                    threads.div_ceil(256) as u32,
                    256,
                    self.side.0,
                    &mut [&mut g, &mut n, &mut code, &mut scale, &mut out, &mut blocks],
                )?;
                let host = dev.partials_host[offset..offset + count].as_ptr() as *mut u8;
                driver::memcpy_dtoh_async(host, out, count * 8, self.side.0)?;
                Some(HandedSumsq::Deferred)
            }
            None => None,
        };
        if on_device {
            let grad = dev.device.as_ref().expect("checked").grad + (h.range.start * dtype.size()) as u64;
            driver::memcpy_dtod_async(grad, src, bytes, self.side.0)?;
        }
        if let Some(scale_slot) = h.sumsq_scale.map(|_| h.slice) {
            let e = Self::event(&mut state)?;
            driver::event_record(e.0, self.side.0)?;
            let dev = state.subgroups.get_mut(&h.sg).expect("checked");
            if let Some(old) = dev.sumsq_ready[scale_slot].replace(e) {
                state.free_events.push(old);
            }
        }
        if side_used {
            // The copy stream ends every sequence: `record_stream` on it covers the reads of
            // the sum of squares and of the device-gradient copy too.
            let e = Self::event(&mut state)?;
            driver::event_record(e.0, self.side.0)?;
            driver::stream_wait_event(self.d2h[0].0, e.0)?;
            state.free_events.push(e);
        }
        if !on_device {
            self.copy_pieces(&mut state, dst, src, bytes)?;
        }
        let end = Self::event(&mut state)?;
        driver::event_record(end.0, self.d2h[0].0)?;
        state.subgroups.get_mut(&h.sg).expect("checked").copies.push(end);
        Ok(handed)
    }

    /// The device-to-host copy of one gradient, in pieces alternating the two copy streams,
    /// each waiting for the one before, the first stream ending with a wait on the last.
    fn copy_pieces(&self, state: &mut State, dst: *mut u8, src: CUdeviceptr, bytes: usize) -> Result<()> {
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
                // The session keeps `dst` alive and untouched until `gradient_ready` has
                // waited for this copy.
                driver::memcpy_dtoh_async(dst.wrapping_add(offset), src + offset as u64, len, stream)?;
            }
            let done = Self::event(state)?;
            driver::event_record(done.0, stream)?;
            previous = Some(done);
        }
        let last = previous.expect("at least one piece");
        if pieces > 1 && !self.faults.no_final_wait {
            driver::stream_wait_event(self.d2h[0].0, last.0)?;
        }
        state.free_events.push(last);
        Ok(())
    }

    /// Waits until everything published so far has landed in the model's parameters.
    pub fn wait_published(&self) -> Result<()> {
        self.enter()?;
        self.noted(driver::stream_synchronize(self.h2d.0))
    }

    /// Makes `stream` wait for what the session has queued once `host_wait` returns (the
    /// caller's wait for a ticket on the host). The wait is timed on the GPU from the point
    /// the stream reached before the host wait: the idle time it caused.
    pub fn enqueue_wait(&self, stream: CUstream, host_wait: impl FnOnce()) -> Result<()> {
        self.enter()?;
        driver::refuse_capturing(stream)?;
        let before = {
            let mut state = self.state.lock().unwrap();
            let before = Self::timing_event(&mut state)?;
            if let Err(e) = driver::event_record(before.0, stream) {
                state.free_timing.push(before);
                return Err(e);
            }
            before
        };
        // Without the state lock: the CPU-Adam thread publishes through it meanwhile.
        host_wait();
        let mut state = self.state.lock().unwrap();
        let events = Self::event(&mut state).and_then(|queued| match Self::timing_event(&mut state) {
            Ok(after) => Ok((queued, after)),
            Err(e) => {
                state.free_events.push(queued);
                Err(e)
            }
        });
        let (queued, after) = match events {
            Ok(pair) => pair,
            Err(e) => {
                state.free_timing.push(before);
                return Err(e);
            }
        };
        let recorded = driver::event_record(queued.0, self.h2d.0)
            .and_then(|()| driver::stream_wait_event(stream, queued.0))
            .and_then(|()| driver::event_record(after.0, stream));
        state.free_events.push(queued);
        match recorded {
            Ok(()) => state.waits.push((before, after)),
            Err(_) => state.free_timing.extend([before, after]),
        }
        recorded
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
        self.noted(outcome)
    }

    fn device_state(&self, numel: usize, moment: DType) -> Result<DeviceState> {
        let grad = self.accum_dtype;
        let alloc = |bytes: usize| driver::mem_alloc(bytes);
        let master = alloc(numel * 4)?;
        let rest = (|| {
            Ok::<_, Error>((alloc(numel * moment.size())?, alloc(numel * moment.size())?, alloc(numel * grad.size())?))
        })();
        match rest {
            Ok((exp_avg, exp_avg_sq, g)) => Ok(DeviceState {
                moment_dtype: moment,
                master,
                exp_avg,
                exp_avg_sq,
                grad: g,
                bytes: numel * (4 + 2 * moment.size() + grad.size()),
            }),
            Err(e) => {
                driver::mem_free(master);
                Err(e)
            }
        }
    }

    /// Copies host state to a device state (on the publish stream, complete on return).
    fn upload(&self, d: &DeviceState, state: &mut HostState<'_>) -> Result<()> {
        for (dst, src) in
            [(d.master, &mut state.master), (d.exp_avg, &mut state.exp_avg), (d.exp_avg_sq, &mut state.exp_avg_sq)]
        {
            let (ptr, bytes) = floats_mut_ptr(src);
            driver::memcpy_htod_async(dst, ptr, bytes, self.h2d.0)?;
        }
        self.noted(driver::stream_synchronize(self.h2d.0))
    }

    fn download(&self, d: &DeviceState, state: &mut HostState<'_>) -> Result<()> {
        for (src, dst) in
            [(d.master, &mut state.master), (d.exp_avg, &mut state.exp_avg), (d.exp_avg_sq, &mut state.exp_avg_sq)]
        {
            let (ptr, bytes) = floats_mut_ptr(dst);
            driver::memcpy_dtoh_async(ptr, src, bytes, self.h2d.0)?;
        }
        self.noted(driver::stream_synchronize(self.h2d.0))
    }

    /// Publishes f32 weights at `src` into the model's parameter of `dev`.
    fn publish_from(&self, dev: &SgDevice, src: CUdeviceptr, src_dtype: DType) -> Result<()> {
        let stream = self.h2d.0;
        match (src_dtype, dev.param_dtype) {
            (s, p) if s == p => driver::memcpy_dtod_async(dev.param, src, dev.numel * s.size(), stream),
            (DType::F32, DType::Bf16) => self.kernels.convert(self.kernels.to_bf16, src, dev.param, dev.numel, stream),
            (DType::F32, DType::F16) => self.kernels.convert(self.kernels.to_f16, src, dev.param, dev.numel, stream),
            (s, p) => {
                Err(Error::unsupported(format!("cannot publish {} weights into {} parameters", s.name(), p.name())))
            }
        }
    }

    fn free_device_state(d: DeviceState) {
        for p in [d.master, d.exp_avg, d.exp_avg_sq, d.grad] {
            driver::mem_free(p);
        }
    }
}

/// Copy streams outlive the sessions that used them: callers `record_stream` them into
/// PyTorch's caching allocator, which records events on them whenever it later frees such
/// memory. So they are never destroyed; a later session on the same device reuses them.
static SPARE_STREAMS: Mutex<Vec<(i32, [Raw<CUstream>; 5])>> = Mutex::new(Vec::new());

fn take_streams(device: i32) -> Result<[Raw<CUstream>; 5]> {
    let mut spare = SPARE_STREAMS.lock().unwrap();
    if let Some(i) = spare.iter().position(|(d, _)| *d == device) {
        return Ok(spare.swap_remove(i).1);
    }
    Ok([
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
        Raw(driver::stream_create()?),
    ])
}

fn give_back_streams(device: i32, streams: [Raw<CUstream>; 5]) {
    SPARE_STREAMS.lock().unwrap().push((device, streams));
}

fn not_attached(sg: u32) -> Error {
    Error::new(Status::InvalidState, format!("sub-group {sg} has no device parameter attached"))
}

impl Transport for CudaTransport {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn pin(&self, ptr: *mut u8, bytes: usize) -> Result<()> {
        self.enter()?;
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
        // Staged weights are f32, or the session's low-precision copy when it keeps one.
        let staging_dtype = self.copy_dtype.unwrap_or(DType::F32);
        if staging_dtype != DType::F32 && staging_dtype != device.dtype {
            return Err(Error::unsupported(format!(
                "the session sends {} copies of the weights, which can only be published into {} parameters (this one is {})",
                staging_dtype.name(),
                staging_dtype.name(),
                device.dtype.name()
            )));
        }
        self.enter()?;
        let staging = driver::mem_alloc(numel * staging_dtype.size())?;
        let mut partial_offsets = Vec::with_capacity(slices.len());
        let mut total = 0;
        for r in slices {
            partial_offsets.push(total);
            total += r.len().div_ceil(SUMSQ_BLOCK);
        }
        let partials_dev = match driver::mem_alloc(total * 8) {
            Ok(p) => p,
            Err(e) => {
                driver::mem_free(staging);
                return Err(e);
            }
        };
        let mut partials_host = vec![0.0f64; total].into_boxed_slice();
        let registered = driver::host_register(partials_host.as_mut_ptr().cast(), total * 8);
        let mut dev = SgDevice {
            param: device.ptr,
            param_dtype: device.dtype,
            staging,
            staging_dtype,
            numel,
            slices: slices.to_vec(),
            partial_offsets,
            partials_dev,
            partials_host,
            sumsq_ready: vec![None; slices.len()],
            copies: Vec::new(),
            staged: None,
            published: None,
            device: None,
        };
        let placed = registered.and_then(|_| {
            if placement == Placement::Device {
                let d = self.device_state(numel, state.exp_avg.dtype())?;
                self.upload(&d, &mut state)?;
                dev.device = Some(d);
            }
            Ok(())
        });
        if let Err(e) = placed {
            driver::mem_free(dev.staging);
            driver::mem_free(dev.partials_dev);
            return Err(e);
        }
        self.state.lock().unwrap().subgroups.insert(sg, dev);
        Ok(())
    }

    fn detach(&self, sg: u32) {
        let _ = self.ctx.bind();
        let removed = self.state.lock().unwrap().subgroups.remove(&sg);
        if let Some(mut d) = removed {
            let mut events = std::mem::take(&mut d.copies);
            events.extend(d.staged.take());
            events.extend(d.published.take());
            events.extend(d.sumsq_ready.iter_mut().filter_map(Option::take));
            let _ = self.wait_and_free(events);
            let _ = driver::stream_synchronize(self.side.0);
            let _ = driver::stream_synchronize(self.stage.0);
            let _ = driver::stream_synchronize(self.h2d.0);
            release(d);
        }
    }

    fn gradient_ready(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let copies = {
            let mut state = self.state.lock().unwrap();
            state.subgroups.get_mut(&sg).map(|d| std::mem::take(&mut d.copies)).unwrap_or_default()
        };
        self.wait_and_free(copies)
    }

    fn gradient_landed(&self, sg: u32) -> bool {
        if self.enter().is_err() {
            return true;
        }
        let state = self.state.lock().unwrap();
        let Some(d) = state.subgroups.get(&sg) else { return true };
        // Newest first: a gradient still in flight is then usually found by one query.
        d.copies.iter().rev().chain(d.sumsq_ready.iter().flatten()).all(|e| driver::event_done(e.0).unwrap_or(true))
    }

    fn gradient_sumsq(&self, sg: u32, slice: usize) -> Result<f64> {
        self.enter()?;
        let ready = {
            let mut state = self.state.lock().unwrap();
            let dev = state.subgroups.get_mut(&sg).ok_or_else(|| not_attached(sg))?;
            dev.sumsq_ready[slice].take()
        }
        .ok_or_else(|| Error::new(Status::Panic, format!("sub-group {sg} slice {slice}: no sum of squares queued")))?;
        self.wait_and_free(vec![ready])?;
        let state = self.state.lock().unwrap();
        let dev = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        let (first, count) = (dev.partial_offsets[slice], dev.slices[slice].len().div_ceil(SUMSQ_BLOCK));
        // Block partials in block order, exactly as the CPU kernels add theirs.
        Ok(dev.partials_host[first..first + count].iter().sum())
    }

    fn master_write(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let staged = self.state.lock().unwrap().subgroups.get_mut(&sg).and_then(|d| d.staged.take());
        self.wait_and_free(staged.into_iter().collect())
    }

    fn weights_updated(&self, sg: u32, offset: usize, master: Floats<'_>, copy: Option<Floats<'_>>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let (staging, staging_dtype, numel) = {
            let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
            (d.staging, d.staging_dtype, d.numel)
        };
        let source = match copy {
            Some(c) if c.dtype() == staging_dtype => c,
            _ if master.dtype() == staging_dtype => master,
            _ => {
                return Err(Error::unsupported(format!(
                    "the session keeps no {} copy of the weights to publish",
                    staging_dtype.name()
                )));
            }
        };
        // The staging buffer is overwritten only after the previous publication read it (the
        // first piece of a pass waits; the rest follow it on the stream).
        if let Some(published) = state.subgroups.get_mut(&sg).expect("checked").published.take() {
            let waited = driver::stream_wait_event(self.stage.0, published.0);
            state.free_events.push(published);
            waited?;
        }
        let len = source.len();
        if offset + len > numel {
            return Err(Error::new(Status::Panic, format!("sub-group {sg}: staged elements beyond its end")));
        }
        let size = staging_dtype.size();
        driver::memcpy_htod_async(
            staging + (offset * size) as CUdeviceptr,
            floats_ptr(&source),
            len * size,
            self.stage.0,
        )?;
        let event = Self::event(&mut state)?;
        driver::event_record(event.0, self.stage.0)?;
        // The staging copies of a sub-group run in order on one stream: the newest event
        // covers the earlier ones, which can be reused at once.
        if let Some(previous) = state.subgroups.get_mut(&sg).expect("checked").staged.replace(event) {
            state.free_events.push(previous);
        }
        Ok(())
    }

    fn publish(&self, sg: u32) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        // The latest staging copy (if the host has not waited for it already) comes first.
        if let Some(staged) = &d.staged {
            driver::stream_wait_event(self.h2d.0, staged.0)?;
        }
        self.publish_from(d, d.staging, d.staging_dtype)?;
        let event = Self::event(&mut state)?;
        driver::event_record(event.0, self.h2d.0)?;
        if let Some(previous) = state.subgroups.get_mut(&sg).expect("checked").published.replace(event) {
            state.free_events.push(previous);
        }
        Ok(())
    }

    fn before_step(&self) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let Some(compute) = state.compute else { return Ok(()) };
        let event = Self::event(&mut state)?;
        driver::event_record(event.0, compute.0)?;
        driver::stream_wait_event(self.h2d.0, event.0)?;
        state.free_events.push(event);
        Ok(())
    }

    fn exposed_wait_s(&self) -> f64 {
        if self.ctx.bind().is_err() {
            return 0.0;
        }
        let mut state = self.state.lock().unwrap();
        let mut total = 0.0;
        let mut pending = Vec::new();
        for (before, after) in std::mem::take(&mut state.waits) {
            match driver::event_done(after.0) {
                Ok(false) => pending.push((before, after)),
                done => {
                    if done.is_ok() {
                        total += driver::event_elapsed_ms(before.0, after.0).map_or(0.0, |ms| ms as f64 * 1e-3);
                    }
                    state.free_timing.extend([before, after]);
                }
            }
        }
        state.waits = pending;
        total
    }

    fn after_load(&self) -> Result<()> {
        self.wait_published()
    }

    fn device_step(&self, sg: u32, hp: &AdamHyper, factor: f32) -> Result<()> {
        self.enter()?;
        let copies = {
            let mut state = self.state.lock().unwrap();
            let d = state.subgroups.get_mut(&sg).ok_or_else(|| not_attached(sg))?;
            std::mem::take(&mut d.copies)
        };
        let state = self.state.lock().unwrap();
        for e in &copies {
            driver::stream_wait_event(self.h2d.0, e.0)?;
        }
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        let dev = d.device.as_ref().ok_or_else(|| Error::new(Status::InvalidState, "not device-placed"))?;
        let (k, l2) = hp.device_constants();
        let (mut p, mut g, mut m, mut v, mut out) = (dev.master, dev.grad, dev.exp_avg, dev.exp_avg_sq, d.param);
        let mut n = d.numel as u64;
        let (mut gd, mut md, mut od) =
            (dtype_code(Some(self.accum_dtype)), dtype_code(Some(dev.moment_dtype)), dtype_code(Some(d.param_dtype)));
        let mut scale = factor;
        let [mut b1, mut omb1, mut b2, mut omb2, mut eps, mut sbc2, mut step, mut decay, mut wd] = k;
        let mut has_l2 = u32::from(l2);
        let blocks = d.numel.div_ceil(256).clamp(1, 132 * 16) as u32;
        let launched = self.kernels.launch(
            self.kernels.adam,
            blocks,
            256,
            self.h2d.0,
            &mut [
                &mut p,
                &mut g,
                &mut m,
                &mut v,
                &mut out,
                &mut n,
                &mut gd,
                &mut md,
                &mut od,
                &mut scale,
                &mut b1,
                &mut omb1,
                &mut b2,
                &mut omb2,
                &mut eps,
                &mut sbc2,
                &mut step,
                &mut decay,
                &mut wd,
                &mut has_l2,
            ],
        );
        drop(state);
        self.state.lock().unwrap().free_events.extend(copies);
        launched
    }

    fn device_zero_gradient(&self, sg: u32, range: Range<usize>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        let dev = d.device.as_ref().ok_or_else(|| Error::new(Status::InvalidState, "not device-placed"))?;
        let size = self.accum_dtype.size();
        driver::memset_async(dev.grad + (range.start * size) as u64, range.len() * size, self.side.0)?;
        let e = Self::event(&mut state)?;
        driver::event_record(e.0, self.side.0)?;
        state.subgroups.get_mut(&sg).expect("checked").copies.push(e);
        Ok(())
    }

    fn set_placement(&self, sg: u32, placement: Placement, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let mut state = self.state.lock().unwrap();
        let d = state.subgroups.get_mut(&sg).ok_or_else(|| not_attached(sg))?;
        match (placement, d.device.take()) {
            (Placement::Device, None) => {
                let dev = self.device_state(d.numel, host.exp_avg.dtype())?;
                if let Err(e) = self.upload(&dev, &mut host) {
                    Self::free_device_state(dev);
                    return Err(e);
                }
                d.device = Some(dev);
            }
            (Placement::Host, Some(dev)) => {
                let downloaded = self.download(&dev, &mut host);
                match downloaded {
                    Ok(()) => Self::free_device_state(dev),
                    Err(e) => {
                        d.device = Some(dev);
                        return Err(e);
                    }
                }
            }
            (_, kept) => d.device = kept,
        }
        Ok(())
    }

    fn download_state(&self, sg: u32, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let state = self.state.lock().unwrap();
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        match &d.device {
            Some(dev) => self.download(dev, &mut host),
            None => Ok(()),
        }
    }

    fn load_state(&self, sg: u32, mut host: HostState<'_>) -> Result<()> {
        self.enter()?;
        let state = self.state.lock().unwrap();
        let d = state.subgroups.get(&sg).ok_or_else(|| not_attached(sg))?;
        let dev = d.device.as_ref().ok_or_else(|| Error::new(Status::InvalidState, "not device-placed"))?;
        self.upload(dev, &mut host)?;
        self.publish_from(d, dev.master, DType::F32)
    }

    fn device_bytes(&self) -> usize {
        let state = self.state.lock().unwrap();
        state.subgroups.values().map(SgDevice::bytes).sum::<usize>()
    }
}

/// Frees a detached sub-group's device memory and unpins its partials.
fn release(mut d: SgDevice) {
    driver::mem_free(d.staging);
    driver::mem_free(d.partials_dev);
    if !d.partials_host.is_empty() {
        driver::host_unregister(d.partials_host.as_mut_ptr().cast());
    }
    if let Some(dev) = d.device.take() {
        CudaTransport::free_device_state(dev);
    }
    for e in d.copies.into_iter().chain(d.staged).chain(d.published).chain(d.sumsq_ready.into_iter().flatten()) {
        driver::event_destroy(e.0);
    }
}

impl Drop for CudaTransport {
    fn drop(&mut self) {
        if self.ctx.bind().is_err() {
            return;
        }
        for s in self.d2h.iter().chain([&self.h2d, &self.side, &self.stage]) {
            let _ = driver::stream_synchronize(s.0);
        }
        let state = std::mem::take(&mut *self.state.lock().unwrap());
        for (_, d) in state.subgroups {
            release(d);
        }
        for ptr in state.ours.keys() {
            driver::host_unregister(*ptr as *mut u8);
        }
        for e in state.free_events.into_iter().chain(state.free_timing) {
            driver::event_destroy(e.0);
        }
        for (a, b) in state.waits {
            driver::event_destroy(a.0);
            driver::event_destroy(b.0);
        }
        give_back_streams(self.device, [self.d2h[0], self.d2h[1], self.h2d, self.side, self.stage]);
    }
}
