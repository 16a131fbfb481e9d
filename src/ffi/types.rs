//! Plain C types of the interface: enum values, options and argument structs.

use std::ffi::c_void;

use super::WithStructSize;
use crate::error::{Error, Result};
use crate::kernels::{AdamHyper, AdamMode, DType, Isa};

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

/// How weight decay enters an Adam step (`so_adam_hparams.mode`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_adam_mode {
    /// Decoupled weight decay: `p <- p * (1 - lr * wd)` before the update (torch AdamW).
    Adamw = 1,
    /// L2 regularisation: `g <- g + wd * p` before the moments (torch Adam).
    L2 = 2,
}

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

/// Hyperparameters of one Adam step. Initialise with `so_adam_hparams_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_adam_hparams {
    /// `sizeof(so_adam_hparams)`.
    pub struct_size: usize,
    /// One of `so_adam_mode`.
    pub mode: u32,
    /// Learning rate, finite and >= 0.
    pub lr: f64,
    /// First-moment decay, in [0, 1).
    pub beta1: f64,
    /// Second-moment decay, in [0, 1).
    pub beta2: f64,
    /// Added to the bias-corrected `sqrt(v)`, finite and >= 0.
    pub eps: f64,
    /// Weight decay, finite and >= 0 (0 disables it).
    pub weight_decay: f64,
    /// Divide the moments by `1 - beta^t`.
    pub bias_correction: bool,
    /// The step being taken (or undone), counting from 1.
    pub step: u64,
}

/// The buffers of one Adam step: `numel` elements each, all disjoint.
/// Initialise with `so_adam_buffers_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_adam_buffers {
    /// `sizeof(so_adam_buffers)`.
    pub struct_size: usize,
    /// Elements in every buffer. 0 is a valid no-op (pointers may then be NULL).
    pub numel: usize,
    /// Parameter, read and written; `param_dtype`.
    pub param: *mut c_void,
    /// Gradient, read only; `grad_dtype`, independent of `param_dtype`.
    pub grad: *const c_void,
    /// First moment (`exp_avg`), read and written; `moment_dtype`.
    pub exp_avg: *mut c_void,
    /// Second moment (`exp_avg_sq`), read and written; `moment_dtype`.
    pub exp_avg_sq: *mut c_void,
    /// Optional low-precision copy of the resulting parameter, write only;
    /// `param_copy_dtype`. NULL for none.
    pub param_copy: *mut c_void,
    /// `SO_DTYPE_F32`, `SO_DTYPE_BF16` or `SO_DTYPE_F16`.
    pub param_dtype: u32,
    /// `SO_DTYPE_F32`, `SO_DTYPE_BF16` or `SO_DTYPE_F16`.
    pub grad_dtype: u32,
    /// `SO_DTYPE_F32` or `SO_DTYPE_BF16`, for both moments.
    pub moment_dtype: u32,
    /// `SO_DTYPE_NONE` (with `param_copy` NULL), `SO_DTYPE_BF16` or `SO_DTYPE_F16`.
    pub param_copy_dtype: u32,
}

/// Options of `so_adam_update`. Initialise with `so_update_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_update_options {
    /// `sizeof(so_update_options)`.
    pub struct_size: usize,
    /// Multiplies each gradient element as it is loaded (after promotion to f32); finite
    /// and > 0. A step with scale `s` is bit-identical to a step with scale 1 on the
    /// gradient multiplied by `s` in f32 beforehand.
    pub grad_scale: f32,
    /// Refuse the step, modifying nothing, if any scaled gradient element is inf or NaN
    /// (`SO_STATUS_NON_FINITE`). Costs one read-only pass over the gradient first.
    pub check_finite: bool,
}

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

// SAFETY (all four): `#[repr(C)]` with `struct_size: usize` first.
unsafe impl WithStructSize for so_adam_hparams {
    const NAME: &'static str = "so_adam_hparams";
}
unsafe impl WithStructSize for so_adam_buffers {
    const NAME: &'static str = "so_adam_buffers";
}
unsafe impl WithStructSize for so_update_options {
    const NAME: &'static str = "so_update_options";
}
unsafe impl WithStructSize for so_pool_options {
    const NAME: &'static str = "so_pool_options";
}
unsafe impl WithStructSize for so_pool_info {
    const NAME: &'static str = "so_pool_info";
}

pub(crate) fn dtype_from_raw(raw: u32, field: &str) -> Result<Option<DType>> {
    match raw {
        x if x == so_dtype::None as u32 => Ok(None),
        x if x == so_dtype::F32 as u32 => Ok(Some(DType::F32)),
        x if x == so_dtype::Bf16 as u32 => Ok(Some(DType::Bf16)),
        x if x == so_dtype::F16 as u32 => Ok(Some(DType::F16)),
        _ => Err(Error::invalid(format!("{field} = {raw} is not a so_dtype value"))),
    }
}

pub(crate) fn dtype_to_raw(dtype: DType) -> u32 {
    (match dtype {
        DType::F32 => so_dtype::F32,
        DType::Bf16 => so_dtype::Bf16,
        DType::F16 => so_dtype::F16,
    }) as u32
}

pub(crate) fn isa_from_raw(raw: u32) -> Result<Option<Isa>> {
    match raw {
        x if x == so_isa::Auto as u32 => Ok(None),
        x if x == so_isa::Portable as u32 => Ok(Some(Isa::Portable)),
        x if x == so_isa::Avx2 as u32 => Ok(Some(Isa::Avx2)),
        x if x == so_isa::Avx512 as u32 => Ok(Some(Isa::Avx512)),
        _ => Err(Error::invalid(format!("isa = {raw} is not a so_isa value"))),
    }
}

pub(crate) fn isa_to_raw(isa: Isa) -> u32 {
    (match isa {
        Isa::Portable => so_isa::Portable,
        Isa::Avx2 => so_isa::Avx2,
        Isa::Avx512 => so_isa::Avx512,
    }) as u32
}

impl so_adam_hparams {
    pub(crate) fn from_hyper(hp: &AdamHyper) -> Self {
        so_adam_hparams {
            struct_size: std::mem::size_of::<Self>(),
            mode: match hp.mode {
                AdamMode::AdamW => so_adam_mode::Adamw,
                AdamMode::L2 => so_adam_mode::L2,
            } as u32,
            lr: hp.lr,
            beta1: hp.beta1,
            beta2: hp.beta2,
            eps: hp.eps,
            weight_decay: hp.weight_decay,
            bias_correction: hp.bias_correction,
            step: hp.step,
        }
    }

    pub(crate) fn to_hyper(&self) -> Result<AdamHyper> {
        let mode = match self.mode {
            x if x == so_adam_mode::Adamw as u32 => AdamMode::AdamW,
            x if x == so_adam_mode::L2 as u32 => AdamMode::L2,
            other => return Err(Error::invalid(format!("hparams->mode = {other} is not a so_adam_mode value"))),
        };
        let hp = AdamHyper {
            mode,
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            bias_correction: self.bias_correction,
            step: self.step,
        };
        hp.validate().map_err(|e| Error::new(e.status, format!("hparams->{}", e.message)))?;
        Ok(hp)
    }
}
