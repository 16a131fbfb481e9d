//! The [`Transport`] trait: how gradients and weights move between the session's host buffers
//! and a device, and what a hand-off delivers.

use std::any::Any;
use std::ops::Range;

use super::{DeviceParam, Placement, Ticket};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamHyper, Floats};

/// Where an arriving gradient goes: a slice's range of the sub-group's gradient buffer
/// (or, after the sub-group completed, of its late-gradient buffer).
pub struct HandOff<'a> {
    pub sg: u32,
    /// The slice's index within its sub-group.
    pub slice: usize,
    /// The slice's elements within the sub-group.
    pub range: Range<usize>,
    pub dst: kernels::FloatsMut<'a>,
    /// Add to what is there (a later micro-step, or a repeated gradient), else overwrite.
    pub accumulate: bool,
    pub late: bool,
    /// At the last micro-step: the sum of squares of `scale · gradient` (as accumulated) is
    /// wanted, returned by the delivery or, when it is computed elsewhere (on the device),
    /// later by [`Transport::gradient_sumsq`].
    pub sumsq_scale: Option<f32>,
}

/// A sum of squares of a slice's gradient, as the hand-off left it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HandedSumsq {
    /// Computed during the hand-off.
    Known(f64),
    /// Being computed by the transport: ask [`Transport::gradient_sumsq`].
    Deferred,
}

/// One pass of a device-placed sub-group's final step: the CPU kernels' operation sequence of
/// [`kernels::update`], [`kernels::rollback`] or [`kernels::rescale`], so that a sub-group
/// writes the same bits on the device as on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DevicePass {
    Update { hp: AdamHyper, scale: f32 },
    Rollback { hp: AdamHyper, scale: f32 },
    Rescale { hp: AdamHyper, old_scale: f32, new_scale: f32 },
}

/// Host views of a sub-group's state, for a transport that keeps it on the device.
pub struct HostState<'a> {
    pub master: kernels::FloatsMut<'a>,
    pub exp_avg: kernels::FloatsMut<'a>,
    pub exp_avg_sq: kernels::FloatsMut<'a>,
}

/// How gradients and weights move between the session's host buffers and the device the
/// model lives on. Host mode has none; the CUDA transport implements it.
///
/// Threads: `pin`, `unpin`, `attach`, `detach`, `before_step`, `after_load`,
/// `set_placement`, `load_state`, `download_state` run on the calling thread (under the
/// session's registry lock); the hand-off closure runs on the calling thread; every other
/// hook runs on the CPU-Adam thread. See ARCHITECTURE.md for the lock order.
pub trait Transport: Send + Sync + Any {
    fn as_any(&self) -> &dyn Any;
    /// Page-locks a host buffer the session will copy to or from (in place).
    fn pin(&self, ptr: *mut u8, bytes: usize) -> Result<()>;
    /// Undoes `pin`, when the buffer is freed or no longer borrowed.
    fn unpin(&self, ptr: *mut u8);
    /// A sub-group is being registered (its slices' ranges given): connect it to `device`
    /// and, with [`Placement::Device`], take its state onto the device from `state`.
    fn attach(
        &self,
        _sg: u32,
        _device: Option<DeviceParam>,
        _slices: &[Range<usize>],
        placement: Placement,
        _state: HostState<'_>,
    ) -> Result<()> {
        no_device(placement == Placement::Host)
    }
    /// `sg` is being removed: finish everything that touches its buffers.
    fn detach(&self, _sg: u32) {}
    /// Before sub-group `sg`'s gradient (or late gradients) are read: wait for their copies.
    fn gradient_ready(&self, sg: u32) -> Result<()>;
    /// Whether sub-group `sg`'s gradient copies and deferred sums of squares have landed,
    /// without waiting: the CPU-Adam thread takes no job that would block on the device
    /// while another could run. On a fault: `true` (the job runs and reports it).
    fn gradient_landed(&self, _sg: u32) -> bool {
        true
    }
    /// The sum of squares of a slice's gradient whose hand-off left it [`HandedSumsq::Deferred`].
    fn gradient_sumsq(&self, _sg: u32, _slice: usize) -> Result<f64> {
        Err(Error::new(Status::Panic, "this transport defers no sums of squares"))
    }
    /// Before the master weights (or their copy) of `sg` are modified: wait until nothing
    /// still reads them.
    fn master_write(&self, sg: u32) -> Result<()>;
    /// `sg`'s master weights from element `offset` on changed (its low-precision copy too,
    /// when the session keeps one): `master` and `copy` hold those elements. Stage them for
    /// the device, not yet visible to the model. A pass may report its sub-group piece by
    /// piece, so that staging copies overlap the rest of the pass. Where the session keeps a
    /// copy, the copy is what the device is given: a speculative pass may write it ahead of
    /// the master weights (`master` then still holds the previous step's weights).
    fn weights_updated(&self, sg: u32, offset: usize, master: Floats<'_>, copy: Option<Floats<'_>>) -> Result<()>;
    /// `sg` is final for this step: make the staged weights the model's.
    fn publish(&self, sg: u32) -> Result<()>;
    /// `ticket` of `lane` completes (after its work and any `publish` of it; within a lane, in
    /// issue order).
    fn ticket_done(&self, _lane: u32, _ticket: Ticket) {}
    /// `step()` (or a checkpoint load) was called: what is published from now on must follow
    /// the work the caller has queued so far.
    fn before_step(&self) -> Result<()> {
        Ok(())
    }
    /// Seconds the device waited on tickets since the previous call (exposed optimizer time).
    fn exposed_wait_s(&self) -> f64 {
        0.0
    }
    /// A checkpoint was loaded and republished: return once the device sees it.
    fn after_load(&self) -> Result<()> {
        Ok(())
    }
    /// Queues `passes` over a device-placed sub-group's state (its gradient is on the device),
    /// in order: its speculative update at hand-off, or its final passes. With `publish`, the
    /// weights the last pass writes (with no passes: the state's weights) become the model's.
    fn device_step(&self, _sg: u32, _passes: &[DevicePass], _publish: bool) -> Result<()> {
        no_device(false)
    }
    /// Zeroes part of a device-placed sub-group's gradient (a slice that got none).
    fn device_zero_gradient(&self, _sg: u32, _range: Range<usize>) -> Result<()> {
        no_device(false)
    }
    /// Moves a sub-group's state between host (`state`) and device, bit for bit.
    fn set_placement(&self, _sg: u32, placement: Placement, _state: HostState<'_>) -> Result<()> {
        no_device(placement == Placement::Host)
    }
    /// Copies a device-placed sub-group's state into `state` (for a checkpoint).
    fn download_state(&self, _sg: u32, _state: HostState<'_>) -> Result<()> {
        no_device(false)
    }
    /// Overwrites a device-placed sub-group's state from `state` (a checkpoint load).
    fn load_state(&self, _sg: u32, _state: HostState<'_>) -> Result<()> {
        no_device(false)
    }
    /// Device bytes this transport allocated.
    fn device_bytes(&self) -> usize {
        0
    }
    /// Device bytes per element a host-placed sub-group holds and a device-placed one gives
    /// back (where a host-stepped sub-group's weights wait for publication).
    fn host_placed_device_bytes_per_element(&self) -> usize {
        0
    }
    /// The device's free and total memory in bytes, as the driver reports them now (what
    /// the automatic GPU budget is taken from).
    fn device_memory(&self) -> Result<(usize, usize)> {
        Err(Error::unsupported("this transport has no device memory to measure"))
    }
}

/// The answer of a transport without device-side state.
fn no_device(ok: bool) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::unsupported("this transport cannot keep sub-groups on a device")) }
}
