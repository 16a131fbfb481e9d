//! Step tickets: a per-session sequence of work items that complete in submission order.
//!
//! Ticket numbers start at 1 and increase by one per item; the CPU-Adam thread completes
//! them strictly in order, so "ticket t is done" also means "every ticket before t is
//! done". A failed item keeps its error, which `query` and `wait` report.

use std::collections::BTreeMap;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};

pub type Ticket = u64;

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
    completed: Ticket,
    failures: BTreeMap<Ticket, Error>,
}

#[derive(Default)]
pub(crate) struct Tickets {
    progress: Mutex<Progress>,
    changed: Condvar,
}

impl Tickets {
    /// Reserves the next ticket. Callers issue and enqueue under one lock, so that the
    /// queue order is the ticket order.
    pub(crate) fn issue(&self) -> Ticket {
        let mut p = self.progress.lock().unwrap();
        p.issued += 1;
        p.issued
    }

    pub(crate) fn last_issued(&self) -> Ticket {
        self.progress.lock().unwrap().issued
    }

    /// Marks `ticket` (the next in order) complete, with its outcome.
    pub(crate) fn complete(&self, ticket: Ticket, outcome: Result<()>) {
        let mut p = self.progress.lock().unwrap();
        debug_assert_eq!(ticket, p.completed + 1, "tickets complete in order");
        p.completed = p.completed.max(ticket);
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
        Ok(match (ticket <= p.completed, p.failures.get(&ticket)) {
            (false, _) => TicketState::Pending,
            (true, None) => TicketState::Done,
            (true, Some(e)) => TicketState::Failed(e.clone()),
        })
    }

    /// Waits until `ticket` is complete (`timeout` None = forever). With `all`, reports
    /// the first failure among every ticket up to `ticket`, else only `ticket`'s own.
    pub(crate) fn wait(&self, ticket: Ticket, timeout: Option<Duration>, all: bool) -> Result<()> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut p = self.progress.lock().unwrap();
        Self::state_of(&p, ticket)?;
        while p.completed < ticket {
            match deadline {
                None => p = self.changed.wait(p).unwrap(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(Error::new(
                            Status::Timeout,
                            format!("ticket {ticket} is not complete yet (completed up to {})", p.completed),
                        ));
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
        while p.completed < p.issued {
            p = self.changed.wait(p).unwrap();
        }
    }
}
