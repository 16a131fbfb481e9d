//! Rollback and rescale: round trips and direct steps agree with the f64 reference within
//! the propagated f32 rounding bounds; clamping, NaN and refusals behave as documented.

mod common;

use common::*;
use superoffload::error::Status;
use superoffload::kernels::{self, AdamHyper, AdamMode, DType, Isa, UpdateOptions};

fn modes_and_corrections() -> Vec<(AdamMode, bool, f64)> {
    let mut all = Vec::new();
    for mode in [AdamMode::AdamW, AdamMode::L2] {
        for bias_correction in [true, false] {
            for wd in [0.0, 0.1] {
                all.push((mode, bias_correction, wd));
            }
        }
    }
    all
}

/// update then rollback returns the starting state within the bound of both passes.
#[test]
fn rollback_undoes_update_within_rounding() {
    let mut rng = Rng::new(20);
    let pool = pool(Isa::best(), 3);
    for (mode, bias_correction, weight_decay) in modes_and_corrections() {
        for grad in [DType::F32, DType::Bf16] {
            for (step, warm) in [(1, false), (2, true), (50, true)] {
                let hp = AdamHyper { mode, bias_correction, weight_decay, step, ..random_hyper(&mut rng, mode) };
                let scale = [1.0f32, 0.25][rng.below(2)];
                let start = State::random(&mut rng, 3001, (DType::F32, grad, DType::F32, None), warm, 1.0);
                let mut state = start.clone();
                let opts = UpdateOptions { grad_scale: scale, ..UpdateOptions::default() };
                kernels::update(&pool, &hp, state.buffers(), &opts).unwrap();
                kernels::rollback(&pool, &hp, state.buffers(), scale).unwrap();

                let k = Consts::new(&hp);
                for i in 0..start.len() {
                    let (p, g, m, v) =
                        (exact(start.p.get(i)), exact(start.g.get(i)), exact(start.m.get(i)), exact(start.v.get(i)));
                    let fwd = ref_update(&k, scale as f64, p, g, m, v);
                    let back = ref_rollback(&k, scale as f64, fwd.p, g, fwd.m, fwd.v);
                    let ctx = format!("{hp:?} grad {grad:?}");
                    // In exact arithmetic back == start; the bound is both passes' rounding.
                    assert_close(&format!("p {ctx}"), i, state.p.get(i), T { v: p.v, e: back.p.e }, 2.0);
                    assert_close(&format!("m {ctx}"), i, state.m.get(i), T { v: m.v, e: back.m.e }, 2.0);
                    assert_close(&format!("v {ctx}"), i, state.v.get(i), T { v: v.v, e: back.v.e }, 2.0);
                }
            }
        }
    }
}

#[test]
fn rollback_clamps_v_at_zero_and_keeps_nan() {
    let pool = pool(Isa::best(), 1);
    let hp = AdamHyper { beta2: 0.999, ..AdamHyper::default() };
    // v one ulp below (1 - b2) g^2, as a first step's rounding can leave it: undoing it
    // in f32 goes a hair below zero.
    let n = 4096;
    let one_minus_beta2 = (1.0 - hp.beta2) as f32;
    let grads: Vec<f32> = (0..n).map(|i| 1.0 + i as f32 * 1e-3).collect();
    let mut p = vec![0.5f32; n];
    let mut m: Vec<f32> = grads.iter().map(|g| 0.1 * g).collect();
    let mut v: Vec<f32> = grads.iter().map(|g| f32::from_bits((one_minus_beta2 * g * g).to_bits() - 1)).collect();
    v[7] = f32::NAN;
    let bufs = kernels::AdamBuffers {
        param: kernels::ParamMut::F32(&mut p),
        grad: kernels::GradRef::F32(&grads),
        moments: kernels::MomentsMut::F32 { exp_avg: &mut m, exp_avg_sq: &mut v },
        copy_out: None,
    };
    kernels::rollback(&pool, &hp, bufs, 1.0).unwrap();
    assert!(v[7].is_nan(), "NaN stays NaN");
    let clamped = v.iter().enumerate().filter(|&(i, x)| i != 7 && x.to_bits() == 0).count();
    assert!(clamped > n / 2, "recovered v below zero is clamped to +0 ({clamped} of {n})");
    assert!(v.iter().enumerate().all(|(i, &x)| i == 7 || x >= 0.0), "no negative v");
}

#[test]
fn rescale_equals_the_direct_step_within_rounding() {
    let mut rng = Rng::new(21);
    let pool = pool(Isa::best(), 3);
    for (mode, bias_correction, weight_decay) in modes_and_corrections() {
        for grad in [DType::F32, DType::Bf16] {
            for (step, warm) in [(1, false), (7, true)] {
                for (old, new) in [(1.0f32, 0.5f32), (1.0, 0.01), (0.25, 1.0)] {
                    let hp = AdamHyper { mode, bias_correction, weight_decay, step, ..random_hyper(&mut rng, mode) };
                    let start =
                        State::random(&mut rng, 2049, (DType::F32, grad, DType::F32, Some(DType::Bf16)), warm, 1.0);
                    let mut rescaled = start.clone();
                    kernels::update(
                        &pool,
                        &hp,
                        rescaled.buffers(),
                        &UpdateOptions { grad_scale: old, ..Default::default() },
                    )
                    .unwrap();
                    kernels::rescale(&pool, &hp, rescaled.buffers(), old, new).unwrap();
                    let mut direct = start.clone();
                    kernels::update(
                        &pool,
                        &hp,
                        direct.buffers(),
                        &UpdateOptions { grad_scale: new, ..Default::default() },
                    )
                    .unwrap();

                    let k = Consts::new(&hp);
                    let mut unbounded = 0;
                    for i in 0..start.len() {
                        let (p, g, m, v) = (
                            exact(start.p.get(i)),
                            exact(start.g.get(i)),
                            exact(start.m.get(i)),
                            exact(start.v.get(i)),
                        );
                        let first = ref_update(&k, old as f64, p, g, m, v);
                        let via = ref_rescale(&k, old as f64, new as f64, first.p, g, first.m, first.v);
                        let want = ref_update(&k, new as f64, p, g, m, v);
                        // Where v cancels below its own rounding (first step, L2 decay, large
                        // scale change), f32 cannot tell v_new from 0: the bound is infinite.
                        unbounded += usize::from(!via.p.e.is_finite());
                        let ctx = format!("{hp:?} grad {grad:?} {old}->{new}");
                        // Exact math: via == want. Bound: rounding along the rescale path.
                        assert_close(&format!("p {ctx}"), i, rescaled.p.get(i), T { v: want.p.v, e: via.p.e }, 2.0);
                        assert_close(&format!("m {ctx}"), i, rescaled.m.get(i), T { v: want.m.v, e: via.m.e }, 2.0);
                        assert_close(&format!("v {ctx}"), i, rescaled.v.get(i), T { v: want.v.v, e: via.v.e }, 2.0);
                        // And the direct step is on its own reference.
                        assert_close(&format!("direct p {ctx}"), i, direct.p.get(i), want.p, 2.0);
                    }
                    assert!(unbounded * 50 <= start.len(), "{unbounded} of {} elements ill-conditioned", start.len());
                    let copy = rescaled.out.as_ref().unwrap();
                    for i in 0..start.len() {
                        assert_eq!(copy.bits(i), round_to(DType::Bf16, rescaled.p.get(i) as f32), "rescale copy-out");
                    }
                }
            }
        }
    }
}

#[test]
fn rescale_to_the_same_scale_changes_nothing() {
    let mut rng = Rng::new(22);
    let pool = pool(Isa::best(), 2);
    let mut state = State::random(&mut rng, 999, (DType::F32, DType::Bf16, DType::F32, None), true, 1.0);
    // -0.0 moments would lose their sign through `m + 0 * g`; a same-scale rescale must not.
    state.m.set(3, -0.0);
    let before = state.clone();
    kernels::rescale(&pool, &AdamHyper::default(), state.buffers(), 0.5, 0.5).unwrap();
    assert!(state == before);
}

#[test]
fn rollback_and_rescale_refuse_what_they_cannot_invert() {
    let mut rng = Rng::new(23);
    let pool = pool(Isa::best(), 1);
    for dtypes in [(DType::Bf16, DType::F32, DType::F32, None), (DType::F32, DType::F32, DType::Bf16, None)] {
        let mut state = State::random(&mut rng, 64, dtypes, true, 1.0);
        let before = state.clone();
        let err = kernels::rollback(&pool, &AdamHyper::default(), state.buffers(), 1.0).unwrap_err();
        assert_eq!(err.status, Status::Unsupported);
        assert!(err.message.contains("f32 param and f32 moments"), "{}", err.message);
        let err = kernels::rescale(&pool, &AdamHyper::default(), state.buffers(), 1.0, 0.5).unwrap_err();
        assert_eq!(err.status, Status::Unsupported);
        assert!(state == before);
    }
    let mut state = State::random(&mut rng, 64, (DType::F32, DType::F32, DType::F32, None), true, 1.0);
    let before = state.clone();
    for hp in [
        AdamHyper { beta1: 0.0, ..AdamHyper::default() },
        AdamHyper { beta2: 0.0, ..AdamHyper::default() },
        AdamHyper { lr: 10.0, weight_decay: 0.1, ..AdamHyper::default() },
    ] {
        let err = kernels::rollback(&pool, &hp, state.buffers(), 1.0).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{hp:?}");
    }
    assert!(state == before);
}
