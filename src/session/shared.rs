//! What every part of a session reaches: its options, and what the CPU-Adam thread shares
//! with the session's callers (the pool, the tickets, the scheduler's queue, the policy, the
//! loss scaler, the latest results and the transport).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::buffers::HostBuf;
use super::policy::Policy;
use super::scaler::LossScaler;
use super::scheduler::Scheduler;
use super::tickets::{Ticket, Tickets};
use super::trace::Tracer;
use super::transport::Transport;
use super::types::{SessionOptions, StepResult};
use crate::error::{Error, Result, Status};
use crate::kernels::Pool;

/// The session's parts that every component is given, each a component or a lock of its own.
pub(crate) struct Shared {
    /// As the session was created with. Declared first, so dropped first: a pool they lend
    /// goes with `pool`, before the other parts.
    pub options: SessionOptions,
    pub pool: Arc<Pool>,
    pub tickets: Tickets,
    pub scaler: Mutex<Option<LossScaler>>,
    pub last_result: Mutex<Option<(Ticket, StepResult)>>,
    /// The latest preparation's (serial, local sum of squares), for `local_grad_sumsq`.
    pub prepared: Mutex<Option<(u64, f64)>>,
    pub transport: Option<Arc<dyn Transport>>,
    pub tracer: Tracer,
    pub sched: Scheduler,
    pub policy: Mutex<Policy>,
    /// Nanoseconds callers spent waiting on tickets (the host-mode exposed time).
    pub caller_wait_ns: AtomicU64,
    /// The ticket the latest `step()` returned (0 before the first).
    pub step_ticket: AtomicU64,
}

impl Shared {
    pub(crate) fn transport(&self) -> Option<&dyn Transport> {
        self.transport.as_deref()
    }

    /// Whether sub-group `sg`'s gradient has landed ([`Transport::gradient_landed`]).
    pub(crate) fn gradient_landed(&self, sg: u32) -> bool {
        self.transport().is_none_or(|t| t.gradient_landed(sg))
    }

    /// Completes a ticket: the transport hears of it first, then the host side.
    pub(crate) fn complete(&self, ticket: Ticket, outcome: Result<()>) {
        if let (Some(t), Some(lane)) = (self.transport(), self.tickets.pending_lane(ticket)) {
            t.ticket_done(lane, ticket);
        }
        self.tickets.complete(ticket, outcome);
    }

    /// Waits for a ticket on behalf of a caller, counting the time as exposed.
    pub(crate) fn caller_wait(&self, ticket: Ticket, timeout: Option<Duration>, all: bool) -> Result<()> {
        let start = std::time::Instant::now();
        let outcome = self.tickets.wait(ticket, timeout, all);
        self.caller_wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        outcome
    }

    /// Waits, as the caller, for a sub-group's final ticket `ticket` of its previous step (0:
    /// none yet) whatever its outcome, which the step's ticket reports: until it completes,
    /// the sub-group's buffers must not be written again.
    pub(crate) fn caller_wait_final(&self, ticket: Ticket) {
        if ticket != 0 {
            self.caller_wait(ticket, None, false).ok();
        }
    }

    /// Waits, as the caller, until sub-group `sg` is done with its previous step: its final
    /// ticket `final_ticket`, then the state pass that final pass left, if any (the gradient
    /// buffer is read and the master weights and moments written until then).
    pub(crate) fn caller_wait_idle(&self, sg: u32, final_ticket: Ticket) {
        self.caller_wait_final(final_ticket);
        self.caller_wait_settled(sg, None).ok(); // without a deadline it cannot time out
    }

    /// Waits, up to `deadline` (None: forever), while sub-group `sg`'s state pass is pending,
    /// counting the time as the caller's wait (it holds the backward up); `Timeout` if the
    /// deadline passed first.
    pub(crate) fn caller_wait_settled(&self, sg: u32, deadline: Option<Instant>) -> Result<()> {
        let start = Instant::now();
        let settled = self.sched.wait_settled(sg, deadline);
        if settled != Ok(false) {
            self.caller_wait_ns.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
        settled
            .map(|_| ())
            .map_err(|()| Error::new(Status::Timeout, format!("sub-group {sg}: its state pass has not ended yet")))
    }

    /// The built-in loss scaler's scale once the decision `decide_ticket` (0: none yet) has
    /// set it, waiting for it; 1 without a scaler.
    pub(crate) fn loss_scale_after(&self, decide_ticket: Ticket) -> f32 {
        if decide_ticket != 0 {
            self.tickets.wait(decide_ticket, None, false).ok();
        }
        self.scaler.lock().unwrap().map_or(1.0, |s| s.scale)
    }

    /// Pins a buffer through the transport, if there is one; its address.
    pub(crate) fn pin(&self, buf: &mut HostBuf) -> Result<Option<usize>> {
        let Some(transport) = self.transport() else { return Ok(None) };
        let ptr = buf.as_mut_ptr();
        transport.pin(ptr, buf.bytes())?;
        Ok(Some(ptr as usize))
    }

    /// Undoes the pins of the buffers at `pins` (addresses from [`Shared::pin`]).
    pub(crate) fn unpin_all(&self, pins: impl Iterator<Item = usize>) {
        if let Some(transport) = self.transport() {
            for p in pins {
                transport.unpin(p as *mut u8);
            }
        }
    }
}
