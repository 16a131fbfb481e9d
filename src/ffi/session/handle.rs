//! The session's handle, `so_session`, and the one cast from it to the session behind it:
//! what every file of the session's exports (and `ffi/tickets.rs`, `ffi/cuda.rs`) takes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::error::{Error, Result, Status};
use crate::ffi::handle::{handle, handle_ref, into_handle};
use crate::session::Session;

/// An offload session: sub-groups of parameters whose Adam state lives in host memory,
/// stepped on the session's own CPU-Adam thread.
///
/// Thread-safety: a session may be called from several threads at once (calls are
/// serialised internally); `so_session_destroy` must not race with any other call.
pub struct so_session {
    _private: [u8; 0],
}

handle!(so_session => Box<Session>);

/// The live session handles: each one's address and id (`so_session_id`). A session named by
/// a number no caller can vouch for (the XLA handlers' `session` attribute, compiled into a
/// program that may outlive the session) is looked up here by its id, which, unlike its
/// address, no later session reuses.
static LIVE_SESSIONS: Mutex<BTreeMap<usize, u64>> = Mutex::new(BTreeMap::new());

/// The next session's id (ids start at 1).
static NEXT_SESSION_ID: AtomicU64 = AtomicU64::new(1);

pub(super) fn live_sessions() -> MutexGuard<'static, BTreeMap<usize, u64>> {
    LIVE_SESSIONS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A new session handle owning `session`, recorded as live until `so_session_destroy`.
pub(crate) fn new_session_handle(session: Box<Session>) -> *mut so_session {
    let handle = into_handle::<so_session>(session);
    live_sessions().insert(handle as usize, NEXT_SESSION_ID.fetch_add(1, Ordering::Relaxed));
    handle
}

/// The live session whose id (`so_session_id`) is `id`, a number the caller cannot vouch for
/// (`name` says where it came from): `SO_STATUS_NOT_FOUND` unless a live session has it.
///
/// # Safety
/// The session must not be destroyed while the reference lives (the header's rule that
/// `so_session_destroy` does not race with other calls on the session).
pub(crate) unsafe fn session_by_id<'a>(id: u64, name: &str) -> Result<&'a Session> {
    let address = live_sessions().iter().find(|&(_, &live)| live == id).map(|(&address, _)| address);
    let Some(address) = address else {
        return Err(Error::new(
            Status::NotFound,
            format!("{name} = {id} is not the id of a live session (it was destroyed, or never created)"),
        ));
    };
    // SAFETY: a live handle (recorded at creation, not yet destroyed), alive while the caller
    // says.
    unsafe { session_ref(address as *const so_session) }
}

/// The session behind a `session` argument.
///
/// # Safety
/// `session` must be NULL or a live handle (from `so_session_create` or
/// `so_session_create_cuda`, not yet destroyed); so_session_destroy must not race with the
/// call using it (the header's contract).
pub(crate) unsafe fn session_ref<'a>(session: *const so_session) -> Result<&'a Session> {
    // SAFETY: the caller's contract, passed on.
    unsafe { handle_ref(session, "session") }
}
