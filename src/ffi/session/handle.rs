//! The session's handle, `so_session`, and the one cast from it to the session behind it:
//! what every file of the session's exports (and `ffi/tickets.rs`, `ffi/cuda.rs`) takes.

use crate::error::Result;
use crate::ffi::handle::{handle, handle_ref};
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
