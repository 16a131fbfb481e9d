//! Named regression tests: each pins a defect found in `Session::step` (from outside, or
//! by the fuzzer in `tests/session_fuzz.rs`) and fails on the code that had it.

mod common;

use std::sync::Arc;

use common::*;
use superoffload::error::{Error, Status};
use superoffload::kernels::{DType, Floats, Isa};
use superoffload::session::{
    Borrowed, GroupHparams, LossScalerOptions, NormSource, Session, SessionOptions, SkipReason, SliceDesc, Speculation,
    StepArgs, StepResult, SubGroupDesc,
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

fn step(s: &Session, grads: &[Vec<f32>], args: StepArgs) -> StepResult {
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

/// Hands a sub-group's gradient over and, if that queued a speculative step, waits for the
/// step to run, so that `step()` cannot cancel it (the defects below are in what follows a
/// speculative step that ran).
fn hand_over_speculated(s: &Session, sg: u32, grad: &[f32]) {
    if let Some(t) = s.grad_copy(sg, Floats::F32(grad)).unwrap() {
        // A speculative step on a non-finite gradient fails; that is part of the scenario.
        let _ = s.wait(t, None);
    }
}

/// (master, exp_avg, exp_avg_sq) of one sub-group.
type State = (Vec<f32>, Vec<f32>, Vec<f32>);

/// The state stepped without and with speculation agree within `rel` (relative) element-wise.
fn assert_states_close(without: &State, with: &State, rel: f32, context: &str) {
    let parts = [("p", &without.0, &with.0), ("m", &without.1, &with.1), ("v", &without.2, &with.2)];
    for (what, a, b) in parts {
        for (x, y) in a.iter().zip(b.iter()) {
            assert!(
                (x - y).abs() <= rel * x.abs().max(1e-30),
                "{context}{what}: without speculation {a:?}, with {b:?}"
            );
        }
    }
}

/// One step of `grad` on a sub-group of weights 0.5, under `loss_scale` and clipped to
/// `max_norm`, its speculative step (if any) run before `step()`: the state after it and the
/// step's result. The step must be taken and clipped. Err: `begin_step` refused the scale.
fn clipped_step(grad: &[f32], loss_scale: f32, max_norm: f64, speculation: bool) -> Result<(State, StepResult), Error> {
    let mut masters = vec![vec![0.5f32; grad.len()]];
    let s = session(&mut masters, speculation);
    s.begin_step(Some(loss_scale), 1)?;
    hand_over_speculated(&s, 0, grad);
    let t = s.step(local(max_norm)).unwrap();
    let r = s.step_result(t, None).unwrap();
    assert!(!r.skipped && r.clip_coef < 1.0, "{r:?}");
    let (m, v) = s.moments(0).unwrap();
    drop(s);
    Ok(((masters.remove(0), m, v), r))
}

/// Found by the fuzzer (`tests/session_fuzz.rs`, seed 0): `begin_step` accepts a loss scale
/// whose reciprocal is not finite in f32 (1e-40: 1 / 1e-40 overflows), so the unscaling
/// factor of the step is inf. Every speculative step and sum of squares of that step then
/// fails inside the CPU-Adam thread ("scale = inf is out of range"), and so does the step's
/// own ticket: `step_result` returns INVALID_ARGUMENT and the caller cannot learn whether the
/// step was taken. `begin_step` now refuses such a scale (INVALID_ARGUMENT, as for 0 or NaN,
/// naming the reciprocal), changing nothing; so does the built-in scaler's `min_scale` or
/// `init_scale`.
#[test]
fn loss_scale_without_a_finite_reciprocal_is_refused() {
    for speculation in [true, false] {
        let mut masters = vec![vec![0.25f32; 16]];
        let before = masters.clone();
        let s = session(&mut masters, speculation);
        for scale in [1e-40f32, 1e-45, 2.5e-39] {
            let e = s.begin_step(Some(scale), 1).unwrap_err();
            assert_eq!(e.status, Status::InvalidArgument, "{}", e.message);
            assert!(e.message.contains("1 / loss_scale"), "{}", e.message);
        }
        // The smallest loss scales with a finite reciprocal are accepted.
        s.begin_step(Some(3e-39), 1).unwrap();
        s.grad_copy(0, Floats::F32(&[0.0; 16])).unwrap();
        let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: true }).unwrap();
        assert!(s.step_result(t, None).unwrap().skipped);
        // The session goes on: a normal step is taken.
        let r = step(&s, &[vec![1.0; 16]], local(0.0));
        assert!(!r.skipped && s.step_count(0).unwrap() == 1, "{r:?}");
        drop(s);
        let mut fresh = before.clone();
        let f = session(&mut fresh, speculation);
        step(&f, &[vec![1.0; 16]], local(0.0));
        drop(f);
        assert_eq!(masters, fresh, "speculation {speculation}");
    }
    for (init, min) in [(1e-40f32, 1.0f32), (65536.0, 1e-40)] {
        let e = Session::new(SessionOptions {
            loss_scaler: Some(LossScalerOptions { init_scale: init, min_scale: min, ..LossScalerOptions::default() }),
            ..SessionOptions::default()
        })
        .err()
        .expect("a loss scaler whose scale can have no finite reciprocal");
        assert_eq!(e.status, Status::InvalidArgument, "{}", e.message);
    }
}

/// Found by the fuzzer (seed 5): a speculative step on a gradient element whose square
/// overflows f32 (|g / loss_scale| > 1.8e19) stores `exp_avg_sq = inf`; when the step is then
/// skipped or clipped, the rollback or rescale computes `inf - inf` and leaves NaN in
/// `exp_avg_sq` (and from the next step on in the weights), where the same session without
/// speculation changes nothing (skipped) or steps cleanly (clipped). (Even without the inf,
/// a rollback recovers `exp_avg` only to a few ulps of `(1 - beta1) g`: here 1e11.) A
/// sub-group whose sum of squares exceeds `f32::MAX` now declines its speculative step (its
/// ticket completes, nothing is applied) and is stepped once at `step()`: a skipped step
/// leaves it exactly as it was, a clipped one matches the step taken without speculation
/// bit for bit.
#[test]
fn speculative_step_with_an_overflowing_square_is_declined() {
    let grad = vec![1e20f32, 0.1, -0.2, 0.3];
    // Skipped (caller overflow): nothing changes.
    let mut masters = vec![vec![0.5f32; 4]];
    let s = session(&mut masters, true);
    s.begin_step(Some(1.0), 1).unwrap();
    let spec = s.grad_copy(0, Floats::F32(&grad)).unwrap().expect("a speculative step is queued");
    assert_eq!(s.wait(spec, None), Ok(()), "a declined speculative step's ticket");
    let t = s.step(StepArgs { max_norm: 0.0, norm: NormSource::Local, overflow: true }).unwrap();
    let r = s.step_result(t, None).unwrap();
    assert!(r.skipped && r.speculative == 1 && r.rolled_back == 0, "{r:?}");
    let (m, v) = s.moments(0).unwrap();
    drop(s);
    assert!(m.iter().chain(&v).all(|&x| x == 0.0), "moments after a skipped step: m {m:?} v {v:?}");
    assert!(masters[0].iter().all(|&p| p == 0.5), "weights after a skipped step: {:?}", masters[0]);

    // Clipped: the same as stepping after backward.
    let state = |speculation: bool| {
        let (state, r) = clipped_step(&grad, 1.0, 1.0, speculation).unwrap();
        assert_eq!(r.rescaled, 0, "{r:?}");
        state
    };
    assert_eq!(state(false), state(true), "(p, m, v) without and with speculation");
}

/// Found by the fuzzer (seed 5, after the two above were set aside): with a loss scale below
/// about 1e-20 the rescale of a clipped speculative step needs the coefficient
/// `(1 - beta2) * (new^2 - old^2)` of the unscaling factors `1 / loss_scale`, which overflows
/// f32; the rescale then multiplies by inf and writes wrong weights and moments, where the
/// same step without speculation is finite. (`begin_step` accepts any finite positive loss
/// scale.) Here the weights end thousands of times off (NaN in other cases). Either such a
/// scale is refused, or the clipped step matches the step taken
/// without speculation.
#[test]
fn clipped_step_with_a_tiny_loss_scale_matches_the_step_without_speculation() {
    for scale in [2f32.powi(-70), 1e-25, 1e-30] {
        let grad: Vec<f32> = (0..64).map(|i| ((i % 9) as f32 - 4.0) * 0.025 * scale).collect();
        let state = |speculation: bool| match clipped_step(&grad, scale, 0.1, speculation) {
            Ok((state, _)) => Some(state),
            Err(e) => {
                assert_eq!(e.status, Status::InvalidArgument, "{}", e.message);
                None
            }
        };
        let (Some(without), Some(with)) = (state(false), state(true)) else { continue };
        assert_states_close(&without, &with, 1e-5, &format!("loss scale {scale:e}, "));
    }
}

/// Found by the fuzzer (seed 32): the rescale of a clipped speculative step squares the
/// gradient as handed over, before unscaling, in f32: with a large loss scale (here 2^100,
/// gradients of about 1e29 as handed over, 0.1 after unscaling) the square overflows, and
/// the rescale writes NaN weights and moments, where the same step without speculation (and
/// the speculative step itself, which unscales first) is finite.
#[test]
fn clipped_step_with_a_huge_loss_scale_matches_the_step_without_speculation() {
    let scale = 2f32.powi(100);
    let grad: Vec<f32> = [0.1f32, -0.2, 0.3, 0.05].iter().map(|g| g * scale).collect();
    let state = |speculation: bool| clipped_step(&grad, scale, 0.1, speculation).unwrap().0;
    assert_states_close(&state(false), &state(true), 1e-5, "");
}

/// Found by the fuzzer (seed 69): `so_session_step_result` documents NOT_FOUND "for a ticket
/// that is not the latest step's", but given the ticket of a failed speculative step (a NaN
/// gradient) it returns that step's NON_FINITE instead: it waits on the ticket and reports its
/// failure before looking at whether it is a step's ticket at all. Now any ticket but the
/// latest step's is NOT_FOUND at once.
#[test]
fn step_result_of_a_failed_speculative_ticket_is_not_found() {
    let mut masters = vec![vec![0.25f32; 4]];
    let s = session(&mut masters, true);
    s.begin_step(Some(1.0), 1).unwrap();
    let spec = s.grad_copy(0, Floats::F32(&[f32::NAN, 0.0, 0.0, 0.0])).unwrap().expect("completes the sub-group");
    // The speculative step runs (and fails) before step() could cancel it.
    assert_eq!(s.wait(spec, None).unwrap_err().status, Status::NonFinite);
    let t = s.step(local(0.0)).unwrap();
    assert!(s.step_result(t, None).unwrap().skipped);
    let err = s.step_result(spec, None).unwrap_err();
    assert_eq!(err.status, Status::NotFound, "{}", err.message);
}

/// Found while modelling checkpoints for the fuzzer: slices need not cover their sub-group
/// (`add_subgroup` accepts gaps), and the elements outside every slice are stepped like the
/// others (decay and momentum, with a zero gradient) but are in no checkpoint, so a session
/// resumed from a checkpoint in a new process diverges from the uninterrupted one there.
/// Gaps are allowed (alignment padding between parameters); the elements outside every slice
/// are now padding: `add_subgroup` zeroes them in the master weights, moments and gradient
/// buffer, they step to zero, and a resumed session matches the uninterrupted one bit for bit.
#[test]
fn elements_outside_every_slice_are_zero_padding_and_resume_bit_for_bit() {
    let desc = |s: &Session, master: &mut Vec<f32>| {
        // SAFETY: `master` outlives the session that borrows it (dropped at the end of the test).
        let m = unsafe { Borrowed::new("master", master.as_mut_ptr().cast(), master.len(), DType::F32) }.unwrap();
        // Elements 0 and 7 belong to no slice.
        let slices = vec![SliceDesc { name: "w".into(), offset: 1, numel: 6 }];
        s.add_subgroup(SubGroupDesc::new(0, m, slices))
    };
    let new_session = || {
        let s =
            Session::new(SessionOptions { pool: Some(Arc::new(pool(Isa::best(), 2))), ..SessionOptions::default() })
                .unwrap();
        s.add_group(GroupHparams { weight_decay: 0.1, ..GroupHparams::default() }).unwrap();
        s
    };
    let train = |s: &Session, steps: usize| {
        for k in 0..steps {
            s.begin_step(Some(1.0), 1).unwrap();
            s.grad_copy(0, Floats::F32(&[0.1 * (k + 1) as f32; 6])).unwrap();
            let t = s.step(local(0.0)).unwrap();
            s.step_result(t, None).unwrap();
        }
    };
    let path = std::env::temp_dir().join(format!("so-gap-{}.safetensors", std::process::id()));
    let mut uninterrupted = vec![1.0f32; 8];
    let s = new_session();
    desc(&s, &mut uninterrupted).unwrap();
    assert_eq!(uninterrupted, [0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0], "padding zeroed at registration");
    train(&s, 3);
    s.save(&path).unwrap();
    train(&s, 3);
    drop(s);
    // A new process: fresh buffers initialised as the first run's were, then the checkpoint.
    let mut resumed = vec![1.0f32; 8];
    let s = new_session();
    desc(&s, &mut resumed).unwrap();
    s.load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    train(&s, 3);
    drop(s);
    assert_eq!(resumed, uninterrupted, "resumed vs uninterrupted");
}

/// Found by the fuzzer in a long run (seeds 1796297534789846277 and 1796297534789852553): the
/// same squaring of the gradient as handed over (before unscaling) that overflows for large
/// loss scales loses precision for small ones: with a loss scale of 2^-40 and unscaled
/// gradients near 1e-9, the squares of the handed-over gradients (about 1e-42) are subnormal
/// in f32, and the rescaled moments end up to 3e-5 relative (hundreds of ulps) away from the
/// step taken without speculation, beyond the rounding bound of the rescale (it worked on the
/// handed-over, loss-scaled gradient with coefficients of the size of 1 / loss_scale). The
/// rescale now takes the old contribution out and puts the new one in, each formed as the
/// update forms it (`g * scale`); the speculative step is made to run before `step()`.
#[test]
fn clipped_step_with_a_small_loss_scale_keeps_f32_precision() {
    let scale = 2f32.powi(-40);
    let grad: Vec<f32> = [1e-9f32, -2e-9, 3e-9, 0.5e-9].iter().map(|g| g * scale).collect();
    // A clip coefficient near 1/2: the rescale's own rounding (a few ulps of the speculative
    // step's terms, relative to the rescaled ones) stays below 1e-6.
    let state = |speculation: bool| clipped_step(&grad, scale, 5e-7, speculation).unwrap().0;
    assert_states_close(&state(false), &state(true), 1e-6, "");
}

/// Found by the fuzzer after the scheduler rewrite (seed 4): a gradient handed over for the
/// next step while the previous step's final pass of its sub-group is still queued is filed
/// as a late gradient of the new step (`hand_off` asks the scheduler whether the sub-group is
/// complete before it waits for the sub-group's final ticket, and a queued final pass counts
/// as complete). The new step then merges it into the previous step's gradient buffer,
/// takes no speculative step for it and reports `late_gradients = 1`: the weights end wrong.
/// A hand-off must wait for its sub-group's previous step (as the header says it does) and
/// count as the new step's gradient. A hand-off now waits for the sub-group's previous final
/// ticket before it asks whether the sub-group is complete.
#[test]
fn gradient_of_the_next_step_is_not_late_while_the_previous_final_pass_is_queued() {
    // Sub-group 0 is large, so that its final pass keeps sub-group 1's queued for a while.
    const BIG: usize = 1 << 23;
    let run = |wait: bool, speculation: bool| {
        let mut masters = vec![vec![0.5f32; BIG], vec![0.25f32; 64]];
        let s = session(&mut masters, speculation);
        let big: Vec<f32> = (0..BIG).map(|i| (i % 7) as f32 * 1e-3).collect();
        let mut lates = Vec::new();
        for k in 0..4 {
            s.begin_step(Some(1.0), 1).unwrap();
            // Sub-group 1 first: right after the previous step() when not waiting.
            s.grad_copy(1, Floats::F32(&[0.01 * (k + 1) as f32; 64])).unwrap();
            s.grad_copy(0, Floats::F32(&big)).unwrap();
            let t = s.step(local(0.0)).unwrap();
            if wait {
                let r = s.step_result(t, None).unwrap();
                lates.push(r.late_gradients);
                s.wait(s.final_ticket(0).unwrap(), None).unwrap();
                s.wait(s.final_ticket(1).unwrap(), None).unwrap();
            }
        }
        let t = s.final_ticket(1).unwrap();
        s.wait(t, None).unwrap();
        drop(s);
        (masters.remove(1), lates)
    };
    for speculation in [false, true] {
        let (waited, lates) = run(true, speculation);
        assert!(lates.iter().all(|&n| n == 0), "{lates:?}");
        let (raced, _) = run(false, speculation);
        assert_eq!(raced, waited, "speculation {speculation}: sub-group 1 after four steps");
    }
}

/// Found by the fuzzer as a hang (seed 1796300470935466662): a late gradient makes
/// `local_grad_sumsq`'s preparation cancel a speculative step that is still queued, and the
/// cancelled step's ticket then stays pending until `step()`'s final pass of that sub-group.
/// A caller (or, through `so_ticket_enqueue_wait`, a GPU stream) waiting on the ticket the
/// hand-off returned, before calling `step()`, waits forever. A speculative step cancelled
/// (or, preempted, rolled back) by the preparation now completes its ticket there, with OK,
/// once the gradient copies it stood for have landed.
#[test]
fn speculative_ticket_cancelled_by_a_late_gradient_completes_before_step() {
    // Sub-group 0 is large: its speculative step runs while sub-group 1's waits in the queue.
    const BIG: usize = 1 << 23;
    let mut masters = vec![vec![0.5f32; BIG], vec![0.25f32; 64]];
    let s = session(&mut masters, true);
    let big = vec![1e-3f32; BIG];
    s.begin_step(Some(1.0), 1).unwrap();
    s.grad_copy(0, Floats::F32(&big)).unwrap();
    let spec = s.grad_copy(1, Floats::F32(&[0.01; 64])).unwrap().expect("sub-group 1 speculates");
    // A late gradient of sub-group 1, then the preparation (which cancels its queued step).
    s.grad_copy(1, Floats::F32(&[0.02; 64])).unwrap();
    s.local_grad_sumsq(None).unwrap();
    let waited = s.wait(spec, Some(std::time::Duration::from_secs(5)));
    let t = s.step(local(0.0)).unwrap();
    s.step_result(t, None).unwrap();
    assert_eq!(waited, Ok(()), "the speculative ticket before step()");

    // The same for a speculative pass the preparation finds queued, running (preempted, then
    // rolled back) or done, whichever the timing gives: its ticket completes before step().
    s.begin_step(Some(1.0), 1).unwrap();
    let spec = s.grad_copy(0, Floats::F32(&big)).unwrap().expect("sub-group 0 speculates");
    s.grad_copy(0, Floats::F32(&big)).unwrap();
    s.local_grad_sumsq(None).unwrap();
    let waited = s.wait(spec, Some(std::time::Duration::from_secs(5)));
    let t = s.step(local(0.0)).unwrap();
    s.step_result(t, None).unwrap();
    assert_eq!(waited, Ok(()), "a large sub-group's speculative ticket before step()");
}
