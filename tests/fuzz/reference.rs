//! The plain reference: Adam steps with `superoffload::kernels::update` on the test's own
//! copies, the test's own f64 norm, and the element-wise bounds of `tests/common` for
//! sub-groups whose speculative step was rescaled, rolled back or redone.

use std::ops::Range;
use std::sync::OnceLock;

use superoffload::kernels::{self, AdamBuffers, AdamHyper, AdamMode, Floats, FloatsMut, Isa, MomentsMut, Pool};
use superoffload::session::GroupHparams;

use crate::common::{self, Consts, Store, T, exact, ref_rescale, ref_rollback, ref_update};

pub fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| common::pool(Isa::best(), 1))
}

pub fn hyper(g: &GroupHparams, mode: AdamMode, bias_correction: bool, step: u64) -> AdamHyper {
    AdamHyper {
        mode,
        lr: g.lr,
        beta1: g.beta1,
        beta2: g.beta2,
        eps: g.eps,
        weight_decay: g.weight_decay,
        bias_correction,
        step,
    }
}

pub fn floats_mut(s: &mut Store, r: Range<usize>) -> FloatsMut<'_> {
    match s {
        Store::F32(v) => FloatsMut::F32(&mut v[r]),
        Store::Bf16(v) => FloatsMut::Bf16(&mut v[r]),
        Store::F16(v) => FloatsMut::F16(&mut v[r]),
    }
}

pub fn floats(s: &Store, r: Range<usize>) -> Floats<'_> {
    match s {
        Store::F32(v) => Floats::F32(&v[r]),
        Store::Bf16(v) => Floats::Bf16(&v[r]),
        Store::F16(v) => Floats::F16(&v[r]),
    }
}

/// `dst[r] = src` or `dst[r] += src` (promotion to f32, one rounding into dst's dtype).
pub fn copy_into(dst: &mut Store, r: Range<usize>, src: &Store, accumulate: bool) {
    kernels::copy_into(floats_mut(dst, r), floats(src, 0..src.len()), accumulate, None).expect("reference copy");
}

/// One reference Adam step with gradient factor `factor`.
pub fn adam(hp: &AdamHyper, p: &mut Store, g: &Store, m: &mut Store, v: &mut Store, factor: f32) -> Result<(), String> {
    let moments = match (m, v) {
        (Store::F32(m), Store::F32(v)) => MomentsMut::F32 { exp_avg: m, exp_avg_sq: v },
        (Store::Bf16(m), Store::Bf16(v)) => MomentsMut::Bf16 { exp_avg: m, exp_avg_sq: v },
        _ => return Err("moments of two dtypes".into()),
    };
    let n = p.len();
    let bufs = AdamBuffers { param: floats_mut(p, 0..n), grad: floats(g, 0..g.len()), moments, copy_out: None };
    let opts = kernels::UpdateOptions { grad_scale: factor, ..Default::default() };
    kernels::update(pool(), hp, bufs, &opts).map(drop).map_err(|e| format!("reference update: {}", e.message))
}

/// The test's own sum of squares of `scale * g` (each product rounded to f32, as the
/// kernels scale gradients), summed in f64 in index order.
pub fn sumsq(g: &Store, scale: f32) -> f64 {
    (0..g.len())
        .map(|i| {
            let x = (g.get(i) as f32 * scale) as f64;
            x * x
        })
        .sum()
}

/// Relative agreement of two norms (both finite), or both non-finite.
pub fn norm_agrees(got: f64, want: f64, rel: f64) -> bool {
    if !want.is_finite() {
        return !got.is_finite();
    }
    (got - want).abs() <= rel * want.abs() || (got == want)
}

/// What happened to a sub-group whose speculative step was not kept as taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Approx {
    RolledBack,
    Rescaled,
    Redone,
}

/// Everything needed to bound the outcome of an approximate sub-group step.
#[derive(Clone, Debug)]
pub struct ApproxCheck {
    pub kind: Approx,
    pub spec_hp: AdamHyper,
    pub now_hp: AdamHyper,
    pub unscale: f32,
    pub factor: f32,
    pub p0: Store,
    pub m0: Store,
    pub v0: Store,
    /// Known pre-state elements (the others are not checked).
    pub known: Vec<bool>,
    pub g_spec: Store,
    pub g_final: Store,
    /// The state if the speculative step never ran (cancelled, or not submitted): one exact
    /// pass from the pre-state (or none for a skipped step).
    pub exact: [Store; 3],
}

/// Slack on the propagated bound (as `tests/session_reference.rs`).
pub const SLACK: f64 = 2.0;

impl ApproxCheck {
    /// The expected value and bound of (p, m, v) at element `i`; None where the bound is not
    /// finite (the element is not checked).
    pub fn expect(&self, i: usize) -> Option<[T; 3]> {
        if !self.known[i] {
            return None;
        }
        let (ks, kn) = (Consts::new(&self.spec_hp), Consts::new(&self.now_hp));
        let (p, m, v) = (exact(self.p0.get(i)), exact(self.m0.get(i)), exact(self.v0.get(i)));
        let g_spec = exact(self.g_spec.get(i));
        let unscale = self.unscale as f64;
        let spec = ref_update(&ks, unscale, p, g_spec, m, v);
        let out = match self.kind {
            Approx::RolledBack => {
                let back = ref_rollback(&ks, unscale, spec.p, g_spec, spec.m, spec.v);
                [T { v: p.v, e: back.p.e }, T { v: m.v, e: back.m.e }, T { v: v.v, e: back.v.e }]
            }
            Approx::Rescaled => {
                let via = ref_rescale(&ks, unscale, self.factor as f64, spec.p, g_spec, spec.m, spec.v);
                let direct = ref_update(&kn, self.factor as f64, p, g_spec, m, v);
                [T { v: direct.p.v, e: via.p.e }, T { v: direct.m.v, e: via.m.e }, T { v: direct.v.v, e: via.v.e }]
            }
            Approx::Redone => {
                let back = ref_rollback(&ks, unscale, spec.p, g_spec, spec.m, spec.v);
                let perturbed = |x: T, e: f64| T { v: x.v, e };
                let g = exact(self.g_final.get(i));
                let redo = ref_update(
                    &kn,
                    self.factor as f64,
                    perturbed(p, back.p.e),
                    g,
                    perturbed(m, back.m.e),
                    perturbed(v, back.v.e),
                );
                let direct = ref_update(&kn, self.factor as f64, p, g, m, v);
                [T { v: direct.p.v, e: redo.p.e }, T { v: direct.m.v, e: redo.m.e }, T { v: direct.v.v, e: redo.v.e }]
            }
        };
        // The f64 reference does not overflow where the kernels' f32 does (a squared
        // gradient above f32's range makes v inf there): such elements are not checked.
        let fits = |t: &T| t.v.is_finite() && t.e.is_finite() && t.v.abs() <= f32::MAX as f64;
        let g_final = self.g_final.get(i);
        let squares_fit = [g_spec.v, g_final].iter().all(|g| {
            (g * self.unscale as f64).powi(2) <= f32::MAX as f64 && (g * self.factor as f64).powi(2) <= f32::MAX as f64
        });
        (out.iter().all(fits) && squares_fit).then_some(out)
    }
}

/// `got` within `SLACK` times the bound of `want` (plus a tiny absolute floor).
pub fn within(got: f64, want: T) -> bool {
    (got - want.v).abs() <= SLACK * want.e + 1e-37
}
