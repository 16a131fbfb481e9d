//! The session's public value types: options, descriptions of what is registered, the
//! arguments and result of a step.

use std::sync::Arc;

use super::buffers::Borrowed;
use super::scaler::LossScalerOptions;
use crate::error::Result;
use crate::kernels::{AdamHyper, AdamMode, DType, Pool};

/// Hyperparameters of a param group; changeable at any time. Fields as
/// [`so_group_hparams`](crate::ffi::session::so_group_hparams) documents them, in Rust types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupHparams {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl GroupHparams {
    /// Checks the hyperparameters as an update would ([`AdamHyper::validate`]).
    pub(crate) fn validate(&self) -> Result<()> {
        AdamHyper {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            ..Default::default()
        }
        .validate()
    }
}

impl Default for GroupHparams {
    /// `torch.optim.AdamW`'s defaults.
    fn default() -> Self {
        let d = AdamHyper::default();
        GroupHparams { lr: d.lr, beta1: d.beta1, beta2: d.beta2, eps: d.eps, weight_decay: d.weight_decay }
    }
}

/// Whether sub-groups are stepped during backward, before `step()` knows the clip factor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Speculation {
    /// Every sub-group is stepped once, after `step()` decides.
    Off,
    /// Every sub-group that can speculate does, as soon as its gradient is complete.
    On,
    /// Decided per step from what earlier steps measured (see `policy.rs`): speculate while
    /// the clip factor mostly stayed unchanged. A device-placed sub-group's speculative step
    /// waits for the decision (the same bits as `On`, which queues it at hand-off).
    #[default]
    Auto,
}

/// Where a sub-group's master weights and moments live and are stepped.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Host memory, stepped by the CPU kernels.
    #[default]
    Host,
    /// Device memory, stepped by the transport's device kernel (CUDA sessions).
    Device,
}

/// Whether a session keeps a full-size host copy of its master weights in `copy_dtype`
/// (CUDA sessions; a host session always keeps it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostCopy {
    /// Decided when the sub-groups are provisioned (the first `begin_step` after they were
    /// registered) from the host memory measured then: kept where it fits beside the
    /// gradients, else bounded.
    #[default]
    Auto,
    /// Kept: a speculative step writes it during backward (with bf16 moments, ahead of the
    /// rest of the step), and publication reads it.
    Full,
    /// Not kept: each piece of the published weights is written into a bounded buffer of the
    /// transport's as it is published (the final pass's copy output, or converted from the
    /// master weights). 2 bytes per element less host memory; a sub-group with bf16 moments
    /// then takes its step after the decision.
    Bounded,
}

/// Where a host-stepped sub-group's gradient waits for the optimizer (CUDA sessions; a host
/// session keeps it on the host).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GradientHome {
    /// Decided at provisioning from the host and device memory measured then: on the host
    /// for as many sub-groups in forward order as its memory holds, on the device for the
    /// rest.
    #[default]
    Auto,
    /// A pinned host buffer the gradient is copied into as backward produces it.
    Host,
    /// A device buffer of the transport's: each pass that reads the gradient streams it to
    /// the host in bounded pieces. No host memory for it; late gradients are refused.
    Device,
}

/// How a session is set up. Fields as
/// [`so_session_options`](crate::ffi::session::so_session_options) documents them, in Rust
/// types: `None` for a NULL pointer, `SO_DTYPE_NONE` or a `host_memory_limit` of 0, and
/// [`Self::GPU_BUDGET_AUTO`] for `SO_GPU_BUDGET_AUTO`.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub pool: Option<Arc<Pool>>,
    pub cores: Option<Vec<usize>>,
    pub mode: AdamMode,
    pub bias_correction: bool,
    pub moment_dtype: DType,
    pub grad_dtype: DType,
    pub accum_dtype: DType,
    pub speculation: Speculation,
    pub host_memory_limit: Option<usize>,
    pub amsgrad: bool,
    pub loss_scaler: Option<LossScalerOptions>,
    pub copy_dtype: Option<DType>,
    pub gpu_budget_bytes: usize,
    pub host_copy: HostCopy,
    pub gradient_home: GradientHome,
}

impl SessionOptions {
    /// `gpu_budget_bytes` for a budget the session measures itself: after the warm-up steps
    /// it takes the device's free memory less a headroom, and the split places within it as
    /// the exposed time asks (`policy.rs`). C: `SO_GPU_BUDGET_AUTO`.
    pub const GPU_BUDGET_AUTO: usize = usize::MAX;

    /// Device bytes per element of a device-placed sub-group: f32 master, both moments and
    /// the gradient buffer.
    pub(crate) fn device_bytes_per_element(&self) -> usize {
        4 + 2 * self.moment_dtype.size() + self.accum_dtype.size()
    }
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            pool: None,
            cores: None,
            mode: AdamMode::AdamW,
            bias_correction: true,
            moment_dtype: DType::F32,
            grad_dtype: DType::F32,
            accum_dtype: DType::F32,
            speculation: Speculation::Auto,
            host_memory_limit: None,
            amsgrad: false,
            loss_scaler: None,
            copy_dtype: None,
            gpu_budget_bytes: 0,
            host_copy: HostCopy::Auto,
            gradient_home: GradientHome::Auto,
        }
    }
}

/// A named slice of a sub-group: a parameter whose gradient arrives as one piece. Fields as
/// [`so_slice_desc`](crate::ffi::session::so_slice_desc) documents them, in Rust types.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SliceDesc {
    pub name: String,
    pub offset: usize,
    pub numel: usize,
}

/// The model's parameter on the device that a sub-group's updated weights are published to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceParam {
    /// Device address of `numel` elements of `dtype`.
    pub ptr: u64,
    pub dtype: DType,
}

/// A sub-group to register.
#[derive(Clone, Debug)]
pub struct SubGroupDesc {
    pub group: u32,
    /// The master weights (f32 for speculation; bf16 or f16 are stepped at `step()` only).
    pub master: Borrowed,
    /// A caller-provided gradient buffer in `accum_dtype` (else the session allocates one).
    pub grad: Option<Borrowed>,
    /// Caller-provided moment buffers in `moment_dtype` (else the session allocates them).
    pub exp_avg: Option<Borrowed>,
    pub exp_avg_sq: Option<Borrowed>,
    /// A caller-provided buffer in `copy_dtype` where a host session keeps the weights' copy
    /// (else the session allocates one).
    pub copy: Option<Borrowed>,
    pub slices: Vec<SliceDesc>,
    /// With a transport: the model's parameter the weights are published to.
    pub device: Option<DeviceParam>,
    pub placement: Placement,
}

impl SubGroupDesc {
    /// A host sub-group of `master` with session-allocated buffers.
    pub fn new(group: u32, master: Borrowed, slices: Vec<SliceDesc>) -> SubGroupDesc {
        SubGroupDesc {
            group,
            master,
            grad: None,
            exp_avg: None,
            exp_avg_sq: None,
            copy: None,
            slices,
            device: None,
            placement: Placement::Host,
        }
    }
}

/// Where `step()` takes the global gradient norm from.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormSource {
    /// The square root of the sums of squares taken as gradients were handed over.
    Local,
    /// A norm the caller computed (e.g. all-reduced across ranks); inf/NaN skips the step.
    Given(f64),
}

/// What `step()` is told. Fields as [`so_step_args`](crate::ffi::session::so_step_args)
/// documents them, in Rust types; `norm` stands for its `norm_source` and `global_norm`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepArgs {
    pub max_norm: f64,
    pub norm: NormSource,
    pub overflow: bool,
}

/// The outcome of one optimizer step. Fields as
/// [`so_step_result`](crate::ffi::session::so_step_result) documents them, in Rust types.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepResult {
    pub serial: u64,
    pub skipped: bool,
    pub global_norm: f64,
    pub clip_coef: f64,
    pub grad_factor: f32,
    pub loss_scale: f32,
    pub next_loss_scale: f32,
    pub speculative: u32,
    pub late_gradients: u32,
    pub kept: u32,
    pub rescaled: u32,
    pub rolled_back: u32,
    pub redone: u32,
    pub stepped: u32,
    pub skip_reason: SkipReason,
    pub cancelled: u32,
    pub device_stepped: u32,
    pub final_pass_elements: u64,
    pub forward_wait_s: f64,
    pub device_subgroups: u32,
}

/// Why a step was skipped: nothing was stepped, every speculative step was rolled back and
/// step counts are unchanged.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SkipReason {
    /// Not skipped.
    #[default]
    None,
    /// The caller reported an overflow (`StepArgs::overflow`).
    Overflow,
    /// A gradient element was inf or NaN (the local norm then reports it).
    NonFiniteGradient,
    /// The caller-given global norm was inf or NaN.
    NonFiniteNorm,
    /// `clip / loss_scale` rounds to 0 or overflows in f32, so no gradient can be stepped
    /// with it (e.g. a `max_norm` below f32's range).
    UnusableFactor,
}
