//! The few CUDA driver calls the transport makes, on cudarc's raw bindings (loaded at run
//! time: the crate builds and runs without CUDA). Every failure becomes an [`Error`] with
//! the driver's error name.

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

use cudarc::driver::sys;

use crate::error::{Error, Result, Status};

pub(crate) use sys::{CUdeviceptr, CUevent, CUstream};

/// Checks once whether the driver library can be loaded and initialised; every other call
/// in this module requires `Ok` from here first.
pub fn available() -> Result<()> {
    static AVAILABLE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    AVAILABLE
        .get_or_init(|| {
            // SAFETY: only probes whether the shared library loads.
            if !unsafe { sys::is_culib_present() } {
                return Err("the CUDA driver library (libcuda.so) cannot be loaded".into());
            }
            // SAFETY: the library is present; cuInit may be called any number of times.
            let r = unsafe { sys::cuInit(0) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(format!("cuInit failed: {}", error_name(r)));
            }
            let mut count = 0;
            // SAFETY: out-pointer to a local.
            let r = unsafe { sys::cuDeviceGetCount(&mut count) };
            match (r, count) {
                (sys::CUresult::CUDA_SUCCESS, n) if n > 0 => Ok(()),
                (sys::CUresult::CUDA_SUCCESS, _) => Err("the CUDA driver reports no device".into()),
                (r, _) => Err(format!("cuDeviceGetCount failed: {}", error_name(r))),
            }
        })
        .clone()
        .map_err(|why| Error::new(Status::CudaUnavailable, format!("CUDA unavailable: {why}")))
}

fn error_name(r: sys::CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: out-pointer; the driver returns a static string or leaves NULL.
    unsafe { sys::cuGetErrorName(r, &mut name) };
    if name.is_null() {
        format!("{r:?}")
    } else {
        // SAFETY: a static NUL-terminated string from the driver.
        unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned()
    }
}

pub(crate) fn check(r: sys::CUresult, what: &str) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::new(Status::CudaError, format!("{what} failed: {}", error_name(r))))
    }
}

/// The device's primary context (the one PyTorch and JAX use), retained for our lifetime.
pub(crate) struct Context {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (it is made current per thread).
unsafe impl Send for Context {}
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn primary(ordinal: i32) -> Result<Context> {
        available()?;
        let mut device = 0;
        // SAFETY: out-pointers to locals; the library is loaded and initialised.
        check(unsafe { sys::cuDeviceGet(&mut device, ordinal) }, &format!("cuDeviceGet({ordinal})"))?;
        let mut ctx = std::ptr::null_mut();
        check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, device) }, "cuDevicePrimaryCtxRetain")?;
        let context = Context { device, ctx };
        context.bind()?;
        Ok(context)
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: a retained context.
        check(unsafe { sys::cuCtxSetCurrent(self.ctx) }, "cuCtxSetCurrent")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the reference `primary` retained.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.device) };
    }
}

pub(crate) fn stream_create() -> Result<CUstream> {
    let mut stream = std::ptr::null_mut();
    let flags = sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32;
    // SAFETY: out-pointer; a context is current.
    check(unsafe { sys::cuStreamCreate(&mut stream, flags) }, "cuStreamCreate")?;
    Ok(stream)
}

pub(crate) fn stream_synchronize(stream: CUstream) -> Result<()> {
    // SAFETY: a valid stream handle.
    check(unsafe { sys::cuStreamSynchronize(stream) }, "cuStreamSynchronize")
}

/// Refuses a stream that is being captured into a CUDA graph: the session's copies and
/// host waits cannot be part of a graph.
pub(crate) fn refuse_capturing(stream: CUstream) -> Result<()> {
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: out-pointer; a valid (caller's) stream handle.
    check(unsafe { sys::cuStreamIsCapturing(stream, &mut status) }, "cuStreamIsCapturing")?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(Error::new(
            Status::StreamCapturing,
            "the stream is being captured into a CUDA graph; hand gradients over outside capture",
        ));
    }
    Ok(())
}

pub(crate) fn event_create() -> Result<CUevent> {
    let mut event = std::ptr::null_mut();
    let flags = sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
    // SAFETY: out-pointer; a context is current.
    check(unsafe { sys::cuEventCreate(&mut event, flags) }, "cuEventCreate")?;
    Ok(event)
}

pub(crate) fn event_destroy(event: CUevent) {
    // SAFETY: an event this module created.
    unsafe { sys::cuEventDestroy_v2(event) };
}

pub(crate) fn event_record(event: CUevent, stream: CUstream) -> Result<()> {
    // SAFETY: valid handles.
    check(unsafe { sys::cuEventRecord(event, stream) }, "cuEventRecord")
}

pub(crate) fn event_synchronize(event: CUevent) -> Result<()> {
    // SAFETY: a valid event.
    check(unsafe { sys::cuEventSynchronize(event) }, "cuEventSynchronize")
}

pub(crate) fn stream_wait_event(stream: CUstream, event: CUevent) -> Result<()> {
    // SAFETY: valid handles.
    check(unsafe { sys::cuStreamWaitEvent(stream, event, 0) }, "cuStreamWaitEvent")
}

pub(crate) fn memcpy_dtoh_async(dst: *mut u8, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees both ranges stay valid until the copy completes.
    check(unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, bytes, stream) }, "cuMemcpyDtoHAsync")
}

pub(crate) fn memcpy_htod_async(dst: CUdeviceptr, src: *const u8, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: as above.
    check(unsafe { sys::cuMemcpyHtoDAsync_v2(dst, src.cast(), bytes, stream) }, "cuMemcpyHtoDAsync")
}

pub(crate) fn memcpy_dtod_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: as above.
    check(unsafe { sys::cuMemcpyDtoDAsync_v2(dst, src, bytes, stream) }, "cuMemcpyDtoDAsync")
}

pub(crate) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
    let mut ptr = 0;
    // SAFETY: out-pointer; a context is current.
    check(unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) }, &format!("cuMemAlloc({bytes} bytes)"))?;
    Ok(ptr)
}

pub(crate) fn mem_free(ptr: CUdeviceptr) {
    // SAFETY: memory this module allocated.
    unsafe { sys::cuMemFree_v2(ptr) };
}

/// Page-locks host memory in place. `Ok(false)`: it was already page-locked by someone else
/// (e.g. `tensor.pin_memory()`), so it must not be unregistered by us.
pub(crate) fn host_register(ptr: *mut u8, bytes: usize) -> Result<bool> {
    // Memory from cuMemHostAlloc / cudaHostAlloc (torch's pin_memory) is refused by
    // cuMemHostRegister with INVALID_VALUE on some drivers: recognise it first.
    let mut flags = 0;
    // SAFETY: out-pointer; the call only inspects the address.
    if unsafe { sys::cuMemHostGetFlags(&mut flags, ptr.cast()) } == sys::CUresult::CUDA_SUCCESS {
        return Ok(false);
    }
    // SAFETY: the caller guarantees the range is valid host memory.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) };
    if r == sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
        return Ok(false);
    }
    check(r, &format!("cuMemHostRegister({bytes} bytes)"))?;
    Ok(true)
}

pub(crate) fn host_unregister(ptr: *mut u8) {
    // SAFETY: memory `host_register` registered.
    unsafe { sys::cuMemHostUnregister(ptr.cast()) };
}

/// Makes `stream` wait until the 64-bit device word at `flag` is >= `value`.
pub(crate) fn stream_wait_value(stream: CUstream, flag: CUdeviceptr, value: u64) -> Result<()> {
    let flags = sys::CUstreamWaitValue_flags_enum::CU_STREAM_WAIT_VALUE_GEQ as u32;
    // SAFETY: valid stream; `flag` is device memory the transport owns.
    check(unsafe { sys::cuStreamWaitValue64_v2(stream, flag, value, flags) }, "cuStreamWaitValue64")
}

/// Writes `value` to the device word at `flag` when `stream` reaches this point.
pub(crate) fn stream_write_value(stream: CUstream, flag: CUdeviceptr, value: u64) -> Result<()> {
    let flags = sys::CUstreamWriteValue_flags_enum::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
    // SAFETY: as above.
    check(unsafe { sys::cuStreamWriteValue64_v2(stream, flag, value, flags) }, "cuStreamWriteValue64")
}

/// A loaded PTX module and its conversion kernels.
pub(crate) struct Kernels {
    module: sys::CUmodule,
    pub(crate) to_bf16: sys::CUfunction,
    pub(crate) to_f16: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread with the context current.
unsafe impl Send for Kernels {}
unsafe impl Sync for Kernels {}

impl Kernels {
    pub(crate) fn load() -> Result<Kernels> {
        let ptx = std::ffi::CString::new(super::ptx::CONVERT).expect("PTX has no NUL");
        let mut module = std::ptr::null_mut();
        // SAFETY: a NUL-terminated PTX image; a context is current.
        check(
            unsafe { sys::cuModuleLoadData(&mut module, ptx.as_ptr().cast()) },
            "cuModuleLoadData (conversion kernels)",
        )?;
        let function = |name: &CStr| -> Result<sys::CUfunction> {
            let mut f = std::ptr::null_mut();
            // SAFETY: out-pointer; the module is loaded.
            check(unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) }, "cuModuleGetFunction")?;
            Ok(f)
        };
        Ok(Kernels { module, to_bf16: function(c"so_f32_to_bf16")?, to_f16: function(c"so_f32_to_f16")? })
    }

    /// Converts `n` f32 at `src` into 16-bit values at `dst` on `stream`.
    pub(crate) fn convert(
        &self,
        f: sys::CUfunction,
        src: CUdeviceptr,
        dst: CUdeviceptr,
        n: usize,
        stream: CUstream,
    ) -> Result<()> {
        const THREADS: u32 = 256;
        let blocks = (n.div_ceil(THREADS as usize)).clamp(1, 8192) as u32;
        let (mut src, mut dst, mut n) = (src, dst, n as u64);
        let mut params: [*mut c_void; 3] =
            [(&mut src as *mut u64).cast(), (&mut dst as *mut u64).cast(), (&mut n as *mut u64).cast()];
        // SAFETY: the kernel takes (u64, u64, u64); params point to live locals for the call.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    f,
                    blocks,
                    1,
                    1,
                    THREADS,
                    1,
                    1,
                    0,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel (conversion)",
        )
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module `load` loaded.
        unsafe { sys::cuModuleUnload(self.module) };
    }
}
