//! The CPU-Adam thread: runs every optimizer pass of a session, in ticket order.
//!
//! Speculative steps run as soon as a sub-group's gradient is complete; at `step()` the
//! finalize job decides (norm, clip factor, skip) and makes every sub-group exact, in
//! forward order, completing each sub-group's final ticket as it goes.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Condvar, Mutex};

use super::scaler::LossScaler;
use super::tickets::{Ticket, Tickets};
use super::trace::{Lane, Tracer};
use super::{
    GroupHparams, NormSource, SkipReason, StepResult, SubGroup, Transport, clip_coefficient, grad_factor, usable_factor,
};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, AdamHyper, CopyOutMut, FloatsMut, MomentsMut, Pool, UpdateOptions};

/// A speculative step as taken: what a rescale or rollback must use.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SpecRecord {
    pub hp: AdamHyper,
    pub scale: f32,
}

/// The optimizer-side state of a sub-group (under its data lock).
#[derive(Default)]
pub(crate) struct SgWork {
    pub step_count: u64,
    /// The speculative step currently applied to the master weights and moments.
    pub spec: Option<SpecRecord>,
    /// Sum of squares of this step's unscaled gradient, once known.
    pub sumsq: Option<f64>,
    /// The speculative step was undone for a late gradient and must be taken again.
    pub redo: bool,
}

/// Zero-filling, late-gradient merging and sums of squares that must precede the decision.
pub(crate) struct PreparePlan {
    /// Unscaling factor `1 / S` of this step.
    pub scale: f32,
    pub entries: Vec<PrepareEntry>,
}

pub(crate) struct PrepareEntry {
    pub sg: Arc<SubGroup>,
    /// Element ranges that received no gradient this step: they become zeros.
    pub unseen: Vec<std::ops::Range<usize>>,
}

pub(crate) struct FinalizePlan {
    pub serial: u64,
    pub loss_scale: f32,
    pub max_norm: f64,
    pub norm: NormSource,
    pub overflow: bool,
    /// Hyperparameters of every group as of `step()`.
    pub groups: Vec<GroupHparams>,
    /// Sub-groups in forward order, each with its final ticket.
    pub subgroups: Vec<(Arc<SubGroup>, Ticket)>,
    pub decide_ticket: Ticket,
    pub step_ticket: Ticket,
    /// `None` when `local_grad_sumsq` already ran the preparation.
    pub prepare: Option<PreparePlan>,
    pub speculative: u32,
    pub late_gradients: u32,
}

pub(crate) enum Job {
    Speculate { sg: Arc<SubGroup>, hp: AdamHyper, scale: f32, ticket: Ticket },
    SumOfSquares { sg: Arc<SubGroup>, scale: f32, ticket: Ticket },
    Prepare { plan: PreparePlan, ticket: Ticket },
    Finalize(Box<FinalizePlan>),
}

/// What the worker shares with the session's callers.
pub(crate) struct WorkerShared {
    pub pool: Arc<Pool>,
    pub tickets: Tickets,
    pub scaler: Mutex<Option<LossScaler>>,
    pub last_result: Mutex<Option<(Ticket, StepResult)>>,
    pub transport: Option<Arc<dyn Transport>>,
    pub tracer: Tracer,
}

impl WorkerShared {
    fn transport(&self) -> Option<&dyn Transport> {
        self.transport.as_deref()
    }

    fn complete(&self, ticket: Ticket, outcome: Result<()>) {
        if let Some(t) = self.transport() {
            t.ticket_done(ticket);
        }
        self.tickets.complete(ticket, outcome);
    }
}

/// The CPU-Adam thread's work queue: FIFO, with room reserved ahead (one slot per
/// sub-group and a few more) so that a gradient hand-off never allocates to queue a job.
#[derive(Default)]
pub(crate) struct JobQueue {
    state: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
}

impl JobQueue {
    pub(crate) fn push(&self, job: Job) {
        self.state.lock().unwrap().0.push_back(job);
        self.ready.notify_one();
    }

    /// Makes room for `jobs` queued jobs without reallocating.
    pub(crate) fn reserve(&self, jobs: usize) {
        let mut state = self.state.lock().unwrap();
        let more = jobs.saturating_sub(state.0.len());
        state.0.reserve(more);
    }

    /// No more jobs: the thread finishes those queued, then stops.
    pub(crate) fn close(&self) {
        self.state.lock().unwrap().1 = true;
        self.ready.notify_all();
    }

    fn pop(&self) -> Option<Job> {
        let mut state = self.state.lock().unwrap();
        loop {
            if let Some(job) = state.0.pop_front() {
                return Some(job);
            }
            if state.1 {
                return None;
            }
            state = self.ready.wait(state).unwrap();
        }
    }
}

pub(crate) fn run(shared: Arc<WorkerShared>, jobs: Arc<JobQueue>) {
    while let Some(job) = jobs.pop() {
        match job {
            Job::Speculate { sg, hp, scale, ticket } => {
                let span = shared.tracer.span(Lane::CpuAdam, || format!("speculative step, sub-group {}", sg.id));
                let outcome = guarded(|| speculate(&shared, &sg, hp, scale));
                drop(span.arg("ticket", ticket).arg("ok", outcome.is_ok()));
                shared.complete(ticket, outcome);
            }
            Job::SumOfSquares { sg, scale, ticket } => {
                let span = shared.tracer.span(Lane::CpuAdam, || format!("sum of squares, sub-group {}", sg.id));
                let outcome = guarded(|| measure(&shared, &sg, scale));
                drop(span.arg("ticket", ticket));
                shared.complete(ticket, outcome);
            }
            Job::Prepare { plan, ticket } => {
                let span = shared.tracer.span(Lane::CpuAdam, || "prepare (missing and late gradients)".into());
                let outcome = guarded(|| prepare(&shared, &plan));
                drop(span.arg("ticket", ticket));
                shared.complete(ticket, outcome);
            }
            Job::Finalize(plan) => finalize(&shared, *plan),
        }
    }
}

/// Runs a job body; a panic becomes the job's error instead of ending the thread.
fn guarded<T>(body: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(Error::new(Status::Panic, format!("internal error in the CPU-Adam thread: {what}")))
    })
}

fn buffers(data: &mut super::SgData) -> AdamBuffers<'_> {
    let moments = match (data.exp_avg.floats_mut(), data.exp_avg_sq.floats_mut()) {
        (kernels::FloatsMut::F32(m), kernels::FloatsMut::F32(v)) => MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        (kernels::FloatsMut::Bf16(m), kernels::FloatsMut::Bf16(v)) => MomentsMut::Bf16 { exp_avg: m, exp_avg_sq: v },
        _ => unreachable!("moments are allocated f32 or bf16, both alike"),
    };
    let copy_out = data.copy.as_mut().map(|c| match c.floats_mut() {
        FloatsMut::F16(s) => CopyOutMut::F16(s),
        FloatsMut::Bf16(s) => CopyOutMut::Bf16(s),
        FloatsMut::F32(_) => unreachable!("copies are bf16 or f16"),
    });
    AdamBuffers { param: data.master.floats_mut(), grad: data.grad.floats(), moments, copy_out }
}

/// Tells the transport that a pass changed the master weights.
fn staged(shared: &WorkerShared, sg: &SubGroup, data: &super::SgData) -> Result<()> {
    match shared.transport() {
        Some(t) => t.weights_updated(sg.id, data.master.floats(), data.copy.as_ref().map(|c| c.floats())),
        None => Ok(()),
    }
}

fn gradient_ready(shared: &WorkerShared, sg: &SubGroup) -> Result<()> {
    let Some(t) = shared.transport() else { return Ok(()) };
    let _span = shared.tracer.span(Lane::CpuAdam, || format!("wait for gradient copies, sub-group {}", sg.id));
    t.gradient_ready(sg.id)
}

fn master_write(shared: &WorkerShared, sg: &SubGroup) -> Result<()> {
    shared.transport().map_or(Ok(()), |t| t.master_write(sg.id))
}

fn speculate(shared: &WorkerShared, sg: &SubGroup, mut hp: AdamHyper, scale: f32) -> Result<()> {
    gradient_ready(shared, sg)?;
    let mut data = sg.data.lock().unwrap();
    master_write(shared, sg)?;
    hp.step = data.work.step_count + 1;
    let opts = UpdateOptions { grad_scale: scale, check_finite: true, grad_sumsq: true };
    match kernels::update(&shared.pool, &hp, buffers(&mut data), &opts) {
        Ok(report) => {
            data.work.spec = Some(SpecRecord { hp, scale });
            data.work.sumsq = report.grad_sumsq;
            staged(shared, sg, &data)
        }
        Err(e) => {
            // Nothing was modified; a non-finite gradient makes this step skipped at step().
            data.work.sumsq = (e.status == Status::NonFinite).then_some(f64::INFINITY);
            Err(Error::new(e.status, format!("speculative step of sub-group {}: {}", sg.id, e.message)))
        }
    }
}

fn measure(shared: &WorkerShared, sg: &SubGroup, scale: f32) -> Result<()> {
    gradient_ready(shared, sg)?;
    let mut data = sg.data.lock().unwrap();
    let sumsq = kernels::grad_sumsq(&shared.pool, data.grad.floats(), scale)?;
    data.work.sumsq = Some(sumsq);
    Ok(())
}

fn prepare(shared: &WorkerShared, plan: &PreparePlan) -> Result<()> {
    let pool = &shared.pool;
    for entry in &plan.entries {
        gradient_ready(shared, &entry.sg)?;
        let mut data = entry.sg.data.lock().unwrap();
        for range in &entry.unseen {
            data.grad.zero_range(range.clone());
        }
        let mut late = entry.sg.late.lock().unwrap();
        if let Some(late) = late.as_mut().filter(|l| !l.ranges.is_empty()) {
            // A gradient arrived after the speculative step: undo it, then merge. The
            // buffer stays allocated (and pinned) for the next late gradient.
            if let Some(spec) = data.work.spec.take() {
                master_write(shared, &entry.sg)?;
                kernels::rollback(pool, &spec.hp, buffers(&mut data), spec.scale)?;
                data.work.redo = true;
            }
            for range in late.ranges.drain(..) {
                kernels::copy_into(data.grad.range_mut(range.clone()), late.buffer.range(range), true)?;
            }
            data.work.sumsq = None;
        }
        if !entry.unseen.is_empty() {
            data.work.sumsq = None;
        }
        if data.work.sumsq.is_none() {
            data.work.sumsq = Some(kernels::grad_sumsq(pool, data.grad.floats(), plan.scale)?);
        }
    }
    Ok(())
}

fn finalize(shared: &WorkerShared, plan: FinalizePlan) {
    let mut result = StepResult {
        serial: plan.serial,
        loss_scale: plan.loss_scale,
        speculative: plan.speculative,
        late_gradients: plan.late_gradients,
        ..StepResult::default()
    };
    let decide = shared.tracer.span(Lane::CpuAdam, || format!("decide step {}", plan.serial));
    let prepared = match &plan.prepare {
        Some(p) => guarded(|| prepare(shared, p)),
        None => Ok(()),
    };

    // Decide: norm, finiteness, skip, clip factor.
    let mut local = 0.0f64;
    let mut all_finite = prepared.is_ok();
    for (sg, _) in &plan.subgroups {
        // A non-finite sum of squares enters the local norm too, so that the result says so.
        let sumsq = sg.data.lock().unwrap().work.sumsq.unwrap_or(f64::NAN);
        all_finite &= sumsq.is_finite();
        local += sumsq;
    }
    result.global_norm = match plan.norm {
        NormSource::Local => local.sqrt(),
        NormSource::Given(norm) => norm,
    };
    let clip = clip_coefficient(plan.max_norm, result.global_norm);
    result.skip_reason = if plan.overflow {
        SkipReason::Overflow
    } else if !all_finite {
        SkipReason::NonFiniteGradient
    } else if !result.global_norm.is_finite() {
        SkipReason::NonFiniteNorm
    } else if !usable_factor(grad_factor(clip, plan.loss_scale)) {
        SkipReason::UnusableFactor
    } else {
        SkipReason::None
    };
    result.skipped = result.skip_reason != SkipReason::None;
    result.clip_coef = if result.skipped { 1.0 } else { clip };
    result.grad_factor = grad_factor(result.clip_coef, plan.loss_scale);
    if let Some(scaler) = shared.scaler.lock().unwrap().as_mut() {
        scaler.update(result.skipped);
        result.next_loss_scale = scaler.scale;
    } else {
        result.next_loss_scale = plan.loss_scale;
    }
    drop(decide.arg("norm", result.global_norm).arg("clip", result.clip_coef).arg("skipped", result.skipped));
    shared.complete(plan.decide_ticket, prepared.clone());

    // Make every sub-group exact, in forward order.
    for (sg, ticket) in &plan.subgroups {
        let group = plan.groups[sg.group as usize];
        let span = shared.tracer.span(Lane::CpuAdam, || format!("finalize sub-group {}", sg.id));
        let before = [result.kept, result.rescaled, result.rolled_back, result.redone, result.stepped];
        let outcome = guarded(|| fix(shared, sg, group, &mut result));
        let after = [result.kept, result.rescaled, result.rolled_back, result.redone, result.stepped];
        let kinds = ["kept", "rescaled", "rolled back", "redone", "stepped"];
        let kind = (0..5).find(|&i| after[i] != before[i]).map_or("unchanged", |i| kinds[i]);
        drop(span.arg("outcome", kind).arg("ticket", ticket));
        shared.complete(*ticket, outcome);
    }
    *shared.last_result.lock().unwrap() = Some((plan.step_ticket, result));
    shared.complete(plan.step_ticket, prepared);
}

fn same_hyperparameters(a: &AdamHyper, b: &GroupHparams) -> bool {
    a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay
}

fn fix(shared: &WorkerShared, sg: &SubGroup, group: GroupHparams, result: &mut StepResult) -> Result<()> {
    let pool = &shared.pool;
    let mut data = sg.data.lock().unwrap();
    let spec = data.work.spec.take();
    let redo = std::mem::take(&mut data.work.redo);
    data.work.sumsq = None;
    if result.skipped {
        if let Some(spec) = spec {
            master_write(shared, sg)?;
            kernels::rollback(pool, &spec.hp, buffers(&mut data), spec.scale)?;
            result.rolled_back += 1;
        } else if redo {
            // Already undone for its late gradient; a skipped step leaves it so.
            result.rolled_back += 1;
        }
        // The model keeps its weights: staged weights of a skipped step are never published.
        return Ok(());
    }
    let factor = result.grad_factor;
    let hp = sg.hyper(group, data.work.step_count + 1);
    let update = UpdateOptions { grad_scale: factor, ..Default::default() };
    match spec {
        Some(spec) if same_hyperparameters(&spec.hp, &group) && spec.scale == factor => result.kept += 1,
        Some(spec) if same_hyperparameters(&spec.hp, &group) => {
            master_write(shared, sg)?;
            if let Err(e) = kernels::rescale(pool, &spec.hp, buffers(&mut data), spec.scale, factor) {
                data.work.spec = Some(spec);
                return Err(e);
            }
            staged(shared, sg, &data)?;
            result.rescaled += 1;
        }
        Some(spec) => {
            master_write(shared, sg)?;
            kernels::rollback(pool, &spec.hp, buffers(&mut data), spec.scale)?;
            kernels::update(pool, &hp, buffers(&mut data), &update)?;
            staged(shared, sg, &data)?;
            result.redone += 1;
        }
        None => {
            master_write(shared, sg)?;
            kernels::update(pool, &hp, buffers(&mut data), &update)?;
            staged(shared, sg, &data)?;
            if redo {
                result.redone += 1;
            } else {
                result.stepped += 1;
            }
        }
    }
    data.work.step_count += 1;
    match shared.transport() {
        Some(t) => t.publish(sg.id),
        None => Ok(()),
    }
}
