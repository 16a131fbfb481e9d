//! `so_pool_*`: thread pools.

use std::sync::Arc;

use super::types::{isa_from_raw, isa_to_raw, so_pool_info, so_pool_options};
use super::{check_struct_size, ffi_boundary, non_null, read_struct};
use crate::error::{Error, Result};
use crate::kernels::{Isa, Pool, PoolOptions};

/// A pool of CPU threads that kernels (and sessions) split their work across.
///
/// Under the hood this is an `Arc` of the pool: a session created with a pool keeps it
/// alive, so destroying the handle while a session still uses the pool is safe.
///
/// Thread-safety: a pool may be used from any number of threads at once.
pub struct so_pool {
    _private: [u8; 0],
}

/// The pool a call runs on: the caller's, or the process-wide default for NULL.
///
/// # Safety
/// `pool` must be NULL or a live handle from `so_pool_create`.
pub(crate) unsafe fn pool_arg(pool: *const so_pool) -> Result<Arc<Pool>> {
    if pool.is_null() {
        return Pool::default_pool();
    }
    let pool = pool.cast::<Pool>();
    // SAFETY: a live handle is a pointer from Arc::into_raw; taking one more reference
    // keeps the caller's reference intact.
    unsafe {
        Arc::increment_strong_count(pool);
        Ok(Arc::from_raw(pool))
    }
}

/// Returns pool options: as many threads as CPUs this process may run on, unpinned, widest
/// instruction set; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_pool_options_default() -> so_pool_options {
    ffi_boundary!("so_pool_options_default", fallback = default_options(), { default_options() })
}

fn default_options() -> so_pool_options {
    so_pool_options {
        struct_size: std::mem::size_of::<so_pool_options>(),
        num_threads: 0,
        cores: std::ptr::null(),
        num_cores: 0,
        isa: super::types::so_isa::Auto as u32,
    }
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
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_pool_create(
    options: *const so_pool_options,
    out_pool: *mut *mut so_pool,
) -> crate::error::Status {
    ffi_boundary!("so_pool_create", {
        non_null(out_pool, "out_pool")?;
        let raw = if options.is_null() { default_options() } else { unsafe { read_struct(options, "options")? } };
        let cores = match (raw.cores.is_null(), raw.num_cores) {
            (true, 0) => None,
            (true, _) => {
                return Err(Error::new(
                    crate::error::Status::NullArgument,
                    "options->cores is NULL but num_cores is not 0",
                ));
            }
            (false, 0) => return Err(Error::invalid("options->cores is set but num_cores is 0")),
            // SAFETY: the header requires `cores` to hold `num_cores` entries.
            (false, n) => {
                Some(unsafe { std::slice::from_raw_parts(raw.cores, n) }.iter().map(|&c| c as usize).collect())
            }
        };
        let options = PoolOptions { num_threads: raw.num_threads, cores, isa: isa_from_raw(raw.isa)? };
        let pool = Arc::new(Pool::new(&options)?);
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { out_pool.write(Arc::into_raw(pool).cast_mut().cast()) };
        Ok(())
    })
}

/// @brief Releases the caller's reference to a pool. NULL is a no-op.
///
/// When no session uses the pool any more, its threads are stopped and joined before this
/// returns. The pool must not be passed to any call after this.
///
/// @note Thread-safety: must not race with calls that use the same handle.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_pool_destroy(pool: *mut so_pool) {
    ffi_boundary!("so_pool_destroy", fallback = (), {
        if !pool.is_null() {
            // SAFETY: a live handle owns one reference from Arc::into_raw.
            drop(unsafe { Arc::from_raw(pool.cast_const().cast::<Pool>()) });
        }
    })
}

/// @brief Describes a pool: instruction set, thread count, pinning.
///
/// @param pool NULL for the default pool (created on first use).
/// @param out_info Caller-provided, with `struct_size = sizeof(so_pool_info)`; filled on
///        success.
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_pool_get_info(pool: *const so_pool, out_info: *mut so_pool_info) -> crate::error::Status {
    ffi_boundary!("so_pool_get_info", {
        non_null(out_info, "out_info")?;
        // SAFETY: non-NULL; struct_size is the first field of the caller's struct.
        check_struct_size::<so_pool_info>(unsafe { out_info.cast::<usize>().read_unaligned() }, "out_info")?;
        let pool = unsafe { pool_arg(pool)? };
        let info = so_pool_info {
            struct_size: std::mem::size_of::<so_pool_info>(),
            isa: isa_to_raw(pool.isa()),
            num_threads: pool.num_threads(),
            pinned: pool.cores().is_some(),
        };
        // SAFETY: checked non-NULL and of the right size.
        unsafe { out_info.write_unaligned(info) };
        Ok(())
    })
}

/// Returns a static name for a `so_isa` value ("portable", "avx2", "avx512", "auto"), or
/// "unknown".
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_isa_name(isa: u32) -> *const std::ffi::c_char {
    ffi_boundary!("so_isa_name", fallback = c"unknown".as_ptr(), {
        match isa_from_raw(isa) {
            Ok(None) => c"auto".as_ptr(),
            Ok(Some(Isa::Portable)) => c"portable".as_ptr(),
            Ok(Some(Isa::Avx2)) => c"avx2".as_ptr(),
            Ok(Some(Isa::Avx512)) => c"avx512".as_ptr(),
            Err(_) => c"unknown".as_ptr(),
        }
    })
}
