//! Fault switches for the tests that prove the transport's failure paths (the GPU tests in
//! `c_tests/`). They exist only with the cargo feature `fault-injection` (off by default;
//! CMake: `-DSO_FAULT_INJECTION=ON`): a library built without it reads none of these
//! environment variables and every switch is off.

#[cfg(feature = "fault-injection")]
use super::driver::{self, CUresult};
use crate::error::Result;

/// Faults in the piece protocol of gradient copies, read once when a transport is created:
/// `SUPEROFFLOAD_DEBUG_COPY=drop-last-piece` (the last piece is never copied) or
/// `=no-final-wait` (the first copy stream does not wait for the last piece).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct CopyFaults {
    pub(crate) drop_last_piece: bool,
    pub(crate) no_final_wait: bool,
}

impl CopyFaults {
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

/// Refuses a host registration of `bytes`, standing in for a pinned-memory limit:
/// `SUPEROFFLOAD_DEBUG_REGISTER_LIMIT=<bytes>` refuses every larger one. Read at each call.
#[cfg(feature = "fault-injection")]
pub(crate) fn register_refused(bytes: usize) -> Result<()> {
    let limit = std::env::var("SUPEROFFLOAD_DEBUG_REGISTER_LIMIT").ok().and_then(|v| v.parse::<usize>().ok());
    match limit {
        Some(limit) if bytes > limit => Err(driver::failure("cuMemHostRegister", CUresult::CUDA_ERROR_OUT_OF_MEMORY)),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn register_refused(_bytes: usize) -> Result<()> {
    Ok(())
}

/// Fails the upload of a device-placed sub-group's state before its first copy:
/// `SUPEROFFLOAD_DEBUG_UPLOAD=fail`. Read at each upload.
#[cfg(feature = "fault-injection")]
pub(crate) fn upload_refused() -> Result<()> {
    match std::env::var("SUPEROFFLOAD_DEBUG_UPLOAD").as_deref() {
        Ok("fail") => Err(driver::failure("cuMemcpyHtoDAsync", CUresult::CUDA_ERROR_INVALID_VALUE)),
        _ => Ok(()),
    }
}

#[cfg(not(feature = "fault-injection"))]
pub(crate) fn upload_refused() -> Result<()> {
    Ok(())
}
