//! `update` against the f64 reference, element by element, for every dtype combination,
//! both modes, with and without bias correction and weight decay, on every ISA.

mod common;

use common::*;
use superoffload::kernels::{self, AdamHyper, AdamMode, DType, UpdateOptions};

/// The reference step of element `i` of `before`, with the gradient times `scale`.
fn ref_update_of(k: &Consts, scale: f64, before: &State, i: usize) -> Ref {
    let (p, g, m, v) = (before.p.get(i), before.g.get(i), before.m.get(i), before.v.get(i));
    ref_update(k, scale, exact(p), exact(g), exact(m), exact(v))
}

/// Runs one update and checks every element of every output against the reference.
fn check_update(
    rng: &mut Rng,
    isa: superoffload::kernels::Isa,
    n: usize,
    dtypes: (DType, DType, DType, Option<DType>),
) {
    let pool = pool(isa, 3);
    for mode in [AdamMode::AdamW, AdamMode::L2] {
        let hp = random_hyper(rng, mode);
        let scale = [1.0, 0.5, 1.0 / 1024.0, 3.0][rng.below(4)] as f32;
        let warm = rng.below(3) != 0;
        let before = State::random(rng, n, dtypes, warm, 0.5);
        let mut after = before.clone();
        let opts = UpdateOptions { grad_scale: scale, check_finite: false, grad_sumsq: true };
        let report = kernels::update(&pool, &hp, after.buffers(), &opts).unwrap();

        let k = Consts::new(&hp);
        let mut sumsq = 0.0f64;
        for i in 0..n {
            let r = ref_update_of(&k, scale as f64, &before, i);
            let ctx = format!("{isa:?} {dtypes:?} {hp:?} scale {scale} n {n}");
            assert_close(&format!("p {ctx}"), i, after.p.get(i), store(dtypes.0, r.p), 2.0);
            assert_close(&format!("m {ctx}"), i, after.m.get(i), store(dtypes.2, r.m), 2.0);
            assert_close(&format!("v {ctx}"), i, after.v.get(i), store(dtypes.2, r.v), 2.0);
            if let Some(out) = &after.out {
                // The copy is the stored parameter rounded to nearest even, bit for bit.
                let p_new = after.p.get(i) as f32;
                assert_eq!(out.bits(i), round_to(out.dtype(), p_new), "copy-out[{i}] {ctx}");
            }
            let gs = (before.g.get(i) as f32 * scale) as f64;
            sumsq += gs * gs;
        }
        let reported = report.grad_sumsq.unwrap();
        assert!((reported - sumsq).abs() <= 1e-12 * sumsq.max(1e-300), "sumsq {reported} vs {sumsq}");
        assert!(after.g == before.g, "the gradient is read only");
    }
}

#[test]
fn update_matches_f64_reference_for_every_dtype_combination() {
    let mut rng = Rng::new(1);
    for isa in supported_isas() {
        for dtypes in all_dtype_combinations() {
            for n in [1, 15, 17, 33, 1000] {
                check_update(&mut rng, isa, n, dtypes);
            }
        }
    }
}

#[test]
fn update_matches_reference_across_chunks_and_blocks() {
    let mut rng = Rng::new(2);
    for isa in supported_isas() {
        for dtypes in [
            (DType::F32, DType::F32, DType::F32, None),
            (DType::F32, DType::Bf16, DType::F32, Some(DType::Bf16)),
            (DType::Bf16, DType::F16, DType::Bf16, Some(DType::F16)),
        ] {
            check_update(&mut rng, isa, 8192 * 9 + 5, dtypes);
        }
    }
}

#[test]
fn several_steps_stay_on_the_reference() {
    // Each step is checked from the kernel's previous output, so bounds stay one-step.
    let mut rng = Rng::new(3);
    let pool = pool(superoffload::kernels::Isa::best(), 2);
    let mut hp = AdamHyper { weight_decay: 0.1, ..AdamHyper::default() };
    let mut state = State::random(&mut rng, 4099, (DType::F32, DType::Bf16, DType::F32, Some(DType::Bf16)), false, 1.0);
    for step in 1..=20 {
        hp.step = step;
        let before = state.clone();
        kernels::update(&pool, &hp, state.buffers(), &UpdateOptions::default()).unwrap();
        let k = Consts::new(&hp);
        for i in 0..state.len() {
            let r = ref_update_of(&k, 1.0, &before, i);
            assert_close(&format!("p step {step}"), i, state.p.get(i), r.p, 2.0);
            assert_close(&format!("v step {step}"), i, state.v.get(i), r.v, 2.0);
        }
        // A fresh gradient for the next step.
        state.g =
            Store::from_f64(DType::Bf16, (0..state.len()).map(|_| rng.normalish(1.0)).collect::<Vec<_>>().into_iter());
    }
}

/// The bound must be tight enough to catch a plausible mistake, or the tests above prove
/// nothing: dropping bias correction, or adding eps before the bias correction, fails it.
#[test]
fn reference_bounds_reject_wrong_formulas() {
    let mut rng = Rng::new(4);
    let pool = pool(superoffload::kernels::Isa::best(), 1);
    let hp = AdamHyper { step: 3, eps: 1e-3, ..AdamHyper::default() };
    let before = State::random(&mut rng, 257, (DType::F32, DType::F32, DType::F32, None), true, 1e-3);
    let mut after = before.clone();
    kernels::update(&pool, &hp, after.buffers(), &UpdateOptions::default()).unwrap();

    // Adding eps before dividing by sqrt(bc2) is the same as a larger eps.
    let eps_first = hp.eps / (hp.bias_corrections().1 as f64).sqrt();
    let wrong_hps = [AdamHyper { bias_correction: false, ..hp }, AdamHyper { eps: eps_first, ..hp }];
    for wrong in wrong_hps {
        let k = Consts::new(&wrong);
        let violations = (0..after.len())
            .filter(|&i| {
                let r = ref_update_of(&k, 1.0, &before, i);
                (after.p.get(i) - r.p.v).abs() > 2.0 * r.p.e
            })
            .count();
        assert!(violations > after.len() / 2, "{wrong:?}: only {violations} elements outside the bound");
    }
}
