//! Refusals change nothing; two callers on one pool both make progress.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use common::*;
use superoffload::error::Status;
use superoffload::kernels::{self, AdamHyper, DType, Isa, UpdateOptions};

#[test]
fn non_finite_gradient_with_check_leaves_everything_untouched() {
    let mut rng = Rng::new(30);
    let pool = pool(Isa::best(), 4);
    for dtypes in all_dtype_combinations() {
        for poison in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 6e4] {
            let n = 8192 * 8 + 9;
            let mut state = State::random(&mut rng, n, dtypes, true, 1.0);
            let at = rng.below(n);
            state.g.set(at, poison);
            // A finite f16/bf16/f32 value that overflows only once scaled.
            let scale = if poison.is_finite() { 1e36 } else { 1.0 };
            let before = state.clone();
            let opts = UpdateOptions { grad_scale: scale, check_finite: true, grad_sumsq: true };
            let err = kernels::update(&pool, &AdamHyper::default(), state.buffers(), &opts).unwrap_err();
            assert_eq!(err.status, Status::NonFinite, "{dtypes:?} poison {poison} at {at}");
            assert!(state == before, "{dtypes:?}: a refused step modified a buffer");
        }
    }
}

#[test]
fn invalid_arguments_leave_everything_untouched() {
    let mut rng = Rng::new(31);
    let pool = pool(Isa::best(), 2);
    let mut state = State::random(&mut rng, 100, (DType::F32, DType::F32, DType::F32, Some(DType::Bf16)), true, 1.0);
    let before = state.clone();
    let bad = [
        AdamHyper { lr: f64::NAN, ..AdamHyper::default() },
        AdamHyper { lr: -1.0, ..AdamHyper::default() },
        AdamHyper { beta1: 1.0, ..AdamHyper::default() },
        AdamHyper { beta2: -0.1, ..AdamHyper::default() },
        AdamHyper { eps: -1e-8, ..AdamHyper::default() },
        AdamHyper { weight_decay: f64::INFINITY, ..AdamHyper::default() },
        AdamHyper { step: 0, ..AdamHyper::default() },
    ];
    for hp in bad {
        let err = kernels::update(&pool, &hp, state.buffers(), &UpdateOptions::default()).unwrap_err();
        assert_eq!(err.status, Status::InvalidArgument, "{hp:?}");
    }
    for scale in [0.0, -1.0, f32::INFINITY, f32::NAN] {
        let opts = UpdateOptions { grad_scale: scale, ..UpdateOptions::default() };
        assert!(kernels::update(&pool, &AdamHyper::default(), state.buffers(), &opts).is_err());
        assert!(kernels::rescale(&pool, &AdamHyper::default(), state.buffers(), 1.0, scale).is_err());
        assert!(kernels::rollback(&pool, &AdamHyper::default(), state.buffers(), scale).is_err());
    }
    state.v = Store::F32(vec![0.0; 99]);
    let short = state.clone();
    let err = kernels::update(&pool, &AdamHyper::default(), state.buffers(), &UpdateOptions::default()).unwrap_err();
    assert!(err.message.contains("lengths differ"), "{}", err.message);
    assert!(state == short);
    state.v = before.v.clone();
    assert!(state == before);
}

/// No global lock: a caller's updates complete while another caller's single long update
/// is still in flight (on another pool; a lock anywhere in the library would make the
/// short updates wait for the long one to return).
#[test]
fn a_caller_completes_steps_during_another_callers_long_step() {
    let mut rng = Rng::new(32);
    let long_pool = pool(Isa::Portable, 1);
    let short_pool = pool(Isa::best(), 1);
    let mut long = State::random(&mut rng, 1 << 25, (DType::F32, DType::F32, DType::F32, None), true, 1.0);
    let short = State::random(&mut rng, 1 << 12, (DType::F32, DType::F32, DType::F32, None), true, 1.0);
    let in_flight = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicBool::new(false));

    let short_runner = {
        let (in_flight, finished) = (in_flight.clone(), finished.clone());
        let mut short = short.clone();
        std::thread::spawn(move || {
            let mut contained = 0;
            let mut step = 1;
            while !finished.load(Ordering::Acquire) {
                let before = in_flight.load(Ordering::Acquire);
                let hp = AdamHyper { step, ..AdamHyper::default() };
                kernels::update(&short_pool, &hp, short.buffers(), &UpdateOptions::default()).unwrap();
                // Odd = the long call is running; unchanged = it ran throughout ours.
                if before % 2 == 1 && in_flight.load(Ordering::Acquire) == before {
                    contained += 1;
                }
                step += 1;
            }
            contained
        })
    };
    for _ in 0..2 {
        in_flight.fetch_add(1, Ordering::AcqRel);
        kernels::update(&long_pool, &AdamHyper::default(), long.buffers(), &UpdateOptions::default()).unwrap();
        in_flight.fetch_add(1, Ordering::AcqRel);
    }
    finished.store(true, Ordering::Release);
    let contained = short_runner.join().unwrap();
    assert!(contained >= 1, "no short update completed inside a long one");
}

/// Two callers sharing one pool: both finish, and each gets exactly the bits it would get
/// alone (their chunks interleave on the pool's threads).
#[test]
fn two_callers_sharing_a_pool_get_their_own_results() {
    let shared = Arc::new(pool(Isa::best(), 2));
    let mut rng = Rng::new(33);
    let starts: Vec<State> = (0..2)
        .map(|_| State::random(&mut rng, 1 << 18, (DType::F32, DType::Bf16, DType::F32, None), true, 1.0))
        .collect();
    let runners: Vec<_> = starts
        .iter()
        .cloned()
        .map(|mut state| {
            let shared = shared.clone();
            std::thread::spawn(move || {
                for step in 1..=10 {
                    let hp = AdamHyper { step, ..AdamHyper::default() };
                    kernels::update(&shared, &hp, state.buffers(), &UpdateOptions::default()).unwrap();
                }
                state
            })
        })
        .collect();
    let alone_pool = pool(Isa::best(), 1);
    for (runner, mut alone) in runners.into_iter().zip(starts) {
        for step in 1..=10 {
            let hp = AdamHyper { step, ..AdamHyper::default() };
            kernels::update(&alone_pool, &hp, alone.buffers(), &UpdateOptions::default()).unwrap();
        }
        assert!(runner.join().unwrap() == alone);
    }
}
