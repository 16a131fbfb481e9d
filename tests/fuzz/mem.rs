//! Caller memory that a session borrows: raw allocations (never moved, never reallocated),
//! read and written only when the header says the caller may.

use std::alloc::{Layout, alloc_zeroed, dealloc};

use superoffload::kernels::{DType, bf16, f16};

use crate::common::Store;

/// A zeroed, 64-byte aligned allocation of `bytes` bytes (at least one).
pub struct RawBuf {
    ptr: *mut u8,
    layout: Layout,
}

unsafe impl Send for RawBuf {}

impl RawBuf {
    pub fn new(bytes: usize) -> RawBuf {
        let layout = Layout::from_size_align(bytes.max(1), 64).unwrap();
        let ptr = unsafe { alloc_zeroed(layout) };
        assert!(!ptr.is_null(), "allocation of {bytes} bytes failed");
        RawBuf { ptr, layout }
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.layout.size()
    }

    /// A copy of `n` elements of `dtype` from the start.
    pub fn read(&self, dtype: DType, n: usize) -> Store {
        assert!(n * dtype.size() <= self.bytes());
        unsafe {
            match dtype {
                DType::F32 => Store::F32(std::slice::from_raw_parts(self.ptr.cast::<f32>(), n).to_vec()),
                DType::Bf16 => Store::Bf16(std::slice::from_raw_parts(self.ptr.cast::<bf16>(), n).to_vec()),
                DType::F16 => Store::F16(std::slice::from_raw_parts(self.ptr.cast::<f16>(), n).to_vec()),
            }
        }
    }

    /// Writes `values` from the start.
    pub fn write(&self, values: &Store) {
        let bytes = store_bytes(values);
        assert!(bytes.len() <= self.bytes());
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr, bytes.len()) };
    }
}

impl Drop for RawBuf {
    fn drop(&mut self) {
        unsafe { dealloc(self.ptr, self.layout) };
    }
}

/// The little-endian bytes of a store.
pub fn store_bytes(s: &Store) -> Vec<u8> {
    match s {
        Store::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Store::Bf16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
        Store::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
    }
}

/// A store from little-endian bytes.
pub fn store_from_bytes(dtype: DType, bytes: &[u8]) -> Store {
    match dtype {
        DType::F32 => Store::F32(bytes.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()),
        DType::Bf16 => Store::Bf16(
            bytes.chunks_exact(2).map(|c| bf16::from_bits(u16::from_le_bytes(c.try_into().unwrap()))).collect(),
        ),
        DType::F16 => Store::F16(
            bytes.chunks_exact(2).map(|c| f16::from_bits(u16::from_le_bytes(c.try_into().unwrap()))).collect(),
        ),
    }
}

/// Zeros of a dtype.
pub fn zeros(dtype: DType, n: usize) -> Store {
    Store::from_f64(dtype, std::iter::repeat_n(0.0, n))
}

/// `dst[range] = src` element for element (same dtype).
pub fn put(dst: &mut Store, offset: usize, src: &Store) {
    for i in 0..src.len() {
        set_bits(dst, offset + i, src.bits(i));
    }
}

pub fn set_bits(dst: &mut Store, i: usize, bits: u32) {
    match dst {
        Store::F32(v) => v[i] = f32::from_bits(bits),
        Store::Bf16(v) => v[i] = bf16::from_bits(bits as u16),
        Store::F16(v) => v[i] = f16::from_bits(bits as u16),
    }
}

/// Elements `range` of a store, as a store.
pub fn sub(s: &Store, range: std::ops::Range<usize>) -> Store {
    match s {
        Store::F32(v) => Store::F32(v[range].to_vec()),
        Store::Bf16(v) => Store::Bf16(v[range].to_vec()),
        Store::F16(v) => Store::F16(v[range].to_vec()),
    }
}
