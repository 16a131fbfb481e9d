//! The C surface, and nothing else: argument checking, handle casts and the panic
//! boundary around every exported function. All behaviour lives in the layers below.
//!
//! Conventions (see the header for the caller's side):
//! - every export is `#[unsafe(no_mangle)] pub extern "C"` and runs inside [`ffi_boundary!`];
//! - every pointer is checked for NULL, every enum arrives as `uint32_t` and is validated;
//! - outputs are written only on success; on failure the thread's last error says why.

#![allow(non_camel_case_types)]

use std::cell::RefCell;
use std::panic::{AssertUnwindSafe, catch_unwind};

use crate::error::{Error, Result, Status};

pub mod kernels;
pub mod pool;
pub mod session;
pub mod types;
pub mod version;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_last_error(message: String) {
    LAST_ERROR.with(|slot| *slot.borrow_mut() = message);
}

/// Runs the body of a status-returning export: `Ok` maps to `SO_STATUS_OK`, an error to its
/// status (with the message stored for `so_last_error_message`), a panic to
/// `SO_STATUS_PANIC`.
macro_rules! ffi_boundary {
    ($name:literal, $body:block) => {
        $crate::ffi::run_boundary($name, move || -> $crate::error::Result<()> { $body })
    };
    // Exports that return a value instead of a status: a panic yields `$fallback`.
    ($name:literal, fallback = $fallback:expr, $body:block) => {
        $crate::ffi::run_value_boundary($fallback, move || $body)
    };
}
pub(crate) use ffi_boundary;

pub(crate) fn run_boundary(name: &str, body: impl FnOnce() -> Result<()>) -> Status {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => Status::Ok,
        Ok(Err(e)) => {
            set_last_error(format!("{name}: {}", e.message));
            e.status
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(format!("{name}: internal error, please report it: {what}"));
            Status::Panic
        }
    }
}

pub(crate) fn run_value_boundary<T>(fallback: T, body: impl FnOnce() -> T) -> T {
    catch_unwind(AssertUnwindSafe(body)).unwrap_or(fallback)
}

/// Rejects a NULL pointer argument.
pub(crate) fn non_null<T>(ptr: *const T, name: &str) -> Result<()> {
    if ptr.is_null() { Err(Error::new(Status::NullArgument, format!("{name} is NULL"))) } else { Ok(()) }
}

/// Types whose first field is `size_t struct_size`.
///
/// # Safety
/// Implementors must be `#[repr(C)]` with `struct_size: usize` as their first field.
pub(crate) unsafe trait WithStructSize {
    const NAME: &'static str;
}

/// Copies a caller's struct after checking its `struct_size`.
///
/// # Safety
/// `ptr` must be NULL or point to a readable `T` (as the header documents).
pub(crate) unsafe fn read_struct<T: Copy + WithStructSize>(ptr: *const T, name: &str) -> Result<T> {
    non_null(ptr, name)?;
    // SAFETY: non-NULL and, per the caller's contract, readable; struct_size is first.
    let size = unsafe { ptr.cast::<usize>().read_unaligned() };
    check_struct_size::<T>(size, name)?;
    // SAFETY: as above; the sizes agree, so the caller's struct has this layout.
    Ok(unsafe { ptr.read_unaligned() })
}

pub(crate) fn check_struct_size<T: WithStructSize>(size: usize, name: &str) -> Result<()> {
    let expected = std::mem::size_of::<T>();
    if size != expected {
        return Err(Error::new(
            Status::StructSize,
            format!(
                "{name}->struct_size is {size}, but this library's {} has {expected} bytes; \
                 initialise it with its _default() function or sizeof, and build against the \
                 header of the library you link",
                T::NAME
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boundary_maps_errors_and_panics() {
        assert_eq!(run_boundary("f", || Ok(())), Status::Ok);
        assert_eq!(run_boundary("f", || Err(Error::invalid("bad x"))), Status::InvalidArgument);
        assert_eq!(LAST_ERROR.with(|e| e.borrow().clone()), "f: bad x");
        let status = run_boundary("g", || panic!("boom"));
        assert_eq!(status, Status::Panic);
        let message = LAST_ERROR.with(|e| e.borrow().clone());
        assert!(message.starts_with("g: internal error") && message.ends_with("boom"), "{message}");
        assert_eq!(run_value_boundary(7u32, || panic!("x")), 7);
    }
}
