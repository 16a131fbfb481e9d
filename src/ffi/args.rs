//! Checking and reading the caller's arguments: pointers, structs with `struct_size`,
//! buffers of (pointer, length, dtype), arrays, strings, out-parameters. Every export takes
//! its arguments through these, so each rule (and its message) is written once.

use std::ffi::{CStr, c_char, c_void};
use std::path::PathBuf;
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats, FloatsMut};
use crate::session::Borrowed;

/// Rejects a NULL pointer argument.
pub(crate) fn non_null<T>(ptr: *const T, name: &str) -> Result<()> {
    if ptr.is_null() { Err(Error::new(Status::NullArgument, format!("{name} is NULL"))) } else { Ok(()) }
}

/// Structs that cross the ABI with `size_t struct_size` as their first field.
///
/// # Safety
/// Implementors must be `#[repr(C)]` with `struct_size: usize` as their first field, and
/// every field must be an integer, a float, a bool or a raw pointer (so that all-zero bytes
/// are a valid value: see `boundary::FailureValue`).
pub(crate) unsafe trait WithStructSize: Copy {
    /// The C name, for messages.
    const NAME: &'static str;
}

/// `unsafe impl WithStructSize` for structs declared with `struct_size` first; the invocation
/// is written `with_struct_size!(unsafe so_a, so_b)` after a `// SAFETY:` comment that says
/// why each listed struct meets the trait's contract.
macro_rules! with_struct_size {
    (unsafe $($c:ident),+ $(,)?) => {$(
        // SAFETY: stated at the invocation, as the macro's syntax demands.
        unsafe impl $crate::ffi::args::WithStructSize for $c {
            const NAME: &'static str = stringify!($c);
        }
    )+};
}
pub(crate) use with_struct_size;

/// Refuses a `struct_size` other than this library's.
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

/// Checks a non-NULL struct's `struct_size`.
///
/// # Safety
/// `ptr` must be NULL or point to at least a readable `size_t`.
unsafe fn check_size_at<T: WithStructSize>(ptr: *const T, name: &str) -> Result<()> {
    non_null(ptr, name)?;
    // SAFETY: non-NULL, and the caller guarantees a readable `size_t` there, which is the
    // struct's first field (`WithStructSize`); read unaligned as the caller's struct may be
    // packed differently than ours.
    let size = unsafe { ptr.cast::<usize>().read_unaligned() };
    check_struct_size::<T>(size, name)
}

/// Copies a caller's input struct after checking its `struct_size`.
///
/// # Safety
/// `ptr` must be NULL or point to a readable `T` (as the header documents).
pub(crate) unsafe fn read_struct<T: WithStructSize>(ptr: *const T, name: &str) -> Result<T> {
    // SAFETY: a readable `T` starts with a readable `size_t`.
    unsafe { check_size_at(ptr, name)? };
    // SAFETY: non-NULL and readable per the caller; the sizes agree, so the caller's struct
    // has this library's layout.
    Ok(unsafe { ptr.read_unaligned() })
}

/// A caller's optional input struct: `default()` for NULL, else as [`read_struct`].
///
/// # Safety
/// As [`read_struct`].
pub(crate) unsafe fn read_struct_or<T: WithStructSize>(
    ptr: *const T,
    name: &str,
    default: impl FnOnce() -> T,
) -> Result<T> {
    if ptr.is_null() {
        return Ok(default());
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { read_struct(ptr, name) }
}

/// Checks a caller's output struct (non-NULL, its `struct_size` set to this library's) before
/// the call does anything, so that nothing happens for an output that cannot be written.
///
/// # Safety
/// `ptr` must be NULL or point to a writable `T`.
pub(crate) unsafe fn check_out_struct<T: WithStructSize>(ptr: *mut T, name: &str) -> Result<()> {
    // SAFETY: a writable `T` holds a readable `size_t` first (the caller sets it).
    unsafe { check_size_at(ptr.cast_const(), name) }
}

/// Writes a required out-parameter.
///
/// # Safety
/// `out` must be NULL or writable.
pub(crate) unsafe fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<()> {
    non_null(out, name)?;
    // SAFETY: checked non-NULL; writable per the caller. Unaligned, as the header does not
    // require more alignment for output structs than C gives them.
    unsafe { out.write_unaligned(value) };
    Ok(())
}

/// Writes an optional out-parameter if the caller gave one.
///
/// # Safety
/// `out` must be NULL or writable.
pub(crate) unsafe fn write_opt<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and writable per the caller.
        unsafe { out.write_unaligned(value) };
    }
}

/// A timeout in nanoseconds; negative waits forever.
pub(crate) fn timeout(ns: i64) -> Option<Duration> {
    (ns >= 0).then(|| Duration::from_nanos(ns as u64))
}

/// A required NUL-terminated UTF-8 string.
///
/// # Safety
/// `ptr` must be NULL or point to a NUL-terminated string that outlives `'a`.
pub(crate) unsafe fn c_str<'a>(ptr: *const c_char, name: &str) -> Result<&'a str> {
    non_null(ptr, name)?;
    // SAFETY: non-NULL and NUL-terminated per the caller.
    unsafe { CStr::from_ptr(ptr) }.to_str().map_err(|_| Error::invalid(format!("{name} is not UTF-8")))
}

/// A file path argument.
///
/// # Safety
/// As [`c_str`].
pub(crate) unsafe fn path_arg(path: *const c_char) -> Result<PathBuf> {
    // SAFETY: the caller's contract, passed on.
    Ok(PathBuf::from(unsafe { c_str(path, "path")? }))
}

/// A caller's buffer: `numel` elements of `dtype` at `addr`, checked to be non-NULL, aligned
/// to its element size, and addressable (the byte length fits in `isize` and does not wrap
/// the address space). The one check of (pointer, length, dtype) arguments; what is in the
/// memory is the caller's contract, taken on by the `unsafe` views.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RawBuf<'n> {
    /// How messages name the pointer (`buffers->param`, `desc->master`, `grad`).
    pub name: &'n str,
    pub addr: usize,
    pub numel: usize,
    pub dtype: DType,
}

impl<'n> RawBuf<'n> {
    /// Checks a buffer argument; `count` names its length in messages (`buffers->numel`).
    pub(crate) fn new(name: &'n str, count: &str, ptr: *const c_void, numel: usize, dtype: DType) -> Result<Self> {
        let addr = ptr as usize;
        if addr == 0 {
            return Err(Error::new(Status::NullArgument, format!("{name} is NULL")));
        }
        check_extent(name, count, addr, numel, dtype.size(), dtype.name())?;
        if !addr.is_multiple_of(dtype.size()) {
            return Err(Error::invalid(format!(
                "{name} ({addr:#x}) is not aligned to its element size ({} bytes for {})",
                dtype.size(),
                dtype.name()
            )));
        }
        Ok(RawBuf { name, addr, numel, dtype })
    }

    /// One past the last byte.
    pub(crate) fn end(&self) -> usize {
        self.addr + self.numel * self.dtype.size()
    }

    /// The buffer as a read-only typed slice.
    ///
    /// # Safety
    /// The memory must be valid for reads and not written by anything else for `'a`.
    pub(crate) unsafe fn floats<'a>(self) -> Floats<'a> {
        let (ptr, n) = (self.addr as *const u8, self.numel);
        // SAFETY: non-NULL, aligned to the element type and in range (checked in `new`);
        // validity for 'a is the caller's.
        unsafe {
            match self.dtype {
                DType::F32 => Floats::F32(std::slice::from_raw_parts(ptr.cast(), n)),
                DType::Bf16 => Floats::Bf16(std::slice::from_raw_parts(ptr.cast(), n)),
                DType::F16 => Floats::F16(std::slice::from_raw_parts(ptr.cast(), n)),
            }
        }
    }

    /// The buffer as a mutable typed slice.
    ///
    /// # Safety
    /// The memory must be valid for reads and writes and not accessed by anything else for
    /// `'a` (in particular, disjoint from every other buffer borrowed with it).
    pub(crate) unsafe fn floats_mut<'a>(self) -> FloatsMut<'a> {
        let (ptr, n) = (self.addr as *mut u8, self.numel);
        // SAFETY: as in `floats`, plus exclusivity from the caller.
        unsafe {
            match self.dtype {
                DType::F32 => FloatsMut::F32(std::slice::from_raw_parts_mut(ptr.cast(), n)),
                DType::Bf16 => FloatsMut::Bf16(std::slice::from_raw_parts_mut(ptr.cast(), n)),
                DType::F16 => FloatsMut::F16(std::slice::from_raw_parts_mut(ptr.cast(), n)),
            }
        }
    }

    /// The buffer lent to a session until it is unregistered.
    ///
    /// # Safety
    /// As [`Borrowed::new`]: valid for reads and writes for as long as the session uses it.
    pub(crate) unsafe fn borrowed(self) -> Result<Borrowed> {
        // SAFETY: the caller's contract, passed on; the checks `Borrowed::new` repeats have
        // passed in `new`.
        unsafe { Borrowed::new(self.name, self.addr as *mut c_void, self.numel, self.dtype) }
    }
}

/// Refuses a length whose bytes do not fit in `isize` or wrap the address space.
fn check_extent(name: &str, count: &str, addr: usize, numel: usize, size: usize, what: &str) -> Result<()> {
    numel
        .checked_mul(size)
        .filter(|&bytes| bytes <= isize::MAX as usize && addr.checked_add(bytes).is_some())
        .map(|_| ())
        .ok_or_else(|| {
            Error::invalid(format!(
                "{count} = {numel} is too large: {name} would not fit in memory ({size}-byte {what})"
            ))
        })
}

/// Refuses buffers that share a byte.
pub(crate) fn check_disjoint(bufs: &[RawBuf<'_>]) -> Result<()> {
    for (i, a) in bufs.iter().enumerate() {
        for b in &bufs[i + 1..] {
            if a.addr < b.end() && b.addr < a.end() {
                return Err(Error::new(
                    Status::Aliasing,
                    format!("{} and {} overlap; every buffer must be distinct", a.name, b.name),
                ));
            }
        }
    }
    Ok(())
}

/// An optional array given as (pointer, count): `None` for (NULL, 0); (NULL, n) and
/// (pointer, 0) are refused.
///
/// # Safety
/// `ptr` must be NULL or point to `len` readable `T`s that outlive `'a`.
pub(crate) unsafe fn optional_array<'a, T>(
    ptr: *const T,
    len: usize,
    name: &str,
    count: &str,
) -> Result<Option<&'a [T]>> {
    match (ptr.is_null(), len) {
        (true, 0) => Ok(None),
        (true, _) => Err(Error::new(Status::NullArgument, format!("{name} is NULL but {count} is not 0"))),
        (false, 0) => Err(Error::invalid(format!("{name} is set but {count} is 0"))),
        // SAFETY: the caller's contract, passed on.
        (false, _) => unsafe { array(ptr, len, name, count) }.map(Some),
    }
}

/// A required, non-empty array given as (pointer, count).
///
/// # Safety
/// As [`optional_array`].
pub(crate) unsafe fn required_array<'a, T>(ptr: *const T, len: usize, name: &str, count: &str) -> Result<&'a [T]> {
    if ptr.is_null() || len == 0 {
        return Err(Error::new(Status::NullArgument, format!("{name} is NULL or {count} is 0")));
    }
    // SAFETY: the caller's contract, passed on.
    unsafe { array(ptr, len, name, count) }
}

/// # Safety
/// `ptr` is non-NULL and points to `len` readable `T`s that outlive `'a`.
unsafe fn array<'a, T>(ptr: *const T, len: usize, name: &str, count: &str) -> Result<&'a [T]> {
    let addr = ptr as usize;
    check_extent(name, count, addr, len, size_of::<T>(), "elements")?;
    if !addr.is_multiple_of(align_of::<T>()) {
        return Err(Error::invalid(format!("{name} ({addr:#x}) is not aligned to {} bytes", align_of::<T>())));
    }
    // SAFETY: non-NULL, aligned and in range (checked above); `len` readable elements that
    // outlive 'a per the caller.
    Ok(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// A list of CPU cores (`uint32_t` entries) given as (pointer, count).
///
/// # Safety
/// As [`optional_array`].
pub(crate) unsafe fn core_list(ptr: *const u32, len: usize, name: &str, count: &str) -> Result<Option<Vec<usize>>> {
    // SAFETY: the caller's contract, passed on.
    let cores = unsafe { optional_array(ptr, len, name, count)? };
    Ok(cores.map(|cores| cores.iter().map(|&c| c as usize).collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_check_for_every_buffer_argument() {
        let data = [0.0f32; 4];
        let ptr = data.as_ptr().cast::<c_void>();
        let buf = RawBuf::new("grad", "numel", ptr, 4, DType::F32).unwrap();
        assert_eq!(buf.end() - buf.addr, 16);

        let e = RawBuf::new("grad", "numel", std::ptr::null(), 4, DType::F32).unwrap_err();
        assert_eq!((e.status, e.message.as_str()), (Status::NullArgument, "grad is NULL"));
        // SAFETY: only the address is used; nothing is read.
        let odd = unsafe { ptr.byte_add(2) };
        let e = RawBuf::new("desc->master", "desc->numel", odd, 1, DType::F32).unwrap_err();
        assert!(e.message.starts_with("desc->master (0x") && e.message.contains("not aligned"), "{}", e.message);
        assert!(RawBuf::new("desc->master", "desc->numel", odd, 1, DType::Bf16).is_ok());
        let e = RawBuf::new("buffers->param", "buffers->numel", ptr, usize::MAX / 2, DType::F32).unwrap_err();
        assert!(e.message.starts_with("buffers->numel = ") && e.message.contains("too large"), "{}", e.message);

        let a = RawBuf::new("a", "n", ptr, 2, DType::F32).unwrap();
        // SAFETY: as above.
        let b = RawBuf::new("b", "n", unsafe { ptr.byte_add(4) }, 2, DType::F32).unwrap();
        let e = check_disjoint(&[a, b]).unwrap_err();
        assert_eq!(
            (e.status, e.message.as_str()),
            (Status::Aliasing, "a and b overlap; every buffer must be distinct")
        );
        // SAFETY: as above.
        let c = RawBuf::new("c", "n", unsafe { ptr.byte_add(8) }, 2, DType::F32).unwrap();
        assert!(check_disjoint(&[a, c]).is_ok(), "adjacent buffers do not overlap");
    }

    #[test]
    fn arrays_given_as_pointer_and_count() {
        let cores = [3u32, 1];
        // SAFETY: `cores` holds 2 entries; NULL is never read.
        unsafe {
            assert_eq!(core_list(cores.as_ptr(), 2, "cores", "num_cores").unwrap(), Some(vec![3, 1]));
            assert_eq!(core_list(std::ptr::null(), 0, "cores", "num_cores").unwrap(), None);
            let e = core_list(std::ptr::null(), 2, "cores", "num_cores").unwrap_err();
            assert_eq!((e.status, e.message.as_str()), (Status::NullArgument, "cores is NULL but num_cores is not 0"));
            let e = core_list(cores.as_ptr(), 0, "cores", "num_cores").unwrap_err();
            assert_eq!((e.status, e.message.as_str()), (Status::InvalidArgument, "cores is set but num_cores is 0"));
            let e = required_array(cores.as_ptr(), 0, "slices", "num_slices").unwrap_err();
            assert_eq!(e.status, Status::NullArgument);
        }
    }
}
