//! What the CPU-Adam thread's jobs do: speculative passes (in chunks, preemptible), the
//! preparation (missing and late gradients), the decision (norm, skip, clip factor) and each
//! sub-group's final pass.

use std::ops::Range;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use super::plans::{PreparePlan, StepPlan};
use super::scheduler::{Job, JobKey, Lifecycle};
use super::trace::Lane;
use super::{
    GroupHparams, HandedSumsq, NormSource, Placement, SgData, Shared, SkipReason, SpecRecord, StepResult, SubGroup,
    Ticket, clip_coefficient, grad_factor, unscale_factor, usable_factor,
};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, AdamHyper, CopyOutMut, FloatsMut, MomentsMut, UpdateOptions};

/// Elements of one chunk of a speculative pass: between two chunks the pass checks whether
/// more urgent work is waiting (about a millisecond of work on a many-core pool).
pub(crate) const SPECULATION_CHUNK: usize = 1 << 22;
/// Elements of a final pass staged for the device at a time (16 MiB of bf16 weights).
const PUBLISH_PIECE: usize = 1 << 23;

/// The step being finalized.
struct StepInFlight {
    result: StepResult,
    groups: Vec<GroupHparams>,
    /// Final tickets by sub-group id.
    finals: std::collections::HashMap<u32, Ticket>,
    /// Final passes still to run.
    remaining: usize,
    /// Moments passes still to run (the step ticket completes after them too).
    settling: usize,
    /// Whether final passes may write the moments after publishing the weights (`policy.rs`).
    moments_may_wait: bool,
    step_ticket: Ticket,
    prepared: Result<()>,
}

/// What one final pass did: its outcome for the trace, the elements it passed over, and the
/// moments pass it left for later.
struct FinalPass {
    kind: &'static str,
    elements: u64,
    moments_after: Option<(AdamHyper, f32)>,
}

impl StepInFlight {
    fn done(&self) -> bool {
        self.remaining == 0 && self.settling == 0
    }
}

/// The CPU-Adam thread's state.
pub(crate) struct Worker {
    pub shared: Arc<Shared>,
    step: Option<StepInFlight>,
    /// Outcome of the latest preparation and elements its rollbacks touched.
    prepared: Option<(u64, Result<()>, u64)>,
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

/// The buffers of elements `range` of a sub-group.
fn buffers(data: &mut SgData, range: Range<usize>) -> AdamBuffers<'_> {
    let moments = match (data.exp_avg.range_mut(range.clone()), data.exp_avg_sq.range_mut(range.clone())) {
        (FloatsMut::F32(m), FloatsMut::F32(v)) => MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        (FloatsMut::Bf16(m), FloatsMut::Bf16(v)) => MomentsMut::Bf16 { exp_avg: m, exp_avg_sq: v },
        _ => unreachable!("moments are allocated f32 or bf16, both alike"),
    };
    let copy_out = data.copy.as_mut().map(|c| match c.range_mut(range.clone()) {
        FloatsMut::F16(s) => CopyOutMut::F16(s),
        FloatsMut::Bf16(s) => CopyOutMut::Bf16(s),
        FloatsMut::F32(_) => unreachable!("copies are bf16 or f16"),
    });
    AdamBuffers { param: data.master.range_mut(range.clone()), grad: data.grad.range(range), moments, copy_out }
}

fn same_hyperparameters(a: &AdamHyper, b: &GroupHparams) -> bool {
    a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps && a.weight_decay == b.weight_decay
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
            Job::Speculate { sg, hp, scale } => self.speculate(&sg, hp, scale),
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
                    let spec = entry.sg.data.lock().unwrap().work.spec;
                    if let Some(spec) = spec.filter(|s| s.done < entry.sg.numel) {
                        self.shared.sched.resume_speculation(plan.serial, entry.sg.clone(), spec.hp, spec.scale);
                    }
                }
            }
            Job::Decide(plan) => self.decide(*plan),
            Job::Finalize(sg) => self.finalize(key.serial, &sg),
            Job::Moments { sg, hp, scale } => self.moments(&sg, &hp, scale),
        }
    }

    fn gradient_ready(&self, sg: &SubGroup) -> Result<()> {
        let Some(t) = self.shared.transport() else { return Ok(()) };
        let _span = self.shared.tracer.span(Lane::CpuAdam, || format!("wait for gradient copies, sub-group {}", sg.id));
        t.gradient_ready(sg.id)
    }

    fn master_write(&self, sg: &SubGroup) -> Result<()> {
        self.shared.transport().map_or(Ok(()), |t| t.master_write(sg.id))
    }

    /// Tells the transport that a pass changed the master weights.
    fn staged(&self, sg: &SubGroup, data: &SgData) -> Result<()> {
        self.staged_range(sg, data, 0..sg.numel)
    }

    /// Tells the transport that a pass changed the master weights in `range`.
    fn staged_range(&self, sg: &SubGroup, data: &SgData, range: Range<usize>) -> Result<()> {
        match self.shared.transport() {
            Some(t) => t.weights_updated(
                sg.id,
                range.start,
                data.master.range(range.clone()),
                data.copy.as_ref().map(|c| c.range(range)),
            ),
            None => Ok(()),
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
                let s = kernels::grad_sumsq(&self.shared.pool, data.grad.range(sg.slices[index].clone()), scale)?;
                data.sumsq[index] = Some(HandedSumsq::Known(s));
                Ok(s)
            }
        }
    }

    /// The local sum of squares over `subgroups` (forward order, slices in order): what the
    /// norm is made of. Every sum must be known (after the preparation).
    fn local_sumsq<'a>(&self, subgroups: impl Iterator<Item = &'a Arc<SubGroup>>, scale: f32) -> Result<f64> {
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

    /// A speculative step of `sg`, in chunks; stops early (keeping what it did) when a
    /// more urgent job is waiting. A gradient whose squares may not fit in f32 (a sum of
    /// squares above `f32::MAX`) is not stepped speculatively: `exp_avg_sq` would become inf,
    /// which no rollback or rescale can undo. Its ticket completes and the sub-group is
    /// stepped once at `step()`.
    fn speculate(&mut self, sg: &Arc<SubGroup>, mut hp: AdamHyper, scale: f32) {
        let Lifecycle::Speculating(ticket) = self.shared.sched.lifecycle(sg.id) else {
            unreachable!("a speculative step runs for a sub-group in Speculating")
        };
        let span = self.shared.tracer.span(Lane::CpuAdam, || format!("speculative step, sub-group {}", sg.id));
        let start = Instant::now();
        let outcome = guarded(|| {
            self.gradient_ready(sg)?;
            let mut data = sg.data.lock().unwrap();
            let mut sumsq = 0.0;
            for index in 0..sg.slices.len() {
                let s = self.slice_sumsq(sg, &mut data, index, scale)?;
                if !s.is_finite() {
                    return Err(Error::new(
                        Status::NonFinite,
                        format!(
                            "speculative step of sub-group {}: the gradient has an inf or NaN element; nothing was modified",
                            sg.id
                        ),
                    ));
                }
                sumsq += s;
            }
            if sumsq > f32::MAX as f64 {
                return Ok(None);
            }
            self.master_write(sg)?;
            hp.step = data.work.step_count + 1;
            // A pass resumed after a preparation preempted it goes on from where it stopped.
            let mut done = match data.work.spec {
                Some(s) if s.hp == hp && s.scale == scale => s.done,
                _ => 0,
            };
            let opts = UpdateOptions { grad_scale: scale, ..Default::default() };
            let start_done = done;
            while done < sg.numel {
                if done > start_done && self.shared.sched.should_yield(&|id| self.shared.gradient_landed(id)) {
                    break;
                }
                let end = (done + SPECULATION_CHUNK).min(sg.numel);
                kernels::update(&self.shared.pool, &hp, buffers(&mut data, done..end), &opts)?;
                done = end;
                data.work.spec = Some(SpecRecord { hp, scale, done });
            }
            if done == sg.numel {
                self.staged(sg, &data)?;
            }
            Ok(Some((done, done - start_done)))
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
                // Whatever chunks ran stay recorded in `spec` and are made exact at step().
                let applied = sg.data.lock().unwrap().work.spec.is_some();
                let state = if applied { Lifecycle::Speculated(None) } else { Lifecycle::Complete };
                self.shared.sched.set_lifecycle(sg.id, state);
                drop(span.arg("ticket", ticket).arg("ok", false));
                self.shared.complete(ticket, Err(e));
            }
        }
    }

    /// Zero-fills slices without a gradient, merges late gradients (undoing a speculative
    /// step taken without them) and completes every sum of squares.
    fn prepare(&self, plan: &PreparePlan, elements: &mut u64) -> Result<()> {
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
                    self.shared.complete(ticket, ready.clone());
                }
                ready?;
            }
            let mut data = sg.data.lock().unwrap();
            let device = data.placement == Placement::Device;
            for &index in &entry.unseen {
                let range = sg.slices[index].clone();
                if device {
                    self.shared
                        .transport()
                        .expect("device placement has a transport")
                        .device_zero_gradient(sg.id, range)?;
                } else {
                    data.grad.zero_range(range);
                }
                data.sumsq[index] = Some(HandedSumsq::Known(0.0));
            }
            if let Some(late) = late.as_mut().filter(|l| !l.ranges.is_empty()) {
                // The late buffer stays allocated (and pinned) for the next late gradient.
                if let Some(spec) = data.work.spec.take() {
                    self.master_write(sg)?;
                    kernels::rollback(pool, &spec.hp, buffers(&mut data, 0..spec.done), spec.scale)?;
                    *elements += spec.done as u64;
                    data.work.redo = true;
                    if let Lifecycle::Speculated(pending) = self.shared.sched.lifecycle(sg.id) {
                        // A pass this preparation preempted is undone, not resumed: its
                        // ticket completes now rather than with step()'s final pass.
                        self.shared.sched.set_lifecycle(sg.id, Lifecycle::Complete);
                        if let Some(ticket) = pending {
                            self.shared.complete(ticket, Ok(()));
                        }
                    }
                }
                for range in late.ranges.drain(..) {
                    kernels::copy_into(
                        data.grad.range_mut(range.clone()),
                        late.buffer.range(range.clone()),
                        true,
                        None,
                    )?;
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

    fn decide(&mut self, plan: StepPlan) {
        let decide = self.shared.tracer.span(Lane::CpuAdam, || format!("decide step {}", plan.serial));
        let (prepared, prepare_elements) = match &plan.prepare {
            Some(p) => {
                let mut elements = 0;
                (guarded(|| self.prepare(p, &mut elements)), elements)
            }
            None => match self.prepared.take() {
                Some((serial, outcome, elements)) if serial == plan.serial => (outcome, elements),
                _ => (Err(Error::new(Status::Panic, "the step's preparation is missing")), 0),
            },
        };
        let local = if prepared.is_ok() {
            guarded(|| self.local_sumsq(plan.subgroups.iter().map(|(sg, _)| sg), unscale_factor(plan.loss_scale)))
        } else {
            Ok(f64::NAN)
        };
        // A sum that could not be read (a failed gradient copy) fails the step, which is then
        // skipped: no sub-group is stepped from a gradient that never arrived.
        let (local, prepared) = match local {
            Ok(local) => (local, prepared),
            Err(e) => (f64::NAN, prepared.and(Err(e))),
        };
        let args = plan.args;
        let mut result = StepResult {
            serial: plan.serial,
            loss_scale: plan.loss_scale,
            speculative: plan.speculative,
            late_gradients: plan.late_gradients,
            forward_wait_s: plan.forward_wait_s,
            final_pass_elements: prepare_elements,
            ..StepResult::default()
        };
        result.global_norm = match args.norm {
            NormSource::Local => local.sqrt(),
            NormSource::Given(norm) => norm,
        };
        let clip = clip_coefficient(args.max_norm, result.global_norm);
        result.skip_reason = if args.overflow {
            SkipReason::Overflow
        } else if !local.is_finite() {
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
        if let Some(scaler) = self.shared.scaler.lock().unwrap().as_mut() {
            scaler.update(result.skipped);
            result.next_loss_scale = scaler.scale;
        } else {
            result.next_loss_scale = plan.loss_scale;
        }
        let unchanged = !result.skipped && result.grad_factor == unscale_factor(plan.loss_scale);
        let moments_may_wait = {
            let mut policy = self.shared.policy.lock().unwrap();
            policy.decided(unchanged);
            policy.moments_can_wait(plan.speculative > 0)
        };
        let subgroups: Vec<Arc<SubGroup>> = plan.subgroups.iter().map(|(sg, _)| sg.clone()).collect();
        result.cancelled = self.shared.sched.finalize_all(plan.serial, &subgroups);
        drop(
            decide
                .arg("norm", result.global_norm)
                .arg("clip", result.clip_coef)
                .arg("skipped", result.skipped)
                .arg("cancelled", result.cancelled),
        );
        self.shared.complete(plan.decide_ticket, prepared.clone());
        let step = StepInFlight {
            result,
            groups: plan.groups,
            finals: plan.subgroups.iter().map(|(sg, t)| (sg.id, *t)).collect(),
            remaining: plan.subgroups.len(),
            settling: 0,
            moments_may_wait,
            step_ticket: plan.step_ticket,
            prepared,
        };
        if step.done() {
            self.finish(step);
        } else {
            self.step = Some(step);
        }
    }

    fn finish(&mut self, step: StepInFlight) {
        *self.shared.last_result.lock().unwrap() = Some((step.step_ticket, step.result));
        self.shared.complete(step.step_ticket, step.prepared);
    }

    fn finalize(&mut self, serial: u64, sg: &Arc<SubGroup>) {
        let mut step = self.step.take().expect("a decided step is being finalized");
        debug_assert_eq!(step.result.serial, serial);
        let Lifecycle::FinalQueued(pending_spec) = self.shared.sched.lifecycle(sg.id) else {
            unreachable!("a final pass runs for a sub-group in FinalQueued")
        };
        let group = step.groups[sg.group as usize];
        let span = self.shared.tracer.span(Lane::CpuAdam, || format!("finalize sub-group {}", sg.id));
        let start = Instant::now();
        let mut done = FinalPass { kind: "unchanged", elements: 0, moments_after: None };
        let outcome = guarded(|| self.final_pass(sg, group, step.moments_may_wait, &mut step.result, &mut done));
        let FinalPass { kind: outcome_kind, elements, moments_after } = done;
        if outcome_kind.starts_with("stepped") && elements > 0 {
            // With the moments after, what the next forward waits for is the weights pass.
            self.shared.policy.lock().unwrap().pass_measured(elements as usize, start.elapsed());
        }
        step.result.final_pass_elements += elements;
        match moments_after {
            Some((hp, scale)) => {
                // The weights were written, so the moments follow even if staging failed.
                // Before the final ticket completes: a hand-off released by it must see the
                // moments pending.
                self.shared.sched.submit_moments(serial, sg.clone(), hp, scale);
                step.settling += 1;
            }
            None => self.shared.sched.set_lifecycle(sg.id, Lifecycle::Idle),
        }
        let final_ticket = step.finals[&sg.id];
        drop(span.arg("outcome", outcome_kind).arg("ticket", final_ticket));
        if let Some(t) = pending_spec {
            self.shared.complete(t, Ok(()));
        }
        self.shared.complete(final_ticket, outcome);
        step.remaining -= 1;
        if step.done() {
            self.finish(step);
        } else {
            self.step = Some(step);
        }
    }

    /// The moments of a sub-group whose final pass wrote only its weights: the second half
    /// of that step (`kernels::update_moments`), from the gradient and moments it left.
    fn moments(&mut self, sg: &Arc<SubGroup>, hp: &AdamHyper, scale: f32) {
        let mut step = self.step.take().expect("a decided step is settling");
        let span = self.shared.tracer.span(Lane::CpuAdam, || format!("moments, sub-group {}", sg.id));
        let outcome = guarded(|| {
            let mut data = sg.data.lock().unwrap();
            kernels::update_moments(&self.shared.pool, hp, buffers(&mut data, 0..sg.numel), scale)
        });
        self.shared.sched.settle(sg.id);
        drop(span.arg("ok", outcome.is_ok()));
        if let Err(e) = outcome {
            // The moments are not those of the step the weights took: the step fails.
            step.prepared = step.prepared.and(Err(e));
        }
        step.settling -= 1;
        if step.done() {
            self.finish(step);
        } else {
            self.step = Some(step);
        }
    }

    /// Makes one sub-group exact with the step's verdict, in as few passes as its state
    /// allows, and publishes it.
    fn final_pass(
        &self,
        sg: &SubGroup,
        group: GroupHparams,
        moments_may_wait: bool,
        result: &mut StepResult,
        out: &mut FinalPass,
    ) -> Result<()> {
        let pool = &self.shared.pool;
        let mut data = sg.data.lock().unwrap();
        data.sumsq.fill(None);
        let n = sg.numel;
        let spec = data.work.spec.take();
        let redo = std::mem::take(&mut data.work.redo);
        if result.skipped {
            // This step's gradient copies end here too: none may still land in the buffer
            // when the next step's arrive.
            drop(data);
            self.gradient_ready(sg)?;
            data = sg.data.lock().unwrap();
            if let Some(spec) = spec {
                self.master_write(sg)?;
                kernels::rollback(pool, &spec.hp, buffers(&mut data, 0..spec.done), spec.scale)?;
                out.elements += spec.done as u64;
            }
            if spec.is_some() || redo {
                result.rolled_back += 1;
                out.kind = "rolled back";
            }
            // The model keeps its weights: staged weights of a skipped step are never published.
            return Ok(());
        }
        let factor = result.grad_factor;
        let hp = sg.hyper(group, data.work.step_count + 1);
        if data.placement == Placement::Device {
            self.shared.transport().expect("device placement has a transport").device_step(sg.id, &hp, factor)?;
            data.work.step_count += 1;
            result.device_stepped += 1;
            out.kind = "stepped on the device";
            out.elements += n as u64;
            return Ok(());
        }
        let update = UpdateOptions { grad_scale: factor, ..Default::default() };
        let kept = spec.is_some_and(|s| s.done == n && s.scale == factor && same_hyperparameters(&s.hp, &group));
        if !kept {
            // The gradient is read below: its copies must have landed.
            drop(data);
            self.gradient_ready(sg)?;
            data = sg.data.lock().unwrap();
        }
        match spec {
            Some(spec) if same_hyperparameters(&spec.hp, &group) => {
                let rescale = spec.scale != factor;
                if rescale || spec.done < n {
                    self.master_write(sg)?;
                }
                if rescale {
                    if let Err(e) =
                        kernels::rescale(pool, &spec.hp, buffers(&mut data, 0..spec.done), spec.scale, factor)
                    {
                        data.work.spec = Some(spec);
                        return Err(e);
                    }
                    out.elements += spec.done as u64;
                    result.rescaled += 1;
                    out.kind = "rescaled";
                } else {
                    result.kept += 1;
                    out.kind = "kept";
                }
                if spec.done < n {
                    kernels::update(pool, &spec.hp, buffers(&mut data, spec.done..n), &update)?;
                    out.elements += (n - spec.done) as u64;
                }
                if rescale || spec.done < n {
                    self.staged(sg, &data)?;
                }
            }
            Some(spec) => {
                self.master_write(sg)?;
                kernels::rollback(pool, &spec.hp, buffers(&mut data, 0..spec.done), spec.scale)?;
                kernels::update(pool, &hp, buffers(&mut data, 0..n), &update)?;
                self.staged(sg, &data)?;
                out.elements += (spec.done + n) as u64;
                result.redone += 1;
                out.kind = "redone";
            }
            None => {
                self.master_write(sg)?;
                // The next forward waits for the weights alone: with a device to publish to,
                // the moments are written by a pass of their own after publication
                // (`Class::Moments`), off that wait, where the CPU has time for it (the
                // policy). Not with a caller-provided gradient buffer, which the caller may
                // rewrite once the weights are final.
                let defer = moments_may_wait
                    && self.shared.transport().is_some()
                    && data.grad.is_owned()
                    && kernels::can_split_update(&hp);
                // With a device to publish to, in pieces, each staged as it is done: the next
                // forward waits for this pass and the staging copy of its last piece only.
                let piece_len = if self.shared.transport().is_some() { PUBLISH_PIECE } else { n.max(1) };
                for start in (0..n).step_by(piece_len) {
                    let piece = start..(start + piece_len).min(n);
                    if defer {
                        kernels::update_weights(pool, &hp, buffers(&mut data, piece.clone()), factor)?;
                    } else {
                        kernels::update(pool, &hp, buffers(&mut data, piece.clone()), &update)?;
                    }
                    self.staged_range(sg, &data, piece)?;
                }
                if defer {
                    out.moments_after = Some((hp, factor));
                }
                out.elements += n as u64;
                if redo {
                    result.redone += 1;
                    out.kind = "redone";
                } else {
                    result.stepped += 1;
                    out.kind = if defer { "stepped, moments after" } else { "stepped" };
                }
            }
        }
        data.work.step_count += 1;
        match self.shared.transport() {
            Some(t) => t.publish(sg.id),
            None => Ok(()),
        }
    }
}

/// The CPU-Adam thread's loop.
pub(crate) fn run_thread(shared: Arc<Shared>) {
    let mut worker = Worker::new(shared.clone());
    while let Some((key, job)) = shared.sched.pop(&|sg| shared.gradient_landed(sg)) {
        worker.run(key, job);
    }
}
