//! The panic boundary around every export, and the thread's last error message.
//!
//! An export's body is `ffi_boundary!({ ... })`: it returns `Result<value>`, and the macro
//! turns it into the export's C return type ([`Export`]): a status export returns the
//! error's status (its message stored for `so_last_error_message`, prefixed with the
//! export's name), any other export the value its return type gives for a failure
//! ([`FailureValue`]). A caught panic is `SO_STATUS_PANIC`, or that same failure value.

use std::cell::RefCell;
use std::ffi::c_char;
use std::panic::{AssertUnwindSafe, catch_unwind};

use super::args::WithStructSize;
use crate::error::{Error, Result, Status};

thread_local! {
    pub(super) static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

fn set_last_error(message: String) {
    LAST_ERROR.with(|slot| *slot.borrow_mut() = message);
}

/// Runs the body of an export (a block evaluating to `Result<value>`) inside the panic
/// boundary. The export's name for messages is taken from the enclosing function, so it is
/// never typed twice.
macro_rules! ffi_boundary {
    ($body:block) => {{
        fn __export() {}
        $crate::ffi::boundary::run(
            || $crate::ffi::boundary::export_name(::std::any::type_name_of_val(&__export)),
            move || -> $crate::error::Result<_> { $body },
        )
    }};
}
pub(crate) use ffi_boundary;

/// The name of the export whose body holds `__export`: the last segment of its parent's
/// path (`superoffload::ffi::pool::so_pool_create::__export` gives `so_pool_create`).
pub(crate) fn export_name(marker_path: &'static str) -> &'static str {
    marker_path.rsplit("::").nth(1).unwrap_or(marker_path)
}

/// A C return type: how a body's success, error and panic become it.
pub(crate) trait Export: Sized {
    /// What the body produces on success.
    type Value;
    fn ok(value: Self::Value) -> Self;
    /// The return value for an error (whose message is already stored).
    fn failed(error: &Error) -> Self;
    /// The return value for a caught panic.
    fn panicked() -> Self;
}

impl Export for Status {
    type Value = ();
    fn ok((): ()) -> Status {
        Status::Ok
    }
    fn failed(error: &Error) -> Status {
        error.status
    }
    fn panicked() -> Status {
        Status::Panic
    }
}

/// Return types of exports that return a value instead of a status, and what they return
/// when their body fails or panics (which the exports that return values never do on
/// purpose: they have nothing to refuse).
pub(crate) trait FailureValue {
    fn failure_value() -> Self;
}

impl<T: FailureValue> Export for T {
    type Value = T;
    fn ok(value: T) -> T {
        value
    }
    fn failed(_: &Error) -> T {
        T::failure_value()
    }
    fn panicked() -> T {
        T::failure_value()
    }
}

impl FailureValue for () {
    fn failure_value() {}
}

/// A count, a length or a version: 0.
impl FailureValue for u32 {
    fn failure_value() -> u32 {
        0
    }
}

impl FailureValue for usize {
    fn failure_value() -> usize {
        0
    }
}

/// Functions returning static strings never return NULL.
impl FailureValue for *const c_char {
    fn failure_value() -> *const c_char {
        c"unknown".as_ptr()
    }
}

/// An options struct from a `_default()` function: all zero, so `struct_size` is 0 and every
/// call it is passed to refuses it with `SO_STATUS_STRUCT_SIZE`.
impl<T: WithStructSize> FailureValue for T {
    fn failure_value() -> T {
        // SAFETY: `WithStructSize` promises that every field is an integer, a float, a bool
        // or a raw pointer, for all of which the all-zero bit pattern is a valid value.
        unsafe { std::mem::zeroed() }
    }
}

/// Runs `body`, catching a panic; see the module docs. `name` is called only to build a
/// message.
pub(crate) fn run<R: Export>(name: impl FnOnce() -> &'static str, body: impl FnOnce() -> Result<R::Value>) -> R {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(value)) => R::ok(value),
        Ok(Err(e)) => {
            set_last_error(format!("{}: {}", name(), e.message));
            R::failed(&e)
        }
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            set_last_error(format!("{}: internal error, please report it: {what}", name()));
            R::panicked()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last_error() -> String {
        LAST_ERROR.with(|e| e.borrow().clone())
    }

    fn so_probe_status(fail: u32) -> Status {
        ffi_boundary!({
            match fail {
                0 => Ok(()),
                1 => Err(Error::invalid("bad x")),
                _ => panic!("boom"),
            }
        })
    }

    fn so_probe_value(fail: bool) -> u32 {
        ffi_boundary!({
            if fail {
                panic!("x");
            }
            Ok(7)
        })
    }

    #[test]
    fn boundary_maps_errors_and_panics() {
        assert_eq!(so_probe_status(0), Status::Ok);
        assert_eq!(so_probe_status(1), Status::InvalidArgument);
        assert_eq!(last_error(), "so_probe_status: bad x");
        assert_eq!(so_probe_status(2), Status::Panic);
        let message = last_error();
        assert!(message.starts_with("so_probe_status: internal error") && message.ends_with("boom"), "{message}");
        assert_eq!(so_probe_value(false), 7);
        assert_eq!(so_probe_value(true), 0);
        assert_eq!(last_error(), "so_probe_value: internal error, please report it: x");
    }

    #[test]
    fn export_names_come_from_the_enclosing_function() {
        fn so_named() -> &'static str {
            fn __export() {}
            export_name(std::any::type_name_of_val(&__export))
        }
        assert_eq!(so_named(), "so_named");
        assert_eq!(export_name("superoffload::ffi::pool::so_pool_create::__export"), "so_pool_create");
    }
}
