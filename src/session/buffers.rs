//! Flat host buffers of one dtype: owned by the session, or borrowed from the caller.

use std::ops::Range;

use half::{bf16, f16};

use crate::error::{Error, Result, Status};
use crate::kernels::{DType, Floats, FloatsMut};

/// Caller memory the session borrows: an address range of `len` elements of `dtype`.
///
/// The caller promises (see the header) that the memory stays valid until the buffer is
/// unregistered or the session destroyed, and that it does not access it while the
/// session may (between a gradient hand-off completing the sub-group and that
/// sub-group's final ticket).
#[derive(Clone, Copy, Debug)]
pub struct Borrowed {
    addr: usize,
    len: usize,
    dtype: DType,
}

impl Borrowed {
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` elements of `dtype` for as long as
    /// the session uses it, as described on [`Borrowed`].
    pub unsafe fn new(name: &str, ptr: *mut std::ffi::c_void, len: usize, dtype: DType) -> Result<Borrowed> {
        let addr = ptr as usize;
        if addr == 0 {
            return Err(Error::new(Status::NullArgument, format!("{name} is NULL")));
        }
        if !addr.is_multiple_of(dtype.size()) {
            return Err(Error::invalid(format!("{name} ({addr:#x}) is not aligned to {} bytes", dtype.size())));
        }
        len.checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize && addr.checked_add(b).is_some())
            .ok_or_else(|| Error::invalid(format!("{name}: {len} elements do not fit in memory")))?;
        Ok(Borrowed { addr, len, dtype })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

enum Storage {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
    F16(Vec<f16>),
}

enum Memory {
    Owned(Storage),
    Borrowed(Borrowed),
}

/// A flat host buffer.
pub(crate) struct HostBuf {
    memory: Memory,
}

fn zeroed<T: Clone>(len: usize, zero: T, what: &str) -> Result<Vec<T>> {
    let mut v: Vec<T> = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::new(Status::OutOfResources, format!("cannot allocate {len} elements for {what}")))?;
    crate::kernels::advise_huge_pages(v.as_mut_ptr().cast(), len * size_of::<T>());
    v.resize(len, zero);
    Ok(v)
}

impl HostBuf {
    pub(crate) fn zeros(dtype: DType, len: usize, what: &str) -> Result<HostBuf> {
        let storage = match dtype {
            DType::F32 => Storage::F32(zeroed(len, 0.0, what)?),
            DType::Bf16 => Storage::Bf16(zeroed(len, bf16::ZERO, what)?),
            DType::F16 => Storage::F16(zeroed(len, f16::ZERO, what)?),
        };
        Ok(HostBuf { memory: Memory::Owned(storage) })
    }

    pub(crate) fn borrowed(b: Borrowed) -> HostBuf {
        HostBuf { memory: Memory::Borrowed(b) }
    }

    pub(crate) fn is_owned(&self) -> bool {
        matches!(self.memory, Memory::Owned(_))
    }

    pub(crate) fn dtype(&self) -> DType {
        match &self.memory {
            Memory::Owned(Storage::F32(_)) => DType::F32,
            Memory::Owned(Storage::Bf16(_)) => DType::Bf16,
            Memory::Owned(Storage::F16(_)) => DType::F16,
            Memory::Borrowed(b) => b.dtype,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match &self.memory {
            Memory::Owned(Storage::F32(v)) => v.len(),
            Memory::Owned(Storage::Bf16(v)) => v.len(),
            Memory::Owned(Storage::F16(v)) => v.len(),
            Memory::Borrowed(b) => b.len,
        }
    }

    pub(crate) fn as_mut_ptr(&mut self) -> *mut u8 {
        match self.floats_mut() {
            FloatsMut::F32(s) => s.as_mut_ptr().cast(),
            FloatsMut::Bf16(s) => s.as_mut_ptr().cast(),
            FloatsMut::F16(s) => s.as_mut_ptr().cast(),
        }
    }

    pub(crate) fn bytes(&self) -> usize {
        self.len() * self.dtype().size()
    }

    /// The address range, for overlap checks.
    pub(crate) fn addr_range(&self) -> Range<usize> {
        let start = self.as_bytes().as_ptr() as usize;
        start..start + self.bytes()
    }

    pub(crate) fn floats(&self) -> Floats<'_> {
        self.range(0..self.len())
    }

    pub(crate) fn floats_mut(&mut self) -> FloatsMut<'_> {
        let len = self.len();
        self.range_mut(0..len)
    }

    pub(crate) fn range(&self, r: Range<usize>) -> Floats<'_> {
        match &self.memory {
            Memory::Owned(Storage::F32(v)) => Floats::F32(&v[r]),
            Memory::Owned(Storage::Bf16(v)) => Floats::Bf16(&v[r]),
            Memory::Owned(Storage::F16(v)) => Floats::F16(&v[r]),
            Memory::Borrowed(b) => {
                assert!(r.start <= r.end && r.end <= b.len);
                let ptr = b.addr as *const u8;
                // SAFETY: in range, aligned and valid per the `Borrowed` contract; the
                // session's protocol gives this access exclusively to the holder of the
                // sub-group's lock.
                unsafe {
                    match b.dtype {
                        DType::F32 => Floats::F32(&std::slice::from_raw_parts(ptr.cast(), b.len)[r]),
                        DType::Bf16 => Floats::Bf16(&std::slice::from_raw_parts(ptr.cast(), b.len)[r]),
                        DType::F16 => Floats::F16(&std::slice::from_raw_parts(ptr.cast(), b.len)[r]),
                    }
                }
            }
        }
    }

    pub(crate) fn range_mut(&mut self, r: Range<usize>) -> FloatsMut<'_> {
        match &mut self.memory {
            Memory::Owned(Storage::F32(v)) => FloatsMut::F32(&mut v[r]),
            Memory::Owned(Storage::Bf16(v)) => FloatsMut::Bf16(&mut v[r]),
            Memory::Owned(Storage::F16(v)) => FloatsMut::F16(&mut v[r]),
            Memory::Borrowed(b) => {
                assert!(r.start <= r.end && r.end <= b.len);
                let ptr = b.addr as *mut u8;
                // SAFETY: as in `range`, with `&mut self` making this the only access.
                unsafe {
                    match b.dtype {
                        DType::F32 => FloatsMut::F32(&mut std::slice::from_raw_parts_mut(ptr.cast(), b.len)[r]),
                        DType::Bf16 => FloatsMut::Bf16(&mut std::slice::from_raw_parts_mut(ptr.cast(), b.len)[r]),
                        DType::F16 => FloatsMut::F16(&mut std::slice::from_raw_parts_mut(ptr.cast(), b.len)[r]),
                    }
                }
            }
        }
    }

    pub(crate) fn zero_range(&mut self, r: Range<usize>) {
        match self.range_mut(r) {
            FloatsMut::F32(s) => s.fill(0.0),
            FloatsMut::Bf16(s) => s.fill(bf16::ZERO),
            FloatsMut::F16(s) => s.fill(f16::ZERO),
        }
    }

    /// The raw bytes (little-endian IEEE values), for checkpoints.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        let (ptr, len) = match self.floats() {
            Floats::F32(s) => (s.as_ptr().cast::<u8>(), s.len() * 4),
            Floats::Bf16(s) => (s.as_ptr().cast::<u8>(), s.len() * 2),
            Floats::F16(s) => (s.as_ptr().cast::<u8>(), s.len() * 2),
        };
        // SAFETY: f32, bf16 and f16 are plain bits with no padding; the range is the
        // slice's own memory, borrowed for `self`'s lifetime.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Overwrites `range` (in elements) with raw little-endian bytes of this dtype.
    pub(crate) fn write_bytes(&mut self, range: Range<usize>, bytes: &[u8]) {
        let size = self.dtype().size();
        assert_eq!(bytes.len(), range.len() * size);
        match self.range_mut(range) {
            FloatsMut::F32(s) => {
                for (d, c) in s.iter_mut().zip(bytes.chunks_exact(4)) {
                    *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            FloatsMut::Bf16(s) => {
                for (d, c) in s.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = bf16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            FloatsMut::F16(s) => {
                for (d, c) in s.iter_mut().zip(bytes.chunks_exact(2)) {
                    *d = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
                }
            }
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// `AnonHugePages` of the mappings that overlap `range`, from /proc/self/smaps (kB): the
    /// advice splits a buffer's mapping at its first and last whole huge page.
    fn huge_kb_in(range: Range<usize>) -> usize {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let mut inside = false;
        let mut total = 0;
        for line in smaps.lines() {
            if let Some((span, _)) = line.split_once(' ')
                && let Some((lo, hi)) = span.split_once('-')
                && let (Ok(lo), Ok(hi)) = (usize::from_str_radix(lo, 16), usize::from_str_radix(hi, 16))
            {
                inside = lo < range.end && range.start < hi;
            } else if inside && let Some(kb) = line.strip_prefix("AnonHugePages:") {
                total += kb.trim().trim_end_matches("kB").trim().parse::<usize>().unwrap();
            }
        }
        total
    }

    #[test]
    fn session_buffers_are_backed_by_huge_pages_where_the_system_allows() {
        let mode = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
        if !mode.contains("[madvise]") && !mode.contains("[always]") {
            eprintln!("skipped: transparent huge pages are off here ({})", mode.trim());
            return;
        }
        let mut buf = HostBuf::zeros(DType::F32, 8 << 20, "a test buffer").unwrap();
        let addr = buf.as_mut_ptr() as usize;
        let huge = huge_kb_in(addr..addr + buf.bytes());
        // 32 MiB from a fresh allocation: at least 14 whole 2 MiB pages, all touched.
        assert!(huge >= 14 * 2048, "{huge} kB of huge pages in the buffer's mapping");
    }
}
