//! The CPU-Adam thread: its loop and the jobs it runs. The two phases of a step are written
//! below it and know nothing of each other: what happens before the decision
//! (`speculation.rs`) and from the decision on (`finalize.rs`). The thread runs their passes
//! under a guard, times them, moves each sub-group's lifecycle and completes the tickets.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Instant;

use super::factors::unscale_factor;
use super::finalize::{self, FinalPass, Outcome};
use super::plans::{PreparePlan, StepPlan};
use super::scheduler::{Job, JobKey, Lifecycle};
use super::shared::Shared;
use super::speculation;
use super::subgroup::{Applied, SubGroup};
use super::subgroup_ops::{local_sumsq, unrun_speculation_outcome};
use super::tickets::Ticket;
use super::trace::Lane;
use super::types::{GroupHparams, StepResult};
use crate::error::{Error, Result, Status};
use crate::kernels::AdamHyper;

/// The CPU-Adam thread's loop.
pub(crate) fn run_thread(shared: Arc<Shared>) {
    let mut worker = Worker { shared: shared.clone(), step: None, prepared: None };
    while let Some((key, job)) = shared.sched.pop(&|sg| shared.gradient_landed(sg)) {
        let start = Instant::now();
        worker.run(key, job);
        shared.policy.lock().unwrap().job_ran(start.elapsed());
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

/// The CPU-Adam thread's state.
struct Worker {
    shared: Arc<Shared>,
    step: Option<StepInFlight>,
    /// Outcome of the latest preparation and elements its rollbacks touched.
    prepared: Option<(u64, Result<()>, u64)>,
}

/// The step being finalized.
struct StepInFlight {
    result: StepResult,
    groups: Vec<GroupHparams>,
    /// Final tickets by sub-group id.
    finals: HashMap<u32, Ticket>,
    /// Final passes still to run.
    remaining: usize,
    /// State passes still to run (the step ticket completes after them too).
    settling: usize,
    /// Elements of the final passes still to run, a prefix in forward order, that may write
    /// the master weights and moments after publishing the weights' copy; `None`: all
    /// (`policy.rs`).
    state_after: Option<usize>,
    step_ticket: Ticket,
    prepared: Result<()>,
}

impl Worker {
    fn run(&mut self, key: JobKey, job: Job) {
        match job {
            Job::Speculate(sg) => self.speculate(&sg),
            Job::Prepare { plan, ticket } => self.prepare(&plan, ticket),
            Job::Decide(plan) => self.decide(*plan),
            Job::Finalize(sg) => self.finalize(key.serial, &sg),
            Job::State { sg, hp, scale } => self.deferred_state(&sg, &hp, scale),
        }
    }

    fn speculate(&mut self, sg: &Arc<SubGroup>) {
        let shared = &*self.shared;
        let Lifecycle::Speculating(ticket) = shared.sched.lifecycle(sg.id) else {
            unreachable!("a speculative step runs for a sub-group in Speculating")
        };
        let span = shared.tracer.span(Lane::CpuAdam, || format!("speculative step, sub-group {}", sg.id));
        let start = Instant::now();
        let outcome = guarded(|| speculation::speculate(shared, sg));
        let elapsed = start.elapsed();
        match outcome {
            Ok(None) => {
                shared.sched.set_lifecycle(sg.id, Lifecycle::Complete);
                drop(span.arg("ticket", ticket).arg("declined", "squares beyond f32"));
                shared.complete(ticket, Ok(()));
            }
            Ok(Some((done, ran))) if done == sg.numel => {
                shared.policy.lock().unwrap().pass_measured(ran, elapsed);
                shared.sched.set_lifecycle(sg.id, Lifecycle::Speculated(None));
                drop(span.arg("ticket", ticket));
                shared.complete(ticket, Ok(()));
            }
            Ok(Some((done, ran))) => {
                shared.policy.lock().unwrap().pass_measured(ran, elapsed);
                shared.sched.set_lifecycle(sg.id, Lifecycle::Speculated(Some(ticket)));
                drop(span.arg("preempted at", done));
            }
            Err(e) => {
                // Whatever chunks ran stay recorded and are made exact at step().
                let ran = matches!(sg.data.lock().unwrap().work.applied, Applied::Speculative(s) if s.done > 0);
                let state = if ran { Lifecycle::Speculated(None) } else { Lifecycle::Complete };
                shared.sched.set_lifecycle(sg.id, state);
                drop(span.arg("ticket", ticket).arg("ok", false));
                shared.complete(ticket, Err(e));
            }
        }
    }

    fn prepare(&mut self, plan: &PreparePlan, ticket: Ticket) {
        let shared = &*self.shared;
        let span = shared.tracer.span(Lane::CpuAdam, || "prepare (missing and late gradients)".into());
        let mut elements = 0;
        let outcome = guarded(|| speculation::prepare(shared, plan, &mut elements));
        let sumsq = guarded(|| local_sumsq(shared, plan.entries.iter().map(|e| &e.sg), plan.scale)).unwrap_or(f64::NAN);
        *shared.prepared.lock().unwrap() = Some((plan.serial, sumsq));
        self.prepared = Some((plan.serial, outcome.clone(), elements));
        drop(span.arg("ticket", ticket));
        shared.complete(ticket, outcome);
        // A speculative pass this preparation preempted goes on until the decision.
        for entry in &plan.entries {
            let applied = entry.sg.data.lock().unwrap().work.applied;
            if matches!(applied, Applied::Speculative(s) if s.done < entry.sg.numel) {
                shared.sched.resume_speculation(plan.serial, entry.sg.clone());
            }
        }
    }

    fn decide(&mut self, plan: StepPlan) {
        let shared = &*self.shared;
        let decide = shared.tracer.span(Lane::CpuAdam, || format!("decide step {}", plan.serial));
        let (prepared, prepare_elements) = match &plan.prepare {
            Some(p) => {
                let mut elements = 0;
                (guarded(|| speculation::prepare(shared, p, &mut elements)), elements)
            }
            None => match self.prepared.take() {
                Some((serial, outcome, elements)) if serial == plan.serial => (outcome, elements),
                _ => (Err(Error::new(Status::Panic, "the step's preparation is missing")), 0),
            },
        };
        let local = if prepared.is_ok() {
            guarded(|| local_sumsq(shared, plan.subgroups.iter().map(|(sg, _)| sg), unscale_factor(plan.loss_scale)))
        } else {
            Ok(f64::NAN)
        };
        // A sum that could not be read (a failed gradient copy) fails the step, which is then
        // skipped: no sub-group is stepped from a gradient that never arrived.
        let (local, prepared) = match local {
            Ok(local) => (local, prepared),
            Err(e) => (f64::NAN, prepared.and(Err(e))),
        };
        let (result, state_after) = finalize::decide_step(shared, &plan, local, prepare_elements);
        drop(
            decide
                .arg("norm", result.global_norm)
                .arg("clip", result.clip_coef)
                .arg("skipped", result.skipped)
                .arg("cancelled", result.cancelled)
                .arg("state after (elements)", state_after.map_or_else(|| "all".to_string(), |l| l.to_string())),
        );
        shared.complete(plan.decide_ticket, prepared.clone());
        let step = StepInFlight {
            result,
            groups: plan.groups,
            finals: plan.subgroups.iter().map(|(sg, t)| (sg.id, *t)).collect(),
            remaining: plan.subgroups.len(),
            settling: 0,
            state_after,
            step_ticket: plan.step_ticket,
            prepared,
        };
        self.continue_step(step);
    }

    fn finalize(&mut self, serial: u64, sg: &Arc<SubGroup>) {
        let shared = &*self.shared;
        let mut step = self.step.take().expect("a decided step is being finalized");
        debug_assert_eq!(step.result.serial, serial);
        let Lifecycle::FinalQueued(pending_spec) = shared.sched.lifecycle(sg.id) else {
            unreachable!("a final pass runs for a sub-group in FinalQueued")
        };
        let group = step.groups[sg.group as usize];
        // A speculative step this final pass absorbs reports what its own pass would have.
        let pending_spec = pending_spec.map(|t| {
            let verdict = guarded(|| unrun_speculation_outcome(shared, sg, &mut sg.data.lock().unwrap()));
            (t, verdict)
        });
        let span = shared.tracer.span(Lane::CpuAdam, || format!("finalize sub-group {}", sg.id));
        let start = Instant::now();
        let mut done = FinalPass::default();
        let outcome =
            guarded(|| finalize::final_pass(shared, sg, group, &mut step.state_after, &step.result, &mut done));
        let FinalPass { outcome: what, elements, state_after } = done;
        what.count(&mut step.result);
        {
            let mut policy = shared.policy.lock().unwrap();
            // Update passes, all of them: a kept speculative step's final pass updates the
            // elements its pass had not reached (all of them, where it was cancelled).
            if matches!(what, Outcome::Stepped | Outcome::SteppedStateAfter | Outcome::Kept) && elements > 0 {
                // With the state after, what the next forward waits for is the copy pass.
                policy.pass_measured(elements as usize, start.elapsed());
            }
            if state_after.is_some() {
                policy.state_deferred(sg.numel);
            }
        }
        step.result.final_pass_elements += elements;
        match state_after {
            Some((hp, scale)) => {
                // The copy was written, so the state follows even if staging failed. Before
                // the final ticket completes: a hand-off released by it must see the state
                // pending.
                shared.sched.submit_state(serial, sg.clone(), hp, scale);
                step.settling += 1;
            }
            None => shared.sched.set_lifecycle(sg.id, Lifecycle::Idle),
        }
        let final_ticket = step.finals[&sg.id];
        drop(span.arg("outcome", what.label()).arg("ticket", final_ticket));
        if let Some((t, verdict)) = pending_spec {
            shared.complete(t, verdict);
        }
        shared.complete(final_ticket, outcome);
        step.remaining -= 1;
        self.continue_step(step);
    }

    fn deferred_state(&mut self, sg: &Arc<SubGroup>, hp: &AdamHyper, scale: f32) {
        let shared = &*self.shared;
        let mut step = self.step.take().expect("a decided step is settling");
        let span = shared.tracer.span(Lane::CpuAdam, || format!("state, sub-group {}", sg.id));
        let start = Instant::now();
        let outcome = guarded(|| finalize::state_pass(shared, sg, hp, scale));
        if outcome.is_ok() {
            shared.policy.lock().unwrap().state_pass_measured(sg.numel, start.elapsed());
        }
        shared.sched.settle(sg.id);
        drop(span.arg("ok", outcome.is_ok()));
        if let Err(e) = outcome {
            // The state is not that of the step the published copy took: the step fails.
            step.prepared = step.prepared.and(Err(e));
        }
        step.settling -= 1;
        self.continue_step(step);
    }

    fn continue_step(&mut self, step: StepInFlight) {
        if step.remaining == 0 && step.settling == 0 {
            *self.shared.last_result.lock().unwrap() = Some((step.step_ticket, step.result));
            self.shared.complete(step.step_ticket, step.prepared);
        } else {
            self.step = Some(step);
        }
    }
}
