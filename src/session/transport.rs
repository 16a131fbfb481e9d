//! The [`Transport`] trait: how gradients and weights move between the session's host buffers
//! and a device, and what a hand-off delivers.

use std::any::Any;
use std::ops::Range;

use super::tickets::Ticket;
use super::types::{DeviceParam, Placement};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamHyper, DType, Floats};

/// Where an arriving gradient goes: a slice's range of the sub-group's gradient buffer
/// (or, after the sub-group completed, of its late-gradient buffer).
pub struct HandOff<'a> {
    pub sg: u32,
    /// The slice's index within its sub-group.
    pub slice: usize,
    /// The slice's elements within the sub-group.
    pub range: Range<usize>,
    /// The host place of the gradient; `None` where the transport keeps it on the device (a
    /// device-placed sub-group, or [`Transport::keep_gradient_on_device`]).
    pub dst: Option<kernels::FloatsMut<'a>>,
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
    /// still reads them (a publication copying them to the device).
    fn master_write(&self, sg: u32) -> Result<()>;
    /// Queues elements `offset..offset + src.len()` of `sg`'s new weights, read from host
    /// memory the session leaves unchanged until its next `master_write` for `sg` (its copy or
    /// its master weights, in the device parameter's dtype), into the model's parameter,
    /// behind what the caller queued before `step()` (which may still read the parameter).
    fn publish_piece(&self, sg: u32, offset: usize, src: Floats<'_>) -> Result<()>;
    /// Like `publish_piece`, for a sub-group that keeps no host copy in the parameter's dtype:
    /// `fill` writes the `len` elements (in `dtype`, the parameter's) into a bounded buffer of
    /// the transport's, which is then copied. A bounded number of pieces are in flight.
    fn publish_filled(
        &self,
        sg: u32,
        offset: usize,
        len: usize,
        dtype: DType,
        fill: &mut dyn FnMut(kernels::FloatsMut<'_>) -> Result<()>,
    ) -> Result<()>;
    /// Every piece of `sg`'s weights for this step is queued: what waits for its final ticket
    /// waits for them.
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
    /// Keeps a host-placed sub-group's gradient on the device from now on: hand-offs deliver
    /// it there (`HandOff::dst` is `None`) and the session reads it with `gradient_pieces`.
    fn keep_gradient_on_device(&self, _sg: u32) -> Result<()> {
        no_device(false)
    }
    /// Copies elements `range` of a gradient kept on the device to the host in pieces of at
    /// most `piece` elements, calling `f(first element, piece)` for each in order; the
    /// copies of the next pieces are in flight while `f` runs. Call after `gradient_ready`.
    fn gradient_pieces(
        &self,
        _sg: u32,
        _range: Range<usize>,
        _piece: usize,
        _f: &mut dyn FnMut(usize, Floats<'_>) -> Result<()>,
    ) -> Result<()> {
        no_device(false)
    }
    /// Zeroes part of a gradient on the device, a device-placed sub-group's or one kept there
    /// (a slice that got none).
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
