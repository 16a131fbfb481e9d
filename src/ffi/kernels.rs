//! `so_adam_*`: the kernels on caller buffers.

use std::ffi::c_void;

use half::{bf16, f16};

use super::pool::{pool_arg, so_pool};
use super::types::{dtype_from_raw, so_adam_buffers, so_adam_hparams, so_update_options};
use super::{ffi_boundary, non_null, read_struct};
use crate::error::{Error, Result, Status};
use crate::kernels::{self, AdamBuffers, AdamHyper, CopyOutMut, DType, GradRef, MomentsMut, ParamMut, UpdateOptions};

/// Returns hyperparameters with `torch.optim.AdamW`'s defaults for the first step:
/// AdamW, lr 1e-3, betas (0.9, 0.999), eps 1e-8, weight decay 0.01, bias correction on,
/// step 1; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_adam_hparams_default() -> so_adam_hparams {
    ffi_boundary!("so_adam_hparams_default", fallback = so_adam_hparams::from_hyper(&AdamHyper::default()), {
        so_adam_hparams::from_hyper(&AdamHyper::default())
    })
}

/// Returns an empty buffer set: `numel` 0, all pointers NULL, f32 param, gradient and
/// moments, no parameter copy; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_adam_buffers_default() -> so_adam_buffers {
    ffi_boundary!("so_adam_buffers_default", fallback = empty_buffers(), { empty_buffers() })
}

fn empty_buffers() -> so_adam_buffers {
    let f32_code = super::types::dtype_to_raw(DType::F32);
    so_adam_buffers {
        struct_size: std::mem::size_of::<so_adam_buffers>(),
        numel: 0,
        param: std::ptr::null_mut(),
        grad: std::ptr::null(),
        exp_avg: std::ptr::null_mut(),
        exp_avg_sq: std::ptr::null_mut(),
        param_copy: std::ptr::null_mut(),
        param_dtype: f32_code,
        grad_dtype: f32_code,
        moment_dtype: f32_code,
        param_copy_dtype: super::types::so_dtype::None as u32,
    }
}

/// Returns update options: gradient scale 1, no finiteness check; `struct_size` set.
///
/// @note Thread-safety: safe to call from any thread.
#[unsafe(no_mangle)]
pub extern "C" fn so_update_options_default() -> so_update_options {
    ffi_boundary!("so_update_options_default", fallback = default_update_options(), { default_update_options() })
}

fn default_update_options() -> so_update_options {
    let d = UpdateOptions::default();
    so_update_options {
        struct_size: std::mem::size_of::<so_update_options>(),
        grad_scale: d.grad_scale,
        check_finite: d.check_finite,
    }
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
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_update(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    options: *const so_update_options,
    out_grad_sumsq: *mut f64,
) -> Status {
    ffi_boundary!("so_adam_update", {
        // SAFETY: pointers are NULL or point to the documented structs.
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_hyper()?;
        let raw = unsafe { read_struct(buffers, "buffers")? };
        let opts =
            if options.is_null() { default_update_options() } else { unsafe { read_struct(options, "options")? } };
        let opts = UpdateOptions {
            grad_scale: opts.grad_scale,
            check_finite: opts.check_finite,
            grad_sumsq: !out_grad_sumsq.is_null(),
        };
        let pool = unsafe { pool_arg(pool)? };
        // SAFETY: the header requires each pointer to be valid for `numel` elements.
        let report = match unsafe { borrow_buffers(&raw)? } {
            Some(bufs) => kernels::update(&pool, &hp, bufs, &opts)?,
            None => kernels::update(&pool, &hp, empty_typed(), &opts)?,
        };
        if let Some(sumsq) = report.grad_sumsq {
            // SAFETY: non-NULL (grad_sumsq was requested) and writable per the contract.
            unsafe { out_grad_sumsq.write(sumsq) };
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
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_rollback(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    grad_scale: f32,
) -> Status {
    ffi_boundary!("so_adam_rollback", {
        // SAFETY: as in so_adam_update.
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_hyper()?;
        let raw = unsafe { read_struct(buffers, "buffers")? };
        let pool = unsafe { pool_arg(pool)? };
        match unsafe { borrow_buffers(&raw)? } {
            Some(bufs) => kernels::rollback(&pool, &hp, bufs, grad_scale),
            None => kernels::rollback(&pool, &hp, empty_typed_like(&raw)?, grad_scale),
        }
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
#[unsafe(no_mangle)]
#[must_use]
pub unsafe extern "C" fn so_adam_rescale(
    pool: *const so_pool,
    hparams: *const so_adam_hparams,
    buffers: *const so_adam_buffers,
    old_scale: f32,
    new_scale: f32,
) -> Status {
    ffi_boundary!("so_adam_rescale", {
        // SAFETY: as in so_adam_update.
        let hp = unsafe { read_struct(hparams, "hparams")? }.to_hyper()?;
        let raw = unsafe { read_struct(buffers, "buffers")? };
        let pool = unsafe { pool_arg(pool)? };
        match unsafe { borrow_buffers(&raw)? } {
            Some(bufs) => kernels::rescale(&pool, &hp, bufs, old_scale, new_scale),
            None => kernels::rescale(&pool, &hp, empty_typed_like(&raw)?, old_scale, new_scale),
        }
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
    ffi_boundary!("so_grad_sumsq", {
        non_null(out_sumsq, "out_sumsq")?;
        let dtype =
            dtype_from_raw(grad_dtype, "grad_dtype")?.ok_or_else(|| Error::invalid("grad_dtype is SO_DTYPE_NONE"))?;
        let pool = unsafe { pool_arg(pool)? };
        let sumsq = if numel == 0 {
            kernels::grad_sumsq(&pool, GradRef::F32(&[]), scale)?
        } else {
            let span = RawSpan::new("grad", grad as usize, numel, dtype)?;
            // SAFETY: the header requires `grad` to be valid for `numel` elements.
            kernels::grad_sumsq(&pool, unsafe { span.grad() }, scale)?
        };
        // SAFETY: checked non-NULL; writable per the contract.
        unsafe { out_sumsq.write(sumsq) };
        Ok(())
    })
}

/// A caller's buffer as an address range, checked before any slice is made of it.
#[derive(Clone, Copy)]
struct RawSpan {
    name: &'static str,
    addr: usize,
    numel: usize,
    dtype: DType,
}

impl RawSpan {
    fn new(name: &'static str, addr: usize, numel: usize, dtype: DType) -> Result<RawSpan> {
        if addr == 0 {
            return Err(Error::new(Status::NullArgument, format!("buffers->{name} is NULL")));
        }
        numel
            .checked_mul(dtype.size())
            .filter(|&bytes| bytes <= isize::MAX as usize && addr.checked_add(bytes).is_some())
            .ok_or_else(|| Error::invalid(format!("buffers->numel = {numel} is too large for {name}")))?;
        if addr % dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "buffers->{name} ({addr:#x}) is not aligned to its element size ({} bytes for {})",
                dtype.size(),
                dtype.name()
            )));
        }
        Ok(RawSpan { name, addr, numel, dtype })
    }

    fn end(&self) -> usize {
        self.addr + self.numel * self.dtype.size()
    }

    /// # Safety
    /// The range must be valid for reads for the lifetime chosen.
    unsafe fn grad<'a>(self) -> GradRef<'a> {
        let ptr = self.addr as *const u8;
        // SAFETY: non-NULL, aligned, in range (checked in `new`); validity is the caller's.
        unsafe {
            match self.dtype {
                DType::F32 => GradRef::F32(std::slice::from_raw_parts(ptr.cast(), self.numel)),
                DType::Bf16 => GradRef::Bf16(std::slice::from_raw_parts(ptr.cast(), self.numel)),
                DType::F16 => GradRef::F16(std::slice::from_raw_parts(ptr.cast(), self.numel)),
            }
        }
    }

    /// # Safety
    /// The range must be valid for reads and writes, and not otherwise accessed, for the
    /// lifetime chosen.
    unsafe fn slice_mut<'a, T>(self) -> &'a mut [T] {
        // SAFETY: as in `grad`, plus exclusivity from the caller and `check_disjoint`.
        unsafe { std::slice::from_raw_parts_mut(self.addr as *mut T, self.numel) }
    }
}

fn check_disjoint(spans: &[RawSpan]) -> Result<()> {
    for (i, a) in spans.iter().enumerate() {
        for b in &spans[i + 1..] {
            if a.addr < b.end() && b.addr < a.end() {
                return Err(Error::new(
                    Status::Aliasing,
                    format!("buffers->{} and buffers->{} overlap; every buffer must be distinct", a.name, b.name),
                ));
            }
        }
    }
    Ok(())
}

struct CheckedDtypes {
    param: DType,
    grad: DType,
    moments: DType,
    copy: Option<DType>,
}

fn check_dtypes(raw: &so_adam_buffers) -> Result<CheckedDtypes> {
    let required = |code: u32, field: &str| {
        dtype_from_raw(code, field)?.ok_or_else(|| Error::invalid(format!("{field} is SO_DTYPE_NONE")))
    };
    let param = required(raw.param_dtype, "buffers->param_dtype")?;
    let grad = required(raw.grad_dtype, "buffers->grad_dtype")?;
    let moments = required(raw.moment_dtype, "buffers->moment_dtype")?;
    if moments == DType::F16 {
        return Err(Error::unsupported("buffers->moment_dtype must be SO_DTYPE_F32 or SO_DTYPE_BF16, not f16"));
    }
    let copy = dtype_from_raw(raw.param_copy_dtype, "buffers->param_copy_dtype")?;
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

/// Validates a caller's buffer set and borrows it as typed slices; `None` when it is empty.
///
/// # Safety
/// Each pointer must be valid for `numel` elements of its dtype, and the buffers must not
/// be accessed by anything else while the result lives.
unsafe fn borrow_buffers<'a>(raw: &so_adam_buffers) -> Result<Option<AdamBuffers<'a>>> {
    let dtypes = check_dtypes(raw)?;
    if raw.numel == 0 {
        return Ok(None);
    }
    let n = raw.numel;
    let param = RawSpan::new("param", raw.param as usize, n, dtypes.param)?;
    let grad = RawSpan::new("grad", raw.grad as usize, n, dtypes.grad)?;
    let exp_avg = RawSpan::new("exp_avg", raw.exp_avg as usize, n, dtypes.moments)?;
    let exp_avg_sq = RawSpan::new("exp_avg_sq", raw.exp_avg_sq as usize, n, dtypes.moments)?;
    let copy = dtypes.copy.map(|d| RawSpan::new("param_copy", raw.param_copy as usize, n, d)).transpose()?;
    let mut spans = vec![param, grad, exp_avg, exp_avg_sq];
    spans.extend(copy);
    check_disjoint(&spans)?;

    // SAFETY: every span is non-NULL, aligned, in range and disjoint from the others;
    // validity and exclusivity are the caller's contract.
    unsafe {
        Ok(Some(AdamBuffers {
            param: match param.dtype {
                DType::F32 => ParamMut::F32(param.slice_mut::<f32>()),
                DType::Bf16 => ParamMut::Bf16(param.slice_mut::<bf16>()),
                DType::F16 => ParamMut::F16(param.slice_mut::<f16>()),
            },
            grad: grad.grad(),
            moments: match dtypes.moments {
                DType::Bf16 => MomentsMut::Bf16 { exp_avg: exp_avg.slice_mut(), exp_avg_sq: exp_avg_sq.slice_mut() },
                _ => MomentsMut::F32 { exp_avg: exp_avg.slice_mut(), exp_avg_sq: exp_avg_sq.slice_mut() },
            },
            copy_out: copy.map(|c| match c.dtype {
                DType::F16 => CopyOutMut::F16(c.slice_mut()),
                _ => CopyOutMut::Bf16(c.slice_mut()),
            }),
        }))
    }
}

/// Empty typed buffers, so that an empty call still validates everything else.
fn empty_typed<'a>() -> AdamBuffers<'a> {
    AdamBuffers {
        param: ParamMut::F32(&mut []),
        grad: GradRef::F32(&[]),
        moments: MomentsMut::F32 { exp_avg: &mut [], exp_avg_sq: &mut [] },
        copy_out: None,
    }
}

/// Empty buffers with the caller's param and moment dtypes, so that an empty rollback or
/// rescale still refuses the dtypes it cannot handle.
fn empty_typed_like<'a>(raw: &so_adam_buffers) -> Result<AdamBuffers<'a>> {
    let dtypes = check_dtypes(raw)?;
    let mut bufs = empty_typed();
    bufs.param = match dtypes.param {
        DType::F32 => ParamMut::F32(&mut []),
        DType::Bf16 => ParamMut::Bf16(&mut []),
        DType::F16 => ParamMut::F16(&mut []),
    };
    if dtypes.moments == DType::Bf16 {
        bufs.moments = MomentsMut::Bf16 { exp_avg: &mut [], exp_avg_sq: &mut [] };
    }
    Ok(bufs)
}
