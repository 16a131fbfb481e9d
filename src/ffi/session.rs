//! `so_session_*`, `so_ticket_*`: the offload session.

use std::ffi::{CStr, c_char, c_void};
use std::time::Duration;

use super::pool::{pool_arg, so_pool};
use super::types::{dtype_from_raw, dtype_to_raw, so_adam_mode, so_dtype};
use super::{WithStructSize, check_struct_size, ffi_boundary, non_null, read_struct};
use crate::cuda::{self, CudaOptions, CudaTransport};
use crate::error::{Error, Result, Status};
use crate::kernels::{AdamMode, DType, Floats};
use crate::session::{
    Borrowed, DeviceParam, GroupHparams, LossScalerOptions, NormSource, Placement, Session, SessionOptions, SkipReason,
    SliceDesc, Speculation, StepArgs, StepResult, SubGroupDesc, TicketState,
};

/// An offload session: sub-groups of parameters whose Adam state lives in host memory,
/// stepped on the session's own CPU-Adam thread.
///
/// Thread-safety: a session may be called from several threads at once (calls are
/// serialised internally); `so_session_destroy` must not race with any other call.
pub struct so_session {
    _private: [u8; 0],
}

/// A ticket: a number in a per-session sequence (from 1) of work items that complete in
/// order. 0 means "no work" and is always complete.
pub type so_ticket = u64;

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

/// Built-in dynamic loss scaler (fp16). Initialise with `so_loss_scaler_options_default()`
/// (torch GradScaler's defaults).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_loss_scaler_options {
    /// `sizeof(so_loss_scaler_options)`.
    pub struct_size: usize,
    /// Scale of the first step.
    pub init_scale: f32,
    /// Multiplies the scale after `growth_interval` steps without overflow; > 1.
    pub growth_factor: f32,
    /// Multiplies the scale after an overflow exhausts the hysteresis; in (0, 1).
    pub backoff_factor: f32,
    /// Steps without overflow before the scale grows; >= 1.
    pub growth_interval: u32,
    /// Overflowing steps tolerated before backing off; 1 backs off at once (torch).
    pub hysteresis: u32,
    /// The scale never goes below this.
    pub min_scale: f32,
}

/// How to create a session. Initialise with `so_session_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_session_options {
    /// `sizeof(so_session_options)`.
    pub struct_size: usize,
    /// Pool for the optimizer passes (the session keeps a reference); NULL to build one
    /// pinned to `cores`, or with no cores to use the default pool.
    pub pool: *const so_pool,
    /// CPU cores for a pool of the session's own (one pinned thread each); copied.
    pub cores: *const u32,
    /// Entries in `cores`.
    pub num_cores: usize,
    /// One of `so_adam_mode`.
    pub mode: u32,
    /// Divide the moments by `1 - beta^t`.
    pub bias_correction: bool,
    /// `SO_DTYPE_F32` or `SO_DTYPE_BF16` (bf16 moments never speculate: rollback needs f32).
    pub moment_dtype: u32,
    /// dtype of the gradients handed to `so_session_grad_copy`.
    pub grad_dtype: u32,
    /// dtype of the sub-group gradient buffers, in which micro-steps accumulate.
    pub accum_dtype: u32,
    /// One of `so_speculation`: whether sub-groups are stepped during backward.
    pub speculation: u32,
    /// Host bytes the session may allocate (moments, gradient buffers, the low-precision copy,
    /// late-gradient buffers); 0 for no limit.
    pub host_memory_limit: u64,
    /// Must be false: AMSGrad cannot be rolled back, so sessions refuse it.
    pub amsgrad: bool,
    /// NULL for no built-in loss scaler (the loss scale is given to each
    /// `so_session_begin_step`, or 1).
    pub loss_scaler: *const so_loss_scaler_options,
    /// `SO_DTYPE_NONE`, or `SO_DTYPE_BF16` / `SO_DTYPE_F16` to keep a low-precision copy of
    /// each sub-group's master weights, written in the same pass as every update (CUDA
    /// sessions then send the copy to the GPU instead of f32).
    pub copy_dtype: u32,
    /// CUDA sessions: device bytes for the automatic split, which places the first
    /// sub-groups in forward order on the GPU after a few measured steps (see the README);
    /// 0 turns it off.
    pub gpu_budget_bytes: u64,
}

/// Whether sub-groups are stepped during backward, before `so_session_step` knows the clip
/// factor (`so_session_options.speculation`).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum so_speculation {
    /// Every sub-group is stepped once, after `so_session_step` decides.
    Off = 0,
    /// Every sub-group that can speculate does, as soon as its gradient is complete.
    On = 1,
    /// Decided per step and sub-group from earlier steps' measurements: speculate while the
    /// clip factor mostly stayed unchanged and the sub-group's gradient arrived early enough
    /// before `so_session_step` (the default).
    Auto = 2,
}

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

/// Hyperparameters of a param group. Initialise with `so_group_hparams_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_group_hparams {
    /// `sizeof(so_group_hparams)`.
    pub struct_size: usize,
    /// Learning rate, finite and >= 0.
    pub lr: f64,
    /// In [0, 1); 0 disables speculation for the group's sub-groups.
    pub beta1: f64,
    /// In [0, 1); 0 disables speculation for the group's sub-groups.
    pub beta2: f64,
    /// Finite and >= 0.
    pub eps: f64,
    /// Finite and >= 0.
    pub weight_decay: f64,
}

/// One named param slice of a sub-group (an element of `so_subgroup_desc.slices`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_slice_desc {
    /// NUL-terminated, unique in the session; copied.
    pub name: *const c_char,
    /// First element within the sub-group.
    pub offset: usize,
    /// Elements, >= 1.
    pub numel: usize,
}

/// A sub-group to register. Initialise with `so_subgroup_desc_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_subgroup_desc {
    /// `sizeof(so_subgroup_desc)`.
    pub struct_size: usize,
    /// The param group, from `so_session_add_group`.
    pub group: u32,
    /// Flat master weights, `numel` elements of `master_dtype`; borrowed (see
    /// `so_session_add_subgroup`).
    pub master: *mut c_void,
    /// `SO_DTYPE_F32` (speculates), or `SO_DTYPE_BF16` / `SO_DTYPE_F16` (stepped at step()).
    pub master_dtype: u32,
    /// Elements of the sub-group.
    pub numel: usize,
    /// NULL (the session allocates the gradient buffer) or a caller buffer of `numel`
    /// elements of the accumulation dtype, borrowed like `master`, for `so_session_grad_written`.
    pub grad: *mut c_void,
    /// The slices whose gradients complete this sub-group; copied. They need not cover the
    /// sub-group: elements outside every slice are padding (e.g. for alignment), set to 0
    /// in `master`, the moments and the gradient buffer at registration; they stay 0 (no
    /// gradient lands there: keep a caller gradient buffer's padding 0) and are in no
    /// checkpoint.
    pub slices: *const so_slice_desc,
    /// Entries in `slices`, >= 1.
    pub num_slices: usize,
    /// CUDA sessions: the model's parameter on the device (`numel` elements of
    /// `device_param_dtype`), where updated weights are published; borrowed like `master`.
    /// 0 in host sessions.
    pub device_param: so_device_ptr,
    /// `SO_DTYPE_F32`, `SO_DTYPE_BF16` or `SO_DTYPE_F16` (CUDA sessions).
    pub device_param_dtype: u32,
    /// NULL (the session allocates them) or caller buffers of `numel` elements of the
    /// session's moment dtype, borrowed like `master`: the first and second moments.
    pub exp_avg: *mut c_void,
    pub exp_avg_sq: *mut c_void,
    /// One of `so_placement`. `SO_PLACEMENT_DEVICE` (CUDA sessions, f32 master) keeps the
    /// master weights and moments in GPU memory (`master` gives their initial values and
    /// receives them back when the sub-group moves to the host); its gradient is copied on
    /// the GPU, never to the host.
    pub placement: u32,
}

/// What `so_session_step` is told. Initialise with `so_step_args_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_step_args {
    /// `sizeof(so_step_args)`.
    pub struct_size: usize,
    /// Clip the global norm to this (torch's `clip_grad_norm_`: coefficient
    /// `min(1, max_norm / (norm + 1e-6))`); 0 disables clipping.
    pub max_norm: f64,
    /// One of `so_norm_source`.
    pub norm_source: u32,
    /// With `SO_NORM_SOURCE_GIVEN`: the global norm of the unscaled gradient.
    pub global_norm: f64,
    /// The caller saw an overflow (e.g. on another rank): skip the step.
    pub overflow: bool,
}

/// The outcome of one step (filled by `so_session_step_result`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_step_result {
    /// Set by the caller to `sizeof(so_step_result)` before the call.
    pub struct_size: usize,
    /// 1 for the session's first step, then one more per `so_session_begin_step`.
    pub serial: u64,
    /// The step was skipped (see `skip_reason`): every speculative step was rolled back,
    /// step counts are unchanged.
    pub skipped: bool,
    /// Global norm of the unscaled gradient (inf or NaN when a gradient element was; the
    /// caller's value with `SO_NORM_SOURCE_GIVEN`).
    pub global_norm: f64,
    /// Clip coefficient applied (1 when not clipped or skipped).
    pub clip_coef: f64,
    /// The factor the gradients were finally stepped with: `clip_coef / loss_scale`.
    pub grad_factor: f32,
    /// The loss scale this step's backward used.
    pub loss_scale: f32,
    /// The loss scale of the next step (the built-in scaler's verdict, else unchanged).
    pub next_loss_scale: f32,
    /// Speculative steps submitted during backward.
    pub speculative: u32,
    /// Gradients that arrived for a sub-group after its speculative step.
    pub late_gradients: u32,
    /// Speculative steps kept as taken.
    pub kept: u32,
    /// Speculative steps rescaled to the final factor (one pass each).
    pub rescaled: u32,
    /// Speculative steps undone (skipped step).
    pub rolled_back: u32,
    /// Speculative steps undone and taken again (late gradient, changed hyperparameters).
    pub redone: u32,
    /// Sub-groups stepped at step() that had not speculated.
    pub stepped: u32,
    /// Why the step was skipped: one of `so_skip_reason` (`SO_SKIP_REASON_NONE` when it was not).
    pub skip_reason: u32,
    /// Speculative steps that had not started at `so_session_step`: cancelled, and their
    /// sub-groups stepped once with the exact factor (also counted in `stepped`).
    pub cancelled: u32,
    /// Sub-groups stepped on the GPU (`SO_PLACEMENT_DEVICE`).
    pub device_stepped: u32,
    /// Sub-groups placed on the GPU during this step.
    pub device_subgroups: u32,
    /// Elements the optimizer passes touched after `so_session_step` was called (a pass over
    /// a sub-group counts its elements): the work left after backward.
    pub final_pass_elements: u64,
    /// Seconds the compute stream (CUDA sessions, through `so_ticket_enqueue_wait`) or the
    /// calling threads (ticket waits) waited on this session's tickets between the previous
    /// `so_session_step` and this one: the optimizer time the previous step left exposed.
    pub forward_wait_s: f64,
}

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

// SAFETY (all): `#[repr(C)]` with `struct_size: usize` first.
unsafe impl WithStructSize for so_loss_scaler_options {
    const NAME: &'static str = "so_loss_scaler_options";
}
unsafe impl WithStructSize for so_session_options {
    const NAME: &'static str = "so_session_options";
}
unsafe impl WithStructSize for so_group_hparams {
    const NAME: &'static str = "so_group_hparams";
}
unsafe impl WithStructSize for so_subgroup_desc {
    const NAME: &'static str = "so_subgroup_desc";
}
unsafe impl WithStructSize for so_step_args {
    const NAME: &'static str = "so_step_args";
}
unsafe impl WithStructSize for so_step_result {
    const NAME: &'static str = "so_step_result";
}

fn scaler_defaults() -> so_loss_scaler_options {
    let d = LossScalerOptions::default();
    so_loss_scaler_options {
        struct_size: std::mem::size_of::<so_loss_scaler_options>(),
        init_scale: d.init_scale,
        growth_factor: d.growth_factor,
        backoff_factor: d.backoff_factor,
        growth_interval: d.growth_interval,
        hysteresis: d.hysteresis,
        min_scale: d.min_scale,
    }
}

fn session_defaults() -> so_session_options {
    let d = SessionOptions::default();
    so_session_options {
        struct_size: std::mem::size_of::<so_session_options>(),
        pool: std::ptr::null(),
        cores: std::ptr::null(),
        num_cores: 0,
        mode: so_adam_mode::Adamw as u32,
        bias_correction: d.bias_correction,
        moment_dtype: dtype_to_raw(d.moment_dtype),
        grad_dtype: dtype_to_raw(d.grad_dtype),
        accum_dtype: dtype_to_raw(d.accum_dtype),
        speculation: so_speculation::Auto as u32,
        host_memory_limit: 0,
        amsgrad: false,
        loss_scaler: std::ptr::null(),
        copy_dtype: so_dtype::None as u32,
        gpu_budget_bytes: 0,
    }
}

fn group_to_c(g: GroupHparams) -> so_group_hparams {
    so_group_hparams {
        struct_size: std::mem::size_of::<so_group_hparams>(),
        lr: g.lr,
        beta1: g.beta1,
        beta2: g.beta2,
        eps: g.eps,
        weight_decay: g.weight_decay,
    }
}

fn group_from_c(g: &so_group_hparams) -> GroupHparams {
    GroupHparams { lr: g.lr, beta1: g.beta1, beta2: g.beta2, eps: g.eps, weight_decay: g.weight_decay }
}

fn step_args_defaults() -> so_step_args {
    so_step_args {
        struct_size: std::mem::size_of::<so_step_args>(),
        max_norm: 0.0,
        norm_source: so_norm_source::Local as u32,
        global_norm: 0.0,
        overflow: false,
    }
}

fn placement_from_raw(raw: u32, field: &str) -> Result<Placement> {
    match raw {
        x if x == so_placement::Host as u32 => Ok(Placement::Host),
        x if x == so_placement::Device as u32 => Ok(Placement::Device),
        other => Err(Error::invalid(format!("{field} = {other} is not a so_placement value"))),
    }
}

fn placement_to_raw(p: Placement) -> u32 {
    (match p {
        Placement::Host => so_placement::Host,
        Placement::Device => so_placement::Device,
    }) as u32
}

fn required_dtype(raw: u32, field: &str) -> Result<DType> {
    dtype_from_raw(raw, field)?.ok_or_else(|| Error::invalid(format!("{field} is SO_DTYPE_NONE")))
}

/// A negative timeout waits forever.
fn timeout(ns: i64) -> Option<Duration> {
    (ns >= 0).then(|| Duration::from_nanos(ns as u64))
}

/// # Safety
/// `session` must be NULL or a live handle (a `Box<Session>` pointer).
unsafe fn session_ref<'a>(session: *const so_session) -> Result<&'a Session> {
    non_null(session, "session")?;
    // SAFETY: a live handle is a Box<Session> pointer.
    Ok(unsafe { &*session.cast::<Session>() })
}

/// Our name for CUDA's stream type is CUDA's own; NULL (the legacy default stream) is valid.
fn stream_arg(stream: so_cuda_stream_t) -> crate::cuda::Stream {
    stream.cast()
}

/// Writes an out-parameter if the caller gave one.
///
/// # Safety
/// `out` must be NULL or writable.
unsafe fn write_opt<T>(out: *mut T, value: T) {
    if !out.is_null() {
        // SAFETY: non-NULL and writable per the contract.
        unsafe { out.write(value) };
    }
}

/// # Safety
/// `out` must be NULL or writable.
unsafe fn write_out<T>(out: *mut T, name: &str, value: T) -> Result<()> {
    non_null(out, name)?;
    // SAFETY: checked non-NULL; writable per the contract.
    unsafe { out.write(value) };
    Ok(())
}

/// Returns the built-in loss scaler's defaults (torch GradScaler's: scale 65536, growth 2,
/// backoff 0.5, interval 2000, hysteresis 1, minimum 1); `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_loss_scaler_options_default() -> so_loss_scaler_options {
    ffi_boundary!("so_loss_scaler_options_default", fallback = scaler_defaults(), { scaler_defaults() })
}

/// Returns session options: default pool, AdamW with bias correction, f32 moments,
/// gradients and accumulation, speculation on, no memory limit, no loss scaler;
/// `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_session_options_default() -> so_session_options {
    ffi_boundary!("so_session_options_default", fallback = session_defaults(), { session_defaults() })
}

/// Returns `torch.optim.AdamW`'s hyperparameters (lr 1e-3, betas 0.9 and 0.999, eps 1e-8,
/// weight decay 0.01); `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_group_hparams_default() -> so_group_hparams {
    ffi_boundary!("so_group_hparams_default", fallback = group_to_c(GroupHparams::default()), {
        group_to_c(GroupHparams::default())
    })
}

/// Returns an empty sub-group description (group 0, no buffers, f32 master, no slices);
/// `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_subgroup_desc_default() -> so_subgroup_desc {
    let empty = || so_subgroup_desc {
        struct_size: std::mem::size_of::<so_subgroup_desc>(),
        group: 0,
        master: std::ptr::null_mut(),
        master_dtype: so_dtype::F32 as u32,
        numel: 0,
        grad: std::ptr::null_mut(),
        slices: std::ptr::null(),
        num_slices: 0,
        device_param: 0,
        device_param_dtype: so_dtype::None as u32,
        exp_avg: std::ptr::null_mut(),
        exp_avg_sq: std::ptr::null_mut(),
        placement: so_placement::Host as u32,
    };
    ffi_boundary!("so_subgroup_desc_default", fallback = empty(), { empty() })
}

/// Returns step arguments: no clipping, local norm, no overflow; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_step_args_default() -> so_step_args {
    ffi_boundary!("so_step_args_default", fallback = step_args_defaults(), { step_args_defaults() })
}

/// @brief Creates a session and starts its CPU-Adam thread.
///
/// @param options NULL for `so_session_options_default()`.
/// @param out_session Receives the session; the caller owns it (`so_session_destroy`).
/// @return `SO_STATUS_OK`; `SO_STATUS_UNSUPPORTED` for AMSGrad or f16 moments;
///         `SO_STATUS_INVALID_ARGUMENT` for bad options (a pool and cores both given, bad
///         cores, bad loss-scaler settings); `SO_STATUS_OUT_OF_RESOURCES` if threads cannot
///         start.
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_create(
    options: *const so_session_options,
    out_session: *mut *mut so_session,
) -> Status {
    ffi_boundary!("so_session_create", {
        non_null(out_session, "out_session")?;
        // SAFETY: as documented; see `session_options`.
        let options = unsafe { session_options(options)? };
        let handle = Box::new(Session::new(options)?);
        // SAFETY: checked non-NULL.
        unsafe { out_session.write(Box::into_raw(handle).cast()) };
        Ok(())
    })
}

/// @brief Creates a CUDA session: as `so_session_create`, with gradients handed over as
/// device pointers (`so_session_grad_device`) and updated weights published into each
/// sub-group's device parameter (`so_subgroup_desc.device_param`) after `so_session_step`
/// decides. Uses the device's primary context (the one PyTorch and JAX use) and creates its
/// own copy streams; nothing the caller owns is ever freed or destroyed. Session-allocated
/// host buffers and the borrowed master weights are page-locked (`cuMemHostRegister`, in
/// place; buffers the caller already pinned are used as they are and never unregistered).
///
/// @param cuda NULL for `so_cuda_options_default()`.
/// @return As `so_session_create`; `SO_STATUS_CUDA_UNAVAILABLE` without a driver or device;
///         `SO_STATUS_CUDA_ERROR` (with the driver's error name) if setup fails.
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_create_cuda(
    options: *const so_session_options,
    cuda: *const so_cuda_options,
    out_session: *mut *mut so_session,
) -> Status {
    ffi_boundary!("so_session_create_cuda", {
        non_null(out_session, "out_session")?;
        let options = unsafe { session_options(options)? };
        let c = if cuda.is_null() { cuda_defaults() } else { unsafe { read_struct(cuda, "cuda")? } };
        let handle =
            Box::new(cuda::create_session(options, CudaOptions { device: c.device, piece_bytes: c.piece_bytes })?);
        unsafe { out_session.write(Box::into_raw(handle).cast()) };
        Ok(())
    })
}

/// Reads and converts session options.
///
/// # Safety
/// `options` must be NULL or point to a `so_session_options` whose pointers are valid.
unsafe fn session_options(options: *const so_session_options) -> Result<SessionOptions> {
    {
        // SAFETY: pointers are NULL or point to the documented structs and arrays.
        let raw = if options.is_null() { session_defaults() } else { unsafe { read_struct(options, "options")? } };
        let pool = if raw.pool.is_null() { None } else { Some(unsafe { pool_arg(raw.pool)? }) };
        let cores = match (raw.cores.is_null(), raw.num_cores) {
            (true, 0) => None,
            (true, _) => return Err(Error::new(Status::NullArgument, "options->cores is NULL but num_cores is not 0")),
            (false, 0) => return Err(Error::invalid("options->cores is set but num_cores is 0")),
            (false, n) => {
                Some(unsafe { std::slice::from_raw_parts(raw.cores, n) }.iter().map(|&c| c as usize).collect())
            }
        };
        let mode = match raw.mode {
            x if x == so_adam_mode::Adamw as u32 => AdamMode::AdamW,
            x if x == so_adam_mode::L2 as u32 => AdamMode::L2,
            other => return Err(Error::invalid(format!("options->mode = {other} is not a so_adam_mode value"))),
        };
        let loss_scaler = if raw.loss_scaler.is_null() {
            None
        } else {
            let s = unsafe { read_struct(raw.loss_scaler, "options->loss_scaler")? };
            Some(LossScalerOptions {
                init_scale: s.init_scale,
                growth_factor: s.growth_factor,
                backoff_factor: s.backoff_factor,
                growth_interval: s.growth_interval,
                hysteresis: s.hysteresis,
                min_scale: s.min_scale,
            })
        };
        let options = SessionOptions {
            pool,
            cores,
            mode,
            bias_correction: raw.bias_correction,
            moment_dtype: required_dtype(raw.moment_dtype, "options->moment_dtype")?,
            grad_dtype: required_dtype(raw.grad_dtype, "options->grad_dtype")?,
            accum_dtype: required_dtype(raw.accum_dtype, "options->accum_dtype")?,
            speculation: match raw.speculation {
                x if x == so_speculation::Off as u32 => Speculation::Off,
                x if x == so_speculation::On as u32 => Speculation::On,
                x if x == so_speculation::Auto as u32 => Speculation::Auto,
                other => {
                    return Err(Error::invalid(format!(
                        "options->speculation = {other} is not a so_speculation value"
                    )));
                }
            },
            host_memory_limit: (raw.host_memory_limit != 0).then_some(raw.host_memory_limit as usize),
            amsgrad: raw.amsgrad,
            loss_scaler,
            copy_dtype: dtype_from_raw(raw.copy_dtype, "options->copy_dtype")?,
            gpu_budget_bytes: raw.gpu_budget_bytes as usize,
        };
        Ok(options)
    }
}

/// @brief Destroys a session: waits for every queued step to finish, stops the CPU-Adam
/// thread, frees the session's memory and releases its pool reference. NULL is a no-op.
/// Borrowed buffers are not used after this returns. A CUDA session's copy streams are not
/// destroyed (an allocator may still record events on them, after `record_stream`): a later
/// CUDA session on the same device reuses them. Its device word for GPU-side ticket waits is
/// freed, so no stream may still be waiting on one of its tickets.
///
/// @note Thread-safety: must not race with other calls on the session.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn so_session_destroy(session: *mut so_session) {
    ffi_boundary!("so_session_destroy", fallback = (), {
        if !session.is_null() {
            // SAFETY: a live handle owns its Box.
            drop(unsafe { Box::from_raw(session.cast::<Session>()) });
        }
    })
}

/// @brief Adds a param group.
/// @param out_group Receives its id (0, 1, ... in order of addition).
/// @return `SO_STATUS_OK` or `SO_STATUS_INVALID_ARGUMENT` for out-of-range values.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_add_group(
    session: *mut so_session,
    hparams: *const so_group_hparams,
    out_group: *mut u32,
) -> Status {
    ffi_boundary!("so_session_add_group", {
        let s = unsafe { session_ref(session)? };
        non_null(out_group, "out_group")?;
        let hp = unsafe { read_struct(hparams, "hparams")? };
        let id = s.add_group(group_from_c(&hp))?;
        unsafe { write_out(out_group, "out_group", id) }
    })
}

/// @brief Changes a group's hyperparameters, at any time (LR and momentum schedules).
/// Speculative steps submitted afterwards use them; at the next `so_session_step`, every
/// sub-group is finalized with the values current when `so_session_step` is called
/// (speculative steps taken with other values are rolled back and redone).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_group(
    session: *mut so_session,
    group: u32,
    hparams: *const so_group_hparams,
) -> Status {
    ffi_boundary!("so_session_set_group", {
        let s = unsafe { session_ref(session)? };
        let hp = unsafe { read_struct(hparams, "hparams")? };
        s.set_group_hparams(group, group_from_c(&hp))
    })
}

/// @brief Reads a group's current hyperparameters into `out_hparams` (whose `struct_size`
/// the caller sets).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_get_group(
    session: *const so_session,
    group: u32,
    out_hparams: *mut so_group_hparams,
) -> Status {
    ffi_boundary!("so_session_get_group", {
        let s = unsafe { session_ref(session)? };
        non_null(out_hparams, "out_hparams")?;
        check_struct_size::<so_group_hparams>(unsafe { out_hparams.cast::<usize>().read_unaligned() }, "out_hparams")?;
        let g = s.group_hparams(group)?;
        unsafe { write_out(out_hparams, "out_hparams", group_to_c(g)) }
    })
}

/// @brief Registers a sub-group, between steps.
///
/// The session allocates its moments (and its gradient buffer unless `desc->grad` is
/// given). `desc->master` (and `desc->grad`) are **borrowed** until the sub-group is
/// removed or the session destroyed: the memory must stay valid, and the caller must not
/// access it from the moment a gradient hand-off completes the sub-group until the
/// sub-group's final ticket (`so_session_final_ticket`) of that step is complete. Reading
/// the master weights between steps, after the final ticket, is the normal use.
/// Sub-groups are finalized at `so_session_step` in the order they were registered:
/// register them in forward order.
///
/// @param out_subgroup Receives the sub-group id (0, 1, ... in order of registration).
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` during a step; `SO_STATUS_NOT_FOUND`
///         for an unknown group; `SO_STATUS_ALIASING` for overlapping slices or buffers
///         that overlap another sub-group's; `SO_STATUS_INVALID_ARGUMENT` for slices
///         outside the sub-group, empty or duplicate names, a gradient buffer of the wrong
///         dtype; `SO_STATUS_OUT_OF_RESOURCES` beyond the host-memory limit. Nothing is
///         registered on error.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_add_subgroup(
    session: *mut so_session,
    desc: *const so_subgroup_desc,
    out_subgroup: *mut u32,
) -> Status {
    ffi_boundary!("so_session_add_subgroup", {
        let s = unsafe { session_ref(session)? };
        non_null(out_subgroup, "out_subgroup")?;
        let d = unsafe { read_struct(desc, "desc")? };
        let master_dtype = required_dtype(d.master_dtype, "desc->master_dtype")?;
        // SAFETY: the header makes the caller keep both buffers valid while borrowed.
        let master = unsafe { Borrowed::new("desc->master", d.master, d.numel, master_dtype)? };
        let optional = |ptr: *mut c_void, name: &str, dtype: DType| -> Result<Option<Borrowed>> {
            // SAFETY: as `master`.
            (!ptr.is_null()).then(|| unsafe { Borrowed::new(name, ptr, d.numel, dtype) }).transpose()
        };
        let grad = optional(d.grad, "desc->grad", s.options().accum_dtype)?;
        let exp_avg = optional(d.exp_avg, "desc->exp_avg", s.options().moment_dtype)?;
        let exp_avg_sq = optional(d.exp_avg_sq, "desc->exp_avg_sq", s.options().moment_dtype)?;
        let placement = placement_from_raw(d.placement, "desc->placement")?;
        let device = if d.device_param == 0 {
            None
        } else {
            Some(DeviceParam {
                ptr: d.device_param,
                dtype: required_dtype(d.device_param_dtype, "desc->device_param_dtype")?,
            })
        };
        if d.slices.is_null() || d.num_slices == 0 {
            return Err(Error::new(Status::NullArgument, "desc->slices is NULL or num_slices is 0"));
        }
        let raw_slices = unsafe { std::slice::from_raw_parts(d.slices, d.num_slices) };
        let mut slices = Vec::with_capacity(raw_slices.len());
        for (i, raw) in raw_slices.iter().enumerate() {
            non_null(raw.name, &format!("desc->slices[{i}].name"))?;
            let name = unsafe { CStr::from_ptr(raw.name) }
                .to_str()
                .map_err(|_| Error::invalid(format!("desc->slices[{i}].name is not UTF-8")))?;
            slices.push(SliceDesc { name: name.to_string(), offset: raw.offset, numel: raw.numel });
        }
        let id = s.add_subgroup(SubGroupDesc {
            group: d.group,
            master,
            grad,
            exp_avg,
            exp_avg_sq,
            slices,
            device,
            placement,
        })?;
        unsafe { write_out(out_subgroup, "out_subgroup", id) }
    })
}

/// @brief Unregisters a sub-group between steps, after its outstanding work; its slices'
/// names become free, its borrowed buffers are not used after this returns.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_remove_subgroup(session: *mut so_session, subgroup: u32) -> Status {
    ffi_boundary!("so_session_remove_subgroup", { unsafe { session_ref(session)? }.remove_subgroup(subgroup) })
}

/// @brief Looks up the id of a slice by name (ids are stable for the session's lifetime;
/// look them up once, not per gradient).
/// @return `SO_STATUS_OK` or `SO_STATUS_NOT_FOUND`.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_slice_id(
    session: *const so_session,
    name: *const c_char,
    out_slice: *mut u32,
) -> Status {
    ffi_boundary!("so_session_slice_id", {
        let s = unsafe { session_ref(session)? };
        non_null(name, "name")?;
        let name = unsafe { CStr::from_ptr(name) }.to_str().map_err(|_| Error::invalid("name is not UTF-8"))?;
        let id = s.slice_id(name)?;
        unsafe { write_out(out_slice, "out_slice", id) }
    })
}

/// @brief Starts an optimizer step.
///
/// @param loss_scale The loss scale this backward uses (gradients arrive multiplied by it
///        and are unscaled by `1 / loss_scale`), or 0 for the built-in scaler's current
///        scale (which waits for the previous step's verdict) or 1 without a scaler.
/// @param micro_steps Micro-steps of gradient accumulation, >= 1; speculation happens
///        only in the last.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` if the previous step was not given to
///         `so_session_step`; `SO_STATUS_INVALID_ARGUMENT`, changing nothing, for
///         `micro_steps` 0 or a loss scale that is not finite and > 0 or whose reciprocal is
///         not finite in f32 (below about 2.9e-39; the built-in scaler's `init_scale` and
///         `min_scale` are refused likewise at `so_session_create`).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_begin_step(session: *mut so_session, loss_scale: f32, micro_steps: u32) -> Status {
    ffi_boundary!("so_session_begin_step", {
        let s = unsafe { session_ref(session)? };
        s.begin_step((loss_scale != 0.0).then_some(loss_scale), micro_steps)
    })
}

/// @brief Moves to the next micro-step of the current step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_next_micro_step(session: *mut so_session) -> Status {
    ffi_boundary!("so_session_next_micro_step", { unsafe { session_ref(session)? }.next_micro_step() })
}

/// @brief Hands over a slice's gradient by copy (into the sub-group's gradient buffer, in
/// the accumulation dtype; the first gradient of the step overwrites, later ones add).
///
/// When the slice's gradient of the last micro-step completes its sub-group, the session
/// queues the sub-group's speculative step (scale `1 / loss_scale`; or, for a sub-group
/// that cannot speculate, the measurement of its sum of squares) and returns its ticket. A
/// gradient for a sub-group that already completed this step is kept aside (allocating a
/// buffer of the sub-group's size, once) and the sub-group is rolled back and redone at
/// `so_session_step`. The copy is done before this returns: `grad` may be reused at once.
/// No allocation on the normal path.
///
/// The speculative step's ticket fails with `SO_STATUS_NON_FINITE` if the gradient has an
/// inf or NaN element. A speculative step that does not run completes its ticket with
/// `SO_STATUS_OK`, and the sub-group is stepped once at `so_session_step`: one cancelled
/// at `so_session_step` (ticket complete with the sub-group's final pass), one cancelled or
/// undone after a late gradient by `so_session_local_grad_sumsq` (complete there, before
/// `so_session_step`), or one declined because the sum of squares of its unscaled gradient
/// exceeds `FLT_MAX` (`exp_avg_sq` would overflow, which no rollback can undo).
///
/// @param slice From `so_session_slice_id`.
/// @param grad `numel` elements of the session's `grad_dtype`.
/// @param numel Must equal the slice's.
/// @param out_ticket NULL, or receives the ticket of the work this queued (0 if none).
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` outside a step's backward;
///         `SO_STATUS_NOT_FOUND` for an unknown slice; `SO_STATUS_INVALID_ARGUMENT` for a
///         wrong size; `SO_STATUS_OUT_OF_RESOURCES` if a late gradient exceeds the memory
///         limit.
/// @note Thread-safety: see `so_session`. Hand-offs of one slice must not race.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_copy(
    session: *mut so_session,
    slice: u32,
    grad: *const c_void,
    numel: usize,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!("so_session_grad_copy", {
        let s = unsafe { session_ref(session)? };
        non_null(grad, "grad")?;
        let dtype = s.options().grad_dtype;
        if grad as usize % dtype.size() != 0 {
            return Err(Error::invalid(format!("grad is not aligned to {} bytes", dtype.size())));
        }
        if numel.checked_mul(dtype.size()).is_none_or(|b| b > isize::MAX as usize) {
            return Err(Error::invalid(format!("numel = {numel} is too large")));
        }
        // SAFETY: the header requires `grad` to hold `numel` elements of grad_dtype.
        let src = unsafe {
            match dtype {
                DType::F32 => Floats::F32(std::slice::from_raw_parts(grad.cast(), numel)),
                DType::Bf16 => Floats::Bf16(std::slice::from_raw_parts(grad.cast(), numel)),
                DType::F16 => Floats::F16(std::slice::from_raw_parts(grad.cast(), numel)),
            }
        };
        let ticket = s.grad_copy(slice, src)?;
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief Records that the slice's gradient of this micro-step is in place in the
/// sub-group's caller-provided gradient buffer (accumulated by the caller over
/// micro-steps, as torch accumulates `.grad`). Completion and tickets as
/// `so_session_grad_copy`. A late gradient cannot be written in place (the buffer is in
/// use): hand it over with `so_session_grad_copy`.
/// @return As `so_session_grad_copy`; `SO_STATUS_INVALID_ARGUMENT` for a sub-group whose
///         gradient buffer the session owns; `SO_STATUS_INVALID_STATE` for a sub-group that
///         already completed this step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_written(
    session: *mut so_session,
    slice: u32,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!("so_session_grad_written", {
        let ticket = unsafe { session_ref(session)? }.grad_written(slice)?;
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief The sum of squares of this step's unscaled gradient over all sub-groups (zeros
/// for slices that got none, late gradients merged): what an all-reduce across ranks needs.
/// Waits for the speculative passes (up to `timeout_ns`; negative waits forever). Ends the
/// backward: only `so_session_step` may follow. Not finite iff an element is inf or NaN.
/// @return `SO_STATUS_OK`, `SO_STATUS_TIMEOUT` (call again to keep waiting), or
///         `SO_STATUS_INVALID_STATE` outside a step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_local_grad_sumsq(
    session: *mut so_session,
    timeout_ns: i64,
    out_sumsq: *mut f64,
) -> Status {
    ffi_boundary!("so_session_local_grad_sumsq", {
        let s = unsafe { session_ref(session)? };
        non_null(out_sumsq, "out_sumsq")?;
        let sumsq = s.local_grad_sumsq(timeout(timeout_ns))?;
        unsafe { write_out(out_sumsq, "out_sumsq", sumsq) }
    })
}

/// @brief Ends the step and returns at once: the CPU-Adam thread takes the norm (local or
/// given), decides whether to skip (caller overflow, non-finite gradient or norm, or a factor
/// that is 0 or inf in f32: `so_step_result.skip_reason`) and the clip factor
/// `f = min(1, max_norm / (norm + 1e-6)) / loss_scale`, then makes every
/// sub-group exact in registration order: a speculative step with the same factor is kept,
/// with another factor rescaled in one pass, after a late gradient or a change of
/// hyperparameters rolled back and redone, on a skipped step rolled back; sub-groups that
/// did not speculate are stepped. Each sub-group's final ticket completes as it is done
/// (`so_session_final_ticket`), so the next forward can start on the first layers.
///
/// @param args NULL for `so_step_args_default()`.
/// @param out_ticket Receives the ticket that completes when every sub-group is final;
///        pass it to `so_session_step_result`.
/// @return `SO_STATUS_OK`; `SO_STATUS_INVALID_STATE` without `so_session_begin_step`;
///         `SO_STATUS_INVALID_ARGUMENT` for a bad `max_norm`, norm source or a negative
///         given norm (nothing changes then; the step can be given to step() again).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step(
    session: *mut so_session,
    args: *const so_step_args,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!("so_session_step", {
        let s = unsafe { session_ref(session)? };
        non_null(out_ticket, "out_ticket")?;
        let a = if args.is_null() { step_args_defaults() } else { unsafe { read_struct(args, "args")? } };
        let norm = match a.norm_source {
            x if x == so_norm_source::Local as u32 => NormSource::Local,
            x if x == so_norm_source::Given as u32 => NormSource::Given(a.global_norm),
            other => return Err(Error::invalid(format!("args->norm_source = {other} is not a so_norm_source value"))),
        };
        let args = StepArgs { max_norm: a.max_norm, norm, overflow: a.overflow };
        let ticket = s.step(args)?;
        unsafe { write_out(out_ticket, "out_ticket", ticket) }
    })
}

/// @brief Waits up to `timeout_ns` (negative: forever) for the step of `ticket` (as
/// returned by `so_session_step`) and describes it. Only the latest step's result is kept.
/// @param out_result Caller-provided with `struct_size = sizeof(so_step_result)`.
/// @return `SO_STATUS_OK`, `SO_STATUS_TIMEOUT`, or `SO_STATUS_NOT_FOUND` at once, without
///         waiting, for any ticket but the one the latest `so_session_step` returned.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step_result(
    session: *const so_session,
    ticket: so_ticket,
    timeout_ns: i64,
    out_result: *mut so_step_result,
) -> Status {
    ffi_boundary!("so_session_step_result", {
        let s = unsafe { session_ref(session)? };
        non_null(out_result, "out_result")?;
        check_struct_size::<so_step_result>(unsafe { out_result.cast::<usize>().read_unaligned() }, "out_result")?;
        let r: StepResult = s.step_result(ticket, timeout(timeout_ns))?;
        let out = so_step_result {
            struct_size: std::mem::size_of::<so_step_result>(),
            serial: r.serial,
            skipped: r.skipped,
            global_norm: r.global_norm,
            clip_coef: r.clip_coef,
            grad_factor: r.grad_factor,
            loss_scale: r.loss_scale,
            next_loss_scale: r.next_loss_scale,
            speculative: r.speculative,
            late_gradients: r.late_gradients,
            kept: r.kept,
            rescaled: r.rescaled,
            rolled_back: r.rolled_back,
            redone: r.redone,
            stepped: r.stepped,
            skip_reason: (match r.skip_reason {
                SkipReason::None => so_skip_reason::None,
                SkipReason::Overflow => so_skip_reason::Overflow,
                SkipReason::NonFiniteGradient => so_skip_reason::NonFiniteGradient,
                SkipReason::NonFiniteNorm => so_skip_reason::NonFiniteNorm,
                SkipReason::UnusableFactor => so_skip_reason::UnusableFactor,
            }) as u32,
            cancelled: r.cancelled,
            device_stepped: r.device_stepped,
            device_subgroups: r.device_subgroups,
            final_pass_elements: r.final_pass_elements,
            forward_wait_s: r.forward_wait_s,
        };
        unsafe { write_out(out_result, "out_result", out) }
    })
}

/// @brief The ticket that completes when the sub-group's latest step is final (0 before
/// its first step): its master weights may be read once it is complete.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_final_ticket(
    session: *const so_session,
    subgroup: u32,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!("so_session_final_ticket", {
        let t = unsafe { session_ref(session)? }.final_ticket(subgroup)?;
        unsafe { write_out(out_ticket, "out_ticket", t) }
    })
}

/// @brief Steps the sub-group has taken (skipped steps do not count); read it after the
/// sub-group's final ticket for the count after a step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_step_count(
    session: *const so_session,
    subgroup: u32,
    out_count: *mut u64,
) -> Status {
    ffi_boundary!("so_session_step_count", {
        let n = unsafe { session_ref(session)? }.step_count(subgroup)?;
        unsafe { write_out(out_count, "out_count", n) }
    })
}

/// @brief The built-in loss scaler's current scale (after the latest step's verdict, which
/// this waits for), or 1 without a scaler: multiply the loss by it before backward.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_loss_scale(session: *const so_session, out_scale: *mut f32) -> Status {
    ffi_boundary!("so_session_loss_scale", {
        let scale = unsafe { session_ref(session)? }.loss_scale();
        unsafe { write_out(out_scale, "out_scale", scale) }
    })
}

/// @brief Host bytes the session allocated (moments, gradient buffers, late gradients).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_host_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!("so_session_host_bytes", {
        let n = unsafe { session_ref(session)? }.host_bytes();
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}

/// @brief The state of a ticket without waiting.
/// @return `SO_STATUS_OK` if its work completed, `SO_STATUS_PENDING` if not yet, the
///         work's own error status if it failed (message in `so_last_error_message`), or
///         `SO_STATUS_NOT_FOUND` for a ticket never issued.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_query(session: *const so_session, ticket: so_ticket) -> Status {
    ffi_boundary!("so_ticket_query", {
        match unsafe { session_ref(session)? }.ticket_state(ticket)? {
            TicketState::Done => Ok(()),
            TicketState::Pending => Err(Error::new(Status::Pending, format!("ticket {ticket} has not completed yet"))),
            TicketState::Failed(e) => Err(Error::new(e.status, format!("ticket {ticket} failed: {}", e.message))),
        }
    })
}

/// @brief Waits up to `timeout_ns` (negative: forever, 0: poll) for a ticket.
/// @return `SO_STATUS_OK`, the work's error status if it failed, `SO_STATUS_TIMEOUT`, or
///         `SO_STATUS_NOT_FOUND`. A failed step leaves its sub-group as it was before it;
///         the session stays usable.
/// @note Thread-safety: see `so_session`; any thread may wait.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_wait(session: *const so_session, ticket: so_ticket, timeout_ns: i64) -> Status {
    ffi_boundary!("so_ticket_wait", { unsafe { session_ref(session)? }.wait(ticket, timeout(timeout_ns)) })
}

/// @brief Waits for every ticket up to and including `ticket`.
/// @return `SO_STATUS_OK` if all succeeded, else the status of the first that failed —
///         including failures a later `so_session_step` already accounted for (a
///         speculative step refused for a non-finite gradient, which made that step
///         skipped); wait on a step's own ticket for its outcome alone.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_wait_all(session: *const so_session, ticket: so_ticket, timeout_ns: i64) -> Status {
    ffi_boundary!("so_ticket_wait_all", { unsafe { session_ref(session)? }.wait_all(ticket, timeout(timeout_ns)) })
}

/// @brief Saves a checkpoint (safetensors; see the README for the layout), between steps,
/// after in-flight work. Atomic: the file at `path` is either the old one or the new one.
/// @return `SO_STATUS_OK`, `SO_STATUS_IO`, or `SO_STATUS_INVALID_STATE` during a step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_save(session: *mut so_session, path: *const c_char) -> Status {
    ffi_boundary!("so_session_save", {
        let s = unsafe { session_ref(session)? };
        s.save(&path_arg(path)?)
    })
}

/// @brief Loads a checkpoint into the registered sub-groups (which may be partitioned
/// differently from the saved session), between steps: master weights (written into the
/// borrowed buffers), moments, step counts, group hyperparameters, loss-scaler state. A CUDA
/// session also publishes the loaded weights into the sub-groups' device parameters, after
/// the work queued on the compute stream, and returns once they have landed.
/// @return `SO_STATUS_OK`; `SO_STATUS_BAD_CHECKPOINT` for a truncated, corrupt or
///         mismatched file (then nothing changed); `SO_STATUS_IO`; `SO_STATUS_INVALID_STATE`.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_load(session: *mut so_session, path: *const c_char) -> Status {
    ffi_boundary!("so_session_load", {
        let path = path_arg(path)?;
        unsafe { session_ref(session)? }.load(&path)
    })
}

fn path_arg(path: *const c_char) -> Result<std::path::PathBuf> {
    non_null(path, "path")?;
    // SAFETY: non-NULL and NUL-terminated per the contract.
    let path = unsafe { CStr::from_ptr(path) }.to_str().map_err(|_| Error::invalid("path is not UTF-8"))?;
    Ok(std::path::PathBuf::from(path))
}

/// A CUDA stream (`cudaStream_t` and `CUstream` are this same type); the header declares
/// it in build.rs's preamble as `struct CUstream_st *`, so no CUDA header is needed.
pub type so_cuda_stream_t = *mut CUstream_st;

/// CUDA's opaque stream type.
pub struct CUstream_st {
    _private: [u8; 0],
}

/// A device address (`CUdeviceptr`, or a `void*` from `cudaMalloc` cast to an integer).
pub type so_device_ptr = u64;

/// How a CUDA session moves data. Initialise with `so_cuda_options_default()`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_cuda_options {
    /// `sizeof(so_cuda_options)`.
    pub struct_size: usize,
    /// Device ordinal (as the driver numbers them, i.e. after `CUDA_VISIBLE_DEVICES`).
    pub device: i32,
    /// Gradients larger than this go to the host in pieces of this size, alternating two
    /// copy streams, each waiting for the one before (so that other streams' copies, such
    /// as a `.item()`, get in between); >= 4096. Default 16 MiB.
    pub piece_bytes: usize,
}

// SAFETY: `#[repr(C)]` with `struct_size: usize` first.
unsafe impl WithStructSize for so_cuda_options {
    const NAME: &'static str = "so_cuda_options";
}

fn cuda_defaults() -> so_cuda_options {
    let d = CudaOptions::default();
    so_cuda_options {
        struct_size: std::mem::size_of::<so_cuda_options>(),
        device: d.device,
        piece_bytes: d.piece_bytes,
    }
}

/// Returns CUDA options: device 0, 16 MiB pieces; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_cuda_options_default() -> so_cuda_options {
    ffi_boundary!("so_cuda_options_default", fallback = cuda_defaults(), { cuda_defaults() })
}

/// @brief Whether CUDA can be used: the driver library loads, initialises and reports a
/// device. Never aborts on a machine without CUDA.
/// @return `SO_STATUS_OK` or `SO_STATUS_CUDA_UNAVAILABLE` (the message says why).
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
#[must_use]
pub extern "C" fn so_cuda_available() -> Status {
    ffi_boundary!("so_cuda_available", { crate::cuda::available() })
}

/// @brief "The gradient of `slice` is ready at device address `grad` (`numel` elements of
/// `dtype`) on `stream`": queues its copy into the sub-group's pinned host gradient buffer
/// and returns at once; the training thread never waits for copies (the CPU-Adam thread
/// does, before it steps the sub-group).
///
/// The session records an event on `stream` and copies on its own copy stream: a gradient
/// larger than `piece_bytes` goes in pieces alternating two copy streams, each waiting for
/// the one before, the first copy stream ending with a wait on the last piece. `dtype` must
/// be the session's accumulation dtype (bf16 gradients of f32 master weights cross the link
/// once, in bf16). Each slice is handed over once per step, at the last micro-step
/// (accumulate micro-steps on the GPU); a second hand-off after its sub-group completed is a
/// late gradient (redone at `so_session_step`).
///
/// **Lifetime rule:** the device gradient must stay valid until the session's copy stream
/// (`so_session_copy_stream`) has passed the copy: with PyTorch's caching allocator call
/// `grad.record_stream(copy_stream)`; otherwise keep the buffer alive until the returned
/// ticket or the step's ticket is complete.
///
/// @param out_ticket NULL, or the ticket of the speculative step this queued (0 if none).
/// @return As `so_session_grad_copy`; `SO_STATUS_INVALID_STATE` for a host session;
///         `SO_STATUS_STREAM_CAPTURING` for a stream in graph capture; `SO_STATUS_UNSUPPORTED`
///         for a dtype other than the accumulation dtype or a second hand-off in one step
///         before completion; `SO_STATUS_CUDA_ERROR`.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_grad_device(
    session: *mut so_session,
    slice: u32,
    grad: so_device_ptr,
    numel: usize,
    dtype: u32,
    stream: so_cuda_stream_t,
    out_ticket: *mut so_ticket,
) -> Status {
    ffi_boundary!("so_session_grad_device", {
        let s = unsafe { session_ref(session)? };
        let dtype = required_dtype(dtype, "dtype")?;
        let ticket = cuda::gradient_from_device(s, slice, grad, numel, dtype, stream_arg(stream))?;
        unsafe { write_opt(out_ticket, ticket.unwrap_or(0)) };
        Ok(())
    })
}

/// @brief Registers the caller's compute stream (borrowed; NULL is the legacy default
/// stream): each `so_session_step` records an event on it, and updated weights are published
/// only after that point, so a backward still running on the GPU never sees its weights
/// change. Call it once, and again if the compute stream changes.
/// @return `SO_STATUS_OK`, `SO_STATUS_STREAM_CAPTURING`, `SO_STATUS_INVALID_STATE` for a host
///         session.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_compute_stream(session: *mut so_session, stream: so_cuda_stream_t) -> Status {
    ffi_boundary!("so_session_set_compute_stream", {
        let s = unsafe { session_ref(session)? };
        cuda::transport_of(s, "so_session_set_compute_stream")?.set_compute_stream(stream_arg(stream))
    })
}

/// @brief Makes `stream` wait, on the GPU and without blocking the calling thread, until
/// `ticket` is complete — e.g. a sub-group's final ticket before the forward of its layer
/// reads the published weights. Implemented with one device word per ticket lane (a
/// sub-group's tickets, or the step-wide ones) that the session's stream writes as tickets
/// complete (`cuStreamWaitValue64`), so it may be called before the work has even started,
/// and waits for that work alone. The wait is timed on the GPU: the total is the next step
/// result's `forward_wait_s`. The outcome of failed work is reported on the host
/// (`so_ticket_wait`).
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND` for a ticket never issued,
///         `SO_STATUS_STREAM_CAPTURING`, `SO_STATUS_INVALID_STATE` for a host session.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_ticket_enqueue_wait(
    session: *const so_session,
    ticket: so_ticket,
    stream: so_cuda_stream_t,
) -> Status {
    ffi_boundary!("so_ticket_enqueue_wait", {
        cuda::enqueue_wait(unsafe { session_ref(session)? }, ticket, stream_arg(stream))
    })
}

/// @brief The session's first copy stream, on which every gradient copy ends (for
/// `record_stream`); owned by the session, valid until it is destroyed.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_copy_stream(
    session: *const so_session,
    out_stream: *mut so_cuda_stream_t,
) -> Status {
    ffi_boundary!("so_session_copy_stream", {
        let s = unsafe { session_ref(session)? };
        let stream = cuda::transport_of(s, "so_session_copy_stream")?.copy_stream();
        unsafe { write_out(out_stream, "out_stream", stream.cast()) }
    })
}

/// @brief Host bytes the session page-locked (0 for a host session). Buffers the caller
/// had already pinned are not counted; nothing is rounded up to powers of two.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_pinned_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!("so_session_pinned_bytes", {
        let n = unsafe { session_ref(session)? }.transport_as::<CudaTransport>().map_or(0, CudaTransport::pinned_bytes);
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}

/// @brief Starts recording a timeline of the session's work (clearing an earlier one) when
/// `enable`, or stops recording: gradient hand-offs and waits of the calling threads, and
/// the CPU-Adam thread's speculative steps, sums of squares, decisions and per-sub-group
/// finalization (kept, rescaled, rolled back, redone, stepped), and its waits for gradient
/// copies. Costs one clock read per event while on, nothing while off.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_trace(session: *mut so_session, enable: bool) -> Status {
    ffi_boundary!("so_session_trace", {
        unsafe { session_ref(session)? }.trace(enable);
        Ok(())
    })
}

/// @brief Writes the recorded timeline to `path` as Chrome trace-event JSON (open it in
/// Perfetto or chrome://tracing, or render it with `bench/trace_plot.py`).
/// @return `SO_STATUS_OK` or `SO_STATUS_IO`.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_trace_save(session: *const so_session, path: *const c_char) -> Status {
    ffi_boundary!("so_session_trace_save", {
        let s = unsafe { session_ref(session)? };
        s.save_trace(&path_arg(path)?)
    })
}

/// Where a sub-group's state lives (filled by `so_session_get_subgroup_state`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct so_subgroup_state {
    /// Set by the caller to `sizeof(so_subgroup_state)` before the call.
    pub struct_size: usize,
    /// One of `so_placement`: where the sub-group is stepped.
    pub placement: u32,
    /// Elements of the sub-group.
    pub numel: usize,
    /// Host buffers of the master weights and both moments (the caller's borrowed buffers,
    /// or the session's own). For a device-placed sub-group they were brought up to date by
    /// the call.
    pub master: *mut c_void,
    pub exp_avg: *mut c_void,
    pub exp_avg_sq: *mut c_void,
    /// `SO_DTYPE_*` of `master` and of both moments.
    pub master_dtype: u32,
    pub moment_dtype: u32,
    /// Steps the sub-group has taken.
    pub step_count: u64,
}

// SAFETY: `#[repr(C)]` with `struct_size: usize` first.
unsafe impl WithStructSize for so_subgroup_state {
    const NAME: &'static str = "so_subgroup_state";
}

/// @brief Describes a sub-group's state buffers, after its outstanding work, so that a caller
/// can read (or, between steps, write) its master weights and moments in place — e.g. to
/// build a torch-style optimizer state dict. The pointers stay valid until the sub-group is
/// removed or the session destroyed. A device-placed sub-group's host buffers are updated
/// by this call; writes to them reach the device only through `so_session_set_placement`
/// or a checkpoint load.
/// @param out_state Caller-provided with `struct_size = sizeof(so_subgroup_state)`.
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_CUDA_ERROR`.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_get_subgroup_state(
    session: *const so_session,
    subgroup: u32,
    out_state: *mut so_subgroup_state,
) -> Status {
    ffi_boundary!("so_session_get_subgroup_state", {
        let s = unsafe { session_ref(session)? };
        non_null(out_state, "out_state")?;
        check_struct_size::<so_subgroup_state>(unsafe { out_state.cast::<usize>().read_unaligned() }, "out_state")?;
        let st = s.subgroup_state(subgroup)?;
        let out = so_subgroup_state {
            struct_size: std::mem::size_of::<so_subgroup_state>(),
            placement: placement_to_raw(st.placement),
            numel: st.numel,
            master: st.master.cast(),
            exp_avg: st.exp_avg.cast(),
            exp_avg_sq: st.exp_avg_sq.cast(),
            master_dtype: dtype_to_raw(st.master_dtype),
            moment_dtype: dtype_to_raw(st.moment_dtype),
            step_count: st.step_count,
        };
        unsafe { write_out(out_state, "out_state", out) }
    })
}

/// @brief Sets a sub-group's step count, between steps (after writing its state in place,
/// e.g. from a torch optimizer state dict).
/// @return `SO_STATUS_OK`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_INVALID_STATE` during a step.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_step_count(session: *mut so_session, subgroup: u32, count: u64) -> Status {
    ffi_boundary!("so_session_set_step_count", { unsafe { session_ref(session)? }.set_step_count(subgroup, count) })
}

/// @brief Moves a sub-group's master weights and moments between host and GPU memory
/// (`so_placement`), between steps, bit for bit. On the GPU it is stepped by the library's
/// kernel after each decision (never speculatively); back on the host its borrowed master
/// buffer holds the current weights again.
/// @return `SO_STATUS_OK`; `SO_STATUS_UNSUPPORTED` in a host session or for non-f32 master
///         weights; `SO_STATUS_INVALID_STATE` during a step; `SO_STATUS_NOT_FOUND`;
///         `SO_STATUS_CUDA_ERROR` (then nothing changed).
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_set_placement(session: *mut so_session, subgroup: u32, placement: u32) -> Status {
    ffi_boundary!("so_session_set_placement", {
        let placement = placement_from_raw(placement, "placement")?;
        unsafe { session_ref(session)? }.set_placement(subgroup, placement)
    })
}

/// @brief GPU bytes the session allocated (device-placed state, staging buffers, sums of
/// squares, ticket words); 0 for a host session.
/// @note Thread-safety: see `so_session`.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_session_device_bytes(session: *const so_session, out_bytes: *mut usize) -> Status {
    ffi_boundary!("so_session_device_bytes", {
        let n = unsafe { session_ref(session)? }.device_bytes();
        unsafe { write_out(out_bytes, "out_bytes", n) }
    })
}
