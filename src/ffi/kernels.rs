//! `so_adam_*`, `so_grad_sumsq`: the kernels on caller buffers.

use std::ffi::c_void;
use std::sync::Arc;

use super::args::{RawBuf, check_disjoint, non_null, read_struct, read_struct_or, with_struct_size};
use super::boundary::ffi_boundary;
use super::convert::{Field, FromC, abi_struct};
use super::pool::{pool_arg, so_pool};
use super::types::so_dtype;
use crate::error::{Error, Result, Status};
use crate::kernels::{
    self, AdamBuffers, AdamHyper, CopyOutMut, DType, Floats, FloatsMut, MomentsMut, Pool, UpdateOptions,
};

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

abi_struct!(so_adam_hparams <=> AdamHyper { mode, lr, beta1, beta2, eps, weight_decay, bias_correction, step });

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

abi_struct! {
    so_update_options <=> UpdateOptions { grad_scale, check_finite }
    // Asked for by so_adam_update's out_grad_sumsq, not by the struct.
    to_core |raw, arg| { grad_sumsq: false }
    to_c |o| {}
}

// SAFETY: the three are `#[repr(C)]`, `struct_size` first, the other fields numbers, bools and
// raw pointers.
with_struct_size!(unsafe so_adam_hparams, so_adam_buffers, so_update_options);

/// Returns hyperparameters with `torch.optim.AdamW`'s defaults for the first step:
/// AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, bias correction on,
/// step 1; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_adam_hparams_default() -> so_adam_hparams {
    ffi_boundary!({ Ok(so_adam_hparams::from_core(&AdamHyper::default())) })
}

/// Returns an empty buffer set: `numel` 0, all pointers NULL, f32 param, gradient and
/// moments, no parameter copy; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_adam_buffers_default() -> so_adam_buffers {
    ffi_boundary!({
        Ok(so_adam_buffers {
            struct_size: size_of::<so_adam_buffers>(),
            numel: 0,
            param: std::ptr::null_mut(),
            grad: std::ptr::null(),
            exp_avg: std::ptr::null_mut(),
            exp_avg_sq: std::ptr::null_mut(),
            param_copy: std::ptr::null_mut(),
            param_dtype: so_dtype::F32 as u32,
            grad_dtype: so_dtype::F32 as u32,
            moment_dtype: so_dtype::F32 as u32,
            param_copy_dtype: so_dtype::None as u32,
        })
    })
}

/// Returns update options: gradient scale 1, no finiteness check; `struct_size` set.
///
/// The struct is returned by value at this library's size: build the program against the
/// header of the library it runs with (see `SO_ABI_VERSION`).
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_update_options_default() -> so_update_options {
    ffi_boundary!({ Ok(so_update_options::from_core(&UpdateOptions::default())) })
}

/// @brief One Adam step over `buffers`, in one pass over memory.
///
/// Per element, in f32: `g <- grad_scale * g`; Adam-L2 with `wd != 0`: `g <- g + wd * p`;
/// `m <- b1 * m + (1 - b1) * g`; `v <- b2 * v + (1 - b2) * g^2`;
/// `denom = sqrt(v) / sqrt(bc2) + eps`; AdamW: `p <- p * (1 - lr * wd)`; then
/// `p <- p - (lr / bc1) * m / denom`, where `bc1 = 1 - b1^step` and `bc2 = 1 - b2^step`
/// (computed in double, rounded once to float; both 1 without bias correction).
/// Every combination of parameter, gradient and moment dtype works; low-precision stores
/// round to nearest even. With `param_copy`, the updated parameter is also written in
/// `param_copy_dtype` in the same pass.
///
/// Results are bit-identical for every instruction set and thread count.
///
/// @param pool Pool to run on; NULL for the process-wide default pool.
/// @param hparams Hyperparameters, including the step number being taken.
/// @param buffers The buffers; borrowed for the duration of the call only.
/// @param options NULL for `so_update_options_default()`.
/// @param out_grad_sumsq NULL, or receives the sum of squares (in double) of the scaled
///        gradient, computed in the same pass; the same for every ISA and thread count.
/// @return `SO_STATUS_OK`; `SO_STATUS_NON_FINITE` if `options->check_finite` and a scaled
///         gradient element is inf or NaN (then no buffer was modified); or an argument
///         error (NULL, invalid dtype or range, misaligned or overlapping buffers), in which
///         case nothing was modified and `so_last_error_message` says what was wrong.
/// @note Thread-safety: any number of threads may call this at once on disjoint buffers,
///       on the same pool or on different pools. The buffers must not be accessed by
///       anything else during the call.
///
/// # Safety
/// `pool` is NULL or a live pool; `hparams` and `buffers` point to their structs, `options`
/// is NULL or points to its struct; each buffer in `buffers` holds `numel` elements of its
/// dtype and is not accessed by anything else during the call; `out_grad_sumsq` is NULL or
/// writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_update(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    options: *const so_update_options,
    out_grad_sumsq: *mut f64,
) -> Status {
    ffi_boundary!({
        // SAFETY: `pool`, `hparams` and `buffers` are as `Call::read` requires (this function's
        // contract: the same as so_adam_update's).
        let call = unsafe { Call::read(pool, hparams, buffers)? };
        // SAFETY: `options` is NULL or points to a readable `so_update_options` (the contract).
        let options =
            unsafe { read_struct_or(options, "options", || so_update_options::from_core(&Default::default()))? };
        let options = UpdateOptions { grad_sumsq: !out_grad_sumsq.is_null(), ..options.to_core("options")? };
        let report = kernels::update(&call.pool, &call.hp, call.bufs, &options)?;
        if let Some(sumsq) = report.grad_sumsq {
            // SAFETY: `out_grad_sumsq` is non-NULL (else no sum was asked for) and writable
            // (the contract).
            unsafe { out_grad_sumsq.write_unaligned(sumsq) };
        }
        Ok(())
    })
}

/// @brief Undoes one `so_adam_update` taken with the same gradient, `grad_scale` and
/// hyperparameters (the same `step`), in one pass.
///
/// The parameter is recovered first, from the post-step moments, then the moments:
/// AdamW `p <- (p + (lr / bc1) * m / denom(v)) / (1 - lr * wd)`; Adam-L2
/// `p <- p + (lr / bc1) * m / denom(v)` and the L2 term `wd * p` of the recovered `p`
/// enters `g`; `m <- (m - (1 - b1) * g) / b1`; `v <- max(0, (v - (1 - b2) * g^2) / b2)`
/// (a NaN stays NaN). The result equals the state before the step up to f32 rounding of
/// the terms involved (a few ulps of `|p|` and `(lr / bc1) * |m / denom|` for `p`, of
/// `|m|` and `(1 - b1) * |g|` relative to `b1` for `m`). With `param_copy`, the recovered
/// parameter is also written in `param_copy_dtype`.
///
/// @param pool NULL for the default pool.
/// @param hparams As passed to the update being undone; `beta1` and `beta2` must be > 0
///        and, for AdamW, `1 - lr * weight_decay > 0`.
/// @param buffers f32 param and f32 moments (the master-weight case); any gradient dtype.
/// @param grad_scale As passed to the update being undone; finite and > 0.
/// @return `SO_STATUS_OK`, `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an
///         argument error; on error nothing was modified.
/// @note Thread-safety: as `so_adam_update`.
///
/// # Safety
/// As `so_adam_update` (without `options` and `out_grad_sumsq`).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_rollback(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    grad_scale: f32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `pool`, `hparams` and `buffers` are as `Call::read` requires (this function's
        // contract).
        let call = unsafe { Call::read(pool, hparams, buffers)? };
        kernels::rollback(&call.pool, &call.hp, call.bufs, grad_scale)
    })
}

/// @brief Turns a step taken on `old_scale * g` into the step on `new_scale * g` from the
/// same starting state, in one pass (for example when gradient clipping, decided after the
/// step, changes the gradient factor).
///
/// `m <- m + (1 - b1) * (new - old) * g`; `v <- max(0, v + (1 - b2) * (new^2 - old^2) * g^2)`
/// (a NaN stays NaN); `p <- p - (lr / bc1) * (m_new / denom(v_new) - m / denom(v))`, where
/// AdamW's decay cancels. With Adam-L2 and `wd != 0`, `p_prev` is recovered first and the
/// cross term `2 * (1 - b2) * wd * (new - old) * g * p_prev` joins `v`. If
/// `old_scale == new_scale` nothing is touched. The result equals the direct step on
/// `new_scale * g` up to f32 rounding, except that the stored `v` carries its own rounding
/// (`2^-24 * v`) into the smaller `v_new`: its relative error grows like
/// `2^-24 * v / v_new`, which is `2^-24 * (old / new)^2` for AdamW on a first step, and can
/// exceed 1 with Adam-L2 where `new * g + wd * p` nearly cancels. An undo and redo
/// (`so_adam_rollback` then `so_adam_update`) loses the same information.
///
/// @param pool NULL for the default pool.
/// @param hparams As passed to the step being rescaled.
/// @param buffers f32 param and f32 moments; the gradient as passed to the step.
/// @param old_scale The gradient scale the step was taken with; finite and > 0.
/// @param new_scale The gradient scale wanted; finite and > 0.
/// @return `SO_STATUS_OK`, `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an
///         argument error; on error nothing was modified.
/// @note Thread-safety: as `so_adam_update`.
///
/// # Safety
/// As `so_adam_update` (without `options` and `out_grad_sumsq`).
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_rescale(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    old_scale: f32,
    new_scale: f32,
) -> Status {
    ffi_boundary!({
        // SAFETY: `pool`, `hparams` and `buffers` are as `Call::read` requires (this function's
        // contract).
        let call = unsafe { Call::read(pool, hparams, buffers)? };
        kernels::rescale(&call.pool, &call.hp, call.bufs, old_scale, new_scale)
    })
}

/// @brief Sum of squares, in double, of `scale * grad` over `numel` elements of
/// `grad_dtype`: the same value `so_adam_update` reports for that gradient and scale, for
/// every instruction set and thread count. Not finite iff an element is inf or NaN.
///
/// @param pool NULL for the default pool.
/// @param grad Gradient, read only; may be NULL when `numel` is 0.
/// @param grad_dtype One of `SO_DTYPE_F32`, `SO_DTYPE_BF16`, `SO_DTYPE_F16`.
/// @param numel Elements.
/// @param scale Finite and > 0.
/// @param out_sumsq Receives the sum on success.
/// @return `SO_STATUS_OK` or an argument error.
/// @note Thread-safety: safe to call from any thread.
///
/// # Safety
/// `pool` is NULL or a live pool; `grad` holds `numel` readable elements of `grad_dtype`
/// (or `numel` is 0); `out_sumsq` is NULL or writable.
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_grad_sumsq(
    pool: *const so_pool,
    grad: *const c_void,
    grad_dtype: u32,
    numel: usize,
    scale: f32,
    out_sumsq: *mut f64,
) -> Status {
    ffi_boundary!({
        non_null(out_sumsq, "out_sumsq")?;
        let dtype = DType::from_c(grad_dtype, Field::arg("grad_dtype"))?;
        // SAFETY: `pool` is NULL or a live pool.
        let pool = unsafe { pool_arg(pool)? };
        let grad = match numel {
            0 => Floats::F32(&[]),
            // SAFETY: `grad` holds `numel` readable elements of `grad_dtype` (the contract).
            _ => unsafe { RawBuf::new("grad", "numel", grad, numel, dtype)?.floats() },
        };
        let sumsq = kernels::grad_sumsq(&pool, grad, scale)?;
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { out_sumsq.write_unaligned(sumsq) };
        Ok(())
    })
}

/// What the three kernel exports share: the pool, the hyperparameters (validated) and the
/// buffers (validated and borrowed).
struct Call<'a> {
    pool: Arc<Pool>,
    hp: AdamHyper,
    bufs: AdamBuffers<'a>,
}

impl Call<'_> {
    /// Reads and checks the arguments, in this order: `hparams`, `buffers`, `pool`.
    ///
    /// # Safety
    /// `pool` is NULL or a live pool; `hparams` and `buffers` are NULL or point to their
    /// structs; each buffer in `buffers` holds `numel` elements of its dtype and is not
    /// accessed by anything else while the result lives.
    unsafe fn read(
        pool: *const so_pool,
        hparams: *const so_adam_hparams,
        buffers: *const so_adam_buffers,
    ) -> Result<Self> {
        // SAFETY: `hparams` is NULL or points to a `so_adam_hparams` (the contract).
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_core("hparams")?;
        hp.validate().map_err(|e| Error::new(e.status, format!("hparams->{}", e.message)))?;
        // SAFETY: `buffers` is NULL or points to a `so_adam_buffers` (the contract).
        let raw = unsafe { read_struct(buffers, "buffers")? };
        // SAFETY: `pool` is NULL or a live pool (the contract).
        let pool = unsafe { pool_arg(pool)? };
        // SAFETY: the buffers are valid and exclusive while the result lives (the contract).
        let bufs = unsafe { borrow_buffers(&raw)? };
        Ok(Call { pool, hp, bufs })
    }
}

/// The dtypes of a buffer set, checked against what the kernels support.
struct CheckedDtypes {
    param: DType,
    grad: DType,
    moments: DType,
    copy: Option<DType>,
}

fn check_dtypes(raw: &so_adam_buffers) -> Result<CheckedDtypes> {
    let field = |name| Field::member("buffers", name);
    let param = DType::from_c(raw.param_dtype, field("param_dtype"))?;
    let grad = DType::from_c(raw.grad_dtype, field("grad_dtype"))?;
    let moments = DType::from_c(raw.moment_dtype, field("moment_dtype"))?;
    if moments == DType::F16 {
        return Err(Error::unsupported("buffers->moment_dtype must be SO_DTYPE_F32 or SO_DTYPE_BF16, not f16"));
    }
    let copy = Option::<DType>::from_c(raw.param_copy_dtype, field("param_copy_dtype"))?;
    if copy == Some(DType::F32) {
        return Err(Error::unsupported(
            "buffers->param_copy_dtype must be SO_DTYPE_NONE, SO_DTYPE_BF16 or SO_DTYPE_F16",
        ));
    }
    match (copy, raw.param_copy.is_null()) {
        (None, false) => Err(Error::invalid("buffers->param_copy is set but param_copy_dtype is SO_DTYPE_NONE")),
        (Some(_), true) if raw.numel > 0 => {
            Err(Error::new(Status::NullArgument, "buffers->param_copy is NULL but param_copy_dtype asks for a copy"))
        }
        _ => Ok(CheckedDtypes { param, grad, moments, copy }),
    }
}

/// Validates a caller's buffer set and borrows it as typed slices. An empty set (`numel`
/// 0, pointers ignored) still has the caller's dtypes, so that an empty call refuses the
/// combinations a non-empty one would.
///
/// # Safety
/// Each pointer must be valid for `numel` elements of its dtype, and the buffers must not
/// be accessed by anything else while the result lives.
unsafe fn borrow_buffers<'a>(raw: &so_adam_buffers) -> Result<AdamBuffers<'a>> {
    let dtypes = check_dtypes(raw)?;
    let n = raw.numel;
    if n == 0 {
        return Ok(AdamBuffers {
            param: match dtypes.param {
                DType::F32 => FloatsMut::F32(&mut []),
                DType::Bf16 => FloatsMut::Bf16(&mut []),
                DType::F16 => FloatsMut::F16(&mut []),
            },
            grad: Floats::F32(&[]),
            moments: match dtypes.moments {
                DType::Bf16 => MomentsMut::Bf16 { exp_avg: &mut [], exp_avg_sq: &mut [] },
                _ => MomentsMut::F32 { exp_avg: &mut [], exp_avg_sq: &mut [] },
            },
            copy_out: None,
        });
    }
    let buf = |name: &'static str, ptr: *const c_void, dtype| RawBuf::new(name, "buffers->numel", ptr, n, dtype);
    let param = buf("buffers->param", raw.param.cast_const(), dtypes.param)?;
    let grad = buf("buffers->grad", raw.grad, dtypes.grad)?;
    let exp_avg = buf("buffers->exp_avg", raw.exp_avg.cast_const(), dtypes.moments)?;
    let exp_avg_sq = buf("buffers->exp_avg_sq", raw.exp_avg_sq.cast_const(), dtypes.moments)?;
    let copy = dtypes.copy.map(|d| buf("buffers->param_copy", raw.param_copy.cast_const(), d)).transpose()?;
    let mut all = vec![param, grad, exp_avg, exp_avg_sq];
    all.extend(copy);
    check_disjoint(&all)?;

    // SAFETY: every buffer is non-NULL, aligned, in range and disjoint from the others
    // (checked above); validity and exclusivity for 'a are the caller's contract.
    let (param, grad, m, v, copy) = unsafe {
        (param.floats_mut(), grad.floats(), exp_avg.floats_mut(), exp_avg_sq.floats_mut(), copy.map(|c| c.floats_mut()))
    };
    let moments = match (m, v) {
        (FloatsMut::F32(exp_avg), FloatsMut::F32(exp_avg_sq)) => MomentsMut::F32 { exp_avg, exp_avg_sq },
        (FloatsMut::Bf16(exp_avg), FloatsMut::Bf16(exp_avg_sq)) => MomentsMut::Bf16 { exp_avg, exp_avg_sq },
        _ => return Err(Error::unsupported("buffers->moment_dtype must be SO_DTYPE_F32 or SO_DTYPE_BF16")),
    };
    let copy_out = match copy {
        None => None,
        Some(FloatsMut::Bf16(c)) => Some(CopyOutMut::Bf16(c)),
        Some(FloatsMut::F16(c)) => Some(CopyOutMut::F16(c)),
        Some(FloatsMut::F32(_)) => {
            return Err(Error::unsupported("buffers->param_copy_dtype must not be SO_DTYPE_F32"));
        }
    };
    Ok(AdamBuffers { param, grad, moments, copy_out })
}
