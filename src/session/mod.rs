//! The offload session: parameter sub-groups whose Adam state lives in host memory, stepped
//! speculatively on a dedicated CPU-Adam thread as soon as their gradients are complete,
//! and made exact at `step()` (rescale for clipping, rollback for a skipped step, rollback
//! and redo for late gradients or changed hyperparameters).
//!
//! Transport-agnostic: gradients arrive as host slices ("host mode").
//!
//! Protocol of one optimizer step, from the caller's side:
//! 1. `begin_step(loss_scale, micro_steps)`;
//! 2. gradients of named param slices (`grad_copy` / `grad_written`), `next_micro_step`
//!    between micro-steps; when the last micro-step completes a sub-group, its speculative
//!    step (scale `1/S`) is queued and a ticket returned;
//! 3. optionally `local_grad_sumsq` (for an all-reduce across ranks);
//! 4. `step(max_norm, norm, overflow)`: returns at once with a ticket; the CPU-Adam thread
//!    decides and finalizes each sub-group in forward (registration) order, completing its
//!    final ticket, then the step ticket.

mod buffers;
mod checkpoint;
mod scaler;
mod tickets;
mod trace;
mod worker;

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

pub use buffers::Borrowed;
pub use scaler::{LossScaler, LossScalerOptions};
pub use tickets::{Ticket, TicketState};

use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamHyper, AdamMode, DType, Floats, Pool, PoolOptions};
use buffers::HostBuf;
use tickets::Tickets;
use trace::Lane;
use worker::{FinalizePlan, Job, JobQueue, PrepareEntry, PreparePlan, SgWork, WorkerShared};

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
    /// Step sub-groups during backward.
    pub speculation: bool,
    /// Host bytes the session may allocate (moments, gradient buffers); `None` for no limit.
    pub host_memory_limit: Option<usize>,
    /// Rejected: AMSGrad keeps a running maximum that no rollback can undo.
    pub amsgrad: bool,
    /// Built-in dynamic loss scaler (fp16).
    pub loss_scaler: Option<LossScalerOptions>,
    /// Keep a bf16 or f16 copy of each sub-group's master weights, written in the same pass
    /// as every update (what a transport can send to the device at half the bytes).
    pub copy_dtype: Option<DType>,
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
            speculation: true,
            host_memory_limit: None,
            amsgrad: false,
            loss_scaler: None,
            copy_dtype: None,
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

/// A sub-group to register.
#[derive(Clone, Debug)]
pub struct SubGroupDesc {
    pub group: u32,
    /// The master weights (f32 for speculation; bf16 or f16 are stepped at `step()` only).
    pub master: Borrowed,
    /// A caller-provided gradient buffer in `accum_dtype` (else the session allocates one).
    pub grad: Option<Borrowed>,
    pub slices: Vec<SliceDesc>,
}

/// Where `step()` takes the global gradient norm from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormSource {
    /// The square root of the sums of squares gathered in this session's passes.
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
    /// Of the unscaled gradient.
    pub global_norm: f64,
    pub clip_coef: f64,
    /// The factor every gradient was finally stepped with: `clip_coef / loss_scale`.
    pub grad_factor: f32,
    /// The loss scale this step's backward used.
    pub loss_scale: f32,
    /// The loss scale for the next step (the built-in scaler's verdict, else unchanged).
    pub next_loss_scale: f32,
    /// Speculative steps submitted during backward.
    pub speculative: u32,
    /// Gradients that arrived for a sub-group after its speculative step.
    pub late_gradients: u32,
    /// Speculative steps kept as they were (same factor).
    pub kept: u32,
    pub rescaled: u32,
    pub rolled_back: u32,
    /// Speculative steps undone and taken again (late gradient, changed hyperparameters).
    pub redone: u32,
    /// Sub-groups stepped at `step()` without speculation.
    pub stepped: u32,
    /// Why the step was skipped ([`SkipReason::None`] when it was not).
    pub skip_reason: SkipReason,
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
    pub dst: kernels::FloatsMut<'a>,
    /// Add to what is there (a later micro-step, or a repeated gradient), else overwrite.
    pub accumulate: bool,
    pub late: bool,
}

/// How gradients and weights move between the session's host buffers and the device the
/// model lives on. Host mode has none; the CUDA transport implements it. Every hook but
/// `pin`/`unpin` runs on the CPU-Adam thread, in ticket order.
pub trait Transport: Send + Sync {
    /// Page-locks a host buffer the session will copy to or from (in place).
    fn pin(&self, ptr: *mut u8, bytes: usize) -> Result<()>;
    /// Undoes `pin`, when the buffer is freed or no longer borrowed.
    fn unpin(&self, ptr: *mut u8);
    /// Before sub-group `sg`'s gradient (or late gradients) are read: wait for their copies.
    fn gradient_ready(&self, sg: u32) -> Result<()>;
    /// Before the master weights (or their copy) of `sg` are modified: wait until nothing
    /// still reads them.
    fn master_write(&self, sg: u32) -> Result<()>;
    /// `sg`'s master weights changed (its low-precision copy too, when the session keeps one):
    /// stage them for the device, not yet visible to the model.
    fn weights_updated(&self, sg: u32, master: Floats<'_>, copy: Option<Floats<'_>>) -> Result<()>;
    /// `sg` is final for this step: make the staged weights the model's.
    fn publish(&self, sg: u32) -> Result<()>;
    /// `ticket` completes (after its work and any `publish` of it).
    fn ticket_done(&self, ticket: Ticket);
    /// `sg` is being removed: finish everything that touches its buffers.
    fn subgroup_removed(&self, sg: u32);
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
}

/// Gradients that arrived after the sub-group's speculative step.
pub(crate) struct LateGrads {
    pub buffer: HostBuf,
    pub ranges: Vec<Range<usize>>,
}

pub(crate) struct SubGroup {
    pub id: u32,
    pub group: u32,
    pub numel: usize,
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

struct SliceInfo {
    name: String,
    sg: u32,
    range: Range<usize>,
}

struct SgTrack {
    sg: Arc<SubGroup>,
    slices: Range<usize>,
    /// Slices with a gradient in the last micro-step.
    slices_done: usize,
    submitted: bool,
    final_ticket: Ticket,
    /// Borrowed address ranges (master, gradient), for overlap checks.
    borrowed: Vec<Range<usize>>,
    host_bytes: usize,
    /// Host buffers the transport pinned for this sub-group (addresses).
    pinned: Vec<usize>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Between steps.
    Idle,
    /// Gradients arriving.
    Backward { micro: u32, micro_steps: u32 },
    /// `local_grad_sumsq` ran the preparation; only `step()` may follow.
    Prepared { ticket: Ticket },
}

struct Tracking {
    phase: Phase,
    serial: u64,
    loss_scale: f32,
    groups: Vec<GroupHparams>,
    slices: Vec<SliceInfo>,
    names: HashMap<String, u32>,
    /// Per slice: micro-step index + 1 of its latest gradient this step, 0 for none.
    slice_seen: Vec<u32>,
    subgroups: Vec<Option<SgTrack>>,
    host_bytes: usize,
    speculative: u32,
    late_gradients: u32,
    decide_ticket: Ticket,
    step_ticket: Ticket,
}

/// An offload session.
///
/// Thread-safety: `Session` is `Send + Sync`; calls from several threads are serialised
/// on an internal lock held for the duration of each call (a gradient hand-off holds it
/// while it copies).
pub struct Session {
    options: SessionOptions,
    shared: Arc<WorkerShared>,
    transport: Option<Arc<dyn Transport>>,
    jobs: Arc<JobQueue>,
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
        let pool = match (&options.pool, &options.cores) {
            (Some(_), Some(_)) => return Err(Error::invalid("give a pool or a core list, not both")),
            (Some(pool), None) => pool.clone(),
            (None, Some(cores)) => {
                Arc::new(Pool::new(&PoolOptions { cores: Some(cores.clone()), ..Default::default() })?)
            }
            (None, None) => Pool::default_pool()?,
        };
        let shared = Arc::new(WorkerShared {
            pool,
            tickets: Tickets::default(),
            scaler: Mutex::new(options.loss_scaler.map(LossScaler::new)),
            last_result: Mutex::new(None),
            transport: transport.clone(),
            tracer: trace::Tracer::new(),
        });
        let jobs = Arc::new(JobQueue::default());
        jobs.reserve(16);
        let (worker_shared, worker_jobs) = (shared.clone(), jobs.clone());
        let worker = std::thread::Builder::new()
            .name("superoffload-adam".into())
            .spawn(move || {
                // The CPU-Adam thread runs where the pool runs, not on the training thread's
                // core (which it would inherit); failing to pin costs speed, not correctness.
                if let Some(cores) = worker_shared.pool.cores() {
                    let _ = crate::kernels::pool::pin_current_thread_to(cores);
                }
                worker::run(worker_shared, worker_jobs)
            })
            .map_err(|e| Error::new(Status::OutOfResources, format!("cannot start the CPU-Adam thread: {e}")))?;
        let loss_scale = options.loss_scaler.map_or(1.0, |s| s.init_scale);
        Ok(Session {
            options,
            shared,
            transport,
            jobs,
            tracking: Mutex::new(Tracking {
                phase: Phase::Idle,
                serial: 0,
                loss_scale,
                groups: Vec::new(),
                slices: Vec::new(),
                names: HashMap::new(),
                slice_seen: Vec::new(),
                subgroups: Vec::new(),
                host_bytes: 0,
                speculative: 0,
                late_gradients: 0,
                decide_ticket: 0,
                step_ticket: 0,
            }),
            worker: Some(worker),
        })
    }

    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.shared.pool
    }

    fn lock(&self) -> MutexGuard<'_, Tracking> {
        self.tracking.lock().unwrap()
    }

    fn send(&self, job: Job) {
        self.jobs.push(job);
    }

    // ----- groups and sub-groups -----------------------------------------------------

    pub fn add_group(&self, hparams: GroupHparams) -> Result<u32> {
        validate_group(&hparams)?;
        let mut t = self.lock();
        t.groups.push(hparams);
        Ok(t.groups.len() as u32 - 1)
    }

    /// New hyperparameters for a group: speculative steps submitted from now on, and every
    /// sub-group's final step at the next `step()`, use them.
    pub fn set_group_hparams(&self, group: u32, hparams: GroupHparams) -> Result<()> {
        validate_group(&hparams)?;
        let mut t = self.lock();
        let slot = t.groups.get_mut(group as usize).ok_or_else(|| unknown("group", group))?;
        *slot = hparams;
        Ok(())
    }

    pub fn group_hparams(&self, group: u32) -> Result<GroupHparams> {
        self.lock().groups.get(group as usize).copied().ok_or_else(|| unknown("group", group))
    }

    /// Registers a sub-group (between steps). Sub-groups are finalized at `step()` in the
    /// order they were registered: register them in forward order.
    pub fn add_subgroup(&self, desc: SubGroupDesc) -> Result<u32> {
        let mut t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("sub-groups can only be added between steps (before begin_step or after step)"));
        }
        if desc.group as usize >= t.groups.len() {
            return Err(unknown("group", desc.group));
        }
        let master = HostBuf::borrowed(desc.master);
        let numel = master.len();
        if numel == 0 {
            return Err(Error::invalid("the master buffer has 0 elements"));
        }
        let grad = match desc.grad {
            Some(g) => {
                let g = HostBuf::borrowed(g);
                if g.dtype() != self.options.accum_dtype || g.len() != numel {
                    return Err(Error::invalid(format!(
                        "the gradient buffer must hold {numel} elements of {} (the accumulation dtype); it has {} of {}",
                        self.options.accum_dtype.name(),
                        g.len(),
                        g.dtype().name()
                    )));
                }
                Some(g)
            }
            None => None,
        };
        check_slices(&desc.slices, numel, &t.names)?;
        let mut borrowed = vec![master.addr_range()];
        borrowed.extend(grad.as_ref().map(HostBuf::addr_range));
        check_no_overlap(&borrowed, &t.subgroups)?;

        let moment_bytes = 2 * numel * self.options.moment_dtype.size();
        let grad_bytes = if grad.is_none() { numel * self.options.accum_dtype.size() } else { 0 };
        let copy_bytes = self.options.copy_dtype.map_or(0, |d| numel * d.size());
        let host_bytes = moment_bytes + grad_bytes + copy_bytes;
        self.check_memory(t.host_bytes, host_bytes)?;
        let what = "sub-group state";
        let mut data = SgData {
            exp_avg: HostBuf::zeros(self.options.moment_dtype, numel, what)?,
            exp_avg_sq: HostBuf::zeros(self.options.moment_dtype, numel, what)?,
            grad: match grad {
                Some(g) => g,
                None => HostBuf::zeros(self.options.accum_dtype, numel, "a gradient buffer")?,
            },
            copy: self.options.copy_dtype.map(|d| HostBuf::zeros(d, numel, "a master-weight copy")).transpose()?,
            master,
            work: SgWork::default(),
        };
        let pinned = self.pin_all(&mut data)?;
        let id = t.subgroups.len() as u32;
        let speculative_dtypes = data.master.dtype() == DType::F32 && self.options.moment_dtype == DType::F32;
        let sg = Arc::new(SubGroup {
            id,
            group: desc.group,
            numel,
            mode: self.options.mode,
            bias_correction: self.options.bias_correction,
            speculative_dtypes,
            data: Mutex::new(data),
            late: Mutex::new(None),
        });
        let first = t.slices.len();
        for s in &desc.slices {
            let index = t.slices.len() as u32;
            t.names.insert(s.name.clone(), index);
            t.slices.push(SliceInfo { name: s.name.clone(), sg: id, range: s.offset..s.offset + s.numel });
            t.slice_seen.push(0);
        }
        t.host_bytes += host_bytes;
        let slices = first..t.slices.len();
        // A step queues at most one job per sub-group before its finalization.
        self.jobs.reserve(2 * (t.subgroups.len() + 1) + 8);
        t.subgroups.push(Some(SgTrack {
            sg,
            slices,
            slices_done: 0,
            submitted: false,
            final_ticket: 0,
            borrowed,
            host_bytes,
            pinned,
        }));
        Ok(id)
    }

    /// Unregisters a sub-group (between steps), after its outstanding work; its borrowed
    /// buffers are no longer used when this returns.
    pub fn remove_subgroup(&self, sg: u32) -> Result<()> {
        let mut t = self.lock();
        if t.phase != Phase::Idle {
            return Err(state_error("sub-groups can only be removed between steps"));
        }
        let track = t.subgroups.get(sg as usize).and_then(Option::as_ref).ok_or_else(|| unknown("sub-group", sg))?;
        let (slices, mut bytes, pinned) = (track.slices.clone(), track.host_bytes, track.pinned.clone());
        let late = track.sg.late.lock().unwrap().take();
        self.shared.tickets.drain();
        if let Some(transport) = &self.transport {
            transport.subgroup_removed(sg);
            for ptr in pinned {
                transport.unpin(ptr as *mut u8);
            }
        }
        if let Some(mut late) = late {
            bytes += late.buffer.bytes();
            if let Some(transport) = &self.transport {
                transport.unpin(late.buffer.as_mut_ptr());
            }
        }
        for i in slices {
            let name = std::mem::take(&mut t.slices[i].name);
            t.names.remove(&name);
        }
        t.host_bytes -= bytes;
        t.subgroups[sg as usize] = None;
        Ok(())
    }

    /// Pins, through the transport, every buffer of a new sub-group that crosses to the
    /// device: the master weights, the gradient buffer and the copy. Undone on failure.
    fn pin_all(&self, data: &mut SgData) -> Result<Vec<usize>> {
        let Some(transport) = &self.transport else { return Ok(Vec::new()) };
        let mut buffers = vec![&mut data.master, &mut data.grad];
        buffers.extend(data.copy.as_mut());
        let mut pinned = Vec::new();
        for buf in buffers {
            let (ptr, bytes) = (buf.as_mut_ptr(), buf.bytes());
            if let Err(e) = transport.pin(ptr, bytes) {
                for p in pinned {
                    transport.unpin(p as *mut u8);
                }
                return Err(e);
            }
            pinned.push(ptr as usize);
        }
        Ok(pinned)
    }

    /// Pins a buffer the session allocates on the fly (late gradients).
    fn pinned(&self, mut buf: HostBuf) -> Result<HostBuf> {
        if let Some(transport) = &self.transport {
            transport.pin(buf.as_mut_ptr(), buf.bytes())?;
        }
        Ok(buf)
    }

    fn check_memory(&self, in_use: usize, more: usize) -> Result<()> {
        match self.options.host_memory_limit {
            Some(limit) if in_use + more > limit => Err(Error::new(
                Status::OutOfResources,
                format!(
                    "the host-memory limit of {limit} bytes would be exceeded: {more} more bytes needed, {in_use} in use"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The slice id of a name.
    pub fn slice_id(&self, name: &str) -> Result<u32> {
        self.lock()
            .names
            .get(name)
            .copied()
            .ok_or_else(|| Error::new(Status::NotFound, format!("no slice is named {name:?}")))
    }

    /// Host bytes the session allocated (moments, gradient buffers, late gradients).
    pub fn host_bytes(&self) -> usize {
        self.lock().host_bytes
    }

    // ----- one step ------------------------------------------------------------------

    /// Starts an optimizer step whose backward uses `loss_scale` (`None`: the built-in
    /// scaler's current scale, or 1 without one) and `micro_steps` micro-steps.
    ///
    /// With the built-in scaler this waits for the previous step's decision, which sets
    /// the scale.
    pub fn begin_step(&self, loss_scale: Option<f32>, micro_steps: u32) -> Result<()> {
        let mut t = self.lock();
        match t.phase {
            Phase::Idle => {}
            Phase::Backward { .. } | Phase::Prepared { .. } => {
                return Err(state_error("the previous step has not been given to step()"));
            }
        }
        if micro_steps == 0 {
            return Err(Error::invalid("micro_steps must be >= 1"));
        }
        let scale = match loss_scale {
            Some(s) if s.is_finite() && s > 0.0 => s,
            Some(s) => return Err(Error::invalid(format!("loss_scale = {s} must be finite and > 0"))),
            None => {
                if t.decide_ticket != 0 {
                    self.shared.tickets.wait(t.decide_ticket, None, false).ok();
                }
                self.shared.scaler.lock().unwrap().map_or(1.0, |s| s.scale)
            }
        };
        t.loss_scale = scale;
        t.serial += 1;
        t.slice_seen.fill(0);
        for track in t.subgroups.iter_mut().flatten() {
            track.slices_done = 0;
            track.submitted = false;
        }
        t.speculative = 0;
        t.late_gradients = 0;
        t.phase = Phase::Backward { micro: 0, micro_steps };
        Ok(())
    }

    /// The built-in loss scaler's current scale (after the latest step's verdict, which this
    /// waits for), or 1 without a scaler: what `begin_step(None, ..)` will use.
    pub fn loss_scale(&self) -> f32 {
        let decide = self.lock().decide_ticket;
        if decide != 0 {
            self.shared.tickets.wait(decide, None, false).ok();
        }
        self.shared.scaler.lock().unwrap().map_or(1.0, |s| s.scale)
    }

    pub fn next_micro_step(&self) -> Result<()> {
        let mut t = self.lock();
        match t.phase {
            Phase::Backward { micro, micro_steps } if micro + 1 < micro_steps => {
                t.phase = Phase::Backward { micro: micro + 1, micro_steps };
                Ok(())
            }
            Phase::Backward { micro_steps, .. } => {
                Err(state_error(format!("all {micro_steps} micro-steps of this step have begun")))
            }
            Phase::Prepared { .. } => {
                Err(state_error("the backward of this step ended with local_grad_sumsq; call step() next"))
            }
            Phase::Idle => Err(state_error("no step has begun (call begin_step first)")),
        }
    }

    /// Copies (micro-step 1) or adds (later micro-steps, repeated hooks) a slice's gradient
    /// into its sub-group's gradient buffer, in the accumulation dtype. Returns the ticket of
    /// the work submitted if this completed the sub-group. A gradient for a sub-group that
    /// already completed is kept aside; the sub-group is redone at `step()`.
    pub fn grad_copy(&self, slice: u32, src: Floats<'_>) -> Result<Option<Ticket>> {
        if src.dtype() != self.options.grad_dtype {
            return Err(Error::invalid(format!(
                "the gradient is {} but the session's gradient dtype is {}",
                src.dtype().name(),
                self.options.grad_dtype.name()
            )));
        }
        self.hand_off(slice, src.len(), "grad_copy", |h| kernels::copy_into(h.dst, src, h.accumulate))
    }

    /// A gradient arrives that `deliver` writes (or starts writing: a transport may copy
    /// asynchronously, as long as its `gradient_ready` waits for the copy) into the place
    /// the session gives it. Completion and tickets as [`Session::grad_copy`].
    pub fn hand_off(
        &self,
        slice: u32,
        numel: usize,
        what: &str,
        deliver: impl FnOnce(HandOff<'_>) -> Result<()>,
    ) -> Result<Option<Ticket>> {
        let mut t = self.lock();
        let span = self.shared.tracer.span(Lane::Caller, || {
            let name = t.slices.get(slice as usize).map_or("?", |s| s.name.as_str());
            format!("gradient {name}")
        });
        let (micro, micro_steps) = backward_phase(&t, what)?;
        let (sg_index, range) = self.slice_target(&t, slice, numel)?;
        let track = t.subgroups[sg_index].as_ref().expect("checked by slice_target");
        let sg = track.sg.clone();
        if track.submitted {
            self.add_late(&mut t, &sg, range, deliver)?;
            drop(span.arg("late", true));
            return Ok(None);
        }
        self.wait_final(track.final_ticket);
        let seen = t.slice_seen[slice as usize];
        {
            let mut data = sg.data.lock().unwrap();
            deliver(HandOff { sg: sg.id, dst: data.grad.range_mut(range), accumulate: seen > 0, late: false })?;
        }
        let ticket = self.mark_gradient(&mut t, slice, sg_index, micro, micro_steps);
        drop(span.arg("sub-group", sg.id).arg("completes", ticket.is_some()));
        Ok(ticket)
    }

    /// Records that the caller wrote a slice's gradient (accumulated, for later
    /// micro-steps) directly into its sub-group's caller-provided gradient buffer.
    pub fn grad_written(&self, slice: u32) -> Result<Option<Ticket>> {
        let mut t = self.lock();
        let (micro, micro_steps) = backward_phase(&t, "grad_written")?;
        let (sg_index, _) = self.slice_target(&t, slice, usize::MAX)?;
        let track = t.subgroups[sg_index].as_ref().expect("checked by slice_target");
        if track.sg.data.lock().unwrap().grad.is_owned() {
            return Err(Error::invalid(format!(
                "sub-group {sg_index} has a session-owned gradient buffer; hand gradients over with grad_copy"
            )));
        }
        if track.submitted {
            return Err(state_error(format!(
                "slice {:?}: its sub-group was already stepped this step, so its buffer is in use; \
                 hand a late gradient over with grad_copy",
                t.slices[slice as usize].name
            )));
        }
        self.wait_final(track.final_ticket);
        Ok(self.mark_gradient(&mut t, slice, sg_index, micro, micro_steps))
    }

    /// A session-owned gradient buffer of a previous step may still be read by that step's
    /// finalization; the caller normally waited for the final ticket already.
    fn wait_final(&self, ticket: Ticket) {
        if ticket != 0 {
            self.shared.tickets.wait(ticket, None, false).ok();
        }
    }

    fn slice_target(&self, t: &Tracking, slice: u32, numel: usize) -> Result<(usize, Range<usize>)> {
        let info =
            t.slices.get(slice as usize).filter(|s| !s.name.is_empty()).ok_or_else(|| unknown("slice", slice))?;
        if numel != usize::MAX && numel != info.range.len() {
            return Err(Error::invalid(format!(
                "slice {:?} has {} elements; the gradient has {numel}",
                info.name,
                info.range.len()
            )));
        }
        Ok((info.sg as usize, info.range.clone()))
    }

    fn mark_gradient(
        &self,
        t: &mut Tracking,
        slice: u32,
        sg_index: usize,
        micro: u32,
        micro_steps: u32,
    ) -> Option<Ticket> {
        let seen = std::mem::replace(&mut t.slice_seen[slice as usize], micro + 1);
        if micro + 1 != micro_steps || seen == micro + 1 {
            return None;
        }
        let track = t.subgroups[sg_index].as_mut().expect("live sub-group");
        track.slices_done += 1;
        if track.slices_done < track.slices.len() {
            return None;
        }
        Some(self.submit_complete(t, sg_index))
    }

    /// A sub-group's gradient is complete: step it speculatively, or (when it cannot
    /// speculate) measure its sum of squares so the norm is known early.
    fn submit_complete(&self, t: &mut Tracking, sg_index: usize) -> Ticket {
        let scale = (1.0 / t.loss_scale as f64) as f32;
        let ticket = self.shared.tickets.issue();
        let track = t.subgroups[sg_index].as_mut().expect("live sub-group");
        track.submitted = true;
        let sg = track.sg.clone();
        let group = t.groups[sg.group as usize];
        if self.options.speculation && sg.can_speculate(group) {
            t.speculative += 1;
            self.send(Job::Speculate { hp: sg.hyper(group, 0), sg, scale, ticket });
        } else {
            self.send(Job::SumOfSquares { sg, scale, ticket });
        }
        ticket
    }

    fn add_late(
        &self,
        t: &mut Tracking,
        sg: &SubGroup,
        range: Range<usize>,
        deliver: impl FnOnce(HandOff<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut late = sg.late.lock().unwrap();
        if late.is_none() {
            let bytes = sg.numel * self.options.accum_dtype.size();
            self.check_memory(t.host_bytes, bytes)?;
            let buffer = self.pinned(HostBuf::zeros(self.options.accum_dtype, sg.numel, "late gradients")?)?;
            t.host_bytes += bytes;
            *late = Some(LateGrads { buffer, ranges: Vec::new() });
        }
        let late = late.as_mut().expect("just created");
        let seen = late.ranges.contains(&range);
        deliver(HandOff { sg: sg.id, dst: late.buffer.range_mut(range.clone()), accumulate: seen, late: true })?;
        if !seen {
            late.ranges.push(range);
        }
        t.late_gradients += 1;
        Ok(())
    }

    fn prepare_plan(&self, t: &Tracking) -> PreparePlan {
        let entries = t
            .subgroups
            .iter()
            .flatten()
            .map(|track| PrepareEntry {
                sg: track.sg.clone(),
                unseen: track
                    .slices
                    .clone()
                    .filter(|&i| t.slice_seen[i] == 0)
                    .map(|i| t.slices[i].range.clone())
                    .collect(),
            })
            .collect();
        PreparePlan { scale: (1.0 / t.loss_scale as f64) as f32, entries }
    }

    /// The sum of squares of this step's unscaled gradient over every sub-group (zeros for
    /// slices without a gradient, late gradients merged), for an all-reduce across ranks.
    /// Waits for the speculative passes; ends the backward (gradients after this are
    /// refused). Not finite iff a gradient element is inf or NaN.
    pub fn local_grad_sumsq(&self, timeout: Option<Duration>) -> Result<f64> {
        let (ticket, subgroups) = {
            let mut t = self.lock();
            let ticket = match t.phase {
                Phase::Backward { .. } => {
                    let plan = self.prepare_plan(&t);
                    let ticket = self.shared.tickets.issue();
                    self.send(Job::Prepare { plan, ticket });
                    t.phase = Phase::Prepared { ticket };
                    ticket
                }
                Phase::Prepared { ticket } => ticket,
                Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
            };
            (ticket, t.subgroups.iter().flatten().map(|s| s.sg.clone()).collect::<Vec<_>>())
        };
        let span = self.shared.tracer.span(Lane::Caller, || "wait for the local sum of squares".into());
        self.shared.tickets.wait(ticket, timeout, false)?;
        drop(span);
        Ok(subgroups.iter().map(|sg| sg.data.lock().unwrap().work.sumsq.unwrap_or(f64::NAN)).sum())
    }

    /// Ends the step: the CPU-Adam thread computes the norm (or takes the given one),
    /// decides whether to skip, clips, and makes every sub-group exact in forward order.
    /// Returns at once with the ticket that completes when every sub-group is final.
    pub fn step(&self, args: StepArgs) -> Result<Ticket> {
        if !(args.max_norm.is_finite() && args.max_norm >= 0.0) {
            return Err(Error::invalid(format!("max_norm = {} must be finite and >= 0", args.max_norm)));
        }
        if let NormSource::Given(norm) = args.norm {
            // inf or NaN is a verdict (the step is skipped); a negative norm is a caller bug.
            if norm < 0.0 {
                return Err(Error::invalid(format!("the given global norm {norm} is negative")));
            }
        }
        let mut t = self.lock();
        let prepare = match t.phase {
            Phase::Backward { .. } => Some(self.prepare_plan(&t)),
            Phase::Prepared { .. } => None,
            Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
        };
        let decide_ticket = self.shared.tickets.issue();
        let mut subgroups = Vec::new();
        for i in 0..t.subgroups.len() {
            if let Some(track) = t.subgroups[i].as_mut() {
                let ticket = self.shared.tickets.issue();
                track.final_ticket = ticket;
                subgroups.push((track.sg.clone(), ticket));
            }
        }
        let step_ticket = self.shared.tickets.issue();
        let plan = FinalizePlan {
            serial: t.serial,
            loss_scale: t.loss_scale,
            max_norm: args.max_norm,
            norm: args.norm,
            overflow: args.overflow,
            groups: t.groups.clone(),
            subgroups,
            decide_ticket,
            step_ticket,
            prepare,
            speculative: t.speculative,
            late_gradients: t.late_gradients,
        };
        self.send(Job::Finalize(Box::new(plan)));
        t.decide_ticket = decide_ticket;
        t.step_ticket = step_ticket;
        t.phase = Phase::Idle;
        Ok(step_ticket)
    }

    /// The result of the step whose ticket `step()` returned (the latest step's only),
    /// waiting up to `timeout` for it.
    pub fn step_result(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<StepResult> {
        let span = self.shared.tracer.span(Lane::Caller, || format!("wait for step ticket {ticket}"));
        self.shared.tickets.wait(ticket, timeout, false)?;
        drop(span);
        match *self.shared.last_result.lock().unwrap() {
            Some((t, result)) if t == ticket => Ok(result),
            _ => Err(Error::new(
                Status::NotFound,
                format!(
                    "ticket {ticket} is not the ticket of the latest step; results are kept for the latest step only"
                ),
            )),
        }
    }

    /// The ticket that completes when the sub-group's latest step is final (0 before its
    /// first `step()`).
    pub fn final_ticket(&self, sg: u32) -> Result<Ticket> {
        let t = self.lock();
        t.subgroups
            .get(sg as usize)
            .and_then(Option::as_ref)
            .map(|s| s.final_ticket)
            .ok_or_else(|| unknown("sub-group", sg))
    }

    /// Steps the sub-group has taken (skipped steps do not count). Read it after the
    /// sub-group's final ticket for the count after a step.
    pub fn step_count(&self, sg: u32) -> Result<u64> {
        let t = self.lock();
        let track = t.subgroups.get(sg as usize).and_then(Option::as_ref).ok_or_else(|| unknown("sub-group", sg))?;
        Ok(track.sg.data.lock().unwrap().work.step_count)
    }

    /// Copies of a sub-group's moments, as f32 (waits for its outstanding work first).
    pub fn moments(&self, sg: u32) -> Result<(Vec<f32>, Vec<f32>)> {
        let track_sg = {
            let t = self.lock();
            t.subgroups
                .get(sg as usize)
                .and_then(Option::as_ref)
                .map(|s| s.sg.clone())
                .ok_or_else(|| unknown("sub-group", sg))?
        };
        self.shared.tickets.drain();
        let data = track_sg.data.lock().unwrap();
        Ok((to_f32(data.exp_avg.floats()), to_f32(data.exp_avg_sq.floats())))
    }

    // ----- tickets ------------------------------------------------------------------

    pub fn ticket_state(&self, ticket: Ticket) -> Result<TicketState> {
        if ticket == 0 {
            return Ok(TicketState::Done);
        }
        self.shared.tickets.state(ticket)
    }

    /// Waits for `ticket` (0 is always done); its own error, if it failed.
    pub fn wait(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<()> {
        if ticket == 0 {
            return Ok(());
        }
        let _span = self.shared.tracer.span(Lane::Caller, || format!("wait for ticket {ticket}"));
        self.shared.tickets.wait(ticket, timeout, false)
    }

    /// Starts recording a timeline (clearing an earlier one), or stops.
    pub fn trace(&self, enable: bool) {
        self.shared.tracer.set_enabled(enable);
    }

    /// Writes the recorded timeline as Chrome trace JSON (open it in Perfetto).
    pub fn save_trace(&self, path: &std::path::Path) -> Result<()> {
        self.shared.tracer.write(path)
    }

    /// Waits for every ticket up to `ticket`; the first error among them, if any failed.
    pub fn wait_all(&self, ticket: Ticket, timeout: Option<Duration>) -> Result<()> {
        if ticket == 0 {
            return Ok(());
        }
        self.shared.tickets.wait(ticket, timeout, true)
    }

    pub fn last_ticket(&self) -> Ticket {
        self.shared.tickets.last_issued()
    }
}

/// torch's `clip_grad_norm_` coefficient: `min(1, max_norm / (norm + 1e-6))`, 1 when
/// `max_norm` is 0.
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 { (max_norm / (norm + 1e-6)).min(1.0) } else { 1.0 }
}

/// The factor every gradient of a step is finally multiplied by: `clip / loss_scale`,
/// computed in f64 and rounded once (so with `clip == 1` it equals the `1 / loss_scale`
/// of the speculative steps exactly).
pub fn grad_factor(clip: f64, loss_scale: f32) -> f32 {
    (clip / loss_scale as f64) as f32
}

/// Whether a gradient factor can be stepped with: finite and > 0 in f32 (the kernels refuse
/// anything else).
pub fn usable_factor(factor: f32) -> bool {
    factor.is_finite() && factor > 0.0
}

fn backward_phase(t: &Tracking, what: &str) -> Result<(u32, u32)> {
    match t.phase {
        Phase::Backward { micro, micro_steps } => Ok((micro, micro_steps)),
        Phase::Prepared { .. } => {
            Err(state_error(format!("{what} after the backward ended with local_grad_sumsq; call step() next")))
        }
        Phase::Idle => Err(state_error(format!("{what} before any step has begun (call begin_step first)"))),
    }
}

fn to_f32(values: Floats<'_>) -> Vec<f32> {
    match values {
        Floats::F32(v) => v.to_vec(),
        Floats::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        Floats::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
    }
}

fn unknown(what: &str, id: u32) -> Error {
    Error::new(Status::NotFound, format!("no {what} has id {id}"))
}

/// Slices must be named uniquely (across the session), non-empty, inside the sub-group
/// and pairwise disjoint.
fn check_slices(slices: &[SliceDesc], numel: usize, names: &HashMap<String, u32>) -> Result<()> {
    if slices.is_empty() {
        return Err(Error::invalid("a sub-group needs at least one slice"));
    }
    let mut order: Vec<&SliceDesc> = slices.iter().collect();
    order.sort_by_key(|s| s.offset);
    for (i, s) in order.iter().enumerate() {
        if s.name.is_empty() {
            return Err(Error::invalid("slice names must not be empty"));
        }
        if s.numel == 0 || s.offset.checked_add(s.numel).is_none_or(|end| end > numel) {
            return Err(Error::invalid(format!(
                "slice {:?} (offset {}, numel {}) is empty or outside the sub-group's {numel} elements",
                s.name, s.offset, s.numel
            )));
        }
        if names.contains_key(&s.name) || slices.iter().filter(|o| o.name == s.name).count() > 1 {
            return Err(Error::invalid(format!("slice name {:?} is used twice", s.name)));
        }
        if let Some(next) = order.get(i + 1) {
            if s.offset + s.numel > next.offset {
                return Err(Error::new(Status::Aliasing, format!("slices {:?} and {:?} overlap", s.name, next.name)));
            }
        }
    }
    Ok(())
}

fn check_no_overlap(new: &[Range<usize>], subgroups: &[Option<SgTrack>]) -> Result<()> {
    let overlaps = |a: &Range<usize>, b: &Range<usize>| a.start < b.end && b.start < a.end;
    if new.len() == 2 && overlaps(&new[0], &new[1]) {
        return Err(Error::new(Status::Aliasing, "the master buffer and the gradient buffer overlap"));
    }
    for (id, track) in subgroups.iter().enumerate() {
        let Some(track) = track else { continue };
        if track.borrowed.iter().any(|r| new.iter().any(|n| overlaps(n, r))) {
            return Err(Error::new(Status::Aliasing, format!("the buffers overlap those of sub-group {id}")));
        }
    }
    Ok(())
}

impl Drop for Session {
    /// Waits for every queued step, then stops the CPU-Adam thread and unpins what the
    /// transport pinned.
    fn drop(&mut self) {
        let mut t = self.tracking.lock().unwrap_or_else(|e| e.into_inner());
        self.jobs.close();
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        if let Some(transport) = &self.transport {
            for (id, track) in t.subgroups.iter_mut().enumerate() {
                let Some(track) = track else { continue };
                transport.subgroup_removed(id as u32);
                for &ptr in &track.pinned {
                    transport.unpin(ptr as *mut u8);
                }
                if let Some(late) = track.sg.late.lock().unwrap().as_mut() {
                    transport.unpin(late.buffer.as_mut_ptr());
                }
            }
        }
    }
}
