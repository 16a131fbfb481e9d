//! The step call and its decision: the local sum of squares, `so_session_step`, the result it
//! must report, and the reference advanced over it.

use super::{Check, Pending, Phase, PlanSg, Sess, SgM, SliceM, Stats, judge, same_hp, unscale_of};
use crate::fuzz::api::{self, Status, Ticket, so_step_result};
use crate::fuzz::mem::sub;
use crate::fuzz::ops::ArgsSpec;
use crate::fuzz::reference::{self, Approx, ApproxCheck};

/// torch's clip coefficient, written out here (not the library's function).
pub fn clip_coefficient(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 { (max_norm / (norm + 1e-6)).min(1.0) } else { 1.0 }
}

pub fn grad_factor(clip: f64, loss_scale: f32) -> f32 {
    (clip / loss_scale as f64) as f32
}

impl Sess {
    fn own_sumsq(&self) -> f64 {
        let unscale = unscale_of(self.s);
        self.live_sgs().map(|sg| slices_sumsq(&self.slices, sg, unscale)).sum()
    }

    pub(super) fn local_sumsq(&mut self, timeout_ns: i64, null_out: bool, stats: &mut Stats) -> Check {
        let mut out = -7.0f64;
        let st = unsafe { self.h.local_grad_sumsq(timeout_ns, if null_out { std::ptr::null_mut() } else { &mut out }) };
        api::count_call();
        let mut e = Vec::new();
        if null_out {
            e.push(Status::NullArgument);
        }
        if self.phase == Phase::Idle {
            e.push(Status::InvalidState);
        }
        if !e.is_empty() {
            judge("so_session_local_grad_sumsq", st, &e)?;
            stats.refusals += 1;
            ensure!(out == -7.0, "local_grad_sumsq wrote its out-parameter on failure");
            return self.refused(stats);
        }
        if matches!(self.phase, Phase::Backward { .. }) {
            self.prepare();
            self.phase = Phase::Prepared;
        }
        if timeout_ns >= 0 && st == Status::Timeout {
            return Ok(());
        }
        judge("so_session_local_grad_sumsq", st, &[])?;
        let own = self.own_sumsq();
        ensure!(reference::norm_agrees(out, own, 1e-12), "local sum of squares {out:e}, reference {own:e}");
        Ok(())
    }

    pub(super) fn step(&mut self, a: &ArgsSpec, stats: &mut Stats) -> Check {
        if self.phase != Phase::Idle && self.pending.is_some() {
            self.settle_lazy(stats)?;
        }
        let mut args = api::step_args_default();
        args.max_norm = a.max_norm;
        args.norm_source = a.norm_source;
        args.global_norm = a.given;
        args.overflow = a.overflow;
        if a.bad_size {
            args.struct_size += 8;
        }
        let mut ticket: Ticket = 0xDEAD;
        let st = unsafe {
            self.h.step(
                if a.null_args { std::ptr::null() } else { &args },
                if a.null_out { std::ptr::null_mut() } else { &mut ticket },
            )
        };
        api::count_call();
        let (max_norm, source, given, overflow) = if a.null_args {
            (0.0, api::NORM_LOCAL, 0.0, false)
        } else {
            (a.max_norm, a.norm_source, a.given, a.overflow)
        };
        let mut e = Vec::new();
        if a.null_out {
            e.push(Status::NullArgument);
        }
        if !a.null_args {
            if a.bad_size {
                e.push(Status::StructSize);
            }
            if source != api::NORM_LOCAL && source != api::NORM_GIVEN {
                e.push(Status::InvalidArgument);
            }
        }
        if !(max_norm.is_finite() && max_norm >= 0.0) {
            e.push(Status::InvalidArgument);
        }
        if source == api::NORM_GIVEN && given < 0.0 {
            e.push(Status::InvalidArgument);
        }
        if self.phase == Phase::Idle {
            e.push(Status::InvalidState);
        }
        if !judge(&format!("so_session_step({a:?})"), st, &e)? {
            stats.refusals += 1;
            ensure!(ticket == 0xDEAD, "step wrote its ticket on failure");
            return self.refused(stats);
        }
        ensure!(ticket != 0, "step returned ticket 0");
        self.seen_ticket(ticket);
        if matches!(self.phase, Phase::Backward { .. }) {
            self.prepare();
        }
        self.phase = Phase::Idle;
        let given = (source == api::NORM_GIVEN).then_some(given);
        let unscale = unscale_of(self.s);
        let mut plan = Vec::new();
        let mut all_finite = true;
        let mut sumsq = 0.0;
        for sg in self.sgs.iter_mut().flatten() {
            let ss = slices_sumsq(&self.slices, sg, unscale);
            all_finite &= ss.is_finite();
            sumsq += ss;
            sg.count_prev = sg.count;
            sg.final_waited = false;
            plan.push(PlanSg {
                id: sg.id,
                g_final: sg.g.clone(),
                spec: sg.submitted.clone().flatten(),
                late: sg.late_merged,
            });
        }
        let own_norm = sumsq.sqrt();
        let groups = self.groups.clone();
        // Predict the decision at the own norm and at +-1e-11 relative: certain when all agree.
        let norms: Vec<f64> = match given {
            Some(n) => vec![n],
            None if own_norm.is_finite() && own_norm > 0.0 => {
                vec![own_norm * (1.0 - 1e-11), own_norm, own_norm * (1.0 + 1e-11)]
            }
            None => vec![own_norm],
        };
        let verdicts: Vec<(bool, bool)> = norms
            .iter()
            .map(|&n| {
                let d = decide(max_norm, n, given.is_some(), overflow, all_finite, self.s);
                (d.skip(), d.factor == unscale)
            })
            .collect();
        let certain = verdicts.iter().all(|v| *v == verdicts[0]);
        let (skip, kept_factor) = verdicts[0];
        let approx = plan.iter().any(|p| {
            let group = self.sgs[p.id as usize].as_ref().unwrap().group as usize;
            p.spec
                .as_ref()
                .is_some_and(|s| s.applied && (skip || p.late || !same_hp(&s.hp, &groups[group]) || !kept_factor))
        });
        let mut scaler_applied = false;
        if certain {
            if let Some(sc) = self.scaler.as_mut() {
                sc.update(skip);
            }
            scaler_applied = true;
        }
        for p in &plan {
            let t = self.h.final_of(p.id);
            api::count_call();
            let t = t.map_err(|st| format!("final_ticket({}) after step: {st:?}", p.id))?;
            ensure!(t != 0, "final ticket of sub-group {} is 0 after step()", p.id);
            self.seen_ticket(t);
            self.sgs[p.id as usize].as_mut().unwrap().final_ticket = t;
        }
        self.step_tickets.push(ticket);
        self.pending = Some(Pending {
            ticket,
            serial: self.serial,
            s: self.s,
            unscale,
            max_norm,
            given,
            overflow,
            groups,
            plan,
            own_norm,
            all_finite,
            certain,
            predicted_skip: skip,
            scaler_applied,
            needs_settle: !certain || approx || !unscale.is_finite(),
            spec_min: self.spec_min,
            spec_max: self.spec_max,
            late_count: self.late_count,
        });
        stats.steps += 1;
        Ok(())
    }

    /// Checks a step's result against the model; returns the per-sub-group outcome kinds
    /// (None: exact) and advances the scaler if the step did not.
    pub(super) fn judge_result(
        &mut self,
        r: &so_step_result,
        stats: &mut Stats,
    ) -> Result<Vec<Option<Approx>>, String> {
        let p = self.pending.as_ref().unwrap();
        let ctx = format!("step {} result {r:?}", p.serial);
        ensure!(r.serial == p.serial, "{ctx}: serial, model {}", p.serial);
        ensure!(r.loss_scale.to_bits() == p.s.to_bits(), "{ctx}: loss scale, model {}", p.s);
        match p.given {
            Some(n) => ensure!(
                r.global_norm.to_bits() == n.to_bits() || (n.is_nan() && r.global_norm.is_nan()),
                "{ctx}: the given norm was {n}"
            ),
            None => ensure!(
                reference::norm_agrees(r.global_norm, p.own_norm, 1e-12),
                "{ctx}: global norm, reference {:e}",
                p.own_norm
            ),
        }
        let d = decide(p.max_norm, r.global_norm, p.given.is_some(), p.overflow, p.all_finite, p.s);
        let skip = d.skip();
        ensure!(r.skipped == skip, "{ctx}: skipped, model {skip} ({:?})", d.reasons);
        if skip {
            ensure!(d.reasons.contains(&r.skip_reason), "{ctx}: skip reason, model one of {:?}", d.reasons);
            ensure!(r.clip_coef == 1.0, "{ctx}: clip coefficient of a skipped step");
        } else {
            ensure!(r.skip_reason == api::SKIP_NONE, "{ctx}: skip reason of a step taken");
            ensure!(r.clip_coef.to_bits() == d.clip.to_bits(), "{ctx}: clip coefficient, model {}", d.clip);
        }
        let factor = grad_factor(r.clip_coef, p.s);
        ensure!(r.grad_factor.to_bits() == factor.to_bits(), "{ctx}: gradient factor, model {factor}");
        if p.certain {
            ensure!(skip == p.predicted_skip, "{ctx}: a certain prediction failed");
        }
        if !p.scaler_applied
            && let Some(sc) = self.scaler.as_mut()
        {
            sc.update(skip);
        }
        let next = self.scaler.map_or(p.s, |s| s.scale);
        ensure!(r.next_loss_scale.to_bits() == next.to_bits(), "{ctx}: next loss scale, model {next}");
        ensure!(
            (p.spec_min..=p.spec_max).contains(&r.speculative),
            "{ctx}: speculative, model {}..={}",
            p.spec_min,
            p.spec_max
        );
        ensure!(r.cancelled <= r.speculative, "{ctx}: more cancelled than speculative steps");
        ensure!(r.device_stepped == 0 && r.device_subgroups == 0, "{ctx}: device work in a host session");
        ensure!(r.forward_wait_s.is_finite() && r.forward_wait_s >= 0.0, "{ctx}: forward wait");
        ensure!(r.late_gradients == p.late_count, "{ctx}: late gradients, model {}", p.late_count);
        // Per sub-group: what its speculative step becomes if it ran; a speculative step that
        // did not run (not submitted by the policy, or cancelled at the decision, or at a late
        // gradient) leaves the sub-group to one exact pass ("stepped"), as if it never
        // speculated. A copy written ahead is exact whatever it becomes; a late gradient
        // writes it from the masters again, and the step is then one exact pass.
        let mut kinds = Vec::new();
        let mut n = [0u32; 5];
        for ps in &p.plan {
            let group = self.sgs[ps.id as usize].as_ref().unwrap().group as usize;
            let kind = match &ps.spec {
                Some(s) if s.applied && !(s.copy_ahead && ps.late) => {
                    let approx = |k| (!s.copy_ahead).then_some(k);
                    if skip {
                        n[2] += 1;
                        approx(Approx::RolledBack)
                    } else if ps.late || !same_hp(&s.hp, &p.groups[group]) {
                        n[3] += 1;
                        approx(Approx::Redone)
                    } else if factor == p.unscale {
                        n[0] += 1;
                        None
                    } else {
                        n[1] += 1;
                        approx(Approx::Rescaled)
                    }
                }
                _ => {
                    if !skip {
                        n[4] += 1;
                    }
                    None
                }
            };
            kinds.push(kind);
        }
        let a = [r.kept, r.rescaled, r.rolled_back, r.redone, r.stepped];
        let did_not_run: u32 = (0..4).map(|i| n[i].saturating_sub(a[i])).sum();
        let exact_passes = if skip { 0 } else { did_not_run - n[2].saturating_sub(a[2]) };
        ensure!(
            (0..4).all(|i| a[i] <= n[i]) && a[4] == n[4] + exact_passes,
            "{ctx}: kept/rescaled/rolled back/redone/stepped, model {n:?} (or fewer speculative, more stepped)"
        );
        let n = a;
        stats.skipped += skip as u64;
        stats.clipped += (!skip && r.clip_coef < 1.0) as u64;
        stats.kept += n[0] as u64;
        stats.rescaled += n[1] as u64;
        stats.rolled_back += n[2] as u64;
        stats.redone += n[3] as u64;
        stats.stepped += n[4] as u64;
        Ok(kinds)
    }

    /// Advances the reference over the pending step. Exact sub-groups get their new
    /// expected state; approximate ones an `ApproxCheck` (and unknown state until observed).
    pub(super) fn advance(&mut self, r: &so_step_result, kinds: &[Option<Approx>]) -> Check {
        let p = self.pending.take().unwrap();
        let (mode, bias) = (self.opts.mode, self.opts.bias);
        for (ps, kind) in p.plan.iter().zip(kinds) {
            let Some(sg) = self.sgs[ps.id as usize].as_mut() else { continue };
            let now = p.groups[sg.group as usize];
            let count = sg.count;
            if !r.skipped {
                sg.count += 1;
            }
            match kind {
                None if r.skipped => {}
                None => {
                    let hp = reference::hyper(&now, mode, bias, count + 1);
                    reference::adam(&hp, &mut sg.p, &ps.g_final, &mut sg.m, &mut sg.v, r.grad_factor)?;
                }
                Some(k) => {
                    let spec = ps.spec.as_ref().unwrap();
                    let (mut p1, mut m1, mut v1) = (sg.p.clone(), sg.m.clone(), sg.v.clone());
                    if !r.skipped {
                        let hp = reference::hyper(&now, mode, bias, count + 1);
                        reference::adam(&hp, &mut p1, &ps.g_final, &mut m1, &mut v1, r.grad_factor)?;
                    }
                    sg.approx = Some(ApproxCheck {
                        kind: *k,
                        spec_hp: reference::hyper(&spec.hp, mode, bias, count + 1),
                        now_hp: reference::hyper(&now, mode, bias, count + 1),
                        unscale: p.unscale,
                        factor: r.grad_factor,
                        p0: sg.p.clone(),
                        m0: sg.m.clone(),
                        v0: sg.v.clone(),
                        known: sg.known.clone(),
                        g_spec: spec.g.clone(),
                        g_final: ps.g_final.clone(),
                        exact: [p1, m1, v1],
                    });
                    sg.known.fill(false);
                }
            }
        }
        Ok(())
    }
}

/// The test's own sum of squares of a sub-group's gradient: its slices', in order (elements
/// outside every slice are not part of the norm).
pub fn slices_sumsq(slices: &[SliceM], sg: &SgM, unscale: f32) -> f64 {
    sg.slices.iter().map(|&sl| reference::sumsq(&sub(&sg.g, slices[sl as usize].range.clone()), unscale)).sum()
}

/// The decision of `step()` at a reported norm.
pub struct Decision {
    pub reasons: Vec<u32>,
    pub clip: f64,
    pub factor: f32,
}

impl Decision {
    pub fn skip(&self) -> bool {
        !self.reasons.is_empty()
    }
}

pub fn decide(max_norm: f64, norm: f64, given: bool, overflow: bool, all_finite: bool, s: f32) -> Decision {
    let clip = clip_coefficient(max_norm, norm);
    let factor = grad_factor(clip, s);
    let mut reasons = Vec::new();
    if overflow {
        reasons.push(api::SKIP_OVERFLOW);
    }
    if !all_finite {
        reasons.push(api::SKIP_NON_FINITE_GRADIENT);
    }
    if !norm.is_finite() {
        reasons.push(if given { api::SKIP_NON_FINITE_NORM } else { api::SKIP_NON_FINITE_GRADIENT });
    }
    if !(factor.is_finite() && factor > 0.0) {
        reasons.push(api::SKIP_UNUSABLE_FACTOR);
    }
    Decision { reasons, clip, factor }
}
