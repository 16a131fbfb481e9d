//! Fault switches for the tests that prove the transport's failure paths (the GPU tests in
//! `c_tests/`). They exist only with the cargo feature `fault-injection` (off by default;
//! CMake: `-DSO_FAULT_INJECTION=ON`): a library built without it reads none of these
//! environment variables and every switch is off. A switch only says whether the call it
//! guards fails; the caller builds the error that call would have returned.

/// What a fault switch says of the call it guards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Proceed,
    Refuse,
}

/// Faults in the piece protocol of gradient copies, read once when a transport is created:
/// `SUPEROFFLOAD_DEBUG_COPY=drop-last-piece` (the last piece is never copied) or
/// `=no-final-wait` (the first copy stream does not wait for the last piece).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct CopyFaults {
    drop_last_piece: bool,
    no_final_wait: bool,
}

impl CopyFaults {
    /// Whether piece `i` of a copy in `pieces` pieces is left out: the last of several.
    pub(crate) fn drops_piece(&self, i: usize, pieces: usize) -> bool {
        self.drop_last_piece && pieces > 1 && i == pieces - 1
    }

    /// Whether the first copy stream leaves out its wait for the last piece.
    pub(crate) fn skips_final_wait(&self) -> bool {
        self.no_final_wait
    }

    #[cfg(feature = "fault-injection")]
    pub(crate) fn from_env() -> CopyFaults {
        match std::env::var("SUPEROFFLOAD_DEBUG_COPY").as_deref() {
            Ok("drop-last-piece") => CopyFaults { drop_last_piece: true, ..Default::default() },
            Ok("no-final-wait") => CopyFaults { no_final_wait: true, ..Default::default() },
            _ => CopyFaults::default(),
        }
    }

    #[cfg(not(feature = "fault-injection"))]
    pub(crate) fn from_env() -> CopyFaults {
        CopyFaults::default()
    }
}

/// A host registration of `bytes`, refused as by a pinned-memory limit (out of memory):
/// `SUPEROFFLOAD_DEBUG_REGISTER_LIMIT=<bytes>` refuses every larger one. Read at each call.
#[cfg(feature = "fault-injection")]
pub(crate) fn registration(bytes: usize) -> Verdict {
    let limit = std::env::var("SUPEROFFLOAD_DEBUG_REGISTER_LIMIT").ok().and_then(|v| v.parse::<usize>().ok());
    match limit {
        Some(limit) if bytes > limit => Verdict::Refuse,
        _ => Verdict::Proceed,
    }
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn registration(_bytes: usize) -> Verdict {
    Verdict::Proceed
}

/// The upload of a device-placed sub-group's state, failed before its first copy (an invalid
/// value): `SUPEROFFLOAD_DEBUG_UPLOAD=fail`. Read at each upload.
#[cfg(feature = "fault-injection")]
pub(crate) fn upload() -> Verdict {
    match std::env::var("SUPEROFFLOAD_DEBUG_UPLOAD").as_deref() {
        Ok("fail") => Verdict::Refuse,
        _ => Verdict::Proceed,
    }
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn upload() -> Verdict {
    Verdict::Proceed
}
