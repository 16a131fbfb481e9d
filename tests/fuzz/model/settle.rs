//! Settling a step between steps and observing the session's state: the weights read
//! directly, the moments through a checkpoint, compared with the reference and adopted where
//! it was approximate; and the checks that a refusal changed nothing.

use std::path::Path;

use super::{Check, Phase, Sess, Stats, hp_bits_equal, hp_of, judge};
use crate::fuzz::api::{self, Status, Ticket};
use crate::fuzz::ckpt::{self, Snapshot};
use crate::fuzz::mem::{put, sub};
use crate::fuzz::reference;

impl Sess {
    /// The previous step's result while the next step's backward runs: exact outcomes only
    /// (the weights cannot be read now).
    pub(super) fn settle_lazy(&mut self, stats: &mut Stats) -> Check {
        let t = self.pending.as_ref().unwrap().ticket;
        let r = self.h.step_result(t, -1);
        api::count_call();
        let r = r.map_err(|st| format!("step_result({t}) of the previous step: {st:?} ({})", api::last_error()))?;
        let kinds = self.judge_result(&r, stats)?;
        ensure!(kinds.iter().all(Option::is_none), "a step predicted exact was not: {kinds:?}");
        self.outcomes.insert(t, r);
        self.advance(&r, &kinds)
    }

    /// Settles the pending step, if any (between steps): its result, its final tickets, the
    /// weights; the moments through `snap` (a checkpoint just written) or, when needed or
    /// `observe`, a checkpoint written now.
    pub fn settle(&mut self, stats: &mut Stats, scratch: &Path, snap: Option<&Snapshot>, observe: bool) -> Check {
        assert_eq!(self.phase, Phase::Idle);
        if let Some(p) = &self.pending {
            let t = p.ticket;
            let r = self.h.step_result(t, -1);
            api::count_call();
            let r = r.map_err(|st| format!("step_result({t}): {st:?} ({})", api::last_error()))?;
            let kinds = self.judge_result(&r, stats)?;
            self.outcomes.insert(t, r);
            self.advance(&r, &kinds)?;
        }
        self.wait_finals()?;
        let need = self.live_sgs().any(|sg| sg.approx.is_some());
        let owned;
        let snap = match snap {
            Some(s) => Some(s),
            None if need || observe => {
                let st = self.h.save_path(scratch);
                api::count_call();
                judge("so_session_save (observation)", st, &[])?;
                owned = ckpt::read(scratch)?.1;
                Some(&owned)
            }
            None => None,
        };
        self.observe(snap, stats)
    }

    pub(super) fn wait_finals(&mut self) -> Check {
        for sg in self.sgs.iter_mut().flatten() {
            if !sg.final_waited {
                let st = self.h.ticket_wait(sg.final_ticket, -1);
                api::count_call();
                judge(&format!("so_ticket_wait(final ticket of sub-group {})", sg.id), st, &[])?;
                sg.final_waited = true;
            }
        }
        Ok(())
    }

    /// Compares the session's state (masters read directly; moments, step counts, groups and
    /// scaler from `snap` if given) with the model, and adopts it where the model's state
    /// was approximate or unknown.
    fn observe(&mut self, snap: Option<&Snapshot>, stats: &mut Stats) -> Check {
        let moment = self.opts.moment;
        for sg in self.sgs.iter_mut().flatten() {
            let live = sg.master.read(sg.master_dtype, sg.numel);
            let mut file_m = sg.m.clone();
            let mut file_v = sg.v.clone();
            if let Some(snap) = snap {
                for &sl in &sg.slices {
                    let info = &self.slices[sl as usize];
                    let s =
                        snap.slices.get(&info.name).ok_or_else(|| format!("checkpoint lacks slice {}", info.name))?;
                    ensure!(
                        s.step == sg.count,
                        "slice {}: step {} in the checkpoint, model {}",
                        info.name,
                        s.step,
                        sg.count
                    );
                    ensure!(s.group == sg.group as f64, "slice {}: group {}", info.name, s.group);
                    ensure!(
                        s.master == sub(&live, info.range.clone()),
                        "slice {}: the checkpoint's master weights differ from the live ones",
                        info.name
                    );
                    ensure!(
                        s.exp_avg.dtype() == moment && s.exp_avg.len() == info.range.len(),
                        "slice {}: moment layout",
                        info.name
                    );
                    put(&mut file_m, info.range.start, &s.exp_avg);
                    put(&mut file_v, info.range.start, &s.exp_avg_sq);
                }
            }
            let covered = std::mem::take(&mut sg.covered);
            let has_snap = snap.is_some();
            let have_moments = |i: usize| has_snap && covered[i];
            if let Some(check) = sg.approx.take() {
                stats.bound_checks += 1;
                for i in 0..sg.numel {
                    let [ep, em, ev] = &check.exact;
                    let exact = check.known[i]
                        && live.bits(i) == ep.bits(i)
                        && (!have_moments(i) || (file_m.bits(i) == em.bits(i) && file_v.bits(i) == ev.bits(i)));
                    if exact {
                        // The speculative step did not run: one exact pass.
                        continue;
                    }
                    let Some([tp, tm, tv]) = check.expect(i) else { continue };
                    ensure!(
                        reference::within(live.get(i), tp),
                        "sub-group {} element {i} ({:?}): p {:e}, reference {:e} +- {:e}",
                        sg.id,
                        check.kind,
                        live.get(i),
                        tp.v,
                        reference::SLACK * tp.e
                    );
                    if have_moments(i) {
                        for (what, got, want) in [("m", file_m.get(i), tm), ("v", file_v.get(i), tv)] {
                            ensure!(
                                reference::within(got, want),
                                "sub-group {} element {i} ({:?}): {what} {got:e}, reference {:e} +- {:e}",
                                sg.id,
                                check.kind,
                                want.v,
                                reference::SLACK * want.e
                            );
                        }
                    }
                }
            } else {
                for i in 0..sg.numel {
                    if !sg.known[i] {
                        continue;
                    }
                    ensure!(
                        live.bits(i) == sg.p.bits(i),
                        "sub-group {} element {i}: p {:e} ({:#x}), reference {:e} ({:#x}) (step count {})",
                        sg.id,
                        live.get(i),
                        live.bits(i),
                        sg.p.get(i),
                        sg.p.bits(i),
                        sg.count
                    );
                    if have_moments(i) {
                        ensure!(
                            file_m.bits(i) == sg.m.bits(i) && file_v.bits(i) == sg.v.bits(i),
                            "sub-group {} element {i}: m {:e} v {:e}, reference m {:e} v {:e}",
                            sg.id,
                            file_m.get(i),
                            file_v.get(i),
                            sg.m.get(i),
                            sg.v.get(i)
                        );
                    }
                }
            }
            // Adopt: the masters are read, the moments known where the checkpoint has them.
            sg.p = live;
            for i in 0..sg.numel {
                if have_moments(i) {
                    sg.known[i] = true;
                }
            }
            sg.m = file_m;
            sg.v = file_v;
            sg.covered = covered;
            if let Some(b) = &sg.grad_buf {
                let real = b.read(sg.g.dtype(), sg.numel);
                ensure!(real == sg.g, "sub-group {}: the caller gradient buffer differs from the model's", sg.id);
            }
        }
        if let Some(snap) = snap {
            ensure!(snap.groups.len() == self.groups.len(), "checkpoint groups {}", snap.groups.len());
            for (i, g) in snap.groups.iter().enumerate() {
                ensure!(
                    hp_bits_equal(&hp_of(*g), &self.groups[i]),
                    "checkpoint group {i}: {g:?} vs {:?}",
                    self.groups[i]
                );
            }
            match (&snap.scaler, &self.scaler) {
                (None, None) => {}
                (Some(f), Some(m)) => ensure!(
                    f.scale.to_bits() == m.scale.to_bits()
                        && f.growth_tracker == m.tracker
                        && f.hysteresis_left == m.left,
                    "checkpoint scaler {f:?}, model {m:?}"
                ),
                (f, m) => return Err(format!("checkpoint scaler {f:?}, model {m:?}")),
            }
        }
        Ok(())
    }

    /// Forgets what no later check can need, so that long runs keep the model's memory flat:
    /// results of steps before the previous one, and hand-off tickets after the latest 64
    /// except those that decide what `so_ticket_wait_all` reports (failures up to and
    /// including the earliest certain one).
    pub(super) fn prune(&mut self) {
        const KEEP: usize = 64;
        if self.step_tickets.len() > 2 {
            self.step_tickets.drain(..self.step_tickets.len() - 2);
            let keep = self.step_tickets.clone();
            self.outcomes.retain(|t, _| keep.contains(t));
        }
        let prune_list = |list: &mut Vec<(Ticket, Vec<Status>)>| {
            if list.len() <= 2 * KEEP {
                return;
            }
            let mut by_ticket: Vec<(Ticket, Vec<Status>)> = std::mem::take(list);
            by_ticket.sort_by_key(|e| e.0);
            let first_certain = by_ticket.iter().position(|e| !e.1.contains(&Status::Ok));
            let n = by_ticket.len();
            for (i, e) in by_ticket.into_iter().enumerate() {
                let decisive = first_certain.is_some_and(|f| i <= f) && e.1.iter().any(|s| *s != Status::Ok);
                if decisive || i + KEEP >= n {
                    list.push(e);
                }
            }
        };
        prune_list(&mut self.handoffs);
        prune_list(&mut self.hidden);
    }

    /// After a refusal: nothing changed. Every third refusal between steps also compares
    /// the moments (through a checkpoint).
    pub(super) fn refused(&mut self, stats: &mut Stats) -> Check {
        self.check_quiet()?;
        self.refusals += 1;
        if self.phase == Phase::Idle && self.pending.is_none() && self.refusals.is_multiple_of(3) {
            let scratch = self.scratch.clone();
            self.settle(stats, &scratch, None, true)?;
        }
        Ok(())
    }

    /// Nothing changed: the weights that may be read now are the model's, and so are the
    /// caller gradient buffers.
    pub fn check_quiet(&self) -> Check {
        if self.pending.is_some() {
            return Ok(());
        }
        for sg in self.live_sgs() {
            let readable = sg.final_waited
                && sg.approx.is_none()
                && match self.phase {
                    Phase::Idle => true,
                    Phase::Backward { .. } => sg.submitted.is_none(),
                    Phase::Prepared => false,
                };
            if !readable {
                continue;
            }
            sg.check_master("")?;
            if let Some(b) = &sg.grad_buf {
                ensure!(b.read(sg.g.dtype(), sg.numel) == sg.g, "sub-group {}: caller gradient buffer changed", sg.id);
            }
        }
        Ok(())
    }
}
