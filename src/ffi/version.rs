//! Versions, status strings and the thread's last error message.

use std::ffi::c_char;

use super::boundary::{LAST_ERROR, ffi_boundary};
use crate::error::Status;

/// The ABI version of this library: `(major << 16) | minor` while the major version is 0
/// (every 0.x minor release may change the ABI), `major << 16` afterwards. A program may use
/// the library it loaded iff `so_abi_version() == SO_ABI_VERSION` of the header it was
/// built with.
pub(crate) const ABI_VERSION: u32 = {
    let major = parse(env!("CARGO_PKG_VERSION_MAJOR"));
    let minor = parse(env!("CARGO_PKG_VERSION_MINOR"));
    if major == 0 { minor } else { major << 16 }
};

const fn parse(s: &str) -> u32 {
    let bytes = s.as_bytes();
    let mut value = 0;
    let mut i = 0;
    while i < bytes.len() {
        value = value * 10 + (bytes[i] - b'0') as u32;
        i += 1;
    }
    value
}

/// Returns the ABI version of the loaded library; compare with `SO_ABI_VERSION`.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_abi_version() -> u32 {
    ffi_boundary!({ Ok(ABI_VERSION) })
}

/// Returns the library's version as a static string, e.g. "0.1.0".
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_version_string() -> *const c_char {
    const VERSION: &std::ffi::CStr =
        match std::ffi::CStr::from_bytes_with_nul(concat!(env!("CARGO_PKG_VERSION"), "\0").as_bytes()) {
            Ok(v) => v,
            Err(_) => panic!("version has an interior NUL"),
        };
    ffi_boundary!({ Ok(VERSION.as_ptr()) })
}

/// Returns a static, NUL-terminated description of a status value, or "unknown status".
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_status_str(status: u32) -> *const c_char {
    ffi_boundary!({ Ok(Status::from_raw(status).map_or(c"unknown status", Status::description).as_ptr()) })
}

/// @brief Copies the message of the most recent failed call on this thread.
///
/// Every call that returns a status other than `SO_STATUS_OK` sets the message (the
/// function name and what was wrong); successful calls leave it as it was.
///
/// @param buf Receives at most `len - 1` bytes and a terminating NUL; may be NULL if `len`
///        is 0.
/// @param len Size of `buf` in bytes.
/// @return The full length of the message, excluding the NUL (as `snprintf`): the message
///         was truncated iff the result is >= `len`. 0 if no call has failed on this thread.
/// @note Thread-safety: the message is thread-local.
///
/// # Safety
/// `buf` is NULL or holds `len` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_last_error_message(buf: *mut c_char, len: usize) -> usize {
    ffi_boundary!({
        Ok(LAST_ERROR.with(|message| {
            let message = message.borrow();
            if !buf.is_null() && len > 0 {
                let n = message.len().min(len - 1);
                // SAFETY: `buf` holds `len` writable bytes (the contract) and n + 1 <= len; the
                // message is our own thread-local string, so the two cannot overlap.
                unsafe {
                    std::ptr::copy_nonoverlapping(message.as_ptr(), buf.cast::<u8>(), n);
                    buf.add(n).write(0);
                }
            }
            message.len()
        }))
    })
}
