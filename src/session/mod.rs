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
//! The layout: [`registry`] (groups, slices, sub-groups, memory), [`protocol`] (the caller's
//! side of a step), [`scheduler`] (the CPU-Adam thread, job priorities and each sub-group's
//! lifecycle), [`passes`] (the optimizer passes a job runs), [`policy`] (automatic
//! speculation and GPU split), [`tickets`], [`checkpoint`].

mod buffers;
mod checkpoint;
mod passes;
mod policy;
mod protocol;
mod registry;
mod scaler;
mod scheduler;
mod tickets;
mod trace;

use std::any::Any;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

pub use buffers::Borrowed;
pub use registry::SubGroupState;
pub use scaler::{LossScaler, LossScalerOptions};
pub use tickets::{STEP_LANE, Ticket, TicketState, subgroup_lane};

use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamHyper, AdamMode, DType, Floats, Pool, PoolOptions};
use buffers::HostBuf;
use protocol::Tracking;
use scheduler::Scheduler;
use tickets::Tickets;
use trace::Lane;

/// Hyperparameters of a param group; changeable at any time.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupHparams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for GroupHparams {
    /// `torch.optim.AdamW`'s defaults.
    fn default() -> Self {
        let d = AdamHyper::default();
        GroupHparams { lr: d.lr, beta1: d.beta1, beta2: d.beta2, eps: d.eps, weight_decay: d.weight_decay }
    }
}

/// Whether sub-groups are stepped during backward, before `step()` knows the clip factor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Speculation {
    /// Every sub-group is stepped once, after `step()` decides.
    Off,
    /// Every sub-group that can speculate does, as soon as its gradient is complete.
    On,
    /// Decided per step from what earlier steps measured (see `policy.rs`): speculate while
    /// the clip factor mostly stayed unchanged.
    #[default]
    Auto,
}

/// Where a sub-group's master weights and moments live and are stepped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Host memory, stepped by the CPU kernels.
    #[default]
    Host,
    /// Device memory, stepped by the transport's device kernel (CUDA sessions).
    Device,
}

/// How a session is set up.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Pool for the optimizer passes; `None` with `cores` builds one pinned to them, with
    /// neither the process-wide default pool is used.
    pub pool: Option<Arc<Pool>>,
    pub cores: Option<Vec<usize>>,
    pub mode: AdamMode,
    pub bias_correction: bool,
    /// dtype of both moments: f32, or bf16 (then nothing speculates: rollback needs f32).
    pub moment_dtype: DType,
    /// dtype of the gradients handed over.
    pub grad_dtype: DType,
    /// dtype of the sub-group gradient buffers, where micro-steps accumulate.
    pub accum_dtype: DType,
    pub speculation: Speculation,
    /// Host bytes the session may allocate (moments, gradient buffers, the low-precision
    /// copy, late-gradient buffers); `None` for no limit.
    pub host_memory_limit: Option<usize>,
    /// Rejected: AMSGrad keeps a running maximum that no rollback can undo.
    pub amsgrad: bool,
    /// Built-in dynamic loss scaler (fp16).
    pub loss_scaler: Option<LossScalerOptions>,
    /// Keep a bf16 or f16 copy of each sub-group's master weights, written in the same pass
    /// as every update (what a transport can send to the device at half the bytes).
    pub copy_dtype: Option<DType>,
    /// Automatic split: device bytes the session may use to keep the first sub-groups in
    /// forward order on the device, chosen after a few measured steps (`policy.rs`); 0: off.
    pub gpu_budget_bytes: usize,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            pool: None,
            cores: None,
            mode: AdamMode::AdamW,
            bias_correction: true,
            moment_dtype: DType::F32,
            grad_dtype: DType::F32,
            accum_dtype: DType::F32,
            speculation: Speculation::Auto,
            host_memory_limit: None,
            amsgrad: false,
            loss_scaler: None,
            copy_dtype: None,
            gpu_budget_bytes: 0,
        }
    }
}

/// A named slice of a sub-group: a parameter whose gradient arrives as one piece.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceDesc {
    pub name: String,
    pub offset: usize,
    pub numel: usize,
}

/// The model's parameter on the device that a sub-group's updated weights are published to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceParam {
    /// Device address of `numel` elements of `dtype`.
    pub ptr: u64,
    pub dtype: DType,
}

/// A sub-group to register.
#[derive(Clone, Debug)]
pub struct SubGroupDesc {
    pub group: u32,
    /// The master weights (f32 for speculation; bf16 or f16 are stepped at `step()` only).
    pub master: Borrowed,
    /// A caller-provided gradient buffer in `accum_dtype` (else the session allocates one).
    pub grad: Option<Borrowed>,
    /// Caller-provided moment buffers in `moment_dtype` (else the session allocates them).
    pub exp_avg: Option<Borrowed>,
    pub exp_avg_sq: Option<Borrowed>,
    pub slices: Vec<SliceDesc>,
    /// With a transport: the model's parameter the weights are published to.
    pub device: Option<DeviceParam>,
    pub placement: Placement,
}

impl SubGroupDesc {
    /// A host sub-group of `master` with session-allocated buffers.
    pub fn new(group: u32, master: Borrowed, slices: Vec<SliceDesc>) -> SubGroupDesc {
        SubGroupDesc {
            group,
            master,
            grad: None,
            exp_avg: None,
            exp_avg_sq: None,
            slices,
            device: None,
            placement: Placement::Host,
        }
    }
}

/// Where `step()` takes the global gradient norm from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormSource {
    /// The square root of the sums of squares taken as gradients were handed over.
    Local,
    /// A norm the caller computed (e.g. all-reduced across ranks); inf/NaN skips the step.
    Given(f64),
}

/// What `step()` is told.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepArgs {
    /// Clip the global norm to this (torch's `clip_grad_norm_`); 0 disables clipping.
    pub max_norm: f64,
    pub norm: NormSource,
    /// The caller saw an overflow (e.g. on another rank): skip the step.
    pub overflow: bool,
}

/// The outcome of one optimizer step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepResult {
    /// 1 for the first step of the session, then one more per `begin_step`.
    pub serial: u64,
    pub skipped: bool,
    /// Of the unscaled gradient (inf or NaN when a gradient element was).
    pub global_norm: f64,
    pub clip_coef: f64,
    /// The factor every gradient was finally stepped with: `clip_coef / loss_scale`.
    pub grad_factor: f32,
    /// The loss scale this step's backward used.
    pub loss_scale: f32,
    /// The loss scale for the next step (the built-in scaler's verdict, else unchanged).
    pub next_loss_scale: f32,
    /// Speculative steps queued during backward.
    pub speculative: u32,
    /// Gradients that arrived for a sub-group after it was complete.
    pub late_gradients: u32,
    /// Speculative steps kept as they were (same factor), possibly completed by a pass over
    /// the part that a preempted speculative pass had not reached.
    pub kept: u32,
    pub rescaled: u32,
    pub rolled_back: u32,
    /// Speculative steps undone and taken again (late gradient, changed hyperparameters).
    pub redone: u32,
    /// Sub-groups stepped once, at finalization, with no speculative step applied.
    pub stepped: u32,
    /// Why the step was skipped ([`SkipReason::None`] when it was not).
    pub skip_reason: SkipReason,
    /// Speculative steps that had not started at `step()`: cancelled, and their sub-groups
    /// stepped once with the exact factor (counted in `stepped` too).
    pub cancelled: u32,
    /// Sub-groups stepped on the device (device placement).
    pub device_stepped: u32,
    /// Elements the optimizer passes touched after `step()` was called (each pass over a
    /// sub-group counts its elements): the work left after backward before the weights are
    /// final (a moments pass after publication is not counted).
    pub final_pass_elements: u64,
    /// Seconds the compute stream (CUDA) or the calling threads (host mode) waited on this
    /// session's tickets between the previous `step()` and this one: the optimizer time the
    /// previous step left exposed.
    pub forward_wait_s: f64,
    /// Sub-groups placed on the device during this step.
    pub device_subgroups: u32,
}

/// Why a step was skipped: nothing was stepped, every speculative step was rolled back and
/// step counts are unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SkipReason {
    /// Not skipped.
    #[default]
    None,
    /// The caller reported an overflow (`StepArgs::overflow`).
    Overflow,
    /// A gradient element was inf or NaN (the local norm then reports it).
    NonFiniteGradient,
    /// The caller-given global norm was inf or NaN.
    NonFiniteNorm,
    /// `clip / loss_scale` rounds to 0 or overflows in f32, so no gradient can be stepped
    /// with it (e.g. a `max_norm` below f32's range).
    UnusableFactor,
}

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
    /// piece, so that staging copies overlap the rest of the pass.
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
    /// Steps a device-placed sub-group (its gradient is on the device) and publishes it.
    fn device_step(&self, _sg: u32, _hp: &AdamHyper, _factor: f32) -> Result<()> {
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
}

/// The answer of a transport without device-side state.
fn no_device(ok: bool) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::unsupported("this transport cannot keep sub-groups on a device")) }
}

/// Gradients that arrived after the sub-group completed.
pub(crate) struct LateGrads {
    pub buffer: HostBuf,
    pub ranges: Vec<Range<usize>>,
}

/// A speculative step as applied to elements `[0, done)` of a sub-group: what a rescale or
/// rollback must use, and where a preempted pass stopped.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpecRecord {
    pub hp: AdamHyper,
    pub scale: f32,
    pub done: usize,
}

/// The optimizer-side state of a sub-group (under its data lock).
#[derive(Default)]
pub(crate) struct SgWork {
    pub step_count: u64,
    /// The speculative step currently applied to the master weights and moments.
    pub spec: Option<SpecRecord>,
    /// The speculative step was undone for a late gradient and must be taken again.
    pub redo: bool,
}

/// The buffers of a sub-group, owned by whoever holds the lock: the CPU-Adam thread while
/// it steps the sub-group, the caller while it hands a gradient over.
pub(crate) struct SgData {
    pub master: HostBuf,
    pub exp_avg: HostBuf,
    pub exp_avg_sq: HostBuf,
    pub grad: HostBuf,
    /// Low-precision copy of the master weights, written by every pass that changes them.
    pub copy: Option<HostBuf>,
    pub work: SgWork,
    /// Per slice (in sub-group order): the sum of squares of this step's gradient, once
    /// handed over at the last micro-step.
    pub sumsq: Vec<Option<HandedSumsq>>,
    pub placement: Placement,
}

impl SgData {
    pub(crate) fn host_state(&mut self) -> HostState<'_> {
        HostState {
            master: self.master.floats_mut(),
            exp_avg: self.exp_avg.floats_mut(),
            exp_avg_sq: self.exp_avg_sq.floats_mut(),
        }
    }
}

pub(crate) struct SubGroup {
    pub id: u32,
    pub group: u32,
    pub numel: usize,
    /// The ranges of its slices within it, in slice order.
    pub slices: Vec<Range<usize>>,
    mode: AdamMode,
    bias_correction: bool,
    speculative_dtypes: bool,
    pub data: Mutex<SgData>,
    pub late: Mutex<Option<LateGrads>>,
}

impl SubGroup {
    pub(crate) fn hyper(&self, g: GroupHparams, step: u64) -> AdamHyper {
        AdamHyper {
            mode: self.mode,
            lr: g.lr,
            beta1: g.beta1,
            beta2: g.beta2,
            eps: g.eps,
            weight_decay: g.weight_decay,
            bias_correction: self.bias_correction,
            step,
        }
    }

    /// Rollback needs f32 master weights and moments, nonzero betas and an invertible decay.
    fn can_speculate(&self, g: GroupHparams) -> bool {
        self.speculative_dtypes && g.beta1 > 0.0 && g.beta2 > 0.0 && self.hyper(g, 1).decay_factor() > 0.0
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
                scheduler::run(worker_shared)
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
