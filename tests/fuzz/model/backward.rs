//! The backward pass of one step: its beginning, micro-steps, gradient hand-offs (copied or
//! written into the caller's buffer, in time or late) and the speculative steps they submit.

use std::ffi::c_void;
use std::path::Path;

use superoffload::kernels::{AdamMode, DType};
use superoffload::session::GroupHparams;

use super::step::slices_sumsq;
use super::{Check, Phase, Sess, SgM, SpecM, Stats, judge, unscale_of};
use crate::common::{Rng, Store};
use crate::fuzz::api::{self, Status, Ticket};
use crate::fuzz::mem::{RawBuf, put, store_bytes, sub, zeros};
use crate::fuzz::ops::*;
use crate::fuzz::reference;

/// Gradient values of a fill, in `dtype`.
pub fn fill_values(fill: &Fill, n: usize, scale: f64, dtype: DType) -> Store {
    let mut rng = Rng::new(fill.seed);
    let mut v: Vec<f64> = (0..n).map(|_| rng.normalish(fill.magnitude) * scale).collect();
    if n > 0 {
        match fill.special {
            Special::None => {}
            Special::Nan(i) => v[i % n] = f64::NAN,
            Special::Inf(i) => v[i % n] = f64::INFINITY,
            Special::NegInf(i) => v[i % n] = f64::NEG_INFINITY,
            Special::Huge(i) => v[i % n] = 1e30,
        }
    }
    Store::from_f64(dtype, v.into_iter())
}

impl Sess {
    // ----- one step ---------------------------------------------------------------------

    pub(super) fn begin_step(
        &mut self,
        loss_scale: f32,
        micro_steps: u32,
        settle: bool,
        stats: &mut Stats,
        scratch: &Path,
        observe: bool,
    ) -> Check {
        if self.phase == Phase::Idle && self.pending.as_ref().is_some_and(|p| settle || p.needs_settle) {
            self.settle(stats, scratch, None, observe)?;
        }
        self.prune();
        if self.pending.is_some() {
            stats.lazy += 1;
        }
        let st = unsafe { self.h.begin_step(loss_scale, micro_steps) };
        api::count_call();
        let mut e = Vec::new();
        if self.phase != Phase::Idle {
            e.push(Status::InvalidState);
        }
        if micro_steps == 0 {
            e.push(Status::InvalidArgument);
        }
        let explicit = loss_scale != 0.0;
        // The reciprocal must be finite in f32 too (the unscale factor).
        if explicit && !(loss_scale.is_finite() && loss_scale > 0.0 && unscale_of(loss_scale).is_finite()) {
            e.push(Status::InvalidArgument);
        }
        let s = if explicit { loss_scale } else { self.scaler.map_or(1.0, |s| s.scale) };
        if !judge(&format!("so_session_begin_step({loss_scale}, {micro_steps})"), st, &e)? {
            stats.refusals += 1;
            return self.refused(stats);
        }
        self.s = s;
        self.serial += 1;
        self.phase = Phase::Backward { micro: 0, micro_steps };
        for sl in &mut self.slices {
            sl.seen = 0;
        }
        for sg in self.sgs.iter_mut().flatten() {
            sg.slices_done = 0;
            sg.submitted = None;
            sg.late_merged = false;
        }
        self.spec_min = 0;
        self.spec_max = 0;
        self.late_count = 0;
        Ok(())
    }

    pub(super) fn next_micro(&mut self, stats: &mut Stats) -> Check {
        let st = unsafe { self.h.next_micro_step() };
        api::count_call();
        match self.phase {
            Phase::Backward { micro, micro_steps } if micro + 1 < micro_steps => {
                judge("so_session_next_micro_step", st, &[])?;
                self.phase = Phase::Backward { micro: micro + 1, micro_steps };
                Ok(())
            }
            _ => {
                judge("so_session_next_micro_step", st, &[Status::InvalidState])?;
                stats.refusals += 1;
                self.refused(stats)
            }
        }
    }

    /// Can the sub-group step speculatively with these hyperparameters, and does it write the
    /// copy alone (`Some(true)`: no exact rollback, but a copy to write ahead)?
    fn speculation(&self, sg: &SgM, g: &GroupHparams) -> Option<bool> {
        let o = &self.opts;
        let decay = match o.mode {
            AdamMode::AdamW => (1.0 - g.lr * g.weight_decay) as f32,
            AdamMode::L2 => 1.0,
        };
        if o.speculation == api::SPEC_OFF || sg.master_dtype != DType::F32 {
            return None;
        }
        let rollback = o.moment == DType::F32 && g.beta1 > 0.0 && g.beta2 > 0.0 && decay > 0.0;
        if rollback { Some(false) } else { o.copy.is_some().then_some(true) }
    }

    /// A gradient of the slice arrived in the current micro-step: returns whether it
    /// completed its sub-group (which then submits its speculative step or measurement).
    fn mark(&mut self, slice: u32) -> bool {
        let Phase::Backward { micro, micro_steps } = self.phase else { unreachable!() };
        let sl = &mut self.slices[slice as usize];
        let seen = std::mem::replace(&mut sl.seen, micro + 1);
        let sgid = sl.sg;
        if micro + 1 != micro_steps || seen == micro + 1 {
            return false;
        }
        let group = {
            let sg = self.sgs[sgid as usize].as_mut().unwrap();
            sg.slices_done += 1;
            if sg.slices_done < sg.slices.len() {
                return false;
            }
            self.groups[sg.group as usize]
        };
        let sg = self.sgs[sgid as usize].as_ref().unwrap();
        let certain = self.opts.speculation == api::SPEC_ON;
        let spec = self.speculation(sg, &group).map(|copy_ahead| {
            // Non-finite: the speculative step fails; squares beyond f32: it is declined.
            let applied = slices_sumsq(&self.slices, sg, unscale_of(self.s)) <= f32::MAX as f64;
            SpecM { hp: group, g: sg.g.clone(), applied, certain, copy_ahead }
        });
        if spec.is_some() {
            self.spec_min += certain as u32;
            self.spec_max += 1;
        }
        self.sgs[sgid as usize].as_mut().unwrap().submitted = Some(spec);
        true
    }

    pub(super) fn grad_copy(
        &mut self,
        slice: u32,
        numel: usize,
        fill: &Fill,
        bad: GradBad,
        stats: &mut Stats,
    ) -> Check {
        let gdt = self.opts.grad;
        let values = fill_values(fill, numel, self.s as f64, gdt);
        let bytes = store_bytes(&values);
        // Aligned storage, or one byte off.
        let buf = RawBuf::new(bytes.len() + 8);
        let off = if bad == GradBad::Misaligned { 1 } else { 0 };
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.ptr().add(off), bytes.len()) };
        let ptr: *const c_void =
            if bad == GradBad::NullGrad { std::ptr::null() } else { buf.ptr().wrapping_add(off).cast() };
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe {
            self.h.grad_copy(
                slice,
                ptr,
                numel,
                if bad == GradBad::NullOutTicket { std::ptr::null_mut() } else { &mut ticket },
            )
        };
        api::count_call();
        let mut e = Vec::new();
        match bad {
            GradBad::NullGrad => e.push(Status::NullArgument),
            GradBad::Misaligned => e.push(Status::InvalidArgument),
            _ => {}
        }
        if !matches!(self.phase, Phase::Backward { .. }) {
            e.push(Status::InvalidState);
        }
        let target = self.live_slice(slice).map(|s| (s.sg, s.range.clone()));
        match &target {
            None => e.push(Status::NotFound),
            Some((_, r)) if r.len() != numel => e.push(Status::InvalidArgument),
            _ => {}
        }
        let late_alloc = target.as_ref().and_then(|(sgid, _)| {
            let sg = self.sg(*sgid).unwrap();
            (sg.submitted.is_some() && sg.late.is_none()).then_some(sg.numel * self.opts.accum.size())
        });
        if let (Some(more), Some(limit)) = (late_alloc, self.opts.limit)
            && self.host_bytes + more > limit
        {
            e.push(Status::OutOfResources);
        }
        if !judge(&format!("so_session_grad_copy(slice {slice}, {numel})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "grad_copy wrote its ticket on failure");
            return self.refused(stats);
        }
        let (sgid, range) = target.unwrap();
        let accum = self.opts.accum;
        let sg = self.sgs[sgid as usize].as_mut().unwrap();
        if sg.submitted.is_some() {
            // Late: kept aside, merged at step().
            if sg.late.is_none() {
                sg.late = Some((zeros(accum, sg.numel), Vec::new()));
                sg.late_bytes = sg.numel * accum.size();
                self.host_bytes += sg.late_bytes;
            }
            let (buf, ranges) = sg.late.as_mut().unwrap();
            let seen = ranges.contains(&range);
            reference::copy_into(buf, range.clone(), &values, seen);
            if !seen {
                ranges.push(range);
            }
            self.late_count += 1;
            stats.late += 1;
            if bad != GradBad::NullOutTicket {
                ensure!(ticket == 0, "a late gradient returned ticket {ticket}");
            }
            return Ok(());
        }
        let accumulate = self.slices[slice as usize].seen > 0;
        reference::copy_into(&mut sg.g, range, &values, accumulate);
        let completes = self.mark(slice);
        self.after_handoff(slice, completes, bad != GradBad::NullOutTicket, ticket)
    }

    fn after_handoff(&mut self, slice: u32, completes: bool, has_out: bool, ticket: Ticket) -> Check {
        if has_out && !completes {
            ensure!(ticket == 0, "slice {slice}: a hand-off that completes nothing returned ticket {ticket}");
        }
        if !completes {
            return Ok(());
        }
        let sgid = self.slices[slice as usize].sg;
        let sg = self.sgs[sgid as usize].as_mut().unwrap();
        let Some(Some(spec)) = &mut sg.submitted else {
            // No speculative step: nothing queued, no ticket.
            ensure!(!has_out || ticket == 0, "slice {slice}: ticket {ticket} for a sub-group that cannot speculate");
            return Ok(());
        };
        // A speculative step that is cancelled before it runs (or declined) completes its
        // ticket with OK.
        let allowed = if spec.applied { vec![Status::Ok] } else { vec![Status::NonFinite, Status::Ok] };
        if !has_out {
            if allowed != [Status::Ok] {
                self.hidden.push((self.last_seen, allowed));
            }
            return Ok(());
        }
        if ticket == 0 {
            // The policy (speculation auto) did not speculate.
            ensure!(!spec.certain, "slice {slice}: speculation is on but the completing hand-off returned ticket 0");
            sg.submitted = Some(None);
            self.spec_max -= 1;
            return Ok(());
        }
        if !spec.certain {
            spec.certain = true;
            self.spec_min += 1;
        }
        self.seen_ticket(ticket);
        self.handoffs.push((ticket, allowed));
        Ok(())
    }

    pub(super) fn seen_ticket(&mut self, t: Ticket) {
        self.last_seen = self.last_seen.max(t);
    }

    pub(super) fn grad_written(&mut self, slice: u32, fill: &Fill, add: bool, stats: &mut Stats) -> Check {
        let target = self.live_slice(slice).map(|s| (s.sg, s.range.clone()));
        let backward = matches!(self.phase, Phase::Backward { .. });
        // The caller writes its buffer only while the session may not read it.
        if let (true, Some((sgid, range))) = (backward, &target) {
            let (writable, final_ticket, waited) = {
                let sg = self.sg(*sgid).unwrap();
                (sg.grad_buf.is_some() && sg.submitted.is_none(), sg.final_ticket, sg.final_waited)
            };
            if writable {
                if !waited {
                    let st = self.h.ticket_wait(final_ticket, -1);
                    api::count_call();
                    judge("so_ticket_wait(final ticket)", st, &[])?;
                    self.sgs[*sgid as usize].as_mut().unwrap().final_waited = true;
                }
                let accum = self.opts.accum;
                let s = self.s as f64;
                let sg = self.sgs[*sgid as usize].as_mut().unwrap();
                let values = fill_values(fill, range.len(), s, accum);
                reference::copy_into(&mut sg.g, range.clone(), &values, add);
                let part = sub(&sg.g, range.clone());
                let bytes = store_bytes(&part);
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        bytes.as_ptr(),
                        sg.grad_buf.as_ref().unwrap().ptr().add(range.start * accum.size()),
                        bytes.len(),
                    )
                };
            }
        }
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe { self.h.grad_written(slice, &mut ticket) };
        api::count_call();
        let mut e = Vec::new();
        if !backward {
            e.push(Status::InvalidState);
        }
        match &target {
            None => e.push(Status::NotFound),
            Some((sgid, _)) => {
                let sg = self.sg(*sgid).unwrap();
                if sg.grad_buf.is_none() {
                    e.push(Status::InvalidArgument);
                }
                if sg.submitted.is_some() {
                    e.push(Status::InvalidState);
                }
            }
        }
        if !judge(&format!("so_session_grad_written(slice {slice})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "grad_written wrote its ticket on failure");
            return self.refused(stats);
        }
        let completes = self.mark(slice);
        self.after_handoff(slice, completes, true, ticket)
    }

    /// The preparation before the decision: zeros for slices without a gradient, late
    /// gradients merged.
    pub(super) fn prepare(&mut self) {
        for sg in self.sgs.iter_mut().flatten() {
            for &sl in &sg.slices {
                let s = &self.slices[sl as usize];
                if s.seen == 0 {
                    let z = zeros(sg.g.dtype(), s.range.len());
                    put(&mut sg.g, s.range.start, &z);
                }
            }
            if let Some((buf, ranges)) = sg.late.as_mut()
                && !ranges.is_empty()
            {
                for r in ranges.drain(..) {
                    let part = sub(buf, r.clone());
                    reference::copy_into(&mut sg.g, r, &part, true);
                }
                sg.late_merged = true;
            }
        }
    }
}
