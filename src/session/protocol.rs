//! The caller's side of one optimizer step: `begin_step`, gradient hand-offs (with the sum of
//! squares of each slice taken as it arrives), `local_grad_sumsq` and `step`.

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use super::auto_budget::AUTO_BUDGET_AFTER;
use super::buffers::HostBuf;
use super::plans::{PrepareEntry, PreparePlan, StepPlan};
use super::trace::Lane;
use super::{
    Applied, HandOff, HandedSumsq, LateGrads, NormSource, Phase, Placement, STEP_LANE, Session, SessionOptions,
    SpecKind, SpecRecord, StepArgs, SubGroup, Ticket, Tracking, check_loss_scale, state_error, subgroup_lane,
    unscale_factor,
};
use crate::error::{Error, Result};
use crate::kernels::{self, Floats};

/// Bytes in GiB, for the trace.
fn gib(bytes: usize) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn backward_phase(t: &Tracking, what: &str) -> Result<(u32, u32)> {
    match t.phase {
        Phase::Backward { micro, micro_steps } => Ok((micro, micro_steps)),
        Phase::Prepared => {
            Err(state_error(format!("{what} after the backward ended with local_grad_sumsq; call step() next")))
        }
        Phase::Idle => Err(state_error(format!("{what}: no step has begun (call begin_step first)"))),
    }
}

impl Session {
    /// Starts an optimizer step whose backward uses `loss_scale` (`None`: the built-in
    /// scaler's current scale, or 1 without one) and `micro_steps` micro-steps.
    ///
    /// With the built-in scaler this waits for the previous step's decision, which sets
    /// the scale. With `gpu_budget_bytes`, the automatic split is applied here once enough
    /// steps were measured (and the automatic budget chosen, once the warm-up steps ran).
    pub fn begin_step(&self, loss_scale: Option<f32>, micro_steps: u32) -> Result<()> {
        let mut t = self.lock();
        if t.phase != Phase::Idle {
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
            None => {
                if t.decide_ticket != 0 {
                    self.shared.tickets.wait(t.decide_ticket, None, false).ok();
                }
                self.shared.scaler.lock().unwrap().map_or(1.0, |s| s.scale)
            }
        };
        if !t.reg.unprovisioned.is_empty() {
            self.provision(&mut t)?;
        }
        if self.options.gpu_budget_bytes > 0 {
            self.maybe_split(&mut t)?;
        }
        t.loss_scale = scale;
        t.serial += 1;
        t.slice_seen.fill(0);
        t.slices_done.fill(0);
        t.speculative = 0;
        t.late_gradients = 0;
        t.phase = Phase::Backward { micro: 0, micro_steps };
        Ok(())
    }

    /// The automatic split: each time the policy has measured enough steps, places more of
    /// the first sub-groups in forward order on the device (see `policy.rs` for the rule);
    /// with the automatic budget, first measures the budget once the warm-up steps have run.
    /// A device that refuses a placement ends the split there; with the automatic budget that
    /// is no error of the step (the budget is a best effort).
    fn maybe_split(&self, t: &mut Tracking) -> Result<()> {
        let numels: Vec<usize> = t.reg.live().map(|tr| tr.sg.numel).collect();
        let per_element = self.device_bytes_per_element();
        let automatic = self.options.gpu_budget_bytes == SessionOptions::GPU_BUDGET_AUTO;
        let budget = if automatic {
            let chosen = self.shared.policy.lock().unwrap().auto_budget();
            match chosen {
                Some(chosen) => chosen.budget,
                None if t.serial < AUTO_BUDGET_AFTER => return Ok(()),
                None => self.choose_budget()?,
            }
        } else {
            self.options.gpu_budget_bytes
        };
        let Some(count) = self.shared.policy.lock().unwrap().split(&numels, per_element, budget) else {
            return Ok(());
        };
        let ids: Vec<u32> = t.reg.live().take(count).map(|tr| tr.sg.id).collect();
        let mut refused = None;
        for (placed, &id) in ids.iter().enumerate() {
            if let Err(e) = self.place(t, id, Placement::Device) {
                let bytes = numels[..placed].iter().map(|n| n * per_element).sum();
                self.shared.policy.lock().unwrap().placement_refused(placed, bytes);
                refused = Some((placed, id, e));
                break;
            }
        }
        self.shared.tracer.instant(Lane::Caller, || {
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
    fn choose_budget(&self) -> Result<usize> {
        let transport = self.shared.transport().ok_or_else(|| Error::unsupported("a GPU budget needs a device"))?;
        let (free, total) = transport.device_memory()?;
        let chosen = {
            let mut policy = self.shared.policy.lock().unwrap();
            let chosen = policy.measure_budget(free, total);
            policy.budget_chosen(chosen);
            chosen
        };
        self.shared.tracer.instant(Lane::Caller, || {
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
        match self.options.gpu_budget_bytes {
            SessionOptions::GPU_BUDGET_AUTO => self.shared.policy.lock().unwrap().auto_budget().map(|b| b.budget),
            bytes => Some(bytes),
        }
    }

    /// Device bytes per element of a device-placed sub-group: f32 master, both moments and
    /// the gradient buffer.
    fn device_bytes_per_element(&self) -> usize {
        4 + 2 * self.options.moment_dtype.size() + self.options.accum_dtype.size()
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

    /// Whether a step has begun and not yet been given to `step()`.
    pub fn step_in_progress(&self) -> bool {
        self.lock().phase != Phase::Idle
    }

    pub fn next_micro_step(&self) -> Result<()> {
        let mut t = self.lock();
        let (micro, micro_steps) = backward_phase(&t, "next_micro_step")?;
        if micro + 1 >= micro_steps {
            return Err(state_error(format!("all {micro_steps} micro-steps of this step have begun")));
        }
        t.phase = Phase::Backward { micro: micro + 1, micro_steps };
        Ok(())
    }

    /// Copies (micro-step 1) or adds (later micro-steps, repeated hooks) a slice's gradient
    /// into its sub-group's gradient buffer, in the accumulation dtype, taking its sum of
    /// squares in the same pass at the last micro-step. Returns the ticket of the speculative
    /// step queued if this completed the sub-group. A gradient for a sub-group that already
    /// completed is kept aside; the sub-group is redone at `step()`.
    pub fn grad_copy(&self, slice: u32, src: Floats<'_>) -> Result<Option<Ticket>> {
        if src.dtype() != self.options.grad_dtype {
            return Err(Error::invalid(format!(
                "the gradient is {} but the session's gradient dtype is {}",
                src.dtype().name(),
                self.options.grad_dtype.name()
            )));
        }
        self.hand_off(slice, src.len(), "grad_copy", |h| {
            let dst = h.dst.ok_or_else(|| {
                Error::unsupported(format!(
                    "sub-group {}'s gradient is on the device: hand it over from device memory (so_session_grad_device)",
                    h.sg
                ))
            })?;
            Ok(kernels::copy_into(dst, src, h.accumulate, h.sumsq_scale)?.map(HandedSumsq::Known))
        })
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
        let mut t = self.lock();
        let span = self.shared.tracer.span(Lane::Caller, || {
            let name = t.reg.slices.get(slice as usize).map_or("?", |s| s.name.as_str());
            format!("gradient {name}")
        });
        let (micro, micro_steps) = backward_phase(&t, what)?;
        let info = t.reg.slice(slice, Some(numel))?;
        let (index, range) = (info.index, info.range.clone());
        let track = t.reg.track(info.sg)?;
        let (sg, final_ticket) = (track.sg.clone(), track.final_ticket);
        // The previous step's final pass first: until it ran, the sub-group is not idle; and
        // its state pass, when the final pass left the master weights and moments for later (the
        // gradient buffer is read).
        self.wait_final(final_ticket);
        self.wait_settled(sg.id);
        if self.shared.sched.is_complete(sg.id) {
            self.add_late(&mut t, &sg, index, range, deliver)?;
            drop(span.arg("late", true));
            return Ok(None);
        }
        let seen = t.slice_seen[slice as usize];
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
                sumsq_scale: last.then(|| unscale_factor(t.loss_scale)),
            })?;
            if last {
                data.sumsq[index] = handed;
            }
        }
        let ticket = self.mark_gradient(&mut t, slice, &sg, micro, micro_steps);
        drop(span.arg("sub-group", sg.id).arg("completes", ticket.is_some()));
        Ok(ticket)
    }

    /// Records that the caller wrote a slice's gradient (accumulated, for later
    /// micro-steps) directly into its sub-group's caller-provided gradient buffer. At the last
    /// micro-step its sum of squares is taken on the calling thread, unless the sub-group
    /// speculates: then its speculative step takes it on the pool.
    pub fn grad_written(&self, slice: u32) -> Result<Option<Ticket>> {
        let mut t = self.lock();
        let (micro, micro_steps) = backward_phase(&t, "grad_written")?;
        let info = t.reg.slice(slice, None)?;
        let (index, sg_id) = (info.index, info.sg);
        let track = t.reg.track(sg_id)?;
        let (sg, final_ticket) = (track.sg.clone(), track.final_ticket);
        if sg.data.lock().unwrap().grad.as_ref().is_none_or(|g| g.is_owned()) {
            return Err(Error::invalid(format!(
                "sub-group {sg_id} has a session-owned gradient buffer; hand gradients over with grad_copy"
            )));
        }
        self.wait_final(final_ticket);
        if self.shared.sched.is_complete(sg.id) {
            return Err(state_error(format!(
                "slice {:?}: its sub-group was already complete this step, so its buffer is in use; \
                 hand a late gradient over with grad_copy",
                t.reg.slices[slice as usize].name
            )));
        }
        if micro + 1 == micro_steps {
            // A sub-group that speculates has its sum taken on the pool by its speculative step,
            // as soon as the CPU-Adam thread takes it; one that does not would have it taken at
            // the decision, after backward, so it is taken here, beside the backward.
            let group = t.reg.groups[sg.group as usize];
            let speculates = self.shared.policy.lock().unwrap().should_speculate();
            let mut data = sg.data.lock().unwrap();
            data.sumsq[index] = if speculates && sg.speculation(group, &data) == Some(SpecKind::Full) {
                None
            } else {
                let grad = data.grad.as_ref().expect("a lent gradient buffer");
                let range = sg.slices[index].clone();
                Some(HandedSumsq::Known(kernels::grad_sumsq_here(grad.range(range), unscale_factor(t.loss_scale))?))
            };
        }
        Ok(self.mark_gradient(&mut t, slice, &sg, micro, micro_steps))
    }

    /// The sub-group's previous step must be final before its buffers are written again
    /// (the caller normally waited for the final ticket already).
    fn wait_final(&self, ticket: Ticket) {
        if ticket != 0 {
            self.shared.caller_wait(ticket, None, false).ok();
        }
    }

    /// Waits while the sub-group's state pass of the previous step is pending, counting
    /// the time as the caller's wait (it holds the backward up).
    fn wait_settled(&self, sg: u32) {
        let start = std::time::Instant::now();
        if self.shared.sched.wait_settled(sg) {
            let waited = start.elapsed().as_nanos() as u64;
            self.shared.caller_wait_ns.fetch_add(waited, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn mark_gradient(
        &self,
        t: &mut Tracking,
        slice: u32,
        sg: &Arc<SubGroup>,
        micro: u32,
        steps: u32,
    ) -> Option<Ticket> {
        let seen = std::mem::replace(&mut t.slice_seen[slice as usize], micro + 1);
        if micro + 1 != steps || seen == micro + 1 {
            return None;
        }
        t.slices_done[sg.id as usize] += 1;
        if t.slices_done[sg.id as usize] < sg.slices.len() {
            return None;
        }
        self.submit_complete(t, sg)
    }

    /// A sub-group's gradient is complete: plan its speculative step if the policy says it
    /// pays (a whole update's from the history of earlier steps, never from timings: the plan
    /// fixes the step's bits) and queue it (the ticket of it), else just record that it is
    /// complete.
    fn submit_complete(&self, t: &mut Tracking, sg: &Arc<SubGroup>) -> Option<Ticket> {
        let group = t.reg.groups[sg.group as usize];
        let mut data = sg.data.lock().unwrap();
        let (speculate, copy_ahead, device_ahead) = {
            let policy = self.shared.policy.lock().unwrap();
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
                Applied::Speculative(SpecRecord { kind, hp, scale: unscale_factor(t.loss_scale), done: 0 });
        }
        // Where device steps wait for the decision, the speculative step is recorded (it fixes
        // the bits) and left to the final pass, which takes it with its resolution.
        let queued = kind.is_some() && (data.placement == Placement::Host || device_ahead);
        drop(data);
        if !queued {
            self.shared.sched.mark_complete(sg.id);
            return None;
        }
        let ticket = self.shared.tickets.issue(subgroup_lane(sg.id));
        t.speculative += 1;
        self.shared.sched.submit_speculation(t.serial, sg.clone(), ticket);
        Some(ticket)
    }

    fn add_late(
        &self,
        t: &mut Tracking,
        sg: &SubGroup,
        index: usize,
        range: Range<usize>,
        deliver: impl FnOnce(HandOff<'_>) -> Result<Option<HandedSumsq>>,
    ) -> Result<()> {
        let mut late = sg.late.lock().unwrap();
        if late.is_none() {
            let mut buffer = self.pinned(HostBuf::zeros(self.options.accum_dtype, sg.numel, "late gradients")?)?;
            if let Err(e) = self.take_memory(t, buffer.bytes()) {
                if let Some(transport) = self.shared.transport() {
                    transport.unpin(buffer.as_mut_ptr());
                }
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
        t.late_gradients += 1;
        Ok(())
    }

    fn prepare_plan(&self, t: &Tracking) -> PreparePlan {
        let entries = t
            .reg
            .live()
            .map(|track| PrepareEntry {
                sg: track.sg.clone(),
                unseen: track.slices.clone().filter(|&i| t.slice_seen[i] == 0).map(|i| t.reg.slices[i].index).collect(),
            })
            .collect();
        PreparePlan { serial: t.serial, scale: unscale_factor(t.loss_scale), entries }
    }

    /// The sum of squares of this step's unscaled gradient over every sub-group (zeros for
    /// slices without a gradient, late gradients merged), for an all-reduce across ranks.
    /// Ends the backward (gradients after this are refused). Not finite iff a gradient
    /// element is inf or NaN. Waits only for the sums of squares (and late-gradient merges),
    /// never for a speculative pass.
    pub fn local_grad_sumsq(&self, timeout: Option<Duration>) -> Result<f64> {
        let (serial, ticket) = {
            let mut t = self.lock();
            let ticket = match t.phase {
                Phase::Backward { .. } => {
                    let plan = self.prepare_plan(&t);
                    let ticket = self.shared.tickets.issue(STEP_LANE);
                    self.shared.sched.submit_prepare(t.serial, plan, ticket);
                    t.phase = Phase::Prepared;
                    t.decide_ticket = ticket;
                    ticket
                }
                Phase::Prepared => t.decide_ticket,
                Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
            };
            (t.serial, ticket)
        };
        let span = self.shared.tracer.span(Lane::Caller, || "wait for the local sum of squares".into());
        self.shared.caller_wait(ticket, timeout, false)?;
        drop(span);
        match *self.shared.prepared.lock().unwrap() {
            Some((s, sumsq)) if s == serial => Ok(sumsq),
            _ => Err(Error::new(crate::error::Status::Panic, "the preparation left no sum of squares")),
        }
    }

    /// Ends the step: the CPU-Adam thread takes the norm (or the given one), decides whether
    /// to skip, clips, cancels speculative steps that have not started and makes every
    /// sub-group exact in forward order. Returns at once with the ticket that completes when
    /// every sub-group is final.
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
            Phase::Prepared => None,
            Phase::Idle => return Err(state_error("no step has begun (call begin_step first)")),
        };
        if let Some(transport) = self.shared.transport() {
            // The previous step's final tickets must have completed before publication is
            // ordered after the caller's stream: the previous step's weights would otherwise be
            // published only after this step's backward. A sub-group that got a gradient this
            // step was waited for at its hand-off; one that got none may still be finishing.
            for track in t.reg.live() {
                self.wait_final(track.final_ticket);
            }
            transport.before_step()?;
        }
        let decide_ticket = self.shared.tickets.issue(STEP_LANE);
        let mut subgroups = Vec::new();
        for track in t.reg.subgroups.iter_mut().flatten() {
            let ticket = self.shared.tickets.issue(subgroup_lane(track.sg.id));
            track.final_ticket = ticket;
            subgroups.push((track.sg.clone(), ticket));
        }
        let step_ticket = self.shared.tickets.issue(STEP_LANE);
        self.shared.step_ticket.store(step_ticket, std::sync::atomic::Ordering::Release);
        let waited_ns = self.shared.caller_wait_ns.load(std::sync::atomic::Ordering::Relaxed);
        let device_wait = self.shared.transport().map_or(0.0, |tr| tr.exposed_wait_s());
        let forward_wait_s = (waited_ns - t.wait_mark_ns) as f64 * 1e-9 + device_wait;
        t.wait_mark_ns = waited_ns;
        self.shared.policy.lock().unwrap().step_called(forward_wait_s);
        let plan = StepPlan {
            serial: t.serial,
            loss_scale: t.loss_scale,
            args,
            groups: t.reg.groups.clone(),
            subgroups,
            decide_ticket,
            step_ticket,
            prepare,
            speculative: t.speculative,
            late_gradients: t.late_gradients,
            forward_wait_s,
        };
        self.shared.sched.submit_decision(plan);
        t.decide_ticket = decide_ticket;
        t.phase = Phase::Idle;
        Ok(step_ticket)
    }
}
