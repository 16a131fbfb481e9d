//! The CUDA driver calls the transport makes, on cudarc's `result` layer (the driver is
//! loaded at run time: the crate builds and runs without CUDA). cudarc's safe layer is not
//! used: it destroys streams it does not own. Every failure becomes an [`Error`] with the
//! driver's error name.

use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

use cudarc::driver::result::{self, DriverError};
use cudarc::driver::sys;

use super::faults::{self, Verdict};
use crate::error::{Error, Result, Status};
use crate::kernels::DType;

pub(crate) use sys::{CUdeviceptr, CUevent, CUresult, CUstream};

/// A raw driver handle that may cross threads (the driver allows it; we serialise use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Raw<T>(pub T);
// SAFETY: CUDA stream and event handles are usable from any thread. `Raw` is crate-private and
// wraps nothing else (`CUstream`, `CUevent`: pointers to driver objects, never dereferenced here).
unsafe impl<T> Send for Raw<T> {}
// SAFETY: as for `Send`: sharing a `Raw` only copies the handle, and the driver accepts the
// same stream or event from several threads.
unsafe impl<T> Sync for Raw<T> {}

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
            result::init().map_err(|e| format!("cuInit failed: {}", name(e)))?;
            match result::device::get_count() {
                Ok(n) if n > 0 => Ok(()),
                Ok(_) => Err("the CUDA driver reports no device".into()),
                Err(e) => Err(format!("cuDeviceGetCount failed: {}", name(e))),
            }
        })
        .clone()
        .map_err(|why| Error::new(Status::CudaUnavailable, format!("CUDA unavailable: {why}")))
}

fn name(e: DriverError) -> String {
    e.error_name().map_or_else(|_| format!("{:?}", e.0), |n| n.to_string_lossy().into_owned())
}

/// Maps a driver result to ours, naming the call.
fn check<T>(r: std::result::Result<T, DriverError>, what: &str) -> Result<T> {
    r.map_err(|e| Error::new(Status::CudaError, format!("{what} failed: {}", name(e))))
}

/// The error `call` would report had the driver returned `code` (a call a fault switch refused).
pub(crate) fn failure(call: &str, code: CUresult) -> Error {
    check::<()>(Err(DriverError(code)), call).unwrap_err()
}

/// The device's primary context (the one PyTorch and JAX use), retained for our lifetime.
pub(crate) struct Context {
    device: sys::CUdevice,
    ctx: sys::CUcontext,
}

// SAFETY: a CUcontext handle may be used from any thread (it is made current per thread).
unsafe impl Send for Context {}
// SAFETY: `&Context` gives only copies of the two handles (the fields are private and never
// change after `primary`); the driver serialises what it does with them itself.
unsafe impl Sync for Context {}

impl Context {
    pub(crate) fn primary(ordinal: i32) -> Result<Context> {
        available()?;
        let device = check(result::device::get(ordinal), &format!("cuDeviceGet({ordinal})"))?;
        // SAFETY: a valid device; released in Drop.
        let ctx = check(unsafe { result::primary_ctx::retain(device) }, "cuDevicePrimaryCtxRetain")?;
        let context = Context { device, ctx };
        context.bind()?;
        Ok(context)
    }

    /// Makes the context current on the calling thread (cheap when it already is).
    pub(crate) fn bind(&self) -> Result<()> {
        // SAFETY: a retained context.
        check(unsafe { result::ctx::set_current(self.ctx) }, "cuCtxSetCurrent")
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: releases the reference `primary` retained.
        let _ = unsafe { result::primary_ctx::release(self.device) };
    }
}

pub(crate) fn stream_create() -> Result<CUstream> {
    check(result::stream::create(result::stream::StreamKind::NonBlocking), "cuStreamCreate")
}

pub(crate) fn stream_synchronize(stream: CUstream) -> Result<()> {
    // SAFETY: a valid stream handle.
    check(unsafe { result::stream::synchronize(stream) }, "cuStreamSynchronize")
}

/// Refuses a stream that is being captured into a CUDA graph: the session's copies and
/// host waits cannot be part of a graph.
pub(crate) fn refuse_capturing(stream: CUstream) -> Result<()> {
    // SAFETY: a valid (caller's) stream handle.
    let status = check(unsafe { result::stream::is_capturing(stream) }, "cuStreamIsCapturing")?;
    if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
        return Err(Error::new(
            Status::StreamCapturing,
            "the stream is being captured into a CUDA graph; hand gradients over outside capture",
        ));
    }
    Ok(())
}

/// An event for ordering only; `timing` events can also measure elapsed time.
pub(crate) fn event_create(timing: bool) -> Result<CUevent> {
    let flags = if timing { sys::CUevent_flags::CU_EVENT_DEFAULT } else { sys::CUevent_flags::CU_EVENT_DISABLE_TIMING };
    check(result::event::create(flags), "cuEventCreate")
}

pub(crate) fn event_destroy(event: CUevent) {
    // SAFETY: an event this module created.
    let _ = unsafe { result::event::destroy(event) };
}

pub(crate) fn event_record(event: CUevent, stream: CUstream) -> Result<()> {
    // SAFETY: valid handles.
    check(unsafe { result::event::record(event, stream) }, "cuEventRecord")
}

pub(crate) fn event_synchronize(event: CUevent) -> Result<()> {
    // SAFETY: a valid event.
    check(unsafe { result::event::synchronize(event) }, "cuEventSynchronize")
}

/// Whether the work before `event` is done (`Ok(false)`: not yet).
pub(crate) fn event_done(event: CUevent) -> Result<bool> {
    // SAFETY: a valid event.
    match unsafe { result::event::query(event) } {
        Ok(()) => Ok(true),
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
        Err(e) => check(Err(e), "cuEventQuery"),
    }
}

/// Milliseconds between two completed timing events.
pub(crate) fn event_elapsed_ms(start: CUevent, end: CUevent) -> Result<f32> {
    // SAFETY: valid timing events, both complete.
    check(unsafe { result::event::elapsed(start, end) }, "cuEventElapsedTime")
}

pub(crate) fn stream_wait_event(stream: CUstream, event: CUevent) -> Result<()> {
    // SAFETY: valid handles.
    check(
        unsafe { result::stream::wait_event(stream, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) },
        "cuStreamWaitEvent",
    )
}

pub(crate) fn memcpy_dtoh_async(dst: *mut u8, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: the caller guarantees both ranges stay valid until the copy completes.
    let dst = unsafe { std::slice::from_raw_parts_mut(dst, bytes) };
    // SAFETY: `dst` is `bytes` bytes of host memory and `src` a device range of as many bytes,
    // both kept valid by the caller until `stream` has passed the copy.
    check(unsafe { result::memcpy_dtoh_async(dst, src, stream) }, "cuMemcpyDtoHAsync")
}

pub(crate) fn memcpy_htod_async(dst: CUdeviceptr, src: *const u8, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: as above.
    let src = unsafe { std::slice::from_raw_parts(src, bytes) };
    // SAFETY: as in `memcpy_dtoh_async`, with the directions swapped.
    check(unsafe { result::memcpy_htod_async(dst, src, stream) }, "cuMemcpyHtoDAsync")
}

pub(crate) fn memcpy_dtod_async(dst: CUdeviceptr, src: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: as above.
    check(unsafe { result::memcpy_dtod_async(dst, src, bytes, stream) }, "cuMemcpyDtoDAsync")
}

pub(crate) fn memset_async(dst: CUdeviceptr, bytes: usize, stream: CUstream) -> Result<()> {
    // SAFETY: device memory the transport owns, `bytes` long.
    check(unsafe { result::memset_d8_async(dst, 0, bytes, stream) }, "cuMemsetD8Async")
}

pub(crate) fn mem_alloc(bytes: usize) -> Result<CUdeviceptr> {
    // SAFETY: a context is current.
    check(unsafe { result::malloc_sync(bytes.max(1)) }, &format!("cuMemAlloc({bytes} bytes)"))
}

/// The current context's device: (free, total) bytes of memory (`cuMemGetInfo`).
pub(crate) fn mem_info() -> Result<(usize, usize)> {
    check(result::mem_get_info(), "cuMemGetInfo")
}

pub(crate) fn mem_free(ptr: CUdeviceptr) {
    // SAFETY: memory this module allocated.
    let _ = unsafe { result::free_sync(ptr) };
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
    if faults::registration(bytes) == Verdict::Refuse {
        return Err(failure("cuMemHostRegister", CUresult::CUDA_ERROR_OUT_OF_MEMORY));
    }
    // SAFETY: the caller guarantees the range is valid host memory.
    let r = unsafe { sys::cuMemHostRegister_v2(ptr.cast::<c_void>(), bytes, sys::CU_MEMHOSTREGISTER_PORTABLE) };
    if r == sys::CUresult::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED {
        return Ok(false);
    }
    check(r.result(), &format!("cuMemHostRegister({bytes} bytes)"))?;
    Ok(true)
}

pub(crate) fn host_unregister(ptr: *mut u8) {
    // SAFETY: memory `host_register` registered.
    unsafe { sys::cuMemHostUnregister(ptr.cast()) };
}

/// A kernel argument: a pointer to the value, as cuLaunchKernel takes them.
pub(crate) trait KernelArg {
    fn ptr(&mut self) -> *mut c_void;
}
impl KernelArg for u64 {
    fn ptr(&mut self) -> *mut c_void {
        (self as *mut u64).cast()
    }
}
impl KernelArg for u32 {
    fn ptr(&mut self) -> *mut c_void {
        (self as *mut u32).cast()
    }
}
impl KernelArg for f32 {
    fn ptr(&mut self) -> *mut c_void {
        (self as *mut f32).cast()
    }
}

/// The kernels of the PTX module (`ptx.rs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kernel {
    /// `so_f32_to_bf16`.
    ToBf16,
    /// `so_f32_to_f16`.
    ToF16,
    /// `so_sumsq_partials`.
    Sumsq,
    /// `so_adam_step`.
    Adam,
}

/// The loaded PTX module and its kernels (`ptx.rs`).
pub(crate) struct Kernels {
    module: sys::CUmodule,
    to_bf16: sys::CUfunction,
    to_f16: sys::CUfunction,
    sumsq: sys::CUfunction,
    adam: sys::CUfunction,
}

// SAFETY: module and function handles may be used from any thread with the context current.
unsafe impl Send for Kernels {}
// SAFETY: the handles are set once by `load` and only read afterwards; launching one function
// from several threads at once is allowed by the driver.
unsafe impl Sync for Kernels {}

impl Kernels {
    pub(crate) fn load() -> Result<Kernels> {
        let ptx = std::ffi::CString::new(super::ptx::MODULE).expect("PTX has no NUL");
        // SAFETY: a NUL-terminated PTX image; a context is current.
        let module = check(unsafe { result::module::load_data(ptx.as_ptr().cast()) }, "cuModuleLoadData")?;
        let function = |name: &CStr| -> Result<sys::CUfunction> {
            // SAFETY: the module is loaded; the name is NUL-terminated.
            check(unsafe { result::module::get_function(module, name.into()) }, "cuModuleGetFunction")
        };
        Ok(Kernels {
            module,
            to_bf16: function(c"so_f32_to_bf16")?,
            to_f16: function(c"so_f32_to_f16")?,
            sumsq: function(c"so_sumsq_partials")?,
            adam: function(c"so_adam_step")?,
        })
    }

    fn function(&self, kernel: Kernel) -> sys::CUfunction {
        match kernel {
            Kernel::ToBf16 => self.to_bf16,
            Kernel::ToF16 => self.to_f16,
            Kernel::Sumsq => self.sumsq,
            Kernel::Adam => self.adam,
        }
    }

    /// Launches `kernel` on `stream` with `args` (which must match the kernel's parameters).
    pub(crate) fn launch(
        &self,
        kernel: Kernel,
        blocks: u32,
        threads: u32,
        stream: CUstream,
        args: &mut [&mut dyn KernelArg],
    ) -> Result<()> {
        let f = self.function(kernel);
        let mut params: Vec<*mut c_void> = args.iter_mut().map(|a| a.ptr()).collect();
        // SAFETY: `params` points to live values of the kernel's parameter types for the call.
        check(
            unsafe { result::launch_kernel(f, (blocks.max(1), 1, 1), (threads, 1, 1), 0, stream, &mut params) },
            "cuLaunchKernel",
        )
    }

    /// Converts `n` f32 at `src` into 16-bit values at `dst` on `stream` (`kernel`: one of
    /// the conversions).
    pub(crate) fn convert(
        &self,
        kernel: Kernel,
        src: CUdeviceptr,
        dst: CUdeviceptr,
        n: usize,
        stream: CUstream,
    ) -> Result<()> {
        let blocks = n.div_ceil(256 * 4).clamp(1, 8192) as u32;
        let (mut src, mut dst, mut n) = (src, dst, n as u64);
        self.launch(kernel, blocks, 256, stream, &mut [&mut src, &mut dst, &mut n])
    }
}

impl Drop for Kernels {
    fn drop(&mut self) {
        // SAFETY: the module `load` loaded.
        let _ = unsafe { result::module::unload(self.module) };
    }
}

/// A dtype as the device kernels take it.
pub(crate) fn dtype_code(d: DType) -> u32 {
    match d {
        DType::F32 => 1,
        DType::Bf16 => 2,
        DType::F16 => 3,
    }
}
