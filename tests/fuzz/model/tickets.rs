//! Step results, tickets (waits, queries, waits for all), step counts and the loss scale.

use std::path::Path;

use super::{Check, Phase, Sess, Stats, judge};
use crate::fuzz::api::{self, Status, Ticket, so_step_result};
use crate::fuzz::ops::{WaitHow, WhichTicket};

impl Sess {
    // ----- results and tickets ----------------------------------------------------------

    pub(super) fn step_result_op(
        &mut self,
        which: WhichTicket,
        timeout_ns: i64,
        bad_size: bool,
        stats: &mut Stats,
        scratch: &Path,
        observe: bool,
    ) -> Check {
        let latest = self.step_tickets.last().copied();
        let settles = which == WhichTicket::LatestStep
            && !bad_size
            && timeout_ns < 0
            && latest.is_some()
            && self.pending.as_ref().is_some_and(|p| Some(p.ticket) == latest);
        if settles {
            return if self.phase == Phase::Idle {
                self.settle(stats, scratch, None, observe)
            } else {
                self.settle_lazy(stats)
            };
        }
        let t = self.resolve(which);
        let mut r: so_step_result = unsafe { std::mem::zeroed() };
        r.struct_size = std::mem::size_of::<so_step_result>() + if bad_size { 8 } else { 0 };
        r.serial = 0xDEAD;
        let st = unsafe { self.h.step_result_raw(t, timeout_ns, &mut r) };
        api::count_call();
        let mut allowed = Vec::new();
        if bad_size {
            allowed.push(Status::StructSize);
        } else if t != 0 && Some(t) == latest {
            allowed.push(Status::Ok);
            if timeout_ns >= 0 {
                allowed.push(Status::Timeout);
            }
        } else {
            // Any other ticket (an earlier step's included) at once, without waiting.
            allowed.push(Status::NotFound);
        }
        ensure!(
            allowed.contains(&st),
            "step_result({which:?} = {t}): {st:?}, expected one of {allowed:?} ({})",
            api::last_error()
        );
        if st != Status::Ok {
            ensure!(r.serial == 0xDEAD, "step_result wrote its out-parameter on failure");
            return Ok(());
        }
        if let Some(o) = self.outcomes.get(&t) {
            ensure!(
                r.serial == o.serial && r.skipped == o.skipped && r.grad_factor.to_bits() == o.grad_factor.to_bits(),
                "step_result({t}) changed: serial {} skipped {} factor {}, earlier {o:?}",
                r.serial,
                r.skipped,
                r.grad_factor
            );
        } else if let Some(p) = &self.pending {
            ensure!(r.serial == p.serial, "step_result({t}): serial {}, model {}", r.serial, p.serial);
        }
        Ok(())
    }

    fn resolve(&self, which: WhichTicket) -> Ticket {
        match which {
            WhichTicket::LatestStep => self.step_tickets.last().copied().unwrap_or(0),
            WhichTicket::PreviousStep => self.step_tickets.len().checked_sub(2).map_or(0, |i| self.step_tickets[i]),
            WhichTicket::Final(sg) => self.sg(sg).map_or(0, |s| s.final_ticket),
            WhichTicket::HandOff(n) => {
                if self.handoffs.is_empty() {
                    0
                } else {
                    self.handoffs[n % self.handoffs.len()].0
                }
            }
            WhichTicket::Zero => 0,
            WhichTicket::Never => u64::MAX / 2,
        }
    }

    /// The statuses the work of `t` may end with (for a ticket that was issued).
    fn final_statuses(&self, t: Ticket) -> Vec<Status> {
        match self.handoffs.iter().find(|h| h.0 == t) {
            Some((_, allowed)) => allowed.clone(),
            None => vec![Status::Ok],
        }
    }

    /// What `so_ticket_wait_all(t)` may return: the earliest failure up to t.
    fn wait_all_statuses(&self, t: Ticket) -> Vec<Status> {
        // Ordering keys: a known ticket k is 2k, a hidden one issued after ticket k is 2k + 1.
        let mut entries: Vec<(u128, &Vec<Status>)> = self
            .handoffs
            .iter()
            .map(|(k, a)| (2 * *k as u128, a))
            .chain(self.hidden.iter().map(|(k, a)| (2 * *k as u128 + 1, a)))
            .filter(|(key, _)| *key <= 2 * t as u128)
            .collect();
        entries.sort_by_key(|e| e.0);
        let mut out = Vec::new();
        for (_, allowed) in entries {
            out.extend(allowed.iter().copied().filter(|s| *s != Status::Ok));
            if !allowed.contains(&Status::Ok) {
                return out;
            }
        }
        out.push(Status::Ok);
        out
    }

    pub(super) fn ticket_op(&mut self, which: WhichTicket, timeout_ns: i64, how: WaitHow) -> Check {
        let t = self.resolve(which);
        let st = match how {
            WaitHow::Wait => self.h.ticket_wait(t, timeout_ns),
            WaitHow::Query => self.h.ticket_query(t),
            WaitHow::WaitAll => self.h.ticket_wait_all(t, timeout_ns),
        };
        api::count_call();
        let mut allowed = if t == 0 {
            vec![Status::Ok]
        } else if which == WhichTicket::Never {
            vec![Status::NotFound]
        } else {
            let mut a = match how {
                WaitHow::WaitAll => self.wait_all_statuses(t),
                _ => self.final_statuses(t),
            };
            match how {
                WaitHow::Query => a.push(Status::Pending),
                _ if timeout_ns >= 0 => a.push(Status::Timeout),
                _ => {}
            }
            a
        };
        allowed.dedup();
        ensure!(
            allowed.contains(&st),
            "ticket {how:?}({which:?} = {t}, {timeout_ns}): {st:?}, expected one of {allowed:?}"
        );
        if let WhichTicket::Final(sg) = which
            && st == Status::Ok
            && how != WaitHow::Query
            && let Some(s) = self.sgs.get_mut(sg as usize).and_then(Option::as_mut)
            && s.final_ticket == t
        {
            s.final_waited = true;
        }
        Ok(())
    }

    pub(super) fn step_count(&mut self, sg: u32) -> Check {
        let mut n = u64::MAX;
        let st = unsafe { self.h.step_count(sg, &mut n) };
        api::count_call();
        let Some(s) = self.sg(sg) else {
            return judge("so_session_step_count", st, &[Status::NotFound]).map(drop);
        };
        judge("so_session_step_count", st, &[])?;
        let mut allowed = vec![s.count];
        if let Some(p) = &self.pending
            && p.plan.iter().any(|ps| ps.id == sg)
        {
            allowed.push(s.count + 1);
        }
        if !s.final_waited {
            allowed.push(s.count_prev);
        }
        ensure!(allowed.contains(&n), "step count of sub-group {sg}: {n}, model one of {allowed:?}");
        Ok(())
    }

    pub(super) fn loss_scale_op(&mut self, stats: &mut Stats, scratch: &Path) -> Check {
        if self.phase == Phase::Idle && self.pending.as_ref().is_some_and(|p| !p.scaler_applied) {
            self.settle(stats, scratch, None, false)?;
        }
        let mut x = -1.0f32;
        let st = unsafe { self.h.loss_scale(&mut x) };
        api::count_call();
        judge("so_session_loss_scale", st, &[])?;
        let want = self.scaler.map_or(1.0, |s| s.scale);
        ensure!(x.to_bits() == want.to_bits(), "loss scale {x}, model {want}");
        Ok(())
    }
}
