//! The caller's side of one optimizer step: `begin_step`, hand-offs (with the sum of squares of
//! each slice taken as it arrives), `local_grad_sumsq` and `step`. [`Protocol`] is where the
//! step stands, kept under the session's lock beside the registry it reads.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::auto_budget::AUTO_BUDGET_AFTER;
use super::buffers::HostBuf;
use super::factors::{check_loss_scale, unscale_factor};
use super::plans::{PrepareEntry, PreparePlan, StepPlan};
use super::registry::Registry;
use super::shared::Shared;
use super::subgroup::{Applied, LateGrads, SpecKind, SpecRecord, SubGroup};
use super::tickets::{STEP_LANE, Ticket, subgroup_lane};
use super::trace::Lane;
use super::transport::{HandOff, HandedSumsq};
use super::types::{NormSource, Placement, SessionOptions, StepArgs};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, DType, Floats};

/// Where the caller's side of a step stands.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Phase {
    /// Between steps.
    Idle,
    /// Gradients arriving.
    Backward { micro: u32, micro_steps: u32 },
    /// `local_grad_sumsq` ran the preparation; only `step()` may follow.
    Prepared,
}

/// Where the caller's side of the step stands, and what this step has seen so far.
pub(crate) struct Protocol {
    phase: Phase,
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

fn state_error(message: impl Into<String>) -> Error {
    Error::new(Status::InvalidState, message)
}

/// Bytes in GiB, for the trace.
fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

impl Protocol {
    /// Whether a step has begun and not yet been given to `step()`.
    pub(crate) fn in_step(&self) -> bool {
        self.phase != Phase::Idle
    }

    pub(crate) fn new(loss_scale: f32) -> Protocol {
        Protocol {
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

    /// Refuses with `message` (what is done only between steps) while a step is in progress.
    pub(crate) fn between_steps(&self, message: &str) -> Result<()> {
        if self.phase == Phase::Idle { Ok(()) } else { Err(state_error(message)) }
    }

    /// The ticket of the latest decision, or of the preparation `local_grad_sumsq` queued
    /// before it (0 before either).
    pub(crate) fn decide_ticket(&self) -> Ticket {
        self.decide_ticket
    }

    /// The backward's micro-step and micro-step count, or why `what` cannot be called now.
    fn backward(&self, what: &str) -> Result<(u32, u32)> {
        match self.phase {
            Phase::Backward { micro, micro_steps } => Ok((micro, micro_steps)),
            Phase::Prepared => {
                Err(state_error(format!("{what} after the backward ended with local_grad_sumsq; call step() next")))
            }
            Phase::Idle => Err(state_error(format!("{what}: no step has begun (call begin_step first)"))),
        }
    }

    /// [`Session::begin_step`](super::Session::begin_step).
    pub(crate) fn begin_step(
        &mut self,
        reg: &mut Registry,
        shared: &Shared,
        loss_scale: Option<f32>,
        micro_steps: u32,
    ) -> Result<()> {
        if self.phase != Phase::Idle {
            return Err(state_error("the previous step has not been given to step()"));
        }
        if micro_steps == 0 {
            return Err(Error::invalid("micro_steps must be >= 1"));
        }
        let scale = match loss_scale {
            Some(s) => {
                check_loss_scale("loss_scale", s)?;
                s
            }
            None => shared.loss_scale_after(self.decide_ticket),
        };
        reg.provision_pending(shared)?;
        if shared.options.gpu_budget_bytes > 0 {
            maybe_split(reg, shared, self.serial)?;
        }
        self.loss_scale = scale;
        self.serial += 1;
        self.slice_seen.fill(0);
        self.slices_done.fill(0);
        self.speculative = 0;
        self.late_gradients = 0;
        self.phase = Phase::Backward { micro: 0, micro_steps };
        Ok(())
    }

    pub(crate) fn next_micro_step(&mut self) -> Result<()> {
        let (micro, micro_steps) = self.backward("next_micro_step")?;
        if micro + 1 >= micro_steps {
            return Err(state_error(format!("all {micro_steps} micro-steps of this step have begun")));
        }
        self.phase = Phase::Backward { micro: micro + 1, micro_steps };
        Ok(())
    }

    /// [`Session::hand_off`](super::Session::hand_off).
    pub(crate) fn hand_off(
        &mut self,
        reg: &mut Registry,
        shared: &Shared,
        slice: u32,
        numel: usize,
        what: &str,
        deliver: impl FnOnce(HandOff<'_>) -> Result<Option<HandedSumsq>>,
    ) -> Result<Option<Ticket>> {
        let span = shared.tracer.span(Lane::Caller, || format!("gradient {}", reg.slice_name(slice)));
        let (micro, micro_steps) = self.backward(what)?;
        let info = reg.slice(slice, Some(numel))?;
        let (index, range) = (info.index, info.range.clone());
        let track = reg.track(info.sg)?;
        let (sg, final_ticket) = (track.sg().clone(), track.final_ticket());
        // Until its previous step is done with it, the gradient buffer is read.
        shared.caller_wait_idle(sg.id, final_ticket);
        if shared.sched.is_complete(sg.id) {
            self.add_late(reg, shared, &sg, index, range, deliver)?;
            drop(span.arg("late", true));
            return Ok(None);
        }
        let seen = self.slice_seen[slice as usize];
        let last = micro + 1 == micro_steps;
        {
            let mut data = sg.data.lock().unwrap();
            let handed = deliver(HandOff {
                sg: sg.id,
                slice: index,
                dst: data.grad.as_mut().map(|g| g.range_mut(range.clone())),
                range,
                accumulate: seen > 0,
                late: false,
                sumsq_scale: last.then(|| unscale_factor(self.loss_scale)),
            })?;
            if last {
                data.sumsq[index] = handed;
            }
        }
        let ticket = self.mark_gradient(reg, shared, slice, &sg, micro, micro_steps);
        drop(span.arg("sub-group", sg.id).arg("completes", ticket.is_some()));
        Ok(ticket)
    }

    /// [`Session::grad_written`](super::Session::grad_written).
    pub(crate) fn grad_written(&mut self, reg: &Registry, shared: &Shared, slice: u32) -> Result<Option<Ticket>> {
        let (micro, micro_steps) = self.backward("grad_written")?;
        let info = reg.slice(slice, None)?;
        let (index, sg_id) = (info.index, info.sg);
        let track = reg.track(sg_id)?;
        let (sg, final_ticket) = (track.sg().clone(), track.final_ticket());
        if sg.data.lock().unwrap().grad.as_ref().is_none_or(|g| g.is_owned()) {
            return Err(Error::invalid(format!(
                "sub-group {sg_id} has a session-owned gradient buffer; hand gradients over with grad_copy"
            )));
        }
        shared.caller_wait_final(final_ticket);
        if shared.sched.state_pending(sg.id) {
            return Err(state_error(format!(
                "slice {:?}: the previous step's state pass of sub-group {sg_id} still reads its gradient \
                 buffer; wait for it (so_session_wait_settled) before writing the buffer",
                reg.slice_name(slice)
            )));
        }
        if shared.sched.is_complete(sg.id) {
            return Err(state_error(format!(
                "slice {:?}: its sub-group was already complete this step, so its buffer is in use; \
                 hand a late gradient over with grad_copy",
                reg.slice_name(slice)
            )));
        }
        if micro + 1 == micro_steps {
            // A sub-group that speculates has its sum taken on the pool by its speculative step,
            // as soon as the CPU-Adam thread takes it; one that does not would have it taken at
            // the decision, after backward, so it is taken here, beside the backward, on the
            // pool: one thread alone fell behind a fast backward (the same bits either way).
            let group = reg.groups()[sg.group as usize];
            let speculates = shared.policy.lock().unwrap().should_speculate();
            let mut data = sg.data.lock().unwrap();
            data.sumsq[index] = if speculates && sg.speculation(group, &data) == Some(SpecKind::Full) {
                None
            } else {
                let grad = data.grad.as_ref().expect("a lent gradient buffer");
                let range = sg.slices[index].clone();
                let sumsq = kernels::grad_sumsq(&shared.pool, grad.range(range), unscale_factor(self.loss_scale))?;
                Some(HandedSumsq::Known(sumsq))
            };
        }
        Ok(self.mark_gradient(reg, shared, slice, &sg, micro, micro_steps))
    }

    fn mark_gradient(
        &mut self,
        reg: &Registry,
        shared: &Shared,
        slice: u32,
        sg: &Arc<SubGroup>,
        micro: u32,
        steps: u32,
    ) -> Option<Ticket> {
        let seen = std::mem::replace(&mut self.slice_seen[slice as usize], micro + 1);
        if micro + 1 != steps || seen == micro + 1 {
            return None;
        }
        self.slices_done[sg.id as usize] += 1;
        if self.slices_done[sg.id as usize] < sg.slices.len() {
            return None;
        }
        self.submit_complete(reg, shared, sg)
    }

    /// A sub-group's gradient is complete: plan its speculative step if the policy says it
    /// pays (a whole update's from the history of earlier steps, never from timings: the plan
    /// fixes the step's bits) and queue it (the ticket of it), else just record that it is
    /// complete.
    fn submit_complete(&mut self, reg: &Registry, shared: &Shared, sg: &Arc<SubGroup>) -> Option<Ticket> {
        let group = reg.groups()[sg.group as usize];
        let mut data = sg.data.lock().unwrap();
        let (speculate, copy_ahead, device_ahead) = {
            let policy = shared.policy.lock().unwrap();
            (policy.should_speculate(), policy.should_copy_ahead(), policy.device_steps_ahead())
        };
        // A device-placed sub-group speculates with its whole update, queued on the device: it
        // has no copy to write ahead of its state. A copy written ahead fixes no bits, so
        // whether it is planned may follow timings (`policy.rs`, "Copy written ahead").
        let kind = sg
            .speculation(group, &data)
            .filter(|&k| k == SpecKind::Full || data.placement == Placement::Host)
            .filter(|&k| speculate && (k == SpecKind::Full || copy_ahead));
        if let Some(kind) = kind {
            let hp = sg.hyper(group, data.work.step_count + 1);
            data.work.applied =
                Applied::Speculative(SpecRecord { kind, hp, scale: unscale_factor(self.loss_scale), done: 0 });
        }
        // Where device steps wait for the decision, the speculative step is recorded (it fixes
        // the bits) and left to the final pass, which takes it with its resolution.
        let queued = kind.is_some() && (data.placement == Placement::Host || device_ahead);
        drop(data);
        if !queued {
            shared.sched.mark_complete(sg.id);
            return None;
        }
        let ticket = shared.tickets.issue(subgroup_lane(sg.id));
        self.speculative += 1;
        shared.sched.submit_speculation(self.serial, sg.clone(), ticket);
        Some(ticket)
    }

    fn add_late(
        &mut self,
        reg: &mut Registry,
        shared: &Shared,
        sg: &SubGroup,
        index: usize,
        range: Range<usize>,
        deliver: impl FnOnce(HandOff<'_>) -> Result<Option<HandedSumsq>>,
    ) -> Result<()> {
        let mut late = sg.late.lock().unwrap();
        if late.is_none() {
            let mut buffer = HostBuf::zeros(shared.options.accum_dtype, sg.numel, "late gradients")?;
            let pin = shared.pin(&mut buffer)?;
            if let Err(e) = reg.take_memory(shared.options.host_memory_limit, buffer.bytes()) {
                shared.unpin_all(pin.into_iter());
                return Err(e);
            }
            *late = Some(LateGrads { buffer, ranges: Vec::new() });
        }
        let late = late.as_mut().expect("just created");
        let seen = late.ranges.contains(&range);
        deliver(HandOff {
            sg: sg.id,
            slice: index,
            dst: Some(late.buffer.range_mut(range.clone())),
            range: range.clone(),
            accumulate: seen,
            late: true,
            sumsq_scale: None,
        })?;
        if !seen {
            late.ranges.push(range);
        }
        self.late_gradients += 1;
        Ok(())
    }

    fn prepare_plan(&self, reg: &Registry) -> PreparePlan {
        let entries = reg
            .live()
            .map(|track| PrepareEntry {
                sg: track.sg().clone(),
                unseen: reg.slices_of(track).filter(|(i, _)| self.slice_seen[*i] == 0).map(|(_, s)| s.index).collect(),
            })
            .collect();
        PreparePlan { serial: self.serial, scale: unscale_factor(self.loss_scale), entries }
    }

    /// Ends the backward for [`Session::local_grad_sumsq`](super::Session::local_grad_sumsq):
    /// queues the preparation once; the step's serial and the preparation's ticket.
    pub(crate) fn prepare(&mut self, reg: &Registry, shared: &Shared) -> Result<(u64, Ticket)> {
        let ticket = match self.phase {
            Phase::Backward { .. } => {
                let plan = self.prepare_plan(reg);
                let ticket = shared.tickets.issue(STEP_LANE);
                shared.sched.submit_prepare(self.serial, plan, ticket);
                self.phase = Phase::Prepared;
                self.decide_ticket = ticket;
                ticket
            }
            Phase::Prepared => self.decide_ticket,
            Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
        };
        Ok((self.serial, ticket))
    }

    /// [`Session::step`](super::Session::step), its arguments checked ([`check_step_args`]).
    pub(crate) fn step(&mut self, reg: &mut Registry, shared: &Shared, args: StepArgs) -> Result<Ticket> {
        let prepare = match self.phase {
            Phase::Backward { .. } => Some(self.prepare_plan(reg)),
            Phase::Prepared => None,
            Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
        };
        if let Some(transport) = shared.transport() {
            // The previous step's final tickets must have completed before publication is
            // ordered after the caller's stream: the previous step's weights would otherwise be
            // published only after this step's backward. A sub-group that got a gradient this
            // step was waited for at its hand-off; one that got none may still be finishing.
            for track in reg.live() {
                shared.caller_wait_final(track.final_ticket());
            }
            transport.before_step()?;
        }
        let decide_ticket = shared.tickets.issue(STEP_LANE);
        let subgroups = reg.issue_final_tickets(|sg| shared.tickets.issue(subgroup_lane(sg)));
        let step_ticket = shared.tickets.issue(STEP_LANE);
        shared.step_ticket.store(step_ticket, Ordering::Release);
        let waited_ns = shared.caller_wait_ns.load(Ordering::Relaxed);
        let device_wait = shared.transport().map_or(0.0, |tr| tr.exposed_wait_s());
        let forward_wait_s = (waited_ns - self.wait_mark_ns) as f64 * 1e-9 + device_wait;
        self.wait_mark_ns = waited_ns;
        shared.policy.lock().unwrap().step_called(forward_wait_s);
        let plan = StepPlan {
            serial: self.serial,
            loss_scale: self.loss_scale,
            args,
            groups: reg.groups().to_vec(),
            subgroups,
            decide_ticket,
            step_ticket,
            prepare,
            speculative: self.speculative,
            late_gradients: self.late_gradients,
            forward_wait_s,
        };
        shared.sched.submit_decision(plan);
        self.decide_ticket = decide_ticket;
        self.phase = Phase::Idle;
        Ok(step_ticket)
    }
}

/// Refuses a gradient that is not in the session's gradient dtype (`grad_copy`).
pub(crate) fn check_gradient_dtype(options: &SessionOptions, dtype: DType) -> Result<()> {
    if dtype == options.grad_dtype {
        return Ok(());
    }
    Err(Error::invalid(format!(
        "the gradient is {} but the session's gradient dtype is {}",
        dtype.name(),
        options.grad_dtype.name()
    )))
}

/// Copies (or adds) a gradient into the place a hand-off gives it, taking its sum of squares
/// when asked (`grad_copy`).
pub(crate) fn copy_gradient(h: HandOff<'_>, src: Floats<'_>) -> Result<Option<HandedSumsq>> {
    let dst = h.dst.ok_or_else(|| {
        Error::unsupported(format!(
            "sub-group {}'s gradient is on the device: hand it over from device memory (so_session_grad_device)",
            h.sg
        ))
    })?;
    Ok(kernels::copy_into(dst, src, h.accumulate, h.sumsq_scale)?.map(HandedSumsq::Known))
}

/// Refuses what `step()` cannot take: a `max_norm` that is not finite and >= 0, a negative
/// given norm.
pub(crate) fn check_step_args(args: &StepArgs) -> Result<()> {
    if !(args.max_norm.is_finite() && args.max_norm >= 0.0) {
        return Err(Error::invalid(format!("max_norm = {} must be finite and >= 0", args.max_norm)));
    }
    if let NormSource::Given(norm) = args.norm {
        // inf or NaN is a verdict (the step is skipped); a negative norm is a caller bug.
        if norm < 0.0 {
            return Err(Error::invalid(format!("the given global norm {norm} is negative")));
        }
    }
    Ok(())
}

/// Waits, without the session's lock, for the preparation `ticket` of step `serial`
/// ([`Protocol::prepare`]); the local sum of squares it left.
pub(crate) fn local_sumsq(shared: &Shared, serial: u64, ticket: Ticket, timeout: Option<Duration>) -> Result<f64> {
    let span = shared.tracer.span(Lane::Caller, || "wait for the local sum of squares".into());
    shared.caller_wait(ticket, timeout, false)?;
    drop(span);
    match *shared.prepared.lock().unwrap() {
        Some((s, sumsq)) if s == serial => Ok(sumsq),
        _ => Err(Error::new(Status::Panic, "the preparation left no sum of squares")),
    }
}

/// The automatic split: each time the policy has measured enough steps, places more of
/// the first sub-groups in forward order on the device (see `policy.rs` for the rule);
/// with the automatic budget, first measures the budget once the warm-up steps have run.
/// A device that refuses a placement ends the split there; with the automatic budget that
/// is no error of the step (the budget is a best effort).
fn maybe_split(reg: &Registry, shared: &Shared, serial: u64) -> Result<()> {
    let options = &shared.options;
    let numels: Vec<usize> = reg.live().map(|tr| tr.sg().numel).collect();
    let per_element = options.device_bytes_per_element();
    let automatic = options.gpu_budget_bytes == SessionOptions::GPU_BUDGET_AUTO;
    let budget = if automatic {
        let chosen = shared.policy.lock().unwrap().auto_budget();
        match chosen {
            Some(chosen) => chosen.budget,
            None if serial < AUTO_BUDGET_AFTER => return Ok(()),
            None => choose_budget(shared)?,
        }
    } else {
        options.gpu_budget_bytes
    };
    let Some(count) = shared.policy.lock().unwrap().split(&numels, per_element, budget) else {
        return Ok(());
    };
    let ids: Vec<u32> = reg.live().take(count).map(|tr| tr.sg().id).collect();
    let mut refused = None;
    for (placed, &id) in ids.iter().enumerate() {
        if let Err(e) = reg.place(id, Placement::Device, shared) {
            let bytes = numels[..placed].iter().map(|n| n * per_element).sum();
            shared.policy.lock().unwrap().placement_refused(placed, bytes);
            refused = Some((placed, id, e));
            break;
        }
    }
    shared.tracer.instant(Lane::Caller, || {
        let placed = refused.as_ref().map_or(count, |r| r.0);
        let mut what = format!(
            "automatic split: the first {placed} of {} sub-groups on the GPU (budget {})",
            numels.len(),
            gib(budget)
        );
        if let Some((_, id, e)) = &refused {
            what.push_str(&format!("; sub-group {id} could not be placed: {}", e.message));
        }
        what
    });
    match refused {
        Some((_, _, e)) if !automatic => Err(e),
        _ => Ok(()),
    }
}

/// The automatic budget: the device's free memory now, less the headroom, within the
/// caller's limit. The split places within it from now on.
fn choose_budget(shared: &Shared) -> Result<usize> {
    let transport = shared.transport().ok_or_else(|| Error::unsupported("a GPU budget needs a device"))?;
    let (free, total) = transport.device_memory()?;
    let chosen = {
        let mut policy = shared.policy.lock().unwrap();
        let chosen = policy.measure_budget(free, total);
        policy.budget_chosen(chosen);
        chosen
    };
    shared.tracer.instant(Lane::Caller, || {
        let limit = chosen.limit.map_or(String::new(), |l| format!(", the caller's limit {}", gib(l)));
        format!(
            "automatic GPU budget {} ({} free of {} after {AUTO_BUDGET_AFTER} steps{limit}, less a headroom of {}): \
             the split places within it",
            gib(chosen.budget),
            gib(free),
            gib(total),
            gib(chosen.headroom),
        )
    });
    Ok(chosen.budget)
}
