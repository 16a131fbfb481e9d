//! `so_ticket_*`: waiting for the session's work (the device-side wait,
//! `so_ticket_enqueue_wait`, is in `ffi/cuda.rs`).

use super::args::timeout;
use super::boundary::ffi_boundary;
use super::session::{session_ref, so_session};
use crate::error::{Error, Status};
use crate::session::TicketState;

/// A ticket: a number in a per-session sequence (from 1) of work items that complete in
/// order. 0 means "no work" and is always complete.
pub type so_ticket = u64;

/// @brief The state of a ticket without waiting.
/// @return `SO_STATUS_OK` if its work completed, `SO_STATUS_PENDING` if not yet, the
///         work's own error status if it failed (message in `so_last_error_message`), or
///         `SO_STATUS_NOT_FOUND` for a ticket never issued.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_query(session: *const so_session, ticket: so_ticket) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        match unsafe { session_ref(session)? }.ticket_state(ticket)? {
            TicketState::Done => Ok(()),
            TicketState::Pending => Err(Error::new(Status::Pending, format!("ticket {ticket} has not completed yet"))),
            TicketState::Failed(e) => Err(Error::new(e.status, format!("ticket {ticket} failed: {}", e.message))),
        }
    })
}

/// @brief Waits up to `timeout_ns` (negative: forever, 0: poll) for a ticket.
/// @return `SO_STATUS_OK`, the work's error status if it failed, `SO_STATUS_TIMEOUT`, or
///         `SO_STATUS_NOT_FOUND`. A failed step leaves its sub-group as it was before it;
///         the session stays usable.
/// @note Thread-safety: see `so_session`; any thread may wait.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_wait(session: *const so_session, ticket: so_ticket, timeout_ns: i64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.wait(ticket, timeout(timeout_ns))
    })
}

/// @brief Waits for every ticket up to and including `ticket`.
/// @return `SO_STATUS_OK` if all succeeded, else the status of the first that failed —
///         including failures a later `so_session_step` already accounted for (a
///         speculative step refused for a non-finite gradient, which made that step
///         skipped); wait on a step's own ticket for its outcome alone.
/// @note Thread-safety: see `so_session`.
///
/// # Safety
/// `session` is NULL or a live session handle.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_wait_all(session: *const so_session, ticket: so_ticket, timeout_ns: i64) -> Status {
    ffi_boundary!({
        // SAFETY: `session` is NULL or a live session (this function's contract).
        unsafe { session_ref(session)? }.wait_all(ticket, timeout(timeout_ns))
    })
}
