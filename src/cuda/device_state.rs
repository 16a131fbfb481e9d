//! Device-resident state: the master weights, moments and gradient of a device-placed
//! sub-group, their copies to and from the host, and the GPU Adam step over them.

use super::driver::{self, CUdeviceptr, CUresult, CUstream, Kernel, Kernels, dtype_code};
use super::faults::{self, Verdict};
use super::memory::{DeviceBuffer, floats_mut_ptr};
use crate::error::{Error, Result};
use crate::kernels::{DType, device_constants};
use crate::session::{DevicePass, HostState};

/// The master weights (f32), moments and gradient of a device-placed sub-group, freed on drop.
pub(crate) struct DeviceState {
    moment_dtype: DType,
    master: DeviceBuffer,
    exp_avg: DeviceBuffer,
    exp_avg_sq: DeviceBuffer,
    grad: DeviceBuffer,
}

/// Where the model's parameter of a device step is: the kernel writes the stepped weights
/// there (converted to its dtype).
pub(crate) struct Param {
    ptr: CUdeviceptr,
    dtype: DType,
    numel: usize,
}

impl Param {
    /// The parameter at `ptr`: `numel` elements of `dtype`.
    pub(crate) fn new(ptr: CUdeviceptr, dtype: DType, numel: usize) -> Param {
        Param { ptr, dtype, numel }
    }
}

impl DeviceState {
    /// `numel` elements of each, the moments in `moment`, the gradient in `grad`.
    pub(crate) fn alloc(numel: usize, moment: DType, grad: DType) -> Result<DeviceState> {
        Ok(DeviceState {
            moment_dtype: moment,
            master: DeviceBuffer::alloc(numel * 4)?,
            exp_avg: DeviceBuffer::alloc(numel * moment.size())?,
            exp_avg_sq: DeviceBuffer::alloc(numel * moment.size())?,
            grad: DeviceBuffer::alloc(numel * grad.size())?,
        })
    }

    pub(crate) fn bytes(&self) -> usize {
        [&self.master, &self.exp_avg, &self.exp_avg_sq, &self.grad].iter().map(|b| b.bytes()).sum()
    }

    pub(crate) fn master(&self) -> CUdeviceptr {
        self.master.ptr()
    }

    /// The gradient's address `offset` bytes in.
    pub(crate) fn grad_at(&self, offset: usize) -> CUdeviceptr {
        self.grad.at(offset)
    }

    /// Queues the copies of the host state into this one on `stream`; the caller waits.
    pub(crate) fn upload(&self, host: &mut HostState<'_>, stream: CUstream) -> Result<()> {
        if faults::upload() == Verdict::Refuse {
            return Err(driver::failure("cuMemcpyHtoDAsync", CUresult::CUDA_ERROR_INVALID_VALUE));
        }
        for (dst, src) in [
            (&self.master, &mut host.master),
            (&self.exp_avg, &mut host.exp_avg),
            (&self.exp_avg_sq, &mut host.exp_avg_sq),
        ] {
            let (ptr, bytes) = floats_mut_ptr(src);
            driver::memcpy_htod_async(dst.ptr(), ptr, bytes, stream)?;
        }
        Ok(())
    }

    /// Queues the copies of this state into the host state on `stream`; the caller waits.
    pub(crate) fn download(&self, host: &mut HostState<'_>, stream: CUstream) -> Result<()> {
        for (src, dst) in [
            (&self.master, &mut host.master),
            (&self.exp_avg, &mut host.exp_avg),
            (&self.exp_avg_sq, &mut host.exp_avg_sq),
        ] {
            let (ptr, bytes) = floats_mut_ptr(dst);
            driver::memcpy_dtoh_async(ptr, src.ptr(), bytes, stream)?;
        }
        Ok(())
    }

    /// Queues one pass over this state on `stream` (its gradient, in `grad_dtype`): an Adam
    /// step, or the rollback or rescale of one; with `publish`, writing the new weights into
    /// `param` too.
    pub(crate) fn step(
        &self,
        kernels: &Kernels,
        stream: CUstream,
        param: &Param,
        grad_dtype: DType,
        pass: &DevicePass,
        publish: bool,
    ) -> Result<()> {
        let (hp, mut scale, mut new_scale, mut op) = match *pass {
            DevicePass::Update { hp, scale } => (hp, scale, 0.0f32, 0u32),
            DevicePass::Rollback { hp, scale } => (hp, scale, 0.0, 1),
            DevicePass::Rescale { hp, old_scale, new_scale } => (hp, old_scale, new_scale, 2),
        };
        if op != 0 && self.moment_dtype != DType::F32 {
            return Err(Error::unsupported("a rollback or rescale on the device needs f32 moments"));
        }
        let (k, l2) = device_constants(&hp);
        let (mut p, mut g, mut m, mut v, mut out) =
            (self.master.ptr(), self.grad.ptr(), self.exp_avg.ptr(), self.exp_avg_sq.ptr(), param.ptr);
        let mut n = param.numel as u64;
        let mut od = if publish { dtype_code(param.dtype) } else { 0 };
        let (mut gd, mut md) = (dtype_code(grad_dtype), dtype_code(self.moment_dtype));
        let [mut b1, mut omb1, mut b2, mut omb2, mut eps, mut sbc2, mut step, mut decay, mut wd] = k;
        let mut has_l2 = u32::from(l2);
        // Each thread steps four elements a batch (ptx.rs).
        let blocks = param.numel.div_ceil(256 * 4).clamp(1, 132 * 16) as u32;
        kernels.launch(
            Kernel::Adam,
            blocks,
            256,
            stream,
            &mut [
                &mut p,
                &mut g,
                &mut m,
                &mut v,
                &mut out,
                &mut n,
                &mut gd,
                &mut md,
                &mut od,
                &mut scale,
                &mut b1,
                &mut omb1,
                &mut b2,
                &mut omb2,
                &mut eps,
                &mut sbc2,
                &mut step,
                &mut decay,
                &mut wd,
                &mut has_l2,
                &mut op,
                &mut new_scale,
            ],
        )
    }
}
