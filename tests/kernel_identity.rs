//! Bit-identity: every instruction set and thread count gives the same bits, on lengths
//! that are not multiples of the vector width; a step with grad_scale s equals a step on
//! the gradient pre-multiplied by s in f32; the sum of squares is the same everywhere.

mod common;

use common::*;
use superoffload::kernels::{self, AdamHyper, AdamMode, CopyOutMut, DType, GradRef, Isa, UpdateOptions, bf16, f16};

const LENGTHS: [usize; 9] = [1, 7, 15, 16, 17, 31, 1000, 8191, 8192 * 6 + 13];

#[test]
fn update_is_bit_identical_across_isas_and_thread_counts() {
    let mut rng = Rng::new(10);
    let isas = supported_isas();
    let pools: Vec<_> = isas.iter().flat_map(|&isa| [1, 2, 5].map(move |t| (isa, t))).collect();
    let pools: Vec<_> = pools.into_iter().map(|(isa, t)| (isa, t, pool(isa, t))).collect();
    for dtypes in all_dtype_combinations() {
        for &n in &LENGTHS {
            let mode = if rng.below(2) == 0 { AdamMode::AdamW } else { AdamMode::L2 };
            let hp = AdamHyper { weight_decay: 0.05, ..random_hyper(&mut rng, mode) };
            let opts = UpdateOptions { grad_scale: 0.75, check_finite: false, grad_sumsq: true };
            let start = State::random(&mut rng, n, dtypes, true, 1.0);
            let mut reference = None;
            for (isa, threads, pool) in &pools {
                let mut state = start.clone();
                let report = kernels::update(pool, &hp, state.buffers(), &opts).unwrap();
                let sumsq = report.grad_sumsq.unwrap().to_bits();
                match &reference {
                    None => reference = Some((state, sumsq)),
                    Some((want, want_sumsq)) => {
                        assert!(&state == want, "{isa:?} x{threads} differs for {dtypes:?}, n = {n}");
                        assert_eq!(sumsq, *want_sumsq, "sum of squares {isa:?} x{threads} {dtypes:?} n {n}");
                    }
                }
            }
        }
    }
}

#[test]
fn rollback_and_rescale_are_bit_identical_across_isas_and_thread_counts() {
    let mut rng = Rng::new(11);
    for grad in DTYPES {
        for mode in [AdamMode::AdamW, AdamMode::L2] {
            for &n in &LENGTHS {
                let hp = AdamHyper { mode, weight_decay: 0.1, step: 4, ..AdamHyper::default() };
                let dtypes = (DType::F32, grad, DType::F32, Some(DType::Bf16));
                let start = State::random(&mut rng, n, dtypes, true, 1.0);
                let mut results = Vec::new();
                for isa in supported_isas() {
                    for threads in [1, 3] {
                        let pool = pool(isa, threads);
                        let mut a = start.clone();
                        kernels::rollback(&pool, &hp, a.buffers(), 0.5).unwrap();
                        let mut b = start.clone();
                        kernels::rescale(&pool, &hp, b.buffers(), 1.0, 0.25).unwrap();
                        results.push((isa, threads, a, b));
                    }
                }
                let (_, _, a0, b0) = &results[0];
                for (isa, threads, a, b) in &results[1..] {
                    assert!(a == a0, "rollback {isa:?} x{threads} {mode:?} {grad:?} n {n}");
                    assert!(b == b0, "rescale {isa:?} x{threads} {mode:?} {grad:?} n {n}");
                }
            }
        }
    }
}

#[test]
fn grad_scale_equals_prescaled_gradient() {
    let mut rng = Rng::new(12);
    let pool = pool(Isa::best(), 3);
    for grad in DTYPES {
        for scale in [0.5f32, 1.0 / 3.0, 1e-4, 7.0] {
            let dtypes = (DType::F32, grad, DType::F32, Some(DType::Bf16));
            let start = State::random(&mut rng, 8192 + 77, dtypes, true, 1.0);
            let mut hp = AdamHyper::default();
            let mut scaled = start.clone();
            let mut prescaled = start.clone();
            prescaled.g = Store::F32((0..start.len()).map(|i| start.g.get(i) as f32 * scale).collect());
            for step in 1..=3 {
                hp.step = step;
                let opts = UpdateOptions { grad_scale: scale, ..UpdateOptions::default() };
                kernels::update(&pool, &hp, scaled.buffers(), &opts).unwrap();
                kernels::update(&pool, &hp, prescaled.buffers(), &UpdateOptions::default()).unwrap();
                assert!(scaled.p == prescaled.p && scaled.m == prescaled.m && scaled.v == prescaled.v);
                assert!(scaled.out == prescaled.out, "copy-out, scale {scale}, grad {grad:?}");
            }
        }
    }
}

#[test]
fn sum_of_squares_is_invariant_and_matches_the_update() {
    let mut rng = Rng::new(13);
    let n = 8192 * 20 + 3;
    let grad: Vec<f32> = (0..n).map(|_| rng.normalish(1.0) as f32).collect();
    let mut reference = None;
    for isa in supported_isas() {
        for threads in [1, 2, 7] {
            let pool = pool(isa, threads);
            let sumsq = kernels::grad_sumsq(&pool, GradRef::F32(&grad), 0.125).unwrap();
            let want = *reference.get_or_insert(sumsq);
            assert_eq!(sumsq.to_bits(), want.to_bits(), "{isa:?} x{threads}");
        }
    }
    let exact: f64 = grad.iter().map(|&g| ((g * 0.125) as f64).powi(2)).sum();
    let got = reference.unwrap();
    assert!((got - exact).abs() <= 1e-13 * exact, "{got} vs {exact}");

    let pool = pool(Isa::best(), 4);
    let mut state = State::random(&mut rng, n, (DType::F32, DType::F32, DType::F32, None), true, 1.0);
    state.g = Store::F32(grad.clone());
    let opts = UpdateOptions { grad_scale: 0.125, check_finite: false, grad_sumsq: true };
    let fused = kernels::update(&pool, &AdamHyper::default(), state.buffers(), &opts).unwrap().grad_sumsq.unwrap();
    assert_eq!(fused.to_bits(), got.to_bits(), "fused sum of squares equals the separate pass");
    let checked = UpdateOptions { check_finite: true, ..opts };
    let prechecked = kernels::update(&pool, &AdamHyper::default(), state.buffers(), &checked).unwrap();
    assert_eq!(prechecked.grad_sumsq.unwrap().to_bits(), got.to_bits());
}

#[test]
fn a_split_update_writes_exactly_the_bits_of_one_update() {
    let mut rng = Rng::new(12);
    let pools = [pool(Isa::best(), 1), pool(Isa::best(), 3)];
    for dtypes in all_dtype_combinations() {
        for mode in [AdamMode::AdamW, AdamMode::L2] {
            for &n in &LENGTHS {
                let hp = AdamHyper { weight_decay: 0.05, ..random_hyper(&mut rng, mode) };
                let start = State::random(&mut rng, n, dtypes, true, 1.0);
                let mut whole = start.clone();
                let opts = UpdateOptions { grad_scale: 0.75, ..UpdateOptions::default() };
                kernels::update(&pools[0], &hp, whole.buffers(), &opts).unwrap();
                let mut split = start.clone();
                if !kernels::can_split_update(&split.buffers()) {
                    let err = kernels::update_copy(&pools[0], &hp, split.buffers(), 0.75).unwrap_err();
                    assert_eq!(err.status, superoffload::error::Status::Unsupported);
                    assert!(split == start, "a refused split changed the state, {dtypes:?}");
                    continue;
                }
                for pool in &pools {
                    let mut split = start.clone();
                    kernels::update_copy(pool, &hp, split.buffers(), 0.75).unwrap();
                    let mut copy_only = start.clone();
                    copy_only.out = whole.out.clone();
                    assert!(split == copy_only, "the copy pass wrote more than the copy, {dtypes:?} {mode:?} n {n}");
                    kernels::update_state(pool, &hp, split.buffers(), 0.75).unwrap();
                    assert!(split == whole, "copy then state differ from one update, {dtypes:?} {mode:?} n {n}");
                }
            }
        }
    }
}

/// The copy is written around the cache where it is 16-byte aligned and with plain stores
/// elsewhere: the same bits at every offset, for both copy dtypes and every instruction set.
#[test]
fn the_copy_has_the_same_bits_at_any_alignment() {
    let mut rng = Rng::new(13);
    let n = 8192 * 3 + 21;
    for isa in supported_isas() {
        let pool = pool(isa, 2);
        for copy in [DType::Bf16, DType::F16] {
            let hp = random_hyper(&mut rng, AdamMode::AdamW);
            let start = State::random(&mut rng, n, (DType::F32, DType::Bf16, DType::F32, Some(copy)), true, 1.0);
            let mut aligned = start.clone();
            kernels::update_copy(&pool, &hp, aligned.buffers(), 0.5).unwrap();
            let want = aligned.out.unwrap();
            for offset in 1..8 {
                // The same copy, `offset` two-byte elements into a larger buffer.
                let mut shifted = start.clone();
                let mut buffers = shifted.buffers();
                let (mut wide_bf16, mut wide_f16) = (vec![bf16::ZERO; n + offset], vec![f16::ZERO; n + offset]);
                buffers.copy_out = Some(match copy {
                    DType::Bf16 => CopyOutMut::Bf16(&mut wide_bf16[offset..]),
                    _ => CopyOutMut::F16(&mut wide_f16[offset..]),
                });
                kernels::update_copy(&pool, &hp, buffers, 0.5).unwrap();
                let got = match copy {
                    DType::Bf16 => Store::Bf16(wide_bf16[offset..].to_vec()),
                    _ => Store::F16(wide_f16[offset..].to_vec()),
                };
                assert!(got == want, "{isa:?} {copy:?} at offset {offset}");
            }
        }
    }
}

#[test]
fn a_conversion_on_the_pool_writes_the_bits_of_one_on_the_calling_thread() {
    let mut rng = Rng::new(17);
    for isa in supported_isas() {
        for threads in [1, 3] {
            let pool = pool(isa, threads);
            for from in DTYPES {
                for to in DTYPES {
                    for &n in &LENGTHS {
                        let values: Vec<f64> = (0..n).map(|_| rng.normalish(100.0)).collect();
                        let src = Store::from_f64(from, values.into_iter());
                        let mut want = Store::from_f64(to, std::iter::repeat_n(-7.0, n));
                        let mut got = want.clone();
                        kernels::copy_into(want.floats_mut(), src.floats(), false, None).unwrap();
                        kernels::convert(&pool, got.floats_mut(), src.floats()).unwrap();
                        assert!(got == want, "{isa:?} x{threads}: {from:?} -> {to:?}, {n} elements");
                        let mut short = Store::from_f64(to, std::iter::repeat_n(-7.0, n - 1));
                        let err = kernels::convert(&pool, short.floats_mut(), src.floats()).unwrap_err();
                        assert_eq!(err.status, superoffload::error::Status::InvalidArgument, "{}", err.message);
                    }
                }
            }
        }
    }
}
