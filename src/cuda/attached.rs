//! The device side of each sub-group attached to the CUDA transport (its parameter, sums of
//! squares, the events of its queued work, a device-placed one's state, a gradient kept on
//! the device) and the transport's state under its lock.

use std::collections::HashMap;
use std::sync::Arc;

use super::device_state::{DeviceState, Param};
use super::driver::{self, CUdeviceptr, CUstream, Kernel, Kernels, Raw};
use super::events::{Event, EventPool};
use super::memory::{DeviceBuffer, HostRegistration};
use super::partials::SumsqPartials;
use crate::error::{Error, Result, Status};
use crate::kernels::DType;
use crate::session::DeviceParam;

/// The device side of an attached sub-group.
pub(super) struct SgDevice {
    /// The model's parameter (caller-owned device memory).
    param: CUdeviceptr,
    param_dtype: DType,
    numel: usize,
    partials: SumsqPartials,
    /// Recorded after each gradient copy of this step (to the host, or into a device gradient).
    copies: Vec<Event>,
    /// Recorded after the latest publication copy that reads the session's host memory (its
    /// copy or master weights): they are not written again before it is done.
    publishing: Option<Event>,
    /// Recorded after the latest publication (or device step that published): what a stream
    /// waits for before reading this sub-group's parameter.
    published: Option<Event>,
    /// Recorded after the latest device step, which reads the device gradient: the next
    /// gradient written there waits for it (a rolled-back step publishes nothing that the
    /// next backward would otherwise follow).
    stepped: Option<Event>,
    device: Option<DeviceState>,
    /// Whether a host-placed sub-group's gradient is kept on the device (`kept` holds it
    /// while the sub-group is host-placed; a device-placed one uses its state's).
    keeps_gradient: bool,
    kept: Option<DeviceBuffer>,
}

impl SgDevice {
    /// A sub-group of `numel` elements published into `param`, its sums of squares summed in
    /// `partials`, its state on the device where `device` holds it.
    pub(super) fn new(
        param: DeviceParam,
        numel: usize,
        partials: SumsqPartials,
        device: Option<DeviceState>,
    ) -> SgDevice {
        SgDevice {
            param: param.ptr,
            param_dtype: param.dtype,
            numel,
            partials,
            copies: Vec::new(),
            publishing: None,
            published: None,
            stepped: None,
            device,
            keeps_gradient: false,
            kept: None,
        }
    }

    pub(super) fn bytes(&self) -> usize {
        self.partials.host_bytes()
            + self.device.as_ref().map_or(0, DeviceState::bytes)
            + self.kept.as_ref().map_or(0, DeviceBuffer::bytes)
    }

    pub(super) fn param(&self) -> Param {
        Param::new(self.param, self.param_dtype, self.numel)
    }

    /// The address of the parameter's element `offset`.
    pub(super) fn param_at(&self, offset: usize) -> CUdeviceptr {
        self.param + (offset * self.param_dtype.size()) as CUdeviceptr
    }

    pub(super) fn numel(&self) -> usize {
        self.numel
    }

    pub(super) fn param_dtype(&self) -> DType {
        self.param_dtype
    }

    /// The state of a device-placed sub-group.
    pub(super) fn device(&self) -> Option<&DeviceState> {
        self.device.as_ref()
    }

    pub(super) fn partials(&self) -> &SumsqPartials {
        &self.partials
    }

    pub(super) fn partials_mut(&mut self) -> &mut SumsqPartials {
        &mut self.partials
    }

    /// Where a gradient handed over lands on the device, `offset` bytes in: a device-placed
    /// sub-group's state, or the buffer a host-placed one keeps it in; `None`: the host.
    pub(super) fn device_gradient_at(&self, offset: usize) -> Option<CUdeviceptr> {
        match (&self.device, &self.kept) {
            (Some(state), _) => Some(state.grad_at(offset)),
            (None, Some(kept)) => Some(kept.at(offset)),
            (None, None) => None,
        }
    }

    /// Keeps a host-placed sub-group's gradient on the device, in a buffer of `accum_dtype`
    /// (a device-placed one's is in its state already).
    pub(super) fn keep_gradient(&mut self, accum_dtype: DType) -> Result<()> {
        if self.device.is_none() && self.kept.is_none() {
            self.kept = Some(DeviceBuffer::alloc(self.numel * accum_dtype.size())?);
        }
        self.keeps_gradient = true;
        Ok(())
    }

    /// Its state was uploaded to `state`: its state's gradient replaces the one kept for it
    /// (every pass that read that one waited for its copies).
    pub(super) fn placed_on_device(&mut self, state: DeviceState) {
        self.device = Some(state);
        self.kept = None;
    }

    /// A buffer of `accum_dtype` for the gradient it keeps on the device, if it keeps one, to
    /// be allocated before its state leaves the device.
    pub(super) fn gradient_buffer_to_keep(&self, accum_dtype: DType) -> Result<Option<DeviceBuffer>> {
        self.keeps_gradient.then(|| DeviceBuffer::alloc(self.numel * accum_dtype.size())).transpose()
    }

    /// Its state was downloaded to the host: the device state is freed, and the gradient it
    /// keeps on the device goes to `kept`.
    pub(super) fn placed_on_host(&mut self, kept: Option<DeviceBuffer>) {
        self.kept = kept;
        self.device = None;
    }

    /// Checks that elements `offset..offset + len` in `dtype` can be published into the parameter.
    pub(super) fn check_piece(&self, sg: u32, offset: usize, len: usize, dtype: DType) -> Result<()> {
        if dtype != self.param_dtype {
            return Err(Error::unsupported(format!(
                "sub-group {sg}: {} weights cannot be published into a {} parameter",
                dtype.name(),
                self.param_dtype.name()
            )));
        }
        if offset + len > self.numel {
            return Err(Error::new(Status::Panic, format!("sub-group {sg}: published elements beyond its end")));
        }
        Ok(())
    }

    /// Queues on `stream` the publication of the weights at `src` (in `src_dtype`) into the
    /// whole parameter, converted to its dtype.
    pub(super) fn publish_from(
        &self,
        kernels: &Kernels,
        src: CUdeviceptr,
        src_dtype: DType,
        stream: CUstream,
    ) -> Result<()> {
        let (dst, n) = (self.param, self.numel);
        match (src_dtype, self.param_dtype) {
            (s, p) if s == p => driver::memcpy_dtod_async(dst, src, n * s.size(), stream),
            (DType::F32, DType::Bf16) => kernels.convert(Kernel::ToBf16, src, dst, n, stream),
            (DType::F32, DType::F16) => kernels.convert(Kernel::ToF16, src, dst, n, stream),
            (s, p) => {
                Err(Error::unsupported(format!("cannot publish {} weights into {} parameters", s.name(), p.name())))
            }
        }
    }

    /// A gradient copy (or a zeroing of the device gradient) was queued; `copied` is
    /// recorded after it.
    pub(super) fn copy_queued(&mut self, copied: Event) {
        self.copies.push(copied);
    }

    /// Takes the events of this step's gradient copies (the caller waits for them).
    pub(super) fn take_copies(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.copies)
    }

    /// Whether its gradient copies and sums of squares have landed (a failed query counts
    /// as landed: the wait that follows reports it).
    pub(super) fn gradient_landed(&self) -> bool {
        // Newest first: a gradient still in flight is then usually found by one query.
        self.copies.iter().rev().chain(self.partials.pending()).all(|e| e.done().unwrap_or(true))
    }

    /// A publication copy reading the session's host memory was queued, `copied` recorded
    /// after it.
    pub(super) fn set_publishing(&mut self, copied: Event) {
        self.publishing = Some(copied);
    }

    /// Takes the event of the latest publication copy that reads the session's host memory.
    pub(super) fn take_publishing(&mut self) -> Option<Event> {
        self.publishing.take()
    }

    /// The event a stream waits for before reading the parameter.
    pub(super) fn published(&self) -> Option<&Event> {
        self.published.as_ref()
    }

    /// The latest publication (or device step that published) was queued, `done` recorded
    /// after it.
    pub(super) fn set_published(&mut self, done: Event) {
        self.published = Some(done);
    }

    /// The event the next gradient written into the device gradient waits for.
    pub(super) fn stepped(&self) -> Option<&Event> {
        self.stepped.as_ref()
    }

    /// The latest device step was queued, `done` recorded after it.
    pub(super) fn set_stepped(&mut self, done: Event) {
        self.stepped = Some(done);
    }

    /// Every event of work still queued for this sub-group.
    pub(super) fn take_events(&mut self) -> Vec<Event> {
        let mut events = std::mem::take(&mut self.copies);
        events.extend(self.publishing.take());
        events.extend(self.published.take());
        events.extend(self.stepped.take());
        events.extend(self.partials.take_pending());
        events
    }
}

#[derive(Default)]
pub(super) struct State {
    subgroups: HashMap<u32, SgDevice>,
    /// The session's buffers page-locked through `pin`, by address.
    pins: HashMap<usize, HostRegistration>,
    compute: Option<Raw<CUstream>>,
    /// Recorded on the compute stream at `step()`, until the step's first publication waits
    /// for it: the caller's backward may still read the parameters.
    backward_queued: Option<Event>,
}

impl State {
    /// The device side of sub-group `sg`, or the error of one not attached.
    pub(super) fn attached(&self, sg: u32) -> Result<&SgDevice> {
        self.subgroups.get(&sg).ok_or_else(|| not_attached(sg))
    }

    pub(super) fn attached_mut(&mut self, sg: u32) -> Result<&mut SgDevice> {
        self.subgroups.get_mut(&sg).ok_or_else(|| not_attached(sg))
    }

    /// The device side of sub-group `sg`, if it is attached.
    pub(super) fn get(&self, sg: u32) -> Option<&SgDevice> {
        self.subgroups.get(&sg)
    }

    pub(super) fn get_mut(&mut self, sg: u32) -> Option<&mut SgDevice> {
        self.subgroups.get_mut(&sg)
    }

    pub(super) fn attach(&mut self, sg: u32, dev: SgDevice) {
        self.subgroups.insert(sg, dev);
    }

    pub(super) fn detach(&mut self, sg: u32) -> Option<SgDevice> {
        self.subgroups.remove(&sg)
    }

    /// Device bytes the attached sub-groups hold.
    pub(super) fn device_bytes(&self) -> usize {
        self.subgroups.values().map(SgDevice::bytes).sum::<usize>()
    }

    /// Keeps the registration of the buffer at `ptr`; a range pinned twice keeps its first
    /// registration (the second found it registered).
    pub(super) fn keep_pin(&mut self, ptr: usize, registration: HostRegistration) {
        self.pins.entry(ptr).or_insert(registration);
    }

    /// Takes the registration of the buffer at `ptr`, if it is pinned.
    pub(super) fn take_pin(&mut self, ptr: usize) -> Option<HostRegistration> {
        self.pins.remove(&ptr)
    }

    /// Host bytes the session's pinned buffers hold.
    pub(super) fn pinned_bytes(&self) -> usize {
        self.pins.values().map(HostRegistration::pinned_bytes).sum::<usize>()
    }

    /// The caller's compute stream (borrowed), whose work a step's publication follows.
    pub(super) fn set_compute_stream(&mut self, stream: CUstream) {
        self.compute = Some(Raw(stream));
    }

    /// At `step()`: records, on the compute stream if one was set, the work the caller queued
    /// before it.
    pub(super) fn backward_queued(&mut self, events: &Arc<EventPool>) -> Result<()> {
        let Some(compute) = self.compute else { return Ok(()) };
        self.backward_queued = Some(events.record(compute.0)?);
        Ok(())
    }

    /// Makes the publication stream wait, once a step, for the work the caller queued before
    /// `step()`; device steps that publish nothing run before it, beside the backward.
    pub(super) fn publication_follows_backward(&mut self, h2d: CUstream) -> Result<()> {
        match self.backward_queued.take() {
            Some(e) => e.wait_in(h2d),
            None => Ok(()),
        }
    }
}

fn not_attached(sg: u32) -> Error {
    Error::new(Status::InvalidState, format!("sub-group {sg} has no device parameter attached"))
}

pub(super) fn not_device_placed() -> Error {
    Error::new(Status::InvalidState, "not device-placed")
}
