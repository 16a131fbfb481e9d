//! Status codes and the error type shared by every layer.

use std::fmt;

/// Result status of every fallible call (`so_status` in C). `SO_STATUS_OK` (0) is success.
///
/// Values are grouped by origin and never reused: 1–19 arguments and state, 20–29
/// numerics, 30–39 resources, 40–49 waiting, 50–59 files, 60–69 CUDA, 90–99 internal.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Status {
    /// Success.
    Ok = 0,
    /// A pointer that must not be NULL was NULL.
    NullArgument = 1,
    /// An argument is out of range or inconsistent with another one.
    InvalidArgument = 2,
    /// An options or arguments struct has a `struct_size` this library cannot read.
    StructSize = 3,
    /// The request is valid but not supported (dtype combination, ISA, mode).
    Unsupported = 4,
    /// Two buffers that must be disjoint overlap.
    Aliasing = 5,
    /// The call is not valid in the object's current state (e.g. a gradient before
    /// `begin`, `step` twice).
    InvalidState = 6,
    /// An id, name or ticket that does not exist.
    NotFound = 7,
    /// A gradient element (after scaling) is inf or NaN; nothing was modified.
    NonFinite = 20,
    /// Memory or threads could not be obtained, or a configured memory limit would be
    /// exceeded.
    OutOfResources = 30,
    /// A wait ended at its timeout; nothing was changed.
    Timeout = 40,
    /// The work behind a ticket has not completed yet.
    Pending = 41,
    /// A file could not be read or written.
    Io = 50,
    /// A checkpoint file is truncated, corrupt, or does not match the session.
    BadCheckpoint = 51,
    /// No CUDA driver or device could be found (a host-mode session still works).
    CudaUnavailable = 60,
    /// A CUDA call failed; the message names the call and the driver's error.
    CudaError = 61,
    /// A CUDA stream is being captured into a graph, where the session cannot work.
    StreamCapturing = 62,
    /// A panic was caught inside the library; this is a bug in superoffload.
    Panic = 99,
}

/// Each status with its description: `description` and `from_raw` are generated from this
/// one table, and a variant missing from it does not compile (`description` is an
/// exhaustive match).
macro_rules! status_table {
    ($($status:ident => $text:literal,)+) => {
        impl Status {
            /// Static, NUL-terminated description of a status value.
            pub fn description(self) -> &'static std::ffi::CStr {
                match self {
                    $(Status::$status => $text,)+
                }
            }

            /// Maps a raw value from C back to a status, if it is one.
            pub fn from_raw(raw: u32) -> Option<Status> {
                [$(Status::$status),+].into_iter().find(|s| *s as u32 == raw)
            }
        }
    };
}

status_table! {
    Ok => c"success",
    NullArgument => c"a required pointer argument is NULL",
    InvalidArgument => c"an argument is out of range or inconsistent",
    StructSize => c"struct_size does not match a layout this library knows",
    Unsupported => c"the request is valid but not supported",
    Aliasing => c"buffers that must be disjoint overlap",
    InvalidState => c"the call is not valid in the current state",
    NotFound => c"no such id, name or ticket",
    NonFinite => c"a scaled gradient element is inf or NaN; nothing was modified",
    OutOfResources => c"memory or threads could not be obtained, or a memory limit would be exceeded",
    Timeout => c"the wait timed out",
    Pending => c"the work has not completed yet",
    Io => c"a file could not be read or written",
    BadCheckpoint => c"the checkpoint is truncated, corrupt or does not match the session",
    CudaUnavailable => c"CUDA is unavailable (no driver or no device)",
    CudaError => c"a CUDA call failed",
    StreamCapturing => c"the CUDA stream is being captured into a graph",
    Panic => c"internal error (caught panic) in superoffload",
}

/// An error: a status plus a message that says what was wrong with which argument.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    pub status: Status,
    pub message: String,
}

impl Error {
    pub fn new(status: Status, message: impl Into<String>) -> Self {
        Error { status, message: message.into() }
    }

    pub fn invalid(message: impl Into<String>) -> Self {
        Error::new(Status::InvalidArgument, message)
    }

    pub fn unsupported(message: impl Into<String>) -> Self {
        Error::new(Status::Unsupported, message)
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({:?})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_map_back_to_their_status() {
        let mut known = 0;
        for raw in 0..1000u32 {
            if let Some(status) = Status::from_raw(raw) {
                assert_eq!(status as u32, raw);
                assert!(!status.description().is_empty());
                known += 1;
            }
        }
        assert!(known >= 18, "{known}");
        assert_eq!(Status::from_raw(99), Some(Status::Panic));
        assert_eq!(Status::from_raw(8), None);
    }
}
