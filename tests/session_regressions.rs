//! Named regression tests: each pins a defect found in `Session::step` (from outside, or
//! by the fuzzer in `tests/session_fuzz.rs`) and fails on the code that had it.

mod common;

use std::sync::Arc;

use common::*;
use superoffload::error::Status;
use superoffload::kernels::{DType, Floats, Isa};
use superoffload::session::{
    Borrowed, GroupHparams, NormSource, Session, SessionOptions, SkipReason, SliceDesc, Speculation, StepArgs,
    SubGroupDesc,
};

/// A session of one sub-group per entry of `sizes` (one slice each, named `s<i>`), over
/// masters the caller keeps alive.
fn session(masters: &mut [Vec<f32>], speculation: bool) -> Session {
    let s = Session::new(SessionOptions {
        pool: Some(Arc::new(pool(Isa::best(), 2))),
        speculation: if speculation { Speculation::On } else { Speculation::Off },
        ..SessionOptions::default()
    })
    .unwrap();
    s.add_group(GroupHparams::default()).unwrap();
    for (i, m) in masters.iter_mut().enumerate() {
        // SAFETY: the test keeps `masters` alive and unmoved for the session's lifetime.
        let master = unsafe { Borrowed::new("master", m.as_mut_ptr().cast(), m.len(), DType::F32) }.unwrap();
        let slices = vec![SliceDesc { name: format!("s{i}"), offset: 0, numel: m.len() }];
        s.add_subgroup(SubGroupDesc::new(0, master, slices)).unwrap();
    }
    s
}

fn step(s: &Session, grads: &[Vec<f32>], args: StepArgs) -> superoffload::session::StepResult {
    s.begin_step(Some(1.0), 1).unwrap();
    for (i, g) in grads.iter().enumerate() {
        s.grad_copy(i as u32, Floats::F32(g)).unwrap();
    }
    let t = s.step(args).unwrap();
    s.step_result(t, None).unwrap()
}

fn local(max_norm: f64) -> StepArgs {
    StepArgs { max_norm, norm: NormSource::Local, overflow: false }
}

/// Defect 1: `global_norm = -0.5` with `NormSource::Given` was accepted and gave a negative
/// clip coefficient.
#[test]
fn negative_given_norm_is_refused_and_changes_nothing() {
    let mut masters = vec![vec![0.5f32; 16]];
    let before = masters.clone();
    let s = session(&mut masters, true);
    s.begin_step(Some(1.0), 1).unwrap();
    s.grad_copy(0, Floats::F32(&[1.0; 16])).unwrap();
    let err = s.step(StepArgs { max_norm: 1.0, norm: NormSource::Given(-0.5), overflow: false }).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument, "{}", err.message);
    // The step is still open: a valid step() ends it.
    let t = s.step(StepArgs { max_norm: 1.0, norm: NormSource::Given(0.5), overflow: false }).unwrap();
    let r = s.step_result(t, None).unwrap();
    assert!(!r.skipped && r.clip_coef == 1.0);
    drop(s);
    assert_ne!(masters, before);
}

/// Defect 2: a clip coefficient that is 0 in f32 made the final pass fail while the step was
/// reported as taken; with speculation the speculative step stayed applied at step count 0.
#[test]
fn unusable_factor_skips_the_step_on_every_path() {
    for speculation in [true, false] {
        let mut masters = vec![vec![0.25f32; 16]];
        let before = masters.clone();
        let s = session(&mut masters, speculation);
        let r = step(&s, &[vec![1.0; 16]], local(1e-300));
        assert!(r.skipped, "speculation {speculation}: {r:?}");
        assert_eq!(r.skip_reason, SkipReason::UnusableFactor);
        assert_eq!(r.clip_coef, 1.0);
        assert_eq!(s.step_count(0).unwrap(), 0);
        s.wait(s.final_ticket(0).unwrap(), None).unwrap();
        let (m, v) = s.moments(0).unwrap();
        assert!(m.iter().chain(&v).all(|&x| x == 0.0), "moments untouched");
        // The next step is a first step, exactly as in a fresh session.
        let r2 = step(&s, &[vec![1.0; 16]], local(0.0));
        assert!(!r2.skipped);
        drop(s);
        let mut fresh = before.clone();
        let f = session(&mut fresh, speculation);
        step(&f, &[vec![1.0; 16]], local(0.0));
        drop(f);
        assert_eq!(masters, fresh, "speculation {speculation}");
    }
}

/// Defect 3: a step skipped for a NaN gradient reported the norm of the finite sub-groups.
#[test]
fn non_finite_gradient_reports_a_non_finite_norm() {
    let mut masters = vec![vec![0.0f32; 4], vec![0.0f32; 4]];
    let s = session(&mut masters, true);
    let r = step(&s, &[vec![3.0, 0.0, 0.0, 0.0], vec![f32::NAN, 4.0, 0.0, 0.0]], local(1.0));
    assert!(r.skipped);
    assert_eq!(r.skip_reason, SkipReason::NonFiniteGradient);
    assert!(!r.global_norm.is_finite(), "global norm {}", r.global_norm);
    let r = step(&s, &[vec![3.0, 0.0, 0.0, 0.0], vec![f32::INFINITY, 4.0, 0.0, 0.0]], local(1.0));
    assert_eq!(r.skip_reason, SkipReason::NonFiniteGradient);
    assert_eq!(r.global_norm, f64::INFINITY);
    let r = step(&s, &[vec![3.0, 0.0, 0.0, 0.0], vec![0.0, 4.0, 0.0, 0.0]], local(0.0));
    assert!(!r.skipped && r.global_norm == 5.0);
}

/// Found by the fuzzer in a long run (seeds 1796297534789846277 and 1796297534789852553): the
/// same squaring of the gradient as handed over (before unscaling) that overflows for large
/// loss scales loses precision for small ones: with a loss scale of 2^-40 and unscaled
/// gradients near 1e-9, the squares of the handed-over gradients (about 1e-42) are subnormal
/// in f32, and the rescaled moments end up to 3e-5 relative (hundreds of ulps) away from the
/// step taken without speculation, beyond the rounding bound of the rescale (it worked on the
/// handed-over, loss-scaled gradient with coefficients of the size of 1 / loss_scale). The
/// rescale now takes the old contribution out and puts the new one in, each formed as the
/// update forms it (`g * scale`).
#[test]
fn clipped_step_with_a_small_loss_scale_keeps_f32_precision() {
    let scale = 2f32.powi(-40);
    let grad: Vec<f32> = [1e-9f32, -2e-9, 3e-9, 0.5e-9].iter().map(|g| g * scale).collect();
    let state = |speculation: bool| {
        let mut masters = vec![vec![0.5f32; 4]];
        let s = session(&mut masters, speculation);
        s.begin_step(Some(scale), 1).unwrap();
        s.grad_copy(0, Floats::F32(&grad)).unwrap();
        let t = s.step(local(2e-9)).unwrap();
        let r = s.step_result(t, None).unwrap();
        assert!(!r.skipped && r.clip_coef < 1.0, "{r:?}");
        let (m, v) = s.moments(0).unwrap();
        drop(s);
        (masters.remove(0), m, v)
    };
    let (p0, m0, v0) = state(false);
    let (p1, m1, v1) = state(true);
    for (what, a, b) in [("p", &p0, &p1), ("m", &m0, &m1), ("v", &v0, &v1)] {
        for (x, y) in a.iter().zip(b.iter()) {
            assert!((x - y).abs() <= 1e-6 * x.abs().max(1e-30), "{what}: without speculation {a:?}, with {b:?}");
        }
    }
}
