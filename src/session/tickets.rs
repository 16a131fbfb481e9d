//! Step tickets: numbered work items of a session that complete in any order.
//!
//! Ticket numbers start at 1 and increase by one per item issued. Each ticket belongs to a
//! *lane*: [`STEP_LANE`] for step-wide work (preparation, the decision, the whole step) and
//! one lane per sub-group (its speculative and final steps). Within a lane tickets complete
//! in the order they were issued, which is what lets a device wait on one 64-bit word per
//! lane ("the lane's latest completed ticket is >= t"). Across lanes they complete in the
//! order the scheduler runs the work. A failed item keeps its error, which `state` and
//! `wait` report.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};

pub type Ticket = u64;

/// The lane of step-wide tickets; sub-group `k` has lane `k + 1`.
pub const STEP_LANE: u32 = 0;

/// The lane of sub-group `sg`'s tickets.
pub fn subgroup_lane(sg: u32) -> u32 {
    sg + 1
}

/// What is known about one ticket.
#[derive(Clone, Debug, PartialEq)]
pub enum TicketState {
    Pending,
    Done,
    Failed(Error),
}

#[derive(Default)]
struct Progress {
    issued: Ticket,
    /// Issued and not complete, with their lanes.
    pending: BTreeMap<Ticket, u32>,
    failures: BTreeMap<Ticket, Error>,
}

#[derive(Default)]
pub(crate) struct Tickets {
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Tickets {
    /// Issues the next ticket, pending, in `lane`.
    pub(crate) fn issue(&self, lane: u32) -> Ticket {
        let mut p = self.progress.lock().unwrap();
        p.issued += 1;
        let t = p.issued;
        p.pending.insert(t, lane);
        t
    }

    pub(crate) fn last_issued(&self) -> Ticket {
        self.progress.lock().unwrap().issued
    }

    /// The lane of a ticket that is still pending (`None` once it completed).
    pub(crate) fn pending_lane(&self, ticket: Ticket) -> Option<u32> {
        self.progress.lock().unwrap().pending.get(&ticket).copied()
    }

    /// Marks `ticket` complete with its outcome.
    pub(crate) fn complete(&self, ticket: Ticket, outcome: Result<()>) {
        let mut p = self.progress.lock().unwrap();
        let lane = p.pending.remove(&ticket);
        debug_assert!(lane.is_some(), "ticket {ticket} completed twice or never issued");
        if let Some(lane) = lane {
            debug_assert!(
                !p.pending.range(..ticket).any(|(_, &l)| l == lane),
                "tickets of lane {lane} complete in order (ticket {ticket})"
            );
        }
        if let Err(e) = outcome {
            p.failures.insert(ticket, e);
        }
        self.changed.notify_all();
    }

    pub(crate) fn state(&self, ticket: Ticket) -> Result<TicketState> {
        let p = self.progress.lock().unwrap();
        Self::state_of(&p, ticket)
    }

    fn state_of(p: &Progress, ticket: Ticket) -> Result<TicketState> {
        if ticket == 0 || ticket > p.issued {
            return Err(Error::new(
                Status::NotFound,
                format!("ticket {ticket} was never issued by this session (last issued: {})", p.issued),
            ));
        }
        Ok(match (p.pending.contains_key(&ticket), p.failures.get(&ticket)) {
            (true, _) => TicketState::Pending,
            (false, None) => TicketState::Done,
            (false, Some(e)) => TicketState::Failed(e.clone()),
        })
    }

    /// Waits until `ticket` is complete (`timeout` None = forever); its own error, if any.
    /// With `all`, waits for every ticket issued up to `ticket` and reports the first
    /// failure among them.
    pub(crate) fn wait(&self, ticket: Ticket, timeout: Option<Duration>, all: bool) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut p = self.progress.lock().unwrap();
        Self::state_of(&p, ticket)?;
        let busy = |p: &Progress| {
            if all { p.pending.range(..=ticket).next().is_some() } else { p.pending.contains_key(&ticket) }
        };
        while busy(&p) {
            match deadline {
                None => p = self.changed.wait(p).unwrap(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::new(Status::Timeout, format!("ticket {ticket} is not complete yet")));
                    }
                    p = self.changed.wait_timeout(p, deadline - now).unwrap().0;
                }
            }
        }
        let failure = if all { p.failures.range(..=ticket).next() } else { p.failures.get_key_value(&ticket) };
        match failure {
            Some((t, e)) => Err(Error::new(e.status, format!("ticket {t} failed: {}", e.message))),
            None => Ok(()),
        }
    }

    /// Waits for every ticket issued so far, ignoring their outcomes.
    pub(crate) fn drain(&self) {
        let mut p = self.progress.lock().unwrap();
        while !p.pending.is_empty() {
            p = self.changed.wait(p).unwrap();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tickets_complete_out_of_order_and_in_order_per_lane() {
        let t = Tickets::default();
        let a = t.issue(subgroup_lane(3));
        let b = t.issue(subgroup_lane(0));
        let c = t.issue(STEP_LANE);
        t.complete(b, Ok(()));
        assert_eq!(t.state(a).unwrap(), TicketState::Pending);
        assert_eq!(t.state(b).unwrap(), TicketState::Done);
        assert_eq!(t.pending_lane(a), Some(4));
        assert_eq!(t.wait(b, Some(Duration::ZERO), false), Ok(()));
        assert_eq!(t.wait(b, Some(Duration::ZERO), true).unwrap_err().status, Status::Timeout, "a is still pending");
        t.complete(a, Err(Error::invalid("x")));
        assert_eq!(t.wait(c, Some(Duration::ZERO), false).unwrap_err().status, Status::Timeout);
        t.complete(c, Ok(()));
        assert_eq!(t.wait(c, None, false), Ok(()));
        assert_eq!(t.wait(c, None, true).unwrap_err().status, Status::InvalidArgument, "the first failure up to c");
        assert_eq!(t.state(c + 1).unwrap_err().status, Status::NotFound);
    }
}
