//! The offload session: parameter sub-groups whose Adam state lives in host memory (or, for
//! the first sub-groups in forward order, in device memory), stepped on a dedicated CPU-Adam
//! thread in the order the next forward needs them, and made exact at `step()`.
//!
//! Transport-agnostic: gradients arrive as host slices ("host mode") or through a
//! [`Transport`] (the CUDA one lives in `crate::cuda`).
//!
//! Protocol of one optimizer step, from the caller's side:
//! 1. `begin_step(loss_scale, micro_steps)`;
//! 2. gradients of named param slices (`grad_copy` / `grad_written` / a transport's hand-off),
//!    `next_micro_step` between micro-steps. The sum of squares of each slice's gradient is
//!    taken as it is handed over, so the global norm is known as soon as the last gradient
//!    exists. When the last micro-step completes a sub-group, a speculative step (scale
//!    `1/S`) may be queued for it (see [`Speculation`]) and its ticket returned;
//! 3. optionally `local_grad_sumsq` (for an all-reduce across ranks);
//! 4. `step(max_norm, norm, overflow)`: returns at once with a ticket. The CPU-Adam thread
//!    decides (norm, skip, clip factor) before anything else, cancels the speculative steps
//!    that had not started, then finalizes the sub-groups in forward order, each with one
//!    exact pass where possible, publishing each as soon as its own pass ends.
//!
//! The layout: this file is the façade, [`Session`], which holds the session's parts and
//! hands each call to the one that does it: [`registry`] (groups, slices, sub-groups, memory;
//! [`provision`]: the buffers beside the state, from the memory measured), [`protocol`] (the
//! caller's side of a step), [`checkpoint`]. Beneath them [`shared`] (the options and what
//! the CPU-Adam thread shares with the callers), [`worker`] (the CPU-Adam thread, over
//! [`speculation`] and [`finalize`]; [`scheduler`]: job priorities and each sub-group's
//! lifecycle; [`publish`]: the weights to the device), [`policy`] (automatic speculation and
//! GPU split; [`state_after`]: which final passes publish the copy first), [`tickets`], and
//! the vocabulary every part speaks: [`types`], [`subgroup`], [`transport`], [`factors`].

mod auto_budget;
mod buffers;
mod checkpoint;
mod factors;
mod finalize;
mod plans;
mod policy;
mod protocol;
mod provision;
mod publish;
mod registry;
mod scaler;
mod scheduler;
mod shared;
mod speculation;
mod state_after;
mod subgroup;
mod subgroup_ops;
mod tickets;
mod trace;
mod transport;
mod types;
mod worker;

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use buffers::Borrowed;
pub use factors::{clip_coefficient, grad_factor, unscale_factor, usable_factor};
pub use provision::{HostMemory, MemoryBound};
pub use registry::SubGroupState;
pub use scaler::{LossScaler, LossScalerOptions};
pub use tickets::{STEP_LANE, Ticket, TicketState, subgroup_lane};
pub use transport::{DevicePass, HandOff, HandedSumsq, HostState, Transport};
pub use types::{
    DeviceParam, GradientHome, GroupHparams, HostCopy, NormSource, Placement, SessionOptions, SkipReason, SliceDesc,
    Speculation, StepArgs, StepResult, SubGroupDesc,
};

use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats, FloatsMut, Pool, PoolOptions};
use policy::Policy;
use protocol::Protocol;
use registry::Registry;
use scheduler::Scheduler;
use shared::Shared;
use tickets::Tickets;
use trace::{Lane, Tracer};

/// Everything under the session's caller lock: the registry and the step in progress.
struct Tracking {
    reg: Registry,
    protocol: Protocol,
}

/// An offload session.
///
/// Thread-safety: `Session` is `Send + Sync`; calls from several threads are serialised
/// on an internal lock held for the duration of each call (a gradient hand-off holds it
/// while it copies).
pub struct Session {
    shared: Arc<Shared>,
    tracking: Mutex<Tracking>,
    worker: Option<JoinHandle<()>>,
}

impl Session {
    /// A host-mode session.
    pub fn new(options: SessionOptions) -> Result<Session> {
        Session::with_transport(options, None)
    }

    /// A session whose gradients and weights move through `transport`.
    pub fn with_transport(options: SessionOptions, transport: Option<Arc<dyn Transport>>) -> Result<Session> {
        if options.amsgrad {
            return Err(Error::unsupported(
                "AMSGrad is not supported: its running maximum of v cannot be rolled back, so \
                 speculative steps could not be made exact",
            ));
        }
        if options.moment_dtype == DType::F16 {
            return Err(Error::unsupported("moments must be f32 or bf16"));
        }
        if let Some(s) = &options.loss_scaler {
            s.validate()?;
        }
        if options.copy_dtype == Some(DType::F32) {
            return Err(Error::unsupported("the master-weight copy must be bf16 or f16"));
        }
        if options.gpu_budget_bytes > 0 && transport.is_none() {
            return Err(Error::unsupported("gpu_budget_bytes needs a CUDA session (host sessions have no device)"));
        }
        let pool = match (&options.pool, &options.cores) {
            (Some(_), Some(_)) => return Err(Error::invalid("give a pool or a core list, not both")),
            (Some(pool), None) => pool.clone(),
            (None, Some(cores)) => {
                Arc::new(Pool::new(&PoolOptions { cores: Some(cores.clone()), ..Default::default() })?)
            }
            (None, None) => Pool::default_pool()?,
        };
        let loss_scale = options.loss_scaler.map_or(1.0, |s| s.init_scale);
        let shared = Arc::new(Shared {
            pool,
            tickets: Tickets::default(),
            scaler: Mutex::new(options.loss_scaler.map(LossScaler::new)),
            last_result: Mutex::new(None),
            prepared: Mutex::new(None),
            transport,
            tracer: Tracer::new(),
            sched: Scheduler::default(),
            policy: Mutex::new(Policy::new(options.speculation)),
            caller_wait_ns: AtomicU64::new(0),
            step_ticket: AtomicU64::new(0),
            options,
        });
        let worker_shared = shared.clone();
        let worker = std::thread::Builder::new()
            .name("superoffload-adam".into())
            .spawn(move || {
                // The CPU-Adam thread runs where the pool runs, not on the training thread's
                // core (which it would inherit); failing to pin costs speed, not correctness.
                if let Some(cores) = worker_shared.pool.cores() {
                    let _ = crate::kernels::pool::pin_current_thread_to(cores);
                }
                worker::run_thread(worker_shared)
            })
            .map_err(|e| Error::new(Status::OutOfResources, format!("cannot start the CPU-Adam thread: {e}")))?;
        let tracking = Tracking { reg: Registry::default(), protocol: Protocol::new(loss_scale) };
        Ok(Session { shared, tracking: Mutex::new(tracking), worker: Some(worker) })
    }

    pub fn options(&self) -> &SessionOptions {
        &self.shared.options
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    /// The transport, as its concrete type (e.g. `crate::cuda::CudaTransport`).
    pub fn transport_as<T: Transport>(&self) -> Option<&T> {
        self.shared.transport().and_then(|t| t.as_any().downcast_ref::<T>())
    }

    fn lock(&self) -> MutexGuard<'_, Tracking> {
        self.tracking.lock().unwrap()
    }

    // ----- groups and sub-groups (`registry.rs`) ------------------------------------------

    pub fn add_group(&self, hparams: GroupHparams) -> Result<u32> {
        hparams.validate()?;
        Ok(self.lock().reg.add_group(hparams))
    }

    /// New hyperparameters for a group: speculative steps submitted from now on, and every
    /// sub-group's final step at the next `step()`, use them.
    pub fn set_group_hparams(&self, group: u32, hparams: GroupHparams) -> Result<()> {
        hparams.validate()?;
        self.lock().reg.set_group(group, hparams)
    }

    pub fn group_hparams(&self, group: u32) -> Result<GroupHparams> {
        self.lock().reg.group(group)
    }

    /// Registers a sub-group (between steps). Sub-groups are finalized at `step()` in the
    /// order they were registered: register them in forward order.
    pub fn add_subgroup(&self, desc: SubGroupDesc) -> Result<u32> {
        let mut guard = self.lock();
        let t = &mut *guard;
        t.protocol.between_steps("sub-groups can only be added between steps (before begin_step or after step)")?;
        let slices = desc.slices.len();
        let id = t.reg.add_subgroup(desc, &self.shared)?;
        t.protocol.subgroup_added(slices);
        Ok(id)
    }

    /// Unregisters a sub-group (between steps), after its outstanding work; its borrowed
    /// buffers are no longer used when this returns.
    pub fn remove_subgroup(&self, sg: u32) -> Result<()> {
        let mut t = self.lock();
        t.protocol.between_steps("sub-groups can only be removed between steps")?;
        t.reg.remove_subgroup(sg, &self.shared)
    }

    /// The slice id of a name.
    pub fn slice_id(&self, name: &str) -> Result<u32> {
        self.lock().reg.slice_id(name)
    }

    /// Host bytes the session allocated (moments, gradient buffers, copies, late gradients).
    pub fn host_bytes(&self) -> usize {
        self.lock().reg.host_bytes()
    }

    /// Device bytes the transport allocated (0 in host mode).
    pub fn device_bytes(&self) -> usize {
        self.shared.transport().map_or(0, |t| t.device_bytes())
    }

    /// The ticket that completes when the sub-group's latest step is final (0 before its
    /// first `step()`).
    pub fn final_ticket(&self, sg: u32) -> Result<Ticket> {
        self.lock().reg.final_ticket(sg)
    }

    /// Waits until the sub-group's latest decided step has written its master weights and
    /// moments: its final ticket, then the state pass that final pass left, if any. From then
    /// on the session no longer reads the sub-group's gradient buffer, so a caller that lent
    /// it may write the next step's gradient there. `Timeout` if `timeout` passes first.
    pub fn wait_settled(&self, sg: u32, timeout: Option<Duration>) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let final_ticket = self.final_ticket(sg)?;
        let _span = self.shared.tracer.span(Lane::Caller, || format!("wait for sub-group {sg} to settle"));
        if final_ticket != 0 {
            self.shared.caller_wait(final_ticket, timeout, false)?;
        }
        self.shared.caller_wait_settled(sg, deadline)
    }

    /// Copies a slice's master weights into `out` (one element per element of the slice,
    /// rounded to nearest even where `out` is narrower) once its sub-group's latest step is
    /// final: waits for that sub-group's final ticket alone, not for the sub-groups after it.
    /// The weights a forward reads next, for a caller whose parameters are apart from the
    /// master weights (the XLA handlers). Host sessions without a lent copy only: a session
    /// with a device transport publishes to the device, and one that writes the caller's copy
    /// first writes the master weights after the final ticket.
    pub fn read_slice_weights(&self, slice: u32, out: FloatsMut<'_>) -> Result<()> {
        if self.shared.transport().is_some() {
            return Err(Error::unsupported(
                "a session with a device transport publishes its weights to the device: read them there",
            ));
        }
        let (sg, range, final_ticket) = {
            let t = self.lock();
            let info = t.reg.slice(slice, Some(out.len()))?;
            let track = t.reg.track(info.sg)?;
            (Arc::clone(track.sg()), info.range.clone(), track.final_ticket())
        };
        self.wait(final_ticket, None)?;
        let data = sg.data.lock().unwrap();
        if data.copy.as_ref().is_some_and(|c| !c.is_owned()) {
            return Err(Error::unsupported("the sub-group's weights are the caller's copy: read them there"));
        }
        crate::kernels::copy_into(out, data.master.range(range), false, None).map(drop)
    }

    /// Whether a step has begun and not yet been given to `step()`.
    pub fn step_in_progress(&self) -> bool {
        self.lock().protocol.in_step()
    }

    /// The sub-group whose latest final ticket `ticket` is, if any: a wait for it needs that
    /// sub-group's publication alone.
    pub fn final_ticket_of(&self, ticket: Ticket) -> Option<u32> {
        self.lock().reg.final_ticket_of(ticket)
    }

    /// Steps the sub-group has taken (skipped steps do not count). Read it after the
    /// sub-group's final ticket for the count after a step.
    pub fn step_count(&self, sg: u32) -> Result<u64> {
        self.lock().reg.step_count(sg)
    }

    /// Sets a sub-group's step count (between steps), e.g. after writing its state from a
    /// torch-style optimizer state dict.
    pub fn set_step_count(&self, sg: u32, count: u64) -> Result<()> {
        let t = self.lock();
        t.protocol.between_steps("step counts are set between steps")?;
        t.reg.set_step_count(sg, count, &self.shared)
    }

    /// Copies of a sub-group's moments, as f32 (waits for its outstanding work first).
    pub fn moments(&self, sg: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        self.lock().reg.moments(sg, &self.shared)
    }

    /// A sub-group's state buffers (see [`SubGroupState`]), after its outstanding work.
    pub fn subgroup_state(&self, sg: u32) -> Result<SubGroupState> {
        self.lock().reg.subgroup_state(sg, &self.shared)
    }

    /// Moves a sub-group's master weights and moments to `placement` (between steps), bit
    /// for bit; its host buffers hold the state whenever it is on the host.
    pub fn set_placement(&self, sg: u32, placement: Placement) -> Result<()> {
        let t = self.lock();
        t.protocol.between_steps("placement changes between steps")?;
        t.reg.place(sg, placement, &self.shared)
    }

    /// Sub-groups placed on the device.
    pub fn device_subgroups(&self) -> u32 {
        self.lock().reg.device_subgroups()
    }

    // ----- the step (`protocol.rs`) -------------------------------------------------------

    /// Starts an optimizer step whose backward uses `loss_scale` (`None`: the built-in
    /// scaler's current scale, or 1 without one) and `micro_steps` micro-steps.
    ///
    /// With the built-in scaler this waits for the previous step's decision, which sets
    /// the scale. With `gpu_budget_bytes`, the automatic split is applied here once enough
    /// steps were measured (and the automatic budget chosen, once the warm-up steps ran).
    pub fn begin_step(&self, loss_scale: Option<f32>, micro_steps: u32) -> Result<()> {
        let mut guard = self.lock();
        let t = &mut *guard;
        t.protocol.begin_step(&mut t.reg, &self.shared, loss_scale, micro_steps)
    }

    /// Limits the free device memory the automatic budget counts on to `limit` bytes (`None`:
    /// the device's free memory, the default), for a caller whose allocator works under a cap
    /// the device does not show, such as PyTorch's per-process memory fraction: give the cap
    /// less what the caller's allocator and this session hold on the device. It takes effect
    /// when the budget is measured, after the warm-up steps; a chosen budget stays.
    pub fn limit_device_memory(&self, limit: Option<usize>) {
        self.shared.policy.lock().unwrap().limit_device_memory(limit);
    }

    /// Fixes how many elements of a step that does not speculate publish the weights' copy
    /// before writing the master weights and moments (a prefix of the final passes in forward
    /// order; `None`: all), in place of the measured choice (`state_after.rs`), so that tests
    /// can compare layouts. The layout changes which passes run, never the bits.
    #[cfg(feature = "fault-injection")]
    pub fn force_state_after(&self, limit: Option<usize>) {
        self.shared.policy.lock().unwrap().force_state_after(limit);
    }

    /// The budget of the automatic split in bytes: `gpu_budget_bytes` as given, or the one
    /// the automatic budget chose (`None` until the warm-up steps have run).
    pub fn gpu_budget(&self) -> Option<usize> {
        match self.shared.options.gpu_budget_bytes {
            SessionOptions::GPU_BUDGET_AUTO => self.shared.policy.lock().unwrap().auto_budget().map(|b| b.budget),
            bytes => Some(bytes),
        }
    }

    /// The built-in loss scaler's current scale (after the latest step's verdict, which this
    /// waits for), or 1 without a scaler: what `begin_step(None, ..)` will use.
    pub fn loss_scale(&self) -> f32 {
        let decide = self.lock().protocol.decide_ticket();
        self.shared.loss_scale_after(decide)
    }

    pub fn next_micro_step(&self) -> Result<()> {
        self.lock().protocol.next_micro_step()
    }

    /// Copies (micro-step 1) or adds (later micro-steps, repeated hooks) a slice's gradient
    /// into its sub-group's gradient buffer, in the accumulation dtype, taking its sum of
    /// squares in the same pass at the last micro-step. Returns the ticket of the speculative
    /// step queued if this completed the sub-group. A gradient for a sub-group that already
    /// completed is kept aside; the sub-group is redone at `step()`.
    pub fn grad_copy(&self, slice: u32, src: Floats<'_>) -> Result<Option<Ticket>> {
        protocol::check_gradient_dtype(&self.shared.options, src.dtype())?;
        self.hand_off(slice, src.len(), "grad_copy", |h| protocol::copy_gradient(h, src))
    }

    /// A gradient arrives that `deliver` writes (or starts writing: a transport may copy
    /// asynchronously, as long as its `gradient_ready` waits for the copy) into the place
    /// the session gives it, returning its sum of squares when asked for one (or
    /// [`HandedSumsq::Deferred`]). Completion and tickets as [`Session::grad_copy`].
    pub fn hand_off(
        &self,
        slice: u32,
        numel: usize,
        what: &str,
        deliver: impl FnOnce(HandOff<'_>) -> Result<Option<HandedSumsq>>,
    ) -> Result<Option<Ticket>> {
        let mut guard = self.lock();
        let t = &mut *guard;
        t.protocol.hand_off(&mut t.reg, &self.shared, slice, numel, what, deliver)
    }

    /// Records that the caller wrote a slice's gradient (accumulated, for later
    /// micro-steps) directly into its sub-group's caller-provided gradient buffer. At the last
    /// micro-step its sum of squares is taken on the calling thread, unless the sub-group
    /// speculates: then its speculative step takes it on the pool.
    pub fn grad_written(&self, slice: u32) -> Result<Option<Ticket>> {
        let mut guard = self.lock();
        let t = &mut *guard;
        t.protocol.grad_written(&t.reg, &self.shared, slice)
    }

    /// The sum of squares of this step's unscaled gradient over every sub-group (zeros for
    /// slices without a gradient, late gradients merged), for an all-reduce across ranks.
    /// Ends the backward (gradients after this are refused). Not finite iff a gradient
    /// element is inf or NaN. Waits only for the sums of squares (and late-gradient merges),
    /// never for a speculative pass.
    pub fn local_grad_sumsq(&self, timeout: Option<Duration>) -> Result<f64> {
        let (serial, ticket) = {
            let mut guard = self.lock();
            let t = &mut *guard;
            t.protocol.prepare(&t.reg, &self.shared)?
        };
        protocol::local_sumsq(&self.shared, serial, ticket, timeout)
    }

    /// Ends the step: the CPU-Adam thread takes the norm (or the given one), decides whether
    /// to skip, clips, cancels speculative steps that have not started and makes every
    /// sub-group exact in forward order. Returns at once with the ticket that completes when
    /// every sub-group is final.
    pub fn step(&self, args: StepArgs) -> Result<Ticket> {
        protocol::check_step_args(&args)?;
        let mut guard = self.lock();
        let t = &mut *guard;
        t.protocol.step(&mut t.reg, &self.shared, args)
    }

    /// The result of the step whose ticket `step()` returned (the latest step's only),
    /// waiting up to `timeout` for it. Any other ticket (an earlier step's, a speculative
    /// step's or a final pass's, failed or not) is NOT_FOUND at once, without waiting.
    pub fn step_result(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<StepResult> {
        let not_found = || {
            Error::new(
                Status::NotFound,
                format!(
                    "ticket {ticket} is not the ticket of the latest step; results are kept for the latest step only"
                ),
            )
        };
        if ticket == 0 || ticket != self.shared.step_ticket.load(Ordering::Acquire) {
            // A ticket never issued says so.
            self.shared.tickets.state(ticket)?;
            return Err(not_found());
        }
        let span = self.shared.tracer.span(Lane::Caller, || format!("wait for step ticket {ticket}"));
        self.shared.caller_wait(ticket, timeout, false)?;
        drop(span);
        match *self.shared.last_result.lock().unwrap() {
            Some((t, result)) if t == ticket => Ok(result),
            _ => Err(not_found()),
        }
    }

    // ----- tickets ------------------------------------------------------------------

    pub fn ticket_state(&self, ticket: Ticket) -> Result<TicketState> {
        if ticket == 0 {
            return Ok(TicketState::Done);
        }
        self.shared.tickets.state(ticket)
    }

    /// Waits for `ticket` alone (0 is always done); its own error, if it failed.
    pub fn wait(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<()> {
        if ticket == 0 {
            return Ok(());
        }
        let _span = self.shared.tracer.span(Lane::Caller, || format!("wait for ticket {ticket}"));
        self.shared.caller_wait(ticket, timeout, false)
    }

    /// Waits for `ticket` before a stream wait on it (`so_ticket_enqueue_wait`). Not counted
    /// as the caller's wait: the host runs ahead of the GPU here, and the GPU itself times
    /// the idle time the wait causes. Its outcome is the caller's to read on the host.
    pub(crate) fn wait_for_stream(&self, ticket: Ticket) {
        let _span = self.shared.tracer.span(Lane::Caller, || format!("wait for ticket {ticket} (stream)"));
        let _ = self.shared.tickets.wait(ticket, None, false);
    }

    /// Waits for every ticket issued up to `ticket`; the first error among them, if any failed.
    pub fn wait_all(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<()> {
        if ticket == 0 {
            return Ok(());
        }
        self.shared.caller_wait(ticket, timeout, true)
    }

    pub fn last_ticket(&self) -> Ticket {
        self.shared.tickets.last_issued()
    }

    // ----- checkpoints (`checkpoint.rs`) and the trace ---------------------------------------

    /// Writes a checkpoint of everything needed to resume bit for bit. Waits for in-flight
    /// work; only between steps.
    pub fn save(&self, path: &Path) -> Result<()> {
        let t = self.lock();
        t.protocol.between_steps("checkpoints are taken between steps (after step(), before begin_step)")?;
        checkpoint::save(path, &t.reg, &self.shared)
    }

    /// Loads a checkpoint into this session: every registered slice must be in it (with
    /// its dtype and size) and vice versa; the sub-group partition may differ. On any
    /// mismatch or corruption nothing changes. With a transport, the loaded weights are also
    /// published to the model. Waits for in-flight work; only between steps.
    pub fn load(&self, path: &Path) -> Result<()> {
        let mut t = self.lock();
        t.protocol.between_steps("checkpoints are loaded between steps")?;
        checkpoint::load(path, &mut t.reg, &self.shared)
    }

    /// The factor history [`Speculation::Auto`] decides from, for a state dict that is not a
    /// checkpoint file: bit `i` of the first value is 1 when the `i`-th of the last steps
    /// (oldest first; the second value counts them, at most 8) kept its speculative factor
    /// (not clipped, not skipped). A checkpoint file keeps it by itself.
    pub fn speculation_history(&self) -> (u32, u32) {
        let _t = self.lock();
        // The latest step's decision is part of it.
        self.shared.tickets.drain();
        self.shared.policy.lock().unwrap().history_bits()
    }

    /// Restores what [`Session::speculation_history`] returned, between steps. Refuses more
    /// steps than the history keeps, or bits beyond them, and then changes nothing.
    pub fn set_speculation_history(&self, bits: u32, steps: u32) -> Result<()> {
        let t = self.lock();
        t.protocol.between_steps("the speculation history is restored between steps")?;
        self.shared.policy.lock().unwrap().restore_history_bits(bits, steps)
    }

    /// Starts recording a timeline (clearing an earlier one), or stops.
    pub fn trace(&self, enable: bool) {
        self.shared.tracer.set_enabled(enable);
    }

    /// Writes the recorded timeline as Chrome trace JSON (open it in Perfetto).
    pub fn save_trace(&self, path: &Path) -> Result<()> {
        self.shared.tracer.write(path)
    }
}

impl Drop for Session {
    /// Waits for every queued step, then stops the CPU-Adam thread and releases what the
    /// transport holds.
    fn drop(&mut self) {
        let t = self.tracking.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.sched.close();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        t.reg.release_all(&self.shared);
    }
}
