//! The device side of each sub-group attached to the CUDA transport (its parameter, sums of
//! squares, the events of its queued work, a device-placed one's state, a gradient kept on
//! the device) and the transport's state under its lock.

use std::collections::HashMap;

use super::device_state::{DeviceState, Param};
use super::driver::{CUdeviceptr, CUstream, Raw};
use super::events::Event;
use super::memory::{DeviceBuffer, HostRegistration};
use super::partials::SumsqPartials;
use crate::error::{Error, Result, Status};
use crate::kernels::DType;

/// The device side of an attached sub-group.
pub(super) struct SgDevice {
    /// The model's parameter (caller-owned device memory).
    pub(super) param: CUdeviceptr,
    pub(super) param_dtype: DType,
    pub(super) numel: usize,
    pub(super) partials: SumsqPartials,
    /// Recorded after each gradient copy of this step (to the host, or into a device gradient).
    pub(super) copies: Vec<Event>,
    /// Recorded after the latest publication copy that reads the session's host memory (its
    /// copy or master weights): they are not written again before it is done.
    pub(super) publishing: Option<Event>,
    /// Recorded after the latest publication (or device step that published): what a stream
    /// waits for before reading this sub-group's parameter.
    pub(super) published: Option<Event>,
    /// Recorded after the latest device step, which reads the device gradient: the next
    /// gradient written there waits for it (a rolled-back step publishes nothing that the
    /// next backward would otherwise follow).
    pub(super) stepped: Option<Event>,
    pub(super) device: Option<DeviceState>,
    /// Whether a host-placed sub-group's gradient is kept on the device (`kept` holds it
    /// while the sub-group is host-placed; a device-placed one uses its state's).
    pub(super) keeps_gradient: bool,
    pub(super) kept: Option<DeviceBuffer>,
}

impl SgDevice {
    pub(super) fn bytes(&self) -> usize {
        self.partials.host_bytes()
            + self.device.as_ref().map_or(0, DeviceState::bytes)
            + self.kept.as_ref().map_or(0, DeviceBuffer::bytes)
    }

    pub(super) fn param(&self) -> Param {
        Param { ptr: self.param, dtype: self.param_dtype, numel: self.numel }
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
    pub(super) subgroups: HashMap<u32, SgDevice>,
    /// The session's buffers page-locked through `pin`, by address.
    pub(super) pins: HashMap<usize, HostRegistration>,
    pub(super) compute: Option<Raw<CUstream>>,
    /// Recorded on the compute stream at `step()`, until the step's first publication waits
    /// for it: the caller's backward may still read the parameters.
    pub(super) backward_queued: Option<Event>,
}

impl State {
    /// The device side of sub-group `sg`, or the error of one not attached.
    pub(super) fn attached(&self, sg: u32) -> Result<&SgDevice> {
        self.subgroups.get(&sg).ok_or_else(|| not_attached(sg))
    }

    pub(super) fn attached_mut(&mut self, sg: u32) -> Result<&mut SgDevice> {
        self.subgroups.get_mut(&sg).ok_or_else(|| not_attached(sg))
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
