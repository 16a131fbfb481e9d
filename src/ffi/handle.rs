//! Opaque handles: the one place where a handle pointer is made from the Rust value behind
//! it, turned back into a reference (with the NULL check), and freed.
//!
//! A handle type (`so_session`, `so_pool`) is an opaque, never-constructed struct that the
//! header declares; [`handle!`] names the Rust value it stands for and how a live handle
//! owns that value: a `Box` (the handle is the value's only owner) or an `Arc` (the handle
//! holds one reference; others may be held elsewhere, e.g. a session keeps its pool). The
//! pointer is the `Box::into_raw` or `Arc::into_raw` pointer, cast, so a reference to the
//! value is a cast in both cases.

use std::sync::Arc;

use super::args::non_null;
use crate::error::Result;

/// An opaque C handle type and the Rust value it stands for.
///
/// # Safety
/// Implemented only through [`handle!`], for opaque types that are never constructed: every
/// non-NULL pointer to one that the library hands out comes from [`into_handle`] with this
/// `Owner`, so the casts in this module are the inverse of that one cast.
pub(crate) unsafe trait Handle {
    /// The Rust value behind a handle.
    type Target;
    /// How a live handle owns its value: `Box<Target>` or `Arc<Target>`.
    type Owner: Owner<Target = Self::Target>;
}

/// A smart pointer a handle can be made from: `Box` or `Arc`.
pub(crate) trait Owner {
    type Target;
    /// Gives up ownership for a raw pointer to the value.
    fn into_raw(self) -> *const Self::Target;
    /// Takes ownership back.
    ///
    /// # Safety
    /// `ptr` comes from `into_raw` of this same type, and its ownership is given up here.
    unsafe fn from_raw(ptr: *const Self::Target) -> Self;
}

impl<T> Owner for Box<T> {
    type Target = T;
    fn into_raw(self) -> *const T {
        Box::into_raw(self).cast_const()
    }
    unsafe fn from_raw(ptr: *const T) -> Self {
        // SAFETY: `ptr` is from `Box::into_raw`, whose ownership the caller gives up.
        unsafe { Box::from_raw(ptr.cast_mut()) }
    }
}

impl<T> Owner for Arc<T> {
    type Target = T;
    fn into_raw(self) -> *const T {
        Arc::into_raw(self)
    }
    unsafe fn from_raw(ptr: *const T) -> Self {
        // SAFETY: `ptr` is from `Arc::into_raw`, whose reference the caller gives up.
        unsafe { Arc::from_raw(ptr) }
    }
}

/// Declares an opaque handle type: `handle!(so_x => Box<Core>)` or
/// `handle!(so_x => Arc<Core>)`. The type must be a zero-sized struct the library never
/// constructs (`_private: [u8; 0]`), declared next to the invocation for cbindgen.
macro_rules! handle {
    ($c:ident => $owner:ident<$target:ty>) => {
        // SAFETY: `$c` is an opaque type that is never constructed; its pointers are made
        // only by `handle::into_handle` (the trait's contract).
        unsafe impl $crate::ffi::handle::Handle for $c {
            type Target = $target;
            type Owner = $owner<$target>;
        }
    };
}
pub(crate) use handle;

/// A new handle, owning `value`; the caller of the export owns the handle.
pub(crate) fn into_handle<H: Handle>(value: H::Owner) -> *mut H {
    value.into_raw().cast_mut().cast()
}

/// The value behind a handle argument named `name`; NULL is `SO_STATUS_NULL_ARGUMENT`.
///
/// # Safety
/// `handle` must be NULL or a live handle (from [`into_handle`], not yet freed), and not
/// freed while the reference lives (the header's rule that a destroy must not race with
/// other calls on the handle).
pub(crate) unsafe fn handle_ref<'a, H: Handle>(handle: *const H, name: &str) -> Result<&'a H::Target> {
    non_null(handle, name)?;
    // SAFETY: a live handle is the pointer to its value (`into_handle`), alive while the
    // caller says.
    Ok(unsafe { &*handle.cast::<H::Target>() })
}

/// A new reference to the value behind a shared (`Arc`) handle argument named `name`; the
/// handle keeps its own.
///
/// # Safety
/// As [`handle_ref`].
pub(crate) unsafe fn handle_arc<T, H>(handle: *const H, name: &str) -> Result<Arc<T>>
where
    H: Handle<Target = T, Owner = Arc<T>>,
{
    non_null(handle, name)?;
    let ptr = handle.cast::<T>();
    // SAFETY: a live shared handle is a pointer from `Arc::into_raw` whose reference the
    // handle still holds; adding one first means the `Arc` made here owns only its own.
    unsafe {
        Arc::increment_strong_count(ptr);
        Ok(Arc::from_raw(ptr))
    }
}

/// Frees a handle (drops the `Box`, or the handle's `Arc` reference); NULL is a no-op.
///
/// # Safety
/// `handle` must be NULL or a live handle that is not used again, with no other call on it
/// running.
pub(crate) unsafe fn free_handle<H: Handle>(handle: *mut H) {
    if !handle.is_null() {
        // SAFETY: a live handle owns its value through `H::Owner` (`into_handle`), which the
        // caller gives up here.
        drop(unsafe { H::Owner::from_raw(handle.cast_const().cast()) });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::error::Status;

    struct so_boxed {
        _private: [u8; 0],
    }
    struct so_shared {
        _private: [u8; 0],
    }

    static DROPS: AtomicUsize = AtomicUsize::new(0);
    #[derive(Debug)]
    struct Counted(u32);
    impl Drop for Counted {
        fn drop(&mut self) {
            DROPS.fetch_add(1, Ordering::SeqCst);
        }
    }

    handle!(so_boxed => Box<Counted>);
    handle!(so_shared => Arc<u32>);

    #[test]
    fn handles_round_trip_and_free_what_they_own() {
        let boxed: *mut so_boxed = into_handle(Box::new(Counted(7)));
        // SAFETY: `boxed` is live until freed below.
        assert_eq!(unsafe { handle_ref(boxed, "b") }.unwrap().0, 7);
        // SAFETY: NULL is refused before any use.
        let e = unsafe { handle_ref(std::ptr::null::<so_boxed>(), "session") }.unwrap_err();
        assert_eq!((e.status, e.message.as_str()), (Status::NullArgument, "session is NULL"));
        let before = DROPS.load(Ordering::SeqCst);
        // SAFETY: live, and not used again.
        unsafe { free_handle(boxed) };
        assert_eq!(DROPS.load(Ordering::SeqCst), before + 1);
        // SAFETY: NULL is a no-op.
        unsafe { free_handle(std::ptr::null_mut::<so_boxed>()) };

        let value = Arc::new(5u32);
        let shared: *mut so_shared = into_handle(Arc::clone(&value));
        // SAFETY: `shared` is live until freed below.
        let extra = unsafe { handle_arc(shared, "pool") }.unwrap();
        assert_eq!((*extra, Arc::strong_count(&value)), (5, 3));
        // SAFETY: live, and not used again.
        unsafe { free_handle(shared) };
        assert_eq!(Arc::strong_count(&value), 2);
        drop(extra);
        assert_eq!(Arc::strong_count(&value), 1);
    }
}
