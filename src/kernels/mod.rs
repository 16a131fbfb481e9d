//! CPU Adam kernels: update, rollback and rescale of one step, over typed slices.
//!
//! Per element, all arithmetic in f32 (see `math.rs` for the exact sequence):
//! `g ← s·g`; Adam-L2 with `wd ≠ 0`: `g ← g + wd·p`; `m ← β1·m + (1-β1)·g`;
//! `v ← β2·v + (1-β2)·g²`; `denom = √v / √bc2 + ε`; AdamW: `p ← p·(1 - lr·wd)`;
//! then `p ← p - (lr/bc1)·m/denom`, with `bc1 = 1-β1^t`, `bc2 = 1-β2^t` computed in f64
//! and rounded once to f32 (both 1 without bias correction).

mod buffers;
mod dispatch;
mod driver;
pub mod dtype;
mod hyper;
mod lanes;
mod math;
mod pages;
pub mod pool;
mod simd;

pub use buffers::{AdamBuffers, CopyOutMut, Floats, FloatsMut, GradRef, MomentsMut, ParamMut};
pub use dtype::{DType, Elem};
pub use half::{bf16, f16};
pub use hyper::{AdamHyper, AdamMode};
pub use pages::advise_huge_pages;
pub use pool::{Isa, Pool, PoolOptions};

use crate::error::{Error, Result, Status};
use dispatch::{chunk_ranges, run_step_pass, run_sumsq, with_isa};
use driver::BLOCK;
use lanes::{Simd, Stores, SumsqOut};
use math::{MemoryFloor, Rescale, Resolve, Rollback, StepConstants, Undo, Update};

/// The f32 constants of one step with `hp` as the device kernel takes them (see
/// `StepConstants::for_device`): the same derivation as the CPU kernels'.
pub fn device_constants(hp: &AdamHyper) -> ([f32; 9], bool) {
    StepConstants::new(hp).for_device()
}

/// Options of [`update`]. Fields as
/// [`so_update_options`](crate::ffi::kernels::so_update_options) documents them, in Rust
/// types; `grad_sumsq` is the Rust API's own (C asks through `so_adam_update`'s
/// `out_grad_sumsq`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateOptions {
    pub grad_scale: f32,
    pub check_finite: bool,
    /// Also compute the f64 sum of squares of the scaled gradient.
    pub grad_sumsq: bool,
}

impl Default for UpdateOptions {
    fn default() -> Self {
        UpdateOptions { grad_scale: 1.0, check_finite: false, grad_sumsq: false }
    }
}

/// What [`update`] measured along the way.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UpdateReport {
    /// Sum of squares of the scaled gradient, when asked for. It is the same for every
    /// instruction set and thread count.
    pub grad_sumsq: Option<f64>,
}

fn check_scale(name: &str, scale: f32) -> Result<()> {
    if scale.is_finite() && scale > 0.0 {
        Ok(())
    } else {
        Err(Error::invalid(format!("{name} = {scale} is out of range: it must be finite and > 0")))
    }
}

/// One Adam step in one pass over memory. Every dtype combination is supported.
///
/// With `check_finite`, a non-finite scaled gradient returns `Status::NonFinite` and leaves
/// every buffer bit for bit as it was.
pub fn update(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, opts: &UpdateOptions) -> Result<UpdateReport> {
    hp.validate()?;
    check_scale("grad_scale", opts.grad_scale)?;
    bufs.numel()?;
    let prechecked = if opts.check_finite {
        let sumsq = grad_sumsq(pool, bufs.grad, opts.grad_scale)?;
        if !sumsq.is_finite() {
            return Err(Error::new(
                Status::NonFinite,
                format!(
                    "the gradient has an inf or NaN element after scaling by {}; nothing was modified",
                    opts.grad_scale
                ),
            ));
        }
        Some(sumsq)
    } else {
        None
    };
    let op = Update { k: StepConstants::new(hp), grad_scale: opts.grad_scale };
    let fused_sumsq = opts.grad_sumsq && prechecked.is_none();
    let fused = run_step_pass(pool, &op, bufs, fused_sumsq, Stores::All)?;
    Ok(UpdateReport { grad_sumsq: if opts.grad_sumsq { prechecked.or(fused) } else { None } })
}

/// The first half of [`update`] split in two passes: writes the parameter's copy as
/// [`update`] would, and nothing else. [`update_state`] with the same arguments then writes
/// the parameter and the moments as [`update`] would: together they write exactly its bits.
/// The copy is what the device needs for the next forward; it reads what [`update`] reads
/// and writes a fraction of it. Needs [`can_split_update`].
pub fn update_copy(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, grad_scale: f32) -> Result<()> {
    split_update(pool, hp, bufs, grad_scale, Stores::Copy)
}

/// The second half of [`update_copy`]: the parameter and the moments of the same step, from
/// the buffers as [`update_copy`] found them (it changed none of them). The copy is not
/// written, and need not be given.
pub fn update_state(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, grad_scale: f32) -> Result<()> {
    split_update(pool, hp, bufs, grad_scale, Stores::State)
}

/// Whether [`update_copy`] and [`update_state`] can split a step over `bufs`: there is a
/// copy to write, rounded from the f32 parameter (a low-precision parameter's copy is
/// rounded from the parameter as stored, which the first pass does not write).
pub fn can_split_update(bufs: &AdamBuffers<'_>) -> bool {
    bufs.param.dtype() == DType::F32 && bufs.copy_out.is_some()
}

fn split_update(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, grad_scale: f32, stores: Stores) -> Result<()> {
    hp.validate()?;
    check_scale("grad_scale", grad_scale)?;
    // The state pass writes no copy: it needs the f32 parameter alone.
    let splits = bufs.param.dtype() == DType::F32 && (stores == Stores::State || bufs.copy_out.is_some());
    if !splits {
        return Err(Error::unsupported(format!(
            "a split update needs an f32 parameter and a copy to write; got a {} parameter {} a copy",
            bufs.param.dtype().name(),
            if bufs.copy_out.is_some() { "and" } else { "without" }
        )));
    }
    bufs.numel()?;
    run_step_pass(pool, &Update { k: StepConstants::new(hp), grad_scale }, bufs, false, stores).map(drop)
}

/// Undoes one [`update`] taken with the same gradient, `grad_scale` and hyperparameters
/// (including `step`). Needs f32 param and f32 moments.
///
/// In exact arithmetic this is the inverse; in f32 each recovered value is within a few
/// ulps of the terms that formed it (the bounds are in the tests). `v` is clamped at 0,
/// a NaN stays NaN.
pub fn rollback(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, grad_scale: f32) -> Result<()> {
    hp.validate()?;
    hp.validate_invertible("rollback")?;
    check_scale("grad_scale", grad_scale)?;
    require_master_weights("rollback", &bufs)?;
    bufs.numel()?;
    run_step_pass(pool, &Rollback { k: StepConstants::new(hp), grad_scale }, bufs, false, Stores::All).map(drop)
}

/// Turns a step taken on `old_scale · g` into the step on `new_scale · g` from the same
/// starting state, in one pass. A rescale to the same scale changes nothing. Needs f32
/// param and f32 moments.
pub fn rescale(pool: &Pool, hp: &AdamHyper, bufs: AdamBuffers<'_>, old_scale: f32, new_scale: f32) -> Result<()> {
    hp.validate()?;
    check_scale("old_scale", old_scale)?;
    check_scale("new_scale", new_scale)?;
    require_master_weights("rescale", &bufs)?;
    bufs.numel()?;
    if old_scale == new_scale {
        return Ok(());
    }
    run_step_pass(pool, &Rescale { k: StepConstants::new(hp), old_scale, new_scale }, bufs, false, Stores::All)
        .map(drop)
}

/// How the step a speculative [`update`] took (with `hp`, on `scale · g`) is made final
/// once the step's factor is known.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Resolution {
    /// The step stands: the final factor is the speculative one.
    Keep,
    /// The step becomes the step on `factor · g` ([`rescale`]).
    Rescale(f32),
    /// The step is undone ([`rollback`]): the optimizer step was skipped.
    Rollback,
    /// The step is undone and the step with other hyperparameters taken instead.
    Redo { hp: AdamHyper, scale: f32 },
}

/// Makes a speculative step final: `resolution` applied to the buffers after the speculative
/// [`update`] with `hp` on `scale · g`. With `applied`, the buffers already hold that update;
/// without, it is computed in the same pass. Either way the result is bit for bit that of
/// [`update`] followed by the resolution's own pass ([`rescale`], [`rollback`], or
/// [`rollback`] and [`update`]): where a speculative pass ran is a matter of timing, what the
/// buffers end up holding is not. Needs f32 param and f32 moments.
pub fn resolve(
    pool: &Pool,
    hp: &AdamHyper,
    scale: f32,
    resolution: Resolution,
    applied: bool,
    bufs: AdamBuffers<'_>,
) -> Result<()> {
    hp.validate()?;
    check_scale("grad_scale", scale)?;
    require_master_weights("resolve", &bufs)?;
    bufs.numel()?;
    let k = StepConstants::new(hp);
    let (undo, redo) = match resolution {
        Resolution::Keep => (Undo::Keep, None),
        Resolution::Rescale(factor) => {
            check_scale("new_scale", factor)?;
            // A rescale to the same scale changes nothing (as `rescale` does).
            let undo = if factor == scale {
                Undo::Keep
            } else {
                Undo::Rescale(Rescale { k, old_scale: scale, new_scale: factor })
            };
            (undo, None)
        }
        Resolution::Rollback => {
            hp.validate_invertible("rollback")?;
            (Undo::Rollback(Rollback { k, grad_scale: scale }), None)
        }
        Resolution::Redo { hp: redo_hp, scale: redo_scale } => {
            hp.validate_invertible("rollback")?;
            redo_hp.validate()?;
            check_scale("new_scale", redo_scale)?;
            (
                Undo::Rollback(Rollback { k, grad_scale: scale }),
                Some(Update { k: StepConstants::new(&redo_hp), grad_scale: redo_scale }),
            )
        }
    };
    let speculative = (!applied).then_some(Update { k, grad_scale: scale });
    if speculative.is_none() && matches!(undo, Undo::Keep) && redo.is_none() {
        return Ok(());
    }
    run_step_pass(pool, &Resolve { speculative, undo, redo }, bufs, false, Stores::All).map(drop)
}

/// f64 sum of squares of `scale · g`, the same for every instruction set and thread count
/// (and equal to what [`update`] reports for the same gradient and scale).
pub fn grad_sumsq(pool: &Pool, grad: GradRef<'_>, scale: f32) -> Result<f64> {
    check_scale("scale", scale)?;
    let n = grad.len();
    let mut partials = vec![0.0f64; n.div_ceil(BLOCK)];
    let ranges = chunk_ranges(n, pool.num_threads());
    with_isa!(pool.isa(), s => match grad {
        GradRef::F32(g) => run_sumsq(pool, s, scale, g, &mut partials, &ranges),
        GradRef::Bf16(g) => run_sumsq(pool, s, scale, g, &mut partials, &ranges),
        GradRef::F16(g) => run_sumsq(pool, s, scale, g, &mut partials, &ranges),
    });
    Ok(partials.iter().sum())
}

/// The Adam-shaped memory floor: reads and writes exactly what [`update`] does for the same
/// buffers, with trivial arithmetic. For benchmarks.
pub fn memory_floor(pool: &Pool, bufs: AdamBuffers<'_>, grad_scale: f32) -> Result<()> {
    check_scale("grad_scale", grad_scale)?;
    bufs.numel()?;
    run_step_pass(pool, &MemoryFloor { grad_scale }, bufs, false, Stores::All).map(drop)
}

/// Copies `src` into `dst` (or adds it, with `accumulate`), converting between dtypes:
/// promotion to f32, the f32 sum, one rounding to nearest even into `dst`'s dtype. With
/// `sumsq_scale`, also returns the f64 sum of squares of `scale · dst` as stored, equal to
/// [`grad_sumsq`] of `dst` afterwards. Runs on the calling thread.
pub fn copy_into(
    dst: FloatsMut<'_>,
    src: Floats<'_>,
    accumulate: bool,
    sumsq_scale: Option<f32>,
) -> Result<Option<f64>> {
    if dst.len() != src.len() {
        return Err(Error::invalid(format!("copy of {} elements into {}", src.len(), dst.len())));
    }
    if let Some(scale) = sumsq_scale {
        check_scale("scale", scale)?;
    }
    let mut partials = sumsq_scale.map(|_| vec![0.0f64; dst.len().div_ceil(BLOCK)]);
    fn with_src<S: Simd, D: Elem>(s: S, dst: &mut [D], src: Floats<'_>, accumulate: bool, out: Option<SumsqOut<'_>>) {
        match src {
            Floats::F32(g) => s.copy_chunk(dst, g, accumulate, out),
            Floats::Bf16(g) => s.copy_chunk(dst, g, accumulate, out),
            Floats::F16(g) => s.copy_chunk(dst, g, accumulate, out),
        }
    }
    let out = sumsq_scale.zip(partials.as_deref_mut()).map(|(scale, partials)| SumsqOut { scale, partials });
    with_isa!(Isa::best(), s => match dst {
        FloatsMut::F32(d) => with_src(s, d, src, accumulate, out),
        FloatsMut::Bf16(d) => with_src(s, d, src, accumulate, out),
        FloatsMut::F16(d) => with_src(s, d, src, accumulate, out),
    });
    Ok(partials.map(|p| p.iter().sum()))
}

/// [`copy_into`] on `pool`'s threads, without accumulating or summing: for conversions on
/// the optimizer's critical path (a kept speculative step's weights, published piece by
/// piece from the master weights), which on one thread take longer than an update pass over
/// the same elements on the pool. The same bits as [`copy_into`].
pub fn convert(pool: &Pool, dst: FloatsMut<'_>, src: Floats<'_>) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::invalid(format!("conversion of {} elements into {}", src.len(), dst.len())));
    }
    fn run<S: Simd, D: Elem, G: Elem>(pool: &Pool, s: S, mut dst: &mut [D], mut src: &[G]) {
        let ranges = chunk_ranges(dst.len(), pool.num_threads());
        let mut jobs = Vec::with_capacity(ranges.len());
        for range in ranges {
            let (d, rest) = std::mem::take(&mut dst).split_at_mut(range.len());
            dst = rest;
            let (g, rest) = src.split_at(range.len());
            src = rest;
            jobs.push(move || s.copy_chunk(d, g, false, None));
        }
        pool.run_all(jobs);
    }
    fn with_src<S: Simd, D: Elem>(pool: &Pool, s: S, dst: &mut [D], src: Floats<'_>) {
        match src {
            Floats::F32(g) => run(pool, s, dst, g),
            Floats::Bf16(g) => run(pool, s, dst, g),
            Floats::F16(g) => run(pool, s, dst, g),
        }
    }
    with_isa!(pool.isa(), s => match dst {
        FloatsMut::F32(d) => with_src(pool, s, d, src),
        FloatsMut::Bf16(d) => with_src(pool, s, d, src),
        FloatsMut::F16(d) => with_src(pool, s, d, src),
    });
    Ok(())
}

/// [`grad_sumsq`] on the calling thread (same result bit for bit).
pub fn grad_sumsq_here(grad: GradRef<'_>, scale: f32) -> Result<f64> {
    check_scale("scale", scale)?;
    let mut partials = vec![0.0f64; grad.len().div_ceil(BLOCK)];
    with_isa!(Isa::best(), s => match grad {
        GradRef::F32(g) => s.sumsq_chunk(scale, g, &mut partials),
        GradRef::Bf16(g) => s.sumsq_chunk(scale, g, &mut partials),
        GradRef::F16(g) => s.sumsq_chunk(scale, g, &mut partials),
    });
    Ok(partials.iter().sum())
}

fn require_master_weights(what: &str, bufs: &AdamBuffers<'_>) -> Result<()> {
    let (p, m) = (bufs.param.dtype(), bufs.moments.dtype());
    if p != DType::F32 || m != DType::F32 {
        return Err(Error::unsupported(format!(
            "{what} needs f32 param and f32 moments (the master-weight case); got param {} and moments {}",
            p.name(),
            m.name()
        )));
    }
    Ok(())
}
