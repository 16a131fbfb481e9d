//! `so_pool_*`: thread pools.

use std::ffi::c_char;
use std::sync::Arc;

use super::args::{check_out_struct, core_list, non_null, read_struct_or, with_struct_size, write_out};
use super::boundary::ffi_boundary;
use super::convert::{ToC, abi_struct};
use super::handle::{free_handle, handle, handle_arc, into_handle};
use super::types::so_isa;
use crate::error::{Result, Status};
use crate::kernels::{Pool, PoolOptions};

/// Options of `so_pool_create`. Initialise with `so_pool_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_pool_options {
    /// `sizeof(so_pool_options)`.
    pub struct_size: usize,
    /// Threads; 0 means one per listed core, or else one per CPU this process may run on.
    pub num_threads: usize,
    /// Optional list of CPU cores (`num_cores` entries): one thread pinned to each, in this
    /// order. Every core must be in the process's affinity mask, none listed twice. The
    /// list is copied; NULL for unpinned threads.
    pub cores: *const u32,
    /// Entries in `cores`.
    pub num_cores: usize,
    /// One of `so_isa`; `SO_ISA_AUTO` picks the widest the CPU supports.
    pub isa: u32,
}

abi_struct! {
    so_pool_options <=> PoolOptions { num_threads, isa }
    to_core (unsafe) |raw, arg| {
        // SAFETY: `to_core` is unsafe: `cores` is NULL or holds `num_cores` entries.
        cores: unsafe { core_list(raw.cores, raw.num_cores, &format!("{arg}->cores"), "num_cores")? },
    }
    // The defaults borrow nothing.
    to_c |o| { cores: std::ptr::null(), num_cores: 0 }
}

/// What a pool runs with (filled by `so_pool_get_info`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_pool_info {
    /// Set by the caller to `sizeof(so_pool_info)` before the call.
    pub struct_size: usize,
    /// The pool's instruction set, one of `so_isa` (never `SO_ISA_AUTO`).
    pub isa: u32,
    /// Number of worker threads.
    pub num_threads: usize,
    /// Whether each thread is pinned to one core.
    pub pinned: bool,
}

// SAFETY: both are `#[repr(C)]`, `struct_size` first, the other fields numbers, bools and raw
// pointers.
with_struct_size!(unsafe so_pool_options, so_pool_info);

/// A pool of CPU threads that kernels (and sessions) split their work across.
///
/// Under the hood this is an `Arc` of the pool: a session created with a pool keeps it
/// alive, so destroying the handle while a session still uses the pool is safe.
///
/// Thread-safety: a pool may be used from any number of threads at once.
pub struct so_pool {
    _private: [u8; 0],
}

handle!(so_pool => Arc<Pool>);

/// The pool a call runs on: the caller's, or the process-wide default for NULL.
///
/// # Safety
/// `pool` must be NULL or a live handle from `so_pool_create`.
pub(crate) unsafe fn pool_arg(pool: *const so_pool) -> Result<Arc<Pool>> {
    if pool.is_null() {
        return Pool::default_pool();
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { handle_arc(pool, "pool") }
}

/// Returns pool options: as many threads as CPUs this process may run on, unpinned, widest
/// instruction set; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_pool_options_default() -> so_pool_options {
    ffi_boundary!({ Ok(so_pool_options::from_core(&PoolOptions::default())) })
}

/// @brief Creates a thread pool.
///
/// The threads start (and are pinned, with a core list) before this returns. A pool is
/// never rayon's or OpenMP's global pool: it does not compete with other libraries' pools
/// unless their threads share its cores.
///
/// @param options NULL for `so_pool_options_default()`.
/// @param out_pool Receives the new pool on success; the caller owns it and releases it
///        with `so_pool_destroy`.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_ARGUMENT` for a core outside the process's
///         affinity mask, a core listed twice, or a thread count that disagrees with the
///         core list; `SO_STATUS_UNSUPPORTED` for an instruction set the CPU lacks;
///         `SO_STATUS_OUT_OF_RESOURCES` if threads cannot be started or pinned.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `options` is NULL or points to a `so_pool_options` whose `cores` is NULL or holds
/// `num_cores` entries; `out_pool` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_pool_create(options: *const so_pool_options, out_pool: *mut *mut so_pool) -> Status {
    ffi_boundary!({
        non_null(out_pool, "out_pool")?;
        // SAFETY: `options` is NULL or points to a `so_pool_options` whose `cores` holds
        // `num_cores` entries.
        let options = unsafe {
            read_struct_or(options, "options", || so_pool_options::from_core(&PoolOptions::default()))?
                .to_core("options")?
        };
        let pool = Arc::new(Pool::new(&options)?);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { write_out(out_pool, "out_pool", into_handle(pool)) }
    })
}

/// @brief Releases the caller's reference to a pool. NULL is a no-op.
///
/// When no session uses the pool any more, its threads are stopped and joined before this
/// returns. The pool must not be passed to any call after this.
///
/// @note Thread-safety: must not race with calls that use the same handle.
///
/// # Safety
/// `pool` is NULL or a live pool from `so_pool_create`, not used again after this call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_pool_destroy(pool: *mut so_pool) {
    ffi_boundary!({
        // SAFETY: `pool` is NULL or a live handle whose reference the caller gives up here
        // (this function's contract).
        unsafe { free_handle(pool) };
        Ok(())
    })
}

/// @brief Describes a pool: instruction set, thread count, pinning.
///
/// @param pool NULL for the default pool (created on first use).
/// @param out_info Caller-provided, with `struct_size = sizeof(so_pool_info)`; filled on
///        success.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `pool` is NULL or a live pool; `out_info` is NULL or points to a writable
/// `so_pool_info`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_pool_get_info(pool: *const so_pool, out_info: *mut so_pool_info) -> Status {
    ffi_boundary!({
        // SAFETY: `out_info` is NULL or a writable `so_pool_info`; `pool` is NULL or live.
        unsafe { check_out_struct(out_info, "out_info")? };
        // SAFETY: `pool` is NULL or a live pool (this function's contract).
        let pool = unsafe { pool_arg(pool)? };
        let info = so_pool_info {
            struct_size: size_of::<so_pool_info>(),
            isa: pool.isa().to_c(),
            num_threads: pool.num_threads(),
            pinned: pool.cores().is_some(),
        };
        // SAFETY: checked above.
        unsafe { write_out(out_info, "out_info", info) }
    })
}

/// Returns a static name for a `so_isa` value ("portable", "avx2", "avx512", "auto"), or
/// "unknown".
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_isa_name(isa: u32) -> *const c_char {
    ffi_boundary!({
        Ok(match so_isa::from_raw(isa) {
            Some(so_isa::Auto) => c"auto",
            Some(so_isa::Portable) => c"portable",
            Some(so_isa::Avx2) => c"avx2",
            Some(so_isa::Avx512) => c"avx512",
            None => c"unknown",
        }
        .as_ptr())
    })
}
