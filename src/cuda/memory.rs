//! Owners of device memory and host registrations: what they hold is released when they are
//! dropped, on every path, early returns included. Drop them with the transport's context
//! current, as for every driver call.

use super::driver::{self, CUdeviceptr};
use crate::error::Result;
use crate::kernels::{Floats, FloatsMut};

/// Device memory (`cuMemAlloc`), freed on drop.
pub(crate) struct DeviceBuffer {
    ptr: CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    pub(crate) fn alloc(bytes: usize) -> Result<DeviceBuffer> {
        Ok(DeviceBuffer { ptr: driver::mem_alloc(bytes)?, bytes })
    }

    pub(crate) fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The address `offset` bytes in.
    pub(crate) fn at(&self, offset: usize) -> CUdeviceptr {
        self.ptr + offset as CUdeviceptr
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        driver::mem_free(self.ptr);
    }
}

/// A page-locked host range: registered here (unregistered on drop), or page-locked by its
/// owner already (e.g. `tensor.pin_memory()`), which is then left alone.
pub(crate) struct HostRegistration {
    ptr: usize,
    bytes: usize,
    ours: bool,
}

impl HostRegistration {
    /// Page-locks `bytes` of host memory at `ptr`, which must stay valid until the drop.
    pub(crate) fn register(ptr: *mut u8, bytes: usize) -> Result<HostRegistration> {
        let ours = driver::host_register(ptr, bytes)?;
        Ok(HostRegistration { ptr: ptr as usize, bytes, ours })
    }

    /// The bytes this registration page-locked (0 if the owner had).
    pub(crate) fn pinned_bytes(&self) -> usize {
        if self.ours { self.bytes } else { 0 }
    }
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ours {
            driver::host_unregister(self.ptr as *mut u8);
        }
    }
}

/// Host memory allocated and page-locked here: the partials of sums of squares, and the
/// slots of the bounded buffers pieces of weights and gradients pass through.
pub(crate) struct PinnedBox<T> {
    // Declared before `data`, so dropped first: the range is unregistered before it is freed.
    _registration: HostRegistration,
    data: Box<[T]>,
}

impl<T: Copy + Default> PinnedBox<T> {
    /// `len` zeros, page-locked.
    pub(crate) fn zeros(len: usize) -> Result<PinnedBox<T>> {
        let mut data = vec![T::default(); len].into_boxed_slice();
        let registration = HostRegistration::register(data.as_mut_ptr().cast(), len * size_of::<T>())?;
        Ok(PinnedBox { _registration: registration, data })
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        &self.data
    }

    pub(crate) fn bytes(&self) -> usize {
        self.data.len() * size_of::<T>()
    }

    /// The address of elements `[offset, ..)`.
    pub(crate) fn dst_at(&mut self, offset: usize) -> *mut u8 {
        self.data[offset..].as_mut_ptr().cast()
    }
}

/// The address of host memory a copy reads.
pub(super) fn floats_ptr(f: &Floats<'_>) -> *const u8 {
    match f {
        Floats::F32(s) => s.as_ptr().cast(),
        Floats::Bf16(s) => s.as_ptr().cast(),
        Floats::F16(s) => s.as_ptr().cast(),
    }
}

/// The address and bytes of host memory a copy writes.
pub(super) fn floats_mut_ptr(f: &mut FloatsMut<'_>) -> (*mut u8, usize) {
    match f {
        FloatsMut::F32(s) => (s.as_mut_ptr().cast(), s.len() * 4),
        FloatsMut::Bf16(s) => (s.as_mut_ptr().cast(), s.len() * 2),
        FloatsMut::F16(s) => (s.as_mut_ptr().cast(), s.len() * 2),
    }
}
