//! The Adam math, written once for every instruction set.
//!
//! Each operation maps the lanes `(p, g, m, v)` of one vector block to new `(p, m, v)`.
//! The sequence of single-rounded operations here *is* the definition of our results:
//! every back-end executes exactly this sequence, so results are bit-identical across
//! back-ends and thread counts.

use super::hyper::{AdamHyper, AdamMode};
use super::lanes::{LaneOp, Lanes, Simd};

/// Per-call constants of one Adam step, in f32, derived once from the hyperparameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StepConstants {
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    eps: f32,
    /// `sqrt(1 - beta2^t)`, or 1 without bias correction.
    sqrt_bc2: f32,
    /// `lr / (1 - beta1^t)`, or `lr` without bias correction.
    step_size: f32,
    /// AdamW's `1 - lr * wd`; 1 for Adam-L2.
    decay: f32,
    /// Adam-L2's weight decay, folded into the gradient; `None` for AdamW or `wd == 0`.
    l2_decay: Option<f32>,
}

impl StepConstants {
    pub(crate) fn new(hp: &AdamHyper) -> Self {
        let (bc1, bc2) = hp.bias_corrections();
        let l2_decay = (hp.mode == AdamMode::L2 && hp.weight_decay != 0.0).then_some(hp.weight_decay as f32);
        StepConstants {
            beta1: hp.beta1 as f32,
            one_minus_beta1: (1.0 - hp.beta1) as f32,
            beta2: hp.beta2 as f32,
            one_minus_beta2: (1.0 - hp.beta2) as f32,
            eps: hp.eps as f32,
            sqrt_bc2: bc2.sqrt(),
            step_size: (hp.lr / bc1 as f64) as f32,
            decay: hp.decay_factor(),
            l2_decay,
        }
    }

    /// The constants in the order the device kernel takes them (`cuda/ptx.rs`):
    /// `beta1, 1-beta1, beta2, 1-beta2, eps, sqrt(bc2), lr/bc1, decay, wd (L2, else 0)`,
    /// and whether the L2 term applies.
    pub(crate) fn for_device(&self) -> ([f32; 9], bool) {
        let k = self;
        (
            [
                k.beta1,
                k.one_minus_beta1,
                k.beta2,
                k.one_minus_beta2,
                k.eps,
                k.sqrt_bc2,
                k.step_size,
                k.decay,
                k.l2_decay.unwrap_or(0.0),
            ],
            k.l2_decay.is_some(),
        )
    }

    /// `sqrt(v) / sqrt(bc2) + eps`. Dividing by exactly 1 (no bias correction, or a late
    /// step where `1 - beta2^t` rounds to 1) is skipped: same bits, one division less.
    #[inline(always)]
    fn denom<S: Simd>(&self, s: S, v: S::F) -> S::F {
        let root = s.sqrt(v);
        let corrected = if self.sqrt_bc2 == 1.0 { root } else { s.div(root, s.splat(self.sqrt_bc2)) };
        s.add(corrected, s.splat(self.eps))
    }

    /// Undoes AdamW's `p * (1 - lr * wd)`; dividing by exactly 1 is skipped (same bits).
    #[inline(always)]
    fn undo_decay<S: Simd>(&self, s: S, p: S::F) -> S::F {
        if self.decay == 1.0 { p } else { s.div(p, s.splat(self.decay)) }
    }

    /// The gradient that enters the moments: Adam-L2 adds `wd * p_prev`.
    #[inline(always)]
    fn effective_grad<S: Simd>(&self, s: S, scaled: S::F, p_prev: S::F) -> S::F {
        match self.l2_decay {
            Some(wd) => s.mul_add(s.splat(wd), p_prev, scaled),
            None => scaled,
        }
    }
}

/// One Adam step on `grad_scale * g`.
pub(crate) struct Update {
    pub k: StepConstants,
    pub grad_scale: f32,
}

impl LaneOp for Update {
    #[inline(always)]
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F> {
        let k = &self.k;
        let g = s.mul(g, s.splat(self.grad_scale));
        let ge = k.effective_grad(s, g, p);
        let m = s.mul_add(s.splat(k.one_minus_beta1), ge, s.mul(s.splat(k.beta1), m));
        let v = s.mul_add(s.splat(k.one_minus_beta2), s.mul(ge, ge), s.mul(s.splat(k.beta2), v));
        let u = s.div(m, k.denom(s, v));
        let p = s.mul_add(s.splat(-k.step_size), u, s.mul(p, s.splat(k.decay)));
        Lanes { p, m, v, g }
    }
}

/// The inverse of [`Update`] for the same gradient, scale and hyperparameters: the
/// parameter is recovered first, from the post-step moments, then the moments.
pub(crate) struct Rollback {
    pub k: StepConstants,
    pub grad_scale: f32,
}

impl LaneOp for Rollback {
    #[inline(always)]
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F> {
        let k = &self.k;
        let u = s.div(m, k.denom(s, v));
        let p = k.undo_decay(s, s.mul_add(s.splat(k.step_size), u, p));
        let g = s.mul(g, s.splat(self.grad_scale));
        let ge = k.effective_grad(s, g, p);
        let m = s.div(s.mul_add(s.splat(-k.one_minus_beta1), ge, m), s.splat(k.beta1));
        let v_raw = s.mul_add(s.splat(-k.one_minus_beta2), s.mul(ge, ge), v);
        let v = s.max0(s.div(v_raw, s.splat(k.beta2)));
        Lanes { p, m, v, g }
    }
}

/// Turns a step taken on `old_scale * g` into the step on `new_scale * g` from the same
/// starting state: the old gradient's contribution to the moments is taken out and the new
/// one's put in, each formed exactly as [`Update`] forms it (`g * scale`, then the L2 term),
/// so no square is of the raw, loss-scaled gradient (which could underflow or overflow f32
/// when the scales are far from 1). AdamW's decay of `p` does not depend on the gradient and
/// cancels; Adam-L2's term needs `p_prev`, recovered first.
pub(crate) struct Rescale {
    pub k: StepConstants,
    pub old_scale: f32,
    pub new_scale: f32,
}

impl LaneOp for Rescale {
    #[inline(always)]
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F> {
        let k = &self.k;
        let u_old = s.div(m, k.denom(s, v));
        let (ge_old, ge_new) = if k.l2_decay.is_some() {
            let p_prev = s.mul_add(s.splat(k.step_size), u_old, p);
            (
                k.effective_grad(s, s.mul(g, s.splat(self.old_scale)), p_prev),
                k.effective_grad(s, s.mul(g, s.splat(self.new_scale)), p_prev),
            )
        } else {
            (s.mul(g, s.splat(self.old_scale)), s.mul(g, s.splat(self.new_scale)))
        };
        let m_prior = s.mul_add(s.splat(-k.one_minus_beta1), ge_old, m);
        let m_new = s.mul_add(s.splat(k.one_minus_beta1), ge_new, m_prior);
        let v_prior = s.mul_add(s.splat(-k.one_minus_beta2), s.mul(ge_old, ge_old), v);
        let v_new = s.max0(s.mul_add(s.splat(k.one_minus_beta2), s.mul(ge_new, ge_new), v_prior));
        let u_new = s.div(m_new, k.denom(s, v_new));
        let p = s.mul_add(s.splat(-k.step_size), s.sub(u_new, u_old), p);
        Lanes { p, m: m_new, v: v_new, g: ge_new }
    }
}

/// How a speculative step is made final once the step's verdict is known.
pub(crate) enum Undo {
    /// The speculative step stands.
    Keep,
    Rollback(Rollback),
    Rescale(Rescale),
}

/// The whole life of a speculative step over its elements in one pass: the speculative
/// [`Update`] (where it was not applied yet), its resolution, and the update that replaces
/// it (after a rollback for changed hyperparameters). Each stage is the operation sequence
/// of its own pass, on the f32 values that pass would have stored, so one fused pass and
/// the passes taken one by one write the same bits.
pub(crate) struct Resolve {
    pub speculative: Option<Update>,
    pub undo: Undo,
    pub redo: Option<Update>,
}

impl LaneOp for Resolve {
    #[inline(always)]
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F> {
        let mut r = match &self.speculative {
            Some(op) => op.apply(s, p, g, m, v),
            None => Lanes { p, m, v, g },
        };
        r = match &self.undo {
            Undo::Keep => r,
            Undo::Rollback(op) => op.apply(s, r.p, g, r.m, r.v),
            Undo::Rescale(op) => op.apply(s, r.p, g, r.m, r.v),
        };
        match &self.redo {
            Some(op) => op.apply(s, r.p, g, r.m, r.v),
            None => r,
        }
    }
}

/// Adam-shaped memory floor for benchmarks: the same loads and stores as [`Update`]
/// (same dtypes, same copy-out) with trivial arithmetic.
pub(crate) struct MemoryFloor {
    pub grad_scale: f32,
}

impl LaneOp for MemoryFloor {
    #[inline(always)]
    fn apply<S: Simd>(&self, s: S, p: S::F, g: S::F, m: S::F, v: S::F) -> Lanes<S::F> {
        let g = s.mul(g, s.splat(self.grad_scale));
        Lanes { p: s.add(p, g), m: s.add(m, g), v: s.add(v, g), g }
    }
}
