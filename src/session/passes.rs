//! The CPU-Adam thread and what happens before a step is decided: its loop, the speculative
//! passes (in chunks, preemptible) and the preparation (missing and late gradients, every sum
//! of squares). The decision and what follows it are in `finalize.rs`.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use super::finalize::StepInFlight;
use super::plans::PreparePlan;
use super::publish::CopyTo;
use super::scheduler::{Job, JobKey, Lifecycle};
use super::trace::Lane;
use super::{Applied, DevicePass, HandedSumsq, Placement, SgData, Shared, SpecKind, SubGroup, speculation_stands};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, Resolution, UpdateOptions};

/// Elements of one chunk of a speculative pass: between two chunks the pass checks whether
/// more urgent work is waiting (about a millisecond of work on a many-core pool).
pub(crate) const SPECULATION_CHUNK: usize = 1 << 22;
/// The CPU-Adam thread's state.
pub(crate) struct Worker {
    pub shared: Arc<Shared>,
    pub step: Option<StepInFlight>,
    /// Outcome of the latest preparation and elements its rollbacks touched.
    pub prepared: Option<(u64, Result<()>, u64)>,
}

/// Runs a job body; a panic becomes the job's error instead of ending the thread.
pub(crate) fn guarded<T>(body: impl FnOnce() -> Result<T>) -> Result<T> {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
        let what = payload
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(Error::new(Status::Panic, format!("internal error in the CPU-Adam thread: {what}")))
    })
}

impl Worker {
    pub(crate) fn new(shared: Arc<Shared>) -> Worker {
        Worker { shared, step: None, prepared: None }
    }

    pub(crate) fn run(&mut self, key: JobKey, job: Job) {
        let start = Instant::now();
        self.run_job(key, job);
        self.shared.policy.lock().unwrap().job_ran(start.elapsed());
    }

    fn run_job(&mut self, key: JobKey, job: Job) {
        match job {
            Job::Speculate(sg) => self.speculate(&sg),
            Job::Prepare { plan, ticket } => {
                let span = self.shared.tracer.span(Lane::CpuAdam, || "prepare (missing and late gradients)".into());
                let mut elements = 0;
                let outcome = guarded(|| self.prepare(&plan, &mut elements));
                let sumsq =
                    guarded(|| self.local_sumsq(plan.entries.iter().map(|e| &e.sg), plan.scale)).unwrap_or(f64::NAN);
                *self.shared.prepared.lock().unwrap() = Some((plan.serial, sumsq));
                self.prepared = Some((plan.serial, outcome.clone(), elements));
                drop(span.arg("ticket", ticket));
                self.shared.complete(ticket, outcome);
                // A speculative pass this preparation preempted goes on until the decision.
                for entry in &plan.entries {
                    let applied = entry.sg.data.lock().unwrap().work.applied;
                    if matches!(applied, Applied::Speculative(s) if s.done < entry.sg.numel) {
                        self.shared.sched.resume_speculation(plan.serial, entry.sg.clone());
                    }
                }
            }
            Job::Decide(plan) => self.decide(*plan),
            Job::Finalize(sg) => self.finalize(key.serial, &sg),
            Job::State { sg, hp, scale } => self.deferred_state(&sg, &hp, scale),
        }
    }

    pub(crate) fn gradient_ready(&self, sg: &SubGroup) -> Result<()> {
        let Some(t) = self.shared.transport() else { return Ok(()) };
        let _span = self.shared.tracer.span(Lane::CpuAdam, || format!("wait for gradient copies, sub-group {}", sg.id));
        t.gradient_ready(sg.id)
    }

    pub(crate) fn master_write(&self, sg: &SubGroup) -> Result<()> {
        self.shared.transport().map_or(Ok(()), |t| t.master_write(sg.id))
    }

    /// Writes the weights' copy of elements `[0, done)` from the master weights again, as
    /// registration wrote it: what a copy that stepped ahead ([`SpecKind::CopyAhead`]) holds
    /// when its step is not taken.
    pub(crate) fn restore_copy(&self, sg: &SubGroup, data: &mut SgData, done: usize) -> Result<()> {
        let Some(copy) = data.copy.as_mut().filter(|_| done > 0) else { return Ok(()) };
        self.master_write(sg)?;
        kernels::convert(&self.shared.pool, copy.range_mut(0..done), data.master.range(0..done))
    }

    /// What a speculative step's ticket reports whether or not its pass ran (cancelled,
    /// undone): [`speculative_verdict`] of the gradient it was planned with, so that tickets,
    /// like the bits, depend on the inputs alone. A sum that cannot be read is left to the
    /// step's own passes to report.
    pub(crate) fn unrun_speculation_outcome(&self, sg: &SubGroup, data: &mut SgData) -> Result<()> {
        match data.work.applied {
            Applied::Speculative(spec) => match self.subgroup_sumsq(sg, data, spec.scale) {
                Ok(sumsq) => speculative_verdict(sg, sumsq),
                Err(_) => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// The sum of squares of one slice as the hand-off (or the preparation) left it.
    fn slice_sumsq(&self, sg: &SubGroup, data: &mut SgData, index: usize, scale: f32) -> Result<f64> {
        match data.sumsq[index] {
            Some(HandedSumsq::Known(s)) => Ok(s),
            Some(HandedSumsq::Deferred) => {
                let s = self
                    .shared
                    .transport()
                    .ok_or_else(|| Error::new(Status::Panic, "a deferred sum of squares without a transport"))?
                    .gradient_sumsq(sg.id, index)?;
                data.sumsq[index] = Some(HandedSumsq::Known(s));
                Ok(s)
            }
            None => {
                let grad = data.grad.as_ref().ok_or_else(|| {
                    Error::new(Status::Panic, "a gradient kept on the device without a sum of squares")
                })?;
                let s = kernels::grad_sumsq(&self.shared.pool, grad.range(sg.slices[index].clone()), scale)?;
                data.sumsq[index] = Some(HandedSumsq::Known(s));
                Ok(s)
            }
        }
    }

    /// The local sum of squares over `subgroups` (forward order, slices in order): what the
    /// norm is made of. Every sum must be known (after the preparation).
    pub(crate) fn local_sumsq<'a>(
        &self,
        subgroups: impl Iterator<Item = &'a Arc<SubGroup>>,
        scale: f32,
    ) -> Result<f64> {
        let mut total = 0.0;
        for sg in subgroups {
            let mut data = sg.data.lock().unwrap();
            for index in 0..sg.slices.len() {
                total += match data.sumsq[index] {
                    Some(HandedSumsq::Known(s)) => s,
                    _ => self.slice_sumsq(sg, &mut data, index, scale)?,
                };
            }
        }
        Ok(total)
    }

    /// The sum of squares of a sub-group's gradient (slices in order).
    pub(crate) fn subgroup_sumsq(&self, sg: &SubGroup, data: &mut SgData, scale: f32) -> Result<f64> {
        let mut total = 0.0;
        for index in 0..sg.slices.len() {
            total += self.slice_sumsq(sg, data, index, scale)?;
        }
        Ok(total)
    }

    /// The speculative step the session planned for `sg` at hand-off, in chunks; stops early
    /// (keeping what it did) when a more urgent job is waiting. A device-placed sub-group's
    /// step is queued on the device whole. A gradient the step could not be undone from
    /// ([`speculation_stands`]) is not stepped: its ticket completes, and the final pass
    /// steps the sub-group once.
    fn speculate(&mut self, sg: &Arc<SubGroup>) {
        let Lifecycle::Speculating(ticket) = self.shared.sched.lifecycle(sg.id) else {
            unreachable!("a speculative step runs for a sub-group in Speculating")
        };
        let span = self.shared.tracer.span(Lane::CpuAdam, || format!("speculative step, sub-group {}", sg.id));
        let start = Instant::now();
        let outcome = guarded(|| {
            self.gradient_ready(sg)?;
            let mut data = sg.data.lock().unwrap();
            let Applied::Speculative(mut spec) = data.work.applied else {
                unreachable!("sub-group {} speculates without a plan", sg.id)
            };
            let sumsq = self.subgroup_sumsq(sg, &mut data, spec.scale)?;
            speculative_verdict(sg, sumsq)?;
            if !speculation_stands(sumsq) {
                return Ok(None);
            }
            if data.placement == Placement::Device {
                // The whole update, queued on the device beside the rest of the backward:
                // the final pass then only publishes it (or resolves it).
                let transport = self.shared.transport().expect("device placement has a transport");
                transport.device_step(sg.id, &[DevicePass::Update { hp: spec.hp, scale: spec.scale }], false)?;
                spec.done = sg.numel;
                data.work.applied = Applied::Speculative(spec);
                // No host pass ran: nothing for the policy to measure.
                return Ok(Some((spec.done, 0)));
            }
            self.master_write(sg)?;
            let opts = UpdateOptions { grad_scale: spec.scale, ..Default::default() };
            // A pass resumed after a preparation preempted it goes on from where it stopped.
            let start_done = spec.done;
            let pool = &self.shared.pool;
            let mut step = |_: Range<usize>, b: AdamBuffers<'_>| match spec.kind {
                SpecKind::Full => kernels::update(pool, &spec.hp, b, &opts).map(drop),
                SpecKind::CopyAhead => kernels::update_copy(pool, &spec.hp, b, spec.scale),
            };
            while spec.done < sg.numel {
                if spec.done > start_done && self.shared.sched.should_yield(&|id| self.shared.gradient_landed(id)) {
                    break;
                }
                let end = (spec.done + SPECULATION_CHUNK).min(sg.numel);
                self.shared.each_piece(sg, &mut data, spec.done..end, CopyTo::Session, &mut step)?;
                spec.done = end;
                data.work.applied = Applied::Speculative(spec);
            }
            Ok(Some((spec.done, spec.done - start_done)))
        });
        let elapsed = start.elapsed();
        match outcome {
            Ok(None) => {
                self.shared.sched.set_lifecycle(sg.id, Lifecycle::Complete);
                drop(span.arg("ticket", ticket).arg("declined", "squares beyond f32"));
                self.shared.complete(ticket, Ok(()));
            }
            Ok(Some((done, ran))) if done == sg.numel => {
                self.shared.policy.lock().unwrap().pass_measured(ran, elapsed);
                self.shared.sched.set_lifecycle(sg.id, Lifecycle::Speculated(None));
                drop(span.arg("ticket", ticket));
                self.shared.complete(ticket, Ok(()));
            }
            Ok(Some((done, ran))) => {
                self.shared.policy.lock().unwrap().pass_measured(ran, elapsed);
                self.shared.sched.set_lifecycle(sg.id, Lifecycle::Speculated(Some(ticket)));
                drop(span.arg("preempted at", done));
            }
            Err(e) => {
                // Whatever chunks ran stay recorded and are made exact at step().
                let ran = matches!(sg.data.lock().unwrap().work.applied, Applied::Speculative(s) if s.done > 0);
                let state = if ran { Lifecycle::Speculated(None) } else { Lifecycle::Complete };
                self.shared.sched.set_lifecycle(sg.id, state);
                drop(span.arg("ticket", ticket).arg("ok", false));
                self.shared.complete(ticket, Err(e));
            }
        }
    }

    /// Zero-fills slices without a gradient, merges late gradients (undoing a speculative
    /// step taken without them) and completes every sum of squares.
    pub(crate) fn prepare(&self, plan: &PreparePlan, elements: &mut u64) -> Result<()> {
        let pool = &self.shared.pool;
        for entry in &plan.entries {
            let sg = &entry.sg;
            let mut late = sg.late.lock().unwrap();
            let has_late = late.as_ref().is_some_and(|l| !l.ranges.is_empty());
            if has_late {
                // A queued speculative step would read a gradient about to change: it is
                // cancelled, and its ticket completes once the gradient copies it stood for
                // have landed (a caller may wait on it before step()).
                let cancelled = self.shared.sched.cancel_speculation(sg.id);
                let ready = self.gradient_ready(sg);
                if let Some(ticket) = cancelled {
                    let verdict = self.unrun_speculation_outcome(sg, &mut sg.data.lock().unwrap());
                    self.shared.complete(ticket, ready.clone().and(verdict));
                }
                ready?;
            }
            let mut data = sg.data.lock().unwrap();
            let device = data.placement == Placement::Device;
            for &index in &entry.unseen {
                let range = sg.slices[index].clone();
                match data.grad.as_mut().filter(|_| !device) {
                    Some(grad) => grad.zero_range(range),
                    None => self
                        .shared
                        .transport()
                        .expect("a gradient on the device has a transport")
                        .device_zero_gradient(sg.id, range)?,
                }
                data.sumsq[index] = Some(HandedSumsq::Known(0.0));
            }
            if let Some(late) = late.as_mut().filter(|l| !l.ranges.is_empty()) {
                debug_assert!(!device, "a device-placed sub-group's transport refuses late gradients");
                // The late buffer stays allocated (and pinned) for the next late gradient.
                if let Applied::Speculative(spec) = data.work.applied {
                    // The gradient the planned speculative step is taken with is about to
                    // change: the step is undone (as a skipped step undoes it), wherever its
                    // pass got, and taken anew at step().
                    if spec.kind == SpecKind::CopyAhead {
                        // Only the copy stepped ahead: it is the master weights' again.
                        self.restore_copy(sg, &mut data, spec.done)?;
                        data.work.applied = Applied::Nothing;
                    } else if spec.done > 0 || speculation_stands(self.subgroup_sumsq(sg, &mut data, plan.scale)?) {
                        self.master_write(sg)?;
                        let (n, done) = (sg.numel, spec.done);
                        for (range, applied) in [(0..done, true), (done..n, false)] {
                            self.shared.each_piece(
                                sg,
                                &mut data,
                                range,
                                CopyTo::Session,
                                &mut |_, b: AdamBuffers<'_>| {
                                    kernels::resolve(pool, &spec.hp, spec.scale, Resolution::Rollback, applied, b)
                                },
                            )?;
                        }
                        *elements += n as u64;
                        data.work.applied = Applied::Undone;
                    } else {
                        data.work.applied = Applied::Nothing;
                    }
                    if let Lifecycle::Speculated(pending) = self.shared.sched.lifecycle(sg.id) {
                        // A pass this preparation preempted is undone, not resumed: its
                        // ticket completes now rather than with step()'s final pass.
                        self.shared.sched.set_lifecycle(sg.id, Lifecycle::Complete);
                        if let Some(ticket) = pending {
                            self.shared.complete(ticket, Ok(()));
                        }
                    }
                }
                let grad = data
                    .grad
                    .as_mut()
                    .ok_or_else(|| Error::new(Status::Panic, "late gradients for a gradient kept on the device"))?;
                let merged: Vec<Range<usize>> = late.ranges.drain(..).collect();
                for range in &merged {
                    kernels::copy_into(grad.range_mut(range.clone()), late.buffer.range(range.clone()), true, None)?;
                }
                for range in merged {
                    if let Some(index) = sg.slices.iter().position(|r| *r == range) {
                        data.sumsq[index] = None;
                    }
                }
            }
            if data.sumsq.iter().any(Option::is_none) {
                drop(data);
                self.gradient_ready(sg)?;
                data = sg.data.lock().unwrap();
                for index in 0..sg.slices.len() {
                    if data.sumsq[index].is_none() {
                        self.slice_sumsq(sg, &mut data, index, plan.scale)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// A speculative step's outcome for a gradient whose unscaled sum of squares is `sumsq`: an
/// inf or NaN element fails it (nothing is written), whether its pass runs or not.
pub(crate) fn speculative_verdict(sg: &SubGroup, sumsq: f64) -> Result<()> {
    if sumsq.is_finite() {
        return Ok(());
    }
    Err(Error::new(
        Status::NonFinite,
        format!(
            "speculative step of sub-group {}: the gradient has an inf or NaN element; nothing was modified",
            sg.id
        ),
    ))
}

/// The CPU-Adam thread's loop.
pub(crate) fn run_thread(shared: Arc<Shared>) {
    let mut worker = Worker::new(shared.clone());
    while let Some((key, job)) = shared.sched.pop(&|sg| shared.gradient_landed(sg)) {
        worker.run(key, job);
    }
}
