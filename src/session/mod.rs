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
//! The layout: [`registry`] (groups, slices, sub-groups, memory), [`provision`] (the buffers
//! beside the state, from the memory measured), [`protocol`] (the caller's side of a step), [`scheduler`] (the CPU-Adam thread, job priorities and each sub-group's
//! lifecycle), [`passes`] (the optimizer passes a job runs; [`publish`]: the weights to the device), [`policy`] (automatic
//! speculation and GPU split; [`state_after`]: which final passes publish the copy first),
//! [`tickets`], [`checkpoint`].

mod auto_budget;
mod buffers;
mod checkpoint;
mod finalize;
mod plans;
mod policy;
mod protocol;
mod provision;
mod publish;
mod registry;
mod scaler;
mod scheduler;
mod speculation;
mod state_after;
mod subgroup;
mod subgroup_ops;
mod tickets;
mod trace;
mod transport;
mod types;
mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

pub use buffers::Borrowed;
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
use crate::kernels::{AdamHyper, DType, Floats, Pool, PoolOptions};
use registry::Registry;
use scheduler::Scheduler;
pub(crate) use subgroup::{Applied, LateGrads, SgData, SgWork, SpecKind, SpecRecord, SubGroup, speculation_stands};
use tickets::Tickets;
use trace::Lane;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Phase {
    /// Between steps.
    Idle,
    /// Gradients arriving.
    Backward { micro: u32, micro_steps: u32 },
    /// `local_grad_sumsq` ran the preparation; only `step()` may follow.
    Prepared,
}

/// Everything under the session's caller lock: the registry and the step in progress.
pub(crate) struct Tracking {
    pub reg: Registry,
    pub phase: Phase,
    serial: u64,
    loss_scale: f32,
    /// Per slice: micro-step index + 1 of its latest gradient this step, 0 for none.
    slice_seen: Vec<u32>,
    /// Per sub-group: slices with a gradient in the last micro-step.
    slices_done: Vec<usize>,
    speculative: u32,
    late_gradients: u32,
    decide_ticket: Ticket,
    /// The callers' ticket-wait total at the previous `step()`.
    wait_mark_ns: u64,
}

impl Tracking {
    pub(crate) fn new(loss_scale: f32) -> Tracking {
        Tracking {
            reg: Registry::default(),
            phase: Phase::Idle,
            serial: 0,
            loss_scale,
            slice_seen: Vec::new(),
            slices_done: Vec::new(),
            speculative: 0,
            late_gradients: 0,
            decide_ticket: 0,
            wait_mark_ns: 0,
        }
    }

    /// A sub-group with `slices` slices was registered.
    pub(crate) fn subgroup_added(&mut self, slices: usize) {
        self.slice_seen.resize(self.slice_seen.len() + slices, 0);
        self.slices_done.push(0);
    }
}

/// What the CPU-Adam thread shares with the session's callers.
pub(crate) struct Shared {
    pub pool: Arc<Pool>,
    pub tickets: Tickets,
    pub scaler: Mutex<Option<LossScaler>>,
    pub last_result: Mutex<Option<(Ticket, StepResult)>>,
    /// The latest preparation's (serial, local sum of squares), for `local_grad_sumsq`.
    pub prepared: Mutex<Option<(u64, f64)>>,
    pub transport: Option<Arc<dyn Transport>>,
    pub tracer: trace::Tracer,
    pub sched: Scheduler,
    pub policy: Mutex<policy::Policy>,
    /// Nanoseconds callers spent waiting on tickets (the host-mode exposed time).
    pub caller_wait_ns: AtomicU64,
    /// The ticket the latest `step()` returned (0 before the first).
    pub step_ticket: AtomicU64,
}

impl Shared {
    pub(crate) fn transport(&self) -> Option<&dyn Transport> {
        self.transport.as_deref()
    }

    /// Whether sub-group `sg`'s gradient has landed ([`Transport::gradient_landed`]).
    pub(crate) fn gradient_landed(&self, sg: u32) -> bool {
        self.transport().is_none_or(|t| t.gradient_landed(sg))
    }

    /// Completes a ticket: the transport hears of it first, then the host side.
    pub(crate) fn complete(&self, ticket: Ticket, outcome: Result<()>) {
        if let (Some(t), Some(lane)) = (self.transport(), self.tickets.pending_lane(ticket)) {
            t.ticket_done(lane, ticket);
        }
        self.tickets.complete(ticket, outcome);
    }

    /// Waits for a ticket on behalf of a caller, counting the time as exposed.
    pub(crate) fn caller_wait(&self, ticket: Ticket, timeout: Option<Duration>, all: bool) -> Result<()> {
        let start = std::time::Instant::now();
        let outcome = self.tickets.wait(ticket, timeout, all);
        self.caller_wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }
}

/// An offload session.
///
/// Thread-safety: `Session` is `Send + Sync`; calls from several threads are serialised
/// on an internal lock held for the duration of each call (a gradient hand-off holds it
/// while it copies).
pub struct Session {
    options: SessionOptions,
    shared: Arc<Shared>,
    tracking: Mutex<Tracking>,
    worker: Option<JoinHandle<()>>,
}

fn state_error(message: impl Into<String>) -> Error {
    Error::new(Status::InvalidState, message)
}

fn validate_group(g: &GroupHparams) -> Result<()> {
    AdamHyper {
        lr: g.lr,
        beta1: g.beta1,
        beta2: g.beta2,
        eps: g.eps,
        weight_decay: g.weight_decay,
        ..Default::default()
    }
    .validate()
}

fn unknown(what: &str, id: u32) -> Error {
    Error::new(Status::NotFound, format!("no {what} has id {id}"))
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
        let shared = Arc::new(Shared {
            pool,
            tickets: Tickets::default(),
            scaler: Mutex::new(options.loss_scaler.map(LossScaler::new)),
            last_result: Mutex::new(None),
            prepared: Mutex::new(None),
            transport,
            tracer: trace::Tracer::new(),
            sched: Scheduler::default(),
            policy: Mutex::new(policy::Policy::new(options.speculation)),
            caller_wait_ns: AtomicU64::new(0),
            step_ticket: AtomicU64::new(0),
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
        let loss_scale = options.loss_scaler.map_or(1.0, |s| s.init_scale);
        Ok(Session { options, shared, tracking: Mutex::new(Tracking::new(loss_scale)), worker: Some(worker) })
    }

    pub fn options(&self) -> &SessionOptions {
        &self.options
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

    /// Starts recording a timeline (clearing an earlier one), or stops.
    pub fn trace(&self, enable: bool) {
        self.shared.tracer.set_enabled(enable);
    }

    /// Writes the recorded timeline as Chrome trace JSON (open it in Perfetto).
    pub fn save_trace(&self, path: &std::path::Path) -> Result<()> {
        self.shared.tracer.write(path)
    }
}

/// torch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`, 1 when
/// `max_norm` is 0.
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 { (max_norm / (norm + 1e-6)).min(1.0) } else { 1.0 }
}

/// The factor every gradient of a step is finally multiplied by: `clip / loss_scale`,
/// computed in f64 and rounded once. With `clip == 1` it is the unscale factor `1 / S` of the
/// speculative steps exactly, which is what lets a speculative step be kept.
pub fn grad_factor(clip: f64, loss_scale: f32) -> f32 {
    (clip / loss_scale as f64) as f32
}

/// The factor of a speculative step, and of every sum of squares taken at hand-over: the
/// unscaled gradient, `grad_factor(1, loss_scale)`.
pub fn unscale_factor(loss_scale: f32) -> f32 {
    grad_factor(1.0, loss_scale)
}

/// Whether a gradient factor can be stepped with: finite and > 0 in f32 (the kernels refuse
/// anything else).
pub fn usable_factor(factor: f32) -> bool {
    factor.is_finite() && factor > 0.0
}

/// A loss scale must be finite and > 0, and so must its reciprocal in f32, the unscale factor
/// of every sum of squares and speculative step (`1 / loss_scale` overflows for loss scales
/// below about 2.9e-39, subnormals of f32).
pub(crate) fn check_loss_scale(what: &str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 && usable_factor(unscale_factor(scale)) {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "{what} = {scale:e} is out of range: it must be finite and > 0, and 1 / {what} must be finite in f32"
        )))
    }
}

fn to_f32(values: Floats<'_>) -> Vec<f32> {
    match values {
        Floats::F32(v) => v.to_vec(),
        Floats::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        Floats::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
    }
}

impl Drop for Session {
    /// Waits for every queued step, then stops the CPU-Adam thread and releases what the
    /// transport holds.
    fn drop(&mut self) {
        let mut t = self.tracking.lock().unwrap_or_else(|e| e.into_inner());
        self.shared.sched.close();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        self.release_all(&mut t);
    }
}
