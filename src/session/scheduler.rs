//! The CPU-Adam thread's schedule: which job runs next, and where each sub-group is in its
//! step.
//!
//! Jobs run one at a time: the runnable job of highest priority first. A priority is `(step
//! serial, class, forward index)`: everything of an earlier step before anything of a later
//! one; within a step the decision (and the preparation before it) first, then
//! finalizations, then speculative steps; among finalizations and among speculative steps,
//! the sub-group the next forward needs first (registration order) first; last, the master
//! weights and moments of sub-groups whose final pass wrote only the weights' copy, in the
//! order their gradients completed in that step's backward: the next backward delivers its
//! gradients in about that order, and each waits for its sub-group's pass (FSDP2 gathers
//! the root's parameters, the output layer's among them, first in forward, but backward
//! produces the output layer's gradient first). A job is runnable
//! when it would not wait on the device: a speculative step once its sub-group's gradient
//! has landed, the decision once every gradient of its step has (a CUDA caller reaches
//! `step()` while the GPU is still in backward; a decision that waited there would hold up
//! the speculative steps of the gradients landing meanwhile). A speculative pass runs in
//! chunks and stops between two when a runnable job of a higher class is waiting
//! ("preemption"): what it did is kept, and the finalization completes the rest.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::plans::{PreparePlan, StepPlan};
use super::subgroup::SubGroup;
use super::tickets::Ticket;
use crate::kernels::AdamHyper;

/// How often the CPU-Adam thread looks again while every queued job waits on the device.
const LANDING_POLL: Duration = Duration::from_micros(100);

/// Where a sub-group is in the current step. Speculative tickets that are still pending
/// travel with the state, to complete with the final pass that absorbed their work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Lifecycle {
    /// Final for its latest step; this step's gradients may be arriving.
    Idle,
    /// Its gradient is complete and nothing is applied to it.
    Complete,
    SpecQueued(Ticket),
    Speculating(Ticket),
    /// A speculative step is applied, to all of it or (ticket pending) to the part a
    /// preempted pass reached.
    Speculated(Option<Ticket>),
    /// Decided: its final pass is queued.
    FinalQueued(Option<Ticket>),
    /// The copy of its weights is final and published; its master weights and moments are
    /// written by a pass of their own, queued. The gradient buffer is still read: the next
    /// hand-off waits.
    StatePending,
    Removed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Class {
    /// `local_grad_sumsq`'s preparation: a speculative pass it preempted resumes after it.
    Prepare,
    Decide,
    Finalize,
    Speculate,
    State,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct JobKey {
    pub serial: u64,
    pub class: Class,
    /// Among finalizations and speculative steps the sub-group's id (forward order); among
    /// state passes its gradient's completion rank.
    pub forward: u64,
    seq: u64,
}

pub(crate) enum Job {
    Prepare { plan: PreparePlan, ticket: Ticket },
    Decide(Box<StepPlan>),
    Finalize(Arc<SubGroup>),
    Speculate(Arc<SubGroup>),
    State { sg: Arc<SubGroup>, hp: AdamHyper, scale: f32 },
}

#[derive(Default)]
struct Queue {
    ready: BTreeMap<JobKey, Job>,
    seq: u64,
    closed: bool,
    lifecycle: Vec<Lifecycle>,
    /// When each sub-group's gradient last completed (`completions` at that time).
    completed_at: Vec<u64>,
    completions: u64,
}

impl Queue {
    fn record_completion(&mut self, id: u32) {
        self.completions += 1;
        self.completed_at[id as usize] = self.completions;
    }

    fn push(&mut self, serial: u64, class: Class, forward: u64, job: Job) {
        self.seq += 1;
        self.ready.insert(JobKey { serial, class, forward, seq: self.seq }, job);
    }

    /// The first runnable job of the earliest step queued (`urgent`: a job that preempts a
    /// speculative pass).
    fn next_runnable(&self, landed: &dyn Fn(u32) -> bool, urgent: bool) -> Option<JobKey> {
        let serial = self.ready.keys().next()?.serial;
        self.ready
            .iter()
            .take_while(|(k, _)| k.serial == serial && !(urgent && k.class >= Class::Speculate))
            .find(|(_, job)| job.runnable(landed))
            .map(|(k, _)| *k)
    }
}

impl Job {
    fn runnable(&self, landed: &dyn Fn(u32) -> bool) -> bool {
        match self {
            Job::Speculate(sg) => landed(sg.id),
            Job::Decide(plan) => plan.subgroups.iter().all(|(sg, _)| landed(sg.id)),
            Job::Prepare { .. } | Job::Finalize(_) | Job::State { .. } => true,
        }
    }
}

#[derive(Default)]
pub(crate) struct Scheduler {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// A sub-group left `StatePending`.
    settled: Condvar,
    /// A job of a higher class than a speculative step is waiting.
    preempt: AtomicBool,
}

impl Scheduler {
    fn push(&self, serial: u64, class: Class, forward: u64, job: Job) {
        let mut q = self.queue.lock().unwrap();
        q.push(serial, class, forward, job);
        self.update_preempt(&q);
        self.wake.notify_one();
    }

    fn update_preempt(&self, q: &Queue) {
        let urgent = q.ready.keys().next().is_some_and(|k| k.class < Class::Speculate);
        self.preempt.store(urgent, Ordering::Release);
    }

    /// Whether a running speculative pass should stop at its next chunk boundary: a job of a
    /// higher class is queued (the flag, cheap) and runnable (`landed`: see [`run`]).
    pub(crate) fn should_yield(&self, landed: &dyn Fn(u32) -> bool) -> bool {
        if !self.preempt.load(Ordering::Acquire) {
            return false;
        }
        self.queue.lock().unwrap().next_runnable(landed, true).is_some()
    }

    pub(crate) fn add_subgroup(&self, id: u32) {
        let mut q = self.queue.lock().unwrap();
        debug_assert_eq!(q.lifecycle.len(), id as usize);
        q.lifecycle.push(Lifecycle::Idle);
        q.completed_at.push(0);
    }

    pub(crate) fn remove_subgroup(&self, id: u32) {
        self.queue.lock().unwrap().lifecycle[id as usize] = Lifecycle::Removed;
    }

    /// Whether the sub-group's gradient of this step is complete (a further gradient is late).
    pub(crate) fn is_complete(&self, id: u32) -> bool {
        !matches!(self.queue.lock().unwrap().lifecycle[id as usize], Lifecycle::Idle)
    }

    pub(crate) fn lifecycle(&self, id: u32) -> Lifecycle {
        self.queue.lock().unwrap().lifecycle[id as usize]
    }

    pub(crate) fn set_lifecycle(&self, id: u32, state: Lifecycle) {
        self.queue.lock().unwrap().lifecycle[id as usize] = state;
    }

    /// The sub-group's gradient of this step is complete, and it does not speculate.
    pub(crate) fn mark_complete(&self, id: u32) {
        let mut q = self.queue.lock().unwrap();
        q.lifecycle[id as usize] = Lifecycle::Complete;
        q.record_completion(id);
    }

    /// The sub-group's gradient of this step is complete: its speculative step is queued.
    pub(crate) fn submit_speculation(&self, serial: u64, sg: Arc<SubGroup>, ticket: Ticket) {
        let mut q = self.queue.lock().unwrap();
        q.lifecycle[sg.id as usize] = Lifecycle::SpecQueued(ticket);
        q.record_completion(sg.id);
        let forward = u64::from(sg.id);
        q.push(serial, Class::Speculate, forward, Job::Speculate(sg));
        self.update_preempt(&q);
        self.wake.notify_one();
    }

    pub(crate) fn submit_prepare(&self, serial: u64, plan: PreparePlan, ticket: Ticket) {
        self.push(serial, Class::Prepare, 0, Job::Prepare { plan, ticket });
    }

    pub(crate) fn submit_decision(&self, plan: StepPlan) {
        self.push(plan.serial, Class::Decide, 0, Job::Decide(Box::new(plan)));
    }

    /// Queues again the rest of a speculative step a preparation preempted (no decision yet).
    pub(crate) fn resume_speculation(&self, serial: u64, sg: Arc<SubGroup>) {
        let mut q = self.queue.lock().unwrap();
        if let Lifecycle::Speculated(Some(ticket)) = q.lifecycle[sg.id as usize] {
            q.lifecycle[sg.id as usize] = Lifecycle::SpecQueued(ticket);
            let forward = u64::from(sg.id);
            q.push(serial, Class::Speculate, forward, Job::Speculate(sg));
            self.update_preempt(&q);
        }
    }

    /// Cancels the queued speculative step of sub-group `id`, if any: it becomes `Complete`,
    /// and the cancelled step's ticket, returned, is the caller's to complete.
    pub(crate) fn cancel_speculation(&self, id: u32) -> Option<Ticket> {
        let mut q = self.queue.lock().unwrap();
        let Lifecycle::SpecQueued(ticket) = q.lifecycle[id as usize] else { return None };
        q.ready.retain(|k, _| !(k.class == Class::Speculate && k.forward == u64::from(id)));
        q.lifecycle[id as usize] = Lifecycle::Complete;
        self.update_preempt(&q);
        Some(ticket)
    }

    /// Queues the pass that writes the master weights and moments of a sub-group whose final
    /// pass wrote only the weights' copy, in the order the sub-groups' gradients completed.
    pub(crate) fn submit_state(&self, serial: u64, sg: Arc<SubGroup>, hp: AdamHyper, scale: f32) {
        let mut q = self.queue.lock().unwrap();
        q.lifecycle[sg.id as usize] = Lifecycle::StatePending;
        let completed = q.completed_at[sg.id as usize];
        q.push(serial, Class::State, completed, Job::State { sg, hp, scale });
        self.update_preempt(&q);
        self.wake.notify_one();
    }

    /// The sub-group's state is written: it is idle.
    pub(crate) fn settle(&self, id: u32) {
        self.queue.lock().unwrap().lifecycle[id as usize] = Lifecycle::Idle;
        self.settled.notify_all();
    }

    /// Waits while the sub-group's state pass is pending, up to `deadline` (None: forever);
    /// returns whether it waited, or `Err(())` if the deadline passed with the pass pending.
    pub(crate) fn wait_settled(&self, id: u32, deadline: Option<Instant>) -> Result<bool, ()> {
        let mut q = self.queue.lock().unwrap();
        let mut waited = false;
        while q.lifecycle[id as usize] == Lifecycle::StatePending {
            waited = true;
            q = match deadline {
                None => self.settled.wait(q).unwrap(),
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now()).ok_or(())?;
                    self.settled.wait_timeout(q, left).unwrap().0
                }
            };
        }
        Ok(waited)
    }

    /// Whether the sub-group's state pass is pending (its gradient buffer is being read).
    pub(crate) fn state_pending(&self, id: u32) -> bool {
        self.queue.lock().unwrap().lifecycle[id as usize] == Lifecycle::StatePending
    }

    /// Queues the final pass of every sub-group of a decided step, in forward order; the
    /// speculative steps of this step that have not started are cancelled first. Returns
    /// how many were cancelled.
    pub(crate) fn finalize_all(&self, serial: u64, subgroups: &[Arc<SubGroup>]) -> u32 {
        let mut q = self.queue.lock().unwrap();
        let mut cancelled = 0;
        for sg in subgroups {
            let id = sg.id as usize;
            let pending = match q.lifecycle[id] {
                Lifecycle::SpecQueued(t) => {
                    q.ready.retain(|k, _| !(k.class == Class::Speculate && k.forward == u64::from(sg.id)));
                    cancelled += 1;
                    Some(t)
                }
                Lifecycle::Speculated(t) => t,
                Lifecycle::Complete | Lifecycle::Idle => None,
                other => unreachable!("sub-group {id} is {other:?} at its step's decision"),
            };
            q.lifecycle[id] = Lifecycle::FinalQueued(pending);
            q.push(serial, Class::Finalize, u64::from(sg.id), Job::Finalize(sg.clone()));
        }
        self.update_preempt(&q);
        cancelled
    }

    /// Takes the next runnable job (waiting for one); `None` once closed and drained. A
    /// speculative step taken moves its sub-group to `Speculating`.
    pub(crate) fn pop(&self, landed: &dyn Fn(u32) -> bool) -> Option<(JobKey, Job)> {
        let mut q = self.queue.lock().unwrap();
        loop {
            if let Some((key, job)) = q.next_runnable(landed, false).and_then(|key| q.ready.remove_entry(&key)) {
                if let Job::Speculate(sg) = &job {
                    let id = sg.id as usize;
                    let Lifecycle::SpecQueued(t) = q.lifecycle[id] else {
                        unreachable!("a queued speculative step's sub-group is {:?}", q.lifecycle[id])
                    };
                    q.lifecycle[id] = Lifecycle::Speculating(t);
                }
                self.update_preempt(&q);
                return Some((key, job));
            }
            if q.ready.is_empty() {
                if q.closed {
                    return None;
                }
                q = self.wake.wait(q).unwrap();
            } else {
                // Every queued job waits on the device, which signals no condition variable.
                q = self.wake.wait_timeout(q, LANDING_POLL).unwrap().0;
            }
        }
    }

    /// No more jobs: the thread finishes those queued, then stops.
    pub(crate) fn close(&self) {
        self.queue.lock().unwrap().closed = true;
        self.wake.notify_all();
    }
}
