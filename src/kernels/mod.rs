//! CPU Adam kernels: update, rollback and rescale of one step, over typed slices.
//!
//! Per element, all arithmetic in f32 (see `math.rs` for the exact sequence):
//! `g ← s·g`; Adam-L2 with `wd ≠ 0`: `g ← g + wd·p`; `m ← β1·m + (1-β1)·g`;
//! `v ← β2·v + (1-β2)·g²`; `denom = √v / √bc2 + ε`; AdamW: `p ← p·(1 - lr·wd)`;
//! then `p ← p - (lr/bc1)·m/denom`, with `bc1 = 1-β1^t`, `bc2 = 1-β2^t` computed in f64
//! and rounded once to f32 (both 1 without bias correction).

mod buffers;
mod driver;
pub mod dtype;
mod math;
mod pages;
pub mod pool;
mod simd;

pub use buffers::{AdamBuffers, CopyOutMut, Floats, FloatsMut, GradRef, MomentsMut, ParamMut};
pub use dtype::{DType, Elem};
pub use half::{bf16, f16};
pub use pages::advise_huge_pages;
pub use pool::{Isa, Pool, PoolOptions};

use crate::error::{Error, Result, Status};
use driver::{BLOCK, StepChunk, Stores, SumsqOut};
use math::{LaneOp, MemoryFloor, Rescale, Resolve, Rollback, StepConstants, Undo, Update};
use simd::Simd;

/// Calls `$body` with `$s` bound to the token of instruction set `$isa`: a pool's, or
/// `Isa::best()` for work on the calling thread (which must not queue behind optimizer work on
/// a pool).
macro_rules! with_isa {
    ($isa:expr, $s:ident => $body:expr) => {
        match $isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => {
                let $s = simd::avx512::Avx512::detect().ok_or_else(isa_vanished)?;
                $body
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                let $s = simd::avx2::Avx2::detect().ok_or_else(isa_vanished)?;
                $body
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => return Err(isa_vanished()),
            Isa::Portable => {
                let $s = simd::portable::Portable;
                $body
            }
        }
    };
}

/// How weight decay enters the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AdamMode {
    /// Decoupled decay (Loshchilov & Hutter): `p ← p·(1 - lr·wd)` before the update.
    AdamW,
    /// Classic Adam with L2 regularisation: `g ← g + wd·p` before the moments.
    L2,
}

/// Hyperparameters of one Adam step, as the caller states them (in double, like Python
/// floats). Each per-call constant of the f32 arithmetic is derived from these in f64 and
/// rounded once: so `beta2 = 0.999` gives `1 - beta2 = 1e-3` to f32 precision, not
/// `1 - 0.999f32`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamHyper {
    pub mode: AdamMode,
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub bias_correction: bool,
    /// The step being taken, counting from 1.
    pub step: u64,
}

impl Default for AdamHyper {
    /// `torch.optim.AdamW`'s defaults, first step.
    fn default() -> Self {
        AdamHyper {
            mode: AdamMode::AdamW,
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            bias_correction: true,
            step: 1,
        }
    }
}

impl AdamHyper {
    /// Checks every field; the message names the field and its value.
    pub fn validate(&self) -> Result<()> {
        fn check(name: &str, x: f64, ok: bool, range: &str) -> Result<()> {
            if ok && x.is_finite() {
                Ok(())
            } else {
                Err(Error::invalid(format!("{name} = {x} is out of range: it must be {range}")))
            }
        }
        check("lr", self.lr, self.lr >= 0.0, "finite and >= 0")?;
        check("beta1", self.beta1, (0.0..1.0).contains(&self.beta1), "in [0, 1)")?;
        check("beta2", self.beta2, (0.0..1.0).contains(&self.beta2), "in [0, 1)")?;
        check("eps", self.eps, self.eps >= 0.0, "finite and >= 0")?;
        check("weight_decay", self.weight_decay, self.weight_decay >= 0.0, "finite and >= 0")?;
        if self.step == 0 {
            return Err(Error::invalid("step = 0 is out of range: steps count from 1"));
        }
        Ok(())
    }

    /// `(1 - beta1^t, 1 - beta2^t)` computed in f64 and rounded once to f32; `(1, 1)`
    /// without bias correction.
    pub fn bias_corrections(&self) -> (f32, f32) {
        if !self.bias_correction {
            return (1.0, 1.0);
        }
        let t = self.step as f64;
        ((1.0 - self.beta1.powf(t)) as f32, (1.0 - self.beta2.powf(t)) as f32)
    }

    /// The f32 constants of one step as the device kernel takes them (see
    /// `StepConstants::for_device`): the same derivation as the CPU kernels'.
    pub fn device_constants(&self) -> ([f32; 9], bool) {
        StepConstants::new(self).for_device()
    }

    /// AdamW's decay factor `1 - lr * wd`, rounded once to f32 (1 for Adam-L2).
    pub fn decay_factor(&self) -> f32 {
        match self.mode {
            AdamMode::AdamW => (1.0 - self.lr * self.weight_decay) as f32,
            AdamMode::L2 => 1.0,
        }
    }

    /// Rollback and rescale divide by the betas and by AdamW's decay factor.
    fn validate_invertible(&self, what: &str) -> Result<()> {
        if self.beta1 == 0.0 || self.beta2 == 0.0 {
            return Err(Error::invalid(format!(
                "{what} needs beta1 > 0 and beta2 > 0 to recover the previous moments \
                 (got beta1 = {}, beta2 = {})",
                self.beta1, self.beta2
            )));
        }
        if self.decay_factor() <= 0.0 {
            return Err(Error::invalid(format!(
                "{what} needs 1 - lr * weight_decay > 0 to undo AdamW's decay (lr = {}, weight_decay = {})",
                self.lr, self.weight_decay
            )));
        }
        Ok(())
    }
}

/// Options of [`update`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct UpdateOptions {
    /// Multiplies every gradient element as it is loaded (after promotion to f32).
    pub grad_scale: f32,
    /// Refuse the step, touching nothing, when any scaled gradient element is inf or NaN.
    /// Costs a read-only pass over the gradient before the step.
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

fn isa_vanished() -> Error {
    Error::new(Status::Unsupported, "the pool's instruction set is not available on this CPU")
}

/// Runs a step-shaped pass writing `stores`; returns the sum of squares when `want_sumsq`.
fn run_step_pass<O: LaneOp>(
    pool: &Pool,
    op: &O,
    bufs: AdamBuffers<'_>,
    want_sumsq: bool,
    stores: Stores,
) -> Result<Option<f64>> {
    let n = bufs.numel()?;
    let mut partials = want_sumsq.then(|| vec![0.0f64; n.div_ceil(BLOCK)]);
    let pass =
        Pass { pool, op, ranges: chunk_ranges(n, pool.num_threads()), partials: partials.as_deref_mut(), stores };
    with_isa!(pool.isa(), s => pass.dispatch_param(s, bufs));
    Ok(partials.map(|p| p.iter().sum()))
}

const CHUNKS_PER_THREAD: usize = 4;

/// Splits `n` elements into at most `CHUNKS_PER_THREAD × threads` contiguous ranges of whole
/// blocks, at least `MIN_BLOCKS_PER_CHUNK` blocks each (small buffers are not worth waking
/// every thread). Several chunks per thread let the pool's work stealing route around a
/// thread that shares its core with the training thread: with one chunk each, the pass
/// would last as long as that thread's share.
fn chunk_ranges(n: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    const MIN_BLOCKS_PER_CHUNK: usize = 4;
    let blocks = n.div_ceil(BLOCK);
    let chunks = (blocks / MIN_BLOCKS_PER_CHUNK).clamp(1, CHUNKS_PER_THREAD * threads.max(1));
    let (base, extra) = (blocks / chunks, blocks % chunks);
    let mut ranges = Vec::with_capacity(chunks);
    let mut start_block = 0;
    for c in 0..chunks {
        let end_block = start_block + base + usize::from(c < extra);
        ranges.push(start_block * BLOCK..(end_block * BLOCK).min(n));
        start_block = end_block;
    }
    ranges
}

fn run_sumsq<S: Simd, G: Elem>(
    pool: &Pool,
    s: S,
    scale: f32,
    grad: &[G],
    partials: &mut [f64],
    ranges: &[std::ops::Range<usize>],
) {
    let mut jobs = Vec::with_capacity(ranges.len());
    let mut partials = partials;
    for range in ranges {
        let (mine, rest) = std::mem::take(&mut partials).split_at_mut(range.len().div_ceil(BLOCK));
        partials = rest;
        let g = &grad[range.clone()];
        jobs.push(move || s.sumsq_chunk(scale, g, mine));
    }
    pool.run_all(jobs);
}

/// One step-shaped pass being dispatched from dtype-erased buffers to typed chunks.
struct Pass<'p, O> {
    pool: &'p Pool,
    op: &'p O,
    ranges: Vec<std::ops::Range<usize>>,
    partials: Option<&'p mut [f64]>,
    stores: Stores,
}

impl<O: LaneOp> Pass<'_, O> {
    fn dispatch_param<S: Simd>(self, s: S, bufs: AdamBuffers<'_>) {
        let AdamBuffers { param, grad, moments, copy_out } = bufs;
        match param {
            ParamMut::F32(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
            ParamMut::Bf16(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
            ParamMut::F16(p) => self.dispatch_grad(s, p, grad, moments, copy_out),
        }
    }

    fn dispatch_grad<S: Simd, P: Elem>(
        self,
        s: S,
        p: &mut [P],
        grad: GradRef<'_>,
        moments: MomentsMut<'_>,
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match grad {
            GradRef::F32(g) => self.dispatch_moments(s, p, g, moments, copy_out),
            GradRef::Bf16(g) => self.dispatch_moments(s, p, g, moments, copy_out),
            GradRef::F16(g) => self.dispatch_moments(s, p, g, moments, copy_out),
        }
    }

    fn dispatch_moments<S: Simd, P: Elem, G: Elem>(
        self,
        s: S,
        p: &mut [P],
        g: &[G],
        moments: MomentsMut<'_>,
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match moments {
            MomentsMut::F32 { exp_avg, exp_avg_sq } => self.dispatch_copy(s, p, g, exp_avg, exp_avg_sq, copy_out),
            MomentsMut::Bf16 { exp_avg, exp_avg_sq } => self.dispatch_copy(s, p, g, exp_avg, exp_avg_sq, copy_out),
        }
    }

    fn dispatch_copy<S: Simd, P: Elem, G: Elem, M: Elem>(
        self,
        s: S,
        p: &mut [P],
        g: &[G],
        m: &mut [M],
        v: &mut [M],
        copy_out: Option<CopyOutMut<'_>>,
    ) {
        match copy_out {
            None => self.run::<S, P, G, M, bf16>(s, p, g, m, v, None),
            Some(CopyOutMut::Bf16(out)) => self.run(s, p, g, m, v, Some(out)),
            Some(CopyOutMut::F16(out)) => self.run(s, p, g, m, v, Some(out)),
        }
    }

    fn run<S: Simd, P: Elem, G: Elem, M: Elem, C: Elem>(
        self,
        s: S,
        mut p: &mut [P],
        mut g: &[G],
        mut m: &mut [M],
        mut v: &mut [M],
        mut out: Option<&mut [C]>,
    ) {
        let Pass { pool, op, ranges, mut partials, stores } = self;
        let mut jobs = Vec::with_capacity(ranges.len());
        for range in &ranges {
            let len = range.len();
            let (cp, rest) = std::mem::take(&mut p).split_at_mut(len);
            p = rest;
            let (cg, rest) = g.split_at(len);
            g = rest;
            let (cm, rest) = std::mem::take(&mut m).split_at_mut(len);
            m = rest;
            let (cv, rest) = std::mem::take(&mut v).split_at_mut(len);
            v = rest;
            let cout = match out.take() {
                Some(o) => {
                    let (mine, rest) = o.split_at_mut(len);
                    out = Some(rest);
                    Some(mine)
                }
                None => None,
            };
            let cpartials = match partials.take() {
                Some(all) => {
                    let (mine, rest) = all.split_at_mut(len.div_ceil(BLOCK));
                    partials = Some(rest);
                    Some(mine)
                }
                None => None,
            };
            let chunk = StepChunk { stores, p: cp, g: cg, m: cm, v: cv, out: cout, partials: cpartials };
            jobs.push(move || s.step_chunk(op, chunk));
        }
        pool.run_all(jobs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_the_buffer_in_whole_blocks() {
        for &(n, threads) in &[(0, 4), (1, 4), (BLOCK * 4 - 1, 16), (BLOCK * 100 + 17, 16), (BLOCK * 7, 3)] {
            let ranges = chunk_ranges(n, threads);
            assert!(ranges.len() <= CHUNKS_PER_THREAD * threads.max(1));
            let mut next = 0;
            for r in &ranges {
                assert_eq!(r.start, next);
                assert_eq!(r.start % BLOCK, 0);
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }
}
