//! The enums of the interface, and `so_device_ptr`, the device address a sub-group's
//! description and the CUDA exports share. Each enum crosses the ABI as `uint32_t` (never as a
//! Rust enum, so that an unknown code is refused instead of being undefined behaviour) and is
//! mapped to its core type by [`abi_enum!`]; the structs live with the functions that take
//! them.

use super::convert::{Field, FromC, abi_enum};
use crate::error::{Error, Result};
use crate::kernels::{AdamMode, DType, Isa};
use crate::session::{GradientHome, HostCopy, Placement, SkipReason, Speculation};

/// A device address (`CUdeviceptr`, or a `void*` from `cudaMalloc` cast to an integer).
pub type so_device_ptr = u64;

/// Element type of a buffer. Fields and arguments of type `uint32_t` named `*_dtype`
/// take these values.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_dtype {
    /// No buffer (only where a buffer is optional).
    None = 0,
    /// IEEE binary32.
    F32 = 1,
    /// bfloat16 (the upper half of a binary32); stores round to nearest even.
    Bf16 = 2,
    /// IEEE binary16; stores round to nearest even.
    F16 = 3,
}

abi_enum!(so_dtype <=> Option<DType> { None = None, F32 = F32, Bf16 = Bf16, F16 = F16 });

/// A dtype field that must name a buffer type (`SO_DTYPE_NONE` refused).
impl FromC<u32> for DType {
    fn from_c(raw: u32, field: Field<'_>) -> Result<DType> {
        Option::<DType>::from_c(raw, field)?.ok_or_else(|| Error::invalid(format!("{field} is SO_DTYPE_NONE")))
    }
}

/// How weight decay enters an Adam step (`so_adam_hparams.mode`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_adam_mode {
    /// Decoupled weight decay: `p <- p * (1 - lr * wd)` before the update (torch AdamW).
    Adamw = 1,
    /// L2 regularisation: `g <- g + wd * p` before the moments (torch Adam).
    L2 = 2,
}

abi_enum!(so_adam_mode <=> AdamMode { Adamw = AdamW, L2 = L2 });

/// Instruction set of a pool's kernels (`so_pool_options.isa`, `so_pool_info.isa`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_isa {
    /// The widest the CPU supports (only when creating a pool).
    Auto = 0,
    /// Plain code, one lane; runs on every CPU.
    Portable = 1,
    /// x86-64 AVX2 + FMA + F16C, 8 lanes.
    Avx2 = 2,
    /// x86-64 AVX-512F, 16 lanes.
    Avx512 = 3,
}

abi_enum!(so_isa <=> Option<Isa> { Auto = None, Portable = Portable, Avx2 = Avx2, Avx512 = Avx512 });

/// Where `so_session_step` takes the global gradient norm from (`so_step_args.norm_source`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_norm_source {
    /// The square root of the session's own sums of squares (one rank).
    Local = 1,
    /// `so_step_args.global_norm`, e.g. all-reduced across ranks from
    /// `so_session_local_grad_sumsq`; inf or NaN skips the step.
    Given = 2,
}

abi_enum!(so_norm_source { Local, Given });

/// Why a step was skipped (`so_step_result.skip_reason`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_skip_reason {
    /// The step was not skipped.
    None = 0,
    /// The caller reported an overflow (`so_step_args.overflow`).
    Overflow = 1,
    /// A gradient element was inf or NaN; with the local norm, `global_norm` is inf or NaN too.
    NonFiniteGradient = 2,
    /// The caller-given global norm was inf or NaN.
    NonFiniteNorm = 3,
    /// `clip_coef / loss_scale` rounds to 0 or overflows in f32 (e.g. a `max_norm` below the
    /// f32 range), so no gradient could be stepped with it.
    UnusableFactor = 4,
}

abi_enum!(so_skip_reason <=> SkipReason {
    None = None,
    Overflow = Overflow,
    NonFiniteGradient = NonFiniteGradient,
    NonFiniteNorm = NonFiniteNorm,
    UnusableFactor = UnusableFactor,
});

/// Whether sub-groups are stepped during backward, before `so_session_step` knows the clip
/// factor (`so_session_options.speculation`).
///
/// Reproducibility: whichever mode, the same inputs (gradients, hyperparameters, loss scales,
/// step arguments, in the same calls) give the same bits, whatever the timing, thread count,
/// instruction set or placement (host or GPU) of each sub-group, and across a checkpoint. A
/// sub-group speculates or not by a decision made from the inputs and earlier steps alone,
/// and a speculative step ends with the same bits whether its pass ran, was preempted or was
/// cancelled. `SO_SPECULATION_OFF` and the speculative modes differ in the last bits of
/// clipped and skipped steps (a rescale or rollback is exact only to rounding).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_speculation {
    /// Every sub-group is stepped once, after `so_session_step` decides.
    Off = 0,
    /// Every sub-group that can speculate does, as soon as its gradient is complete.
    On = 1,
    /// Decided per step from earlier steps: speculate while the clip factor mostly stayed
    /// unchanged (the default; the history is part of a checkpoint). A speculative pass that
    /// has not started when the step is decided is cancelled and done by the final pass at no
    /// extra memory traffic. A device-placed sub-group's speculative step always waits for the
    /// decision, then runs with its resolution: the same bits as `SO_SPECULATION_ON`, which
    /// queues it on the GPU at hand-off.
    Auto = 2,
}

abi_enum!(so_speculation <=> Speculation { Off = Off, On = On, Auto = Auto });

/// Where a sub-group's master weights and moments live and are stepped
/// (`so_subgroup_desc.placement`, `so_session_set_placement`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_placement {
    /// Host memory, stepped by the CPU kernels.
    Host = 0,
    /// GPU memory (CUDA sessions, f32 master weights): stepped by the library's GPU kernel,
    /// bit-identical to the CPU kernels, after `so_session_step` decides.
    Device = 1,
}

abi_enum!(so_placement <=> Placement { Host = Host, Device = Device });

/// Whether a CUDA session keeps a full host copy of its weights in `copy_dtype`
/// (`so_session_options.host_copy`; a host session always keeps it).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_host_copy {
    /// Decided when the sub-groups are provisioned (the first `so_session_begin_step` after
    /// they were registered), from the host memory available then: kept where it fits beside
    /// the gradients, else bounded.
    Auto = 0,
    /// Kept: speculative steps write it during backward (with bf16 moments, ahead of the rest
    /// of the step) and publication reads it.
    Full = 1,
    /// Not kept: each piece of the published weights is written into one of a few pinned
    /// buffers of 16 MiB as it is published. 2 bytes per element less host memory; with bf16
    /// moments the sub-group then steps after the decision.
    Bounded = 2,
}

abi_enum!(so_host_copy <=> HostCopy { Auto = Auto, Full = Full, Bounded = Bounded });

/// Where a host-stepped sub-group's gradient waits for the optimizer
/// (`so_session_options.gradient_home`; a host session keeps it on the host).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_gradient_home {
    /// Decided when the sub-groups are provisioned, from the host and device memory measured
    /// then: on the host for as many sub-groups in forward order as host memory holds (less a
    /// reserve of max(2 GiB, 12.5 % of the host)), on the device for the rest.
    Auto = 0,
    /// A pinned host buffer (`accum_dtype`), copied into as backward produces the gradient.
    Host = 1,
    /// A device buffer of the session's: every pass that reads the gradient copies it to the
    /// host in pieces of 2 Mi elements through a few pinned buffers. No host memory for it;
    /// late gradients are refused.
    Device = 2,
}

abi_enum!(so_gradient_home <=> GradientHome { Auto = Auto, Host = Host, Device = Device });
