//! The session against a plain reference trainer (collect every gradient, norm, clip, step;
//! no speculation), over 60 steps with: clipping that triggers on some steps, skipped
//! steps (caller overflow flag, fp16 gradient overflow), fp16 loss scaling with growth and
//! backoff, two param groups with an LR schedule, hyperparameter changes between backward
//! and step, late and missing gradients, micro-step accumulation, caller-given and local
//! norms.
//!
//! Each step the reference starts from the session's state. Steps that keep every
//! speculative step as taken must match bit for bit; rescaled, rolled back and redone
//! sub-groups must match within the f32 rounding bound propagated through the operations
//! they went through (tests/common).

mod common;

use common::*;
use superoffload::kernels::{self, AdamHyper, DType, Floats, FloatsMut, Isa, UpdateOptions, f16};
use superoffload::session::{
    Borrowed, GroupHparams, LossScaler, LossScalerOptions, NormSource, Session, SessionOptions, SliceDesc, Speculation,
    StepArgs, SubGroupDesc, clip_coefficient, grad_factor,
};

/// (group, slice sizes) per sub-group, in forward order.
const MODEL: &[(u32, &[usize])] = &[(0, &[1000, 37]), (0, &[4101]), (1, &[300, 300, 17]), (1, &[16385])];
const MAX_NORM: f64 = 1.5;
const STEPS: u64 = 60;

struct Layout {
    /// (sub-group, element range) per slice, slices numbered in forward order.
    slices: Vec<(usize, std::ops::Range<usize>)>,
    numels: Vec<usize>,
}

fn layout() -> Layout {
    let mut slices = Vec::new();
    let mut numels = Vec::new();
    for (sg, (_, sizes)) in MODEL.iter().enumerate() {
        let mut offset = 0;
        for &n in *sizes {
            slices.push((sg, offset..offset + n));
            offset += n;
        }
        numels.push(offset);
    }
    Layout { slices, numels }
}

/// What happens at one step.
struct Events {
    micro_steps: u32,
    missing: Option<usize>,
    late: Option<usize>,
    changed_group: Option<u32>,
    overflow: bool,
    given_norm: bool,
    magnitude: f64,
}

fn events(step: u64, n_slices: usize, rng: &mut Rng) -> Events {
    Events {
        micro_steps: if step % 7 == 3 { 2 } else { 1 },
        missing: (step % 9 == 4).then(|| step as usize % n_slices),
        late: (step % 6 == 2).then(|| (step as usize * 5) % n_slices),
        changed_group: (step % 8 == 5).then_some((step % 2) as u32),
        overflow: step % 13 == 11,
        given_norm: step % 3 == 0,
        magnitude: rng.range(0.002, 0.03),
    }
}

fn schedule(group: u32, step: u64) -> GroupHparams {
    let warmup = (step as f64 / 10.0).min(1.0);
    match group {
        0 => GroupHparams { lr: 1e-3 * warmup, weight_decay: 0.01, ..GroupHparams::default() },
        _ => GroupHparams { lr: 5e-4 * warmup, beta1: 0.85, beta2: 0.995, weight_decay: 0.0, eps: 1e-6 },
    }
}

fn changed(h: GroupHparams) -> GroupHparams {
    GroupHparams { beta1: h.beta1 * 0.98, eps: h.eps * 2.0, ..h }
}

fn hyper(h: GroupHparams, step: u64) -> AdamHyper {
    AdamHyper {
        lr: h.lr,
        beta1: h.beta1,
        beta2: h.beta2,
        eps: h.eps,
        weight_decay: h.weight_decay,
        step,
        ..AdamHyper::default()
    }
}

fn f16_gradient(rng: &mut Rng, n: usize, magnitude: f64, loss_scale: f32) -> Vec<f16> {
    (0..n).map(|_| f16::from_f32((rng.normalish(magnitude) * loss_scale as f64) as f32)).collect()
}

/// How a sub-group's final state came about, as the test predicts it.
#[derive(Debug, PartialEq)]
enum Outcome {
    Exact,
    RolledBack,
    Rescaled,
    Redone,
}

#[test]
fn session_matches_the_reference_trainer() {
    let lay = layout();
    let mut rng = Rng::new(100);
    let scaler_options = LossScalerOptions { init_scale: 1024.0, growth_interval: 5, ..LossScalerOptions::default() };
    let session = Session::new(SessionOptions {
        grad_dtype: DType::F16,
        accum_dtype: DType::F32,
        speculation: Speculation::On,
        loss_scaler: Some(scaler_options),
        pool: Some(std::sync::Arc::new(pool(Isa::best(), 2))),
        ..SessionOptions::default()
    })
    .unwrap();
    let ref_pool = pool(Isa::best(), 3);
    let mut ref_scaler = LossScaler::new(scaler_options);

    for g in 0..2 {
        assert_eq!(session.add_group(schedule(g, 1)).unwrap(), g);
    }
    let mut masters: Vec<Vec<f32>> =
        lay.numels.iter().map(|&n| (0..n).map(|_| rng.normalish(0.5) as f32).collect()).collect();
    for (sg, (group, _)) in MODEL.iter().enumerate() {
        let slices = lay
            .slices
            .iter()
            .enumerate()
            .filter(|(_, (s, _))| *s == sg)
            .map(|(i, (_, r))| SliceDesc { name: format!("slice{i}"), offset: r.start, numel: r.len() })
            .collect();
        // SAFETY: the masters outlive the session and are only read between steps.
        let master =
            unsafe { Borrowed::new("master", masters[sg].as_mut_ptr().cast(), masters[sg].len(), DType::F32) }.unwrap();
        assert_eq!(session.add_subgroup(SubGroupDesc::new(*group, master, slices)).unwrap(), sg as u32);
    }

    let mut seen = std::collections::HashMap::new();
    for step in 1..=STEPS {
        let ev = events(step, lay.slices.len(), &mut rng);
        for g in 0..2 {
            session.set_group_hparams(g, schedule(g, step)).unwrap();
        }
        // The reference starts from the session's state.
        let loss_scale = session.loss_scale();
        assert_eq!(loss_scale, ref_scaler.scale, "step {step}: loss scale");
        let before: Vec<(Vec<f32>, Vec<f32>, Vec<f32>, u64)> = (0..MODEL.len())
            .map(|sg| {
                let (m, v) = session.moments(sg as u32).unwrap();
                (masters[sg].clone(), m, v, session.step_count(sg as u32).unwrap())
            })
            .collect();

        // Backward: gradients in reverse forward order; the reference accumulates the same.
        session.begin_step(None, ev.micro_steps).unwrap();
        let mut ref_grads: Vec<Vec<f32>> = lay.numels.iter().map(|&n| vec![0.0; n]).collect();
        let mut got_any = vec![false; lay.slices.len()];
        let mut spec_tickets = Vec::new();
        for micro in 0..ev.micro_steps {
            if micro > 0 {
                session.next_micro_step().unwrap();
            }
            for (i, (sg, range)) in lay.slices.iter().enumerate().rev() {
                if ev.missing == Some(i) {
                    continue;
                }
                let g = f16_gradient(&mut rng, range.len(), ev.magnitude, loss_scale);
                spec_tickets.extend(session.grad_copy(i as u32, Floats::F16(&g)).unwrap());
                kernels::copy_into(
                    FloatsMut::F32(&mut ref_grads[*sg][range.clone()]),
                    Floats::F16(&g),
                    got_any[i],
                    None,
                )
                .unwrap();
                got_any[i] = true;
            }
        }
        // Every speculative step runs before what follows (none is cancelled or preempted:
        // the paths this test predicts; tests/session_schedule.rs covers the others).
        for t in spec_tickets.drain(..) {
            let _ = session.wait(t, None);
        }
        let complete: Vec<bool> = (0..MODEL.len()).map(|sg| ev.missing.is_none_or(|m| lay.slices[m].0 != sg)).collect();
        let spec_grads = ref_grads.clone();
        let mut late_sg = None;
        if let Some(i) = ev.late {
            let (sg, range) = &lay.slices[i];
            let g = f16_gradient(&mut rng, range.len(), ev.magnitude, loss_scale);
            session.grad_copy(i as u32, Floats::F16(&g)).unwrap();
            kernels::copy_into(FloatsMut::F32(&mut ref_grads[*sg][range.clone()]), Floats::F16(&g), got_any[i], None)
                .unwrap();
            if complete[*sg] {
                late_sg = Some(*sg);
            }
        }
        let spec_groups = [schedule(0, step), schedule(1, step)];
        let mut groups = spec_groups;
        if let Some(g) = ev.changed_group {
            groups[g as usize] = changed(groups[g as usize]);
            session.set_group_hparams(g, groups[g as usize]).unwrap();
        }

        // The reference decision, from the complete gradients.
        let unscale = (1.0 / loss_scale as f64) as f32;
        // Per slice, in forward order, as the session takes them at hand-over.
        let local: f64 = lay
            .slices
            .iter()
            .map(|(sg, r)| kernels::grad_sumsq(&ref_pool, Floats::F32(&ref_grads[*sg][r.clone()]), unscale).unwrap())
            .sum();
        let norm = if ev.given_norm {
            let sumsq = session.local_grad_sumsq(None).unwrap();
            assert_eq!(sumsq.to_bits(), local.to_bits(), "step {step}: local sum of squares");
            NormSource::Given(sumsq.sqrt())
        } else {
            NormSource::Local
        };
        let ticket = session.step(StepArgs { max_norm: MAX_NORM, norm, overflow: ev.overflow }).unwrap();
        let result = session.step_result(ticket, None).unwrap();

        let skip = ev.overflow || !local.is_finite();
        let clip = if skip { 1.0 } else { clip_coefficient(MAX_NORM, local.sqrt()) };
        let factor = grad_factor(clip, loss_scale);
        assert_eq!(result.skipped, skip, "step {step}: skipped");
        if local.is_finite() {
            assert_eq!(result.global_norm.to_bits(), local.sqrt().to_bits(), "step {step}: global norm");
        }
        assert_eq!(result.clip_coef.to_bits(), clip.to_bits(), "step {step}: clip coefficient");
        assert_eq!(result.grad_factor.to_bits(), factor.to_bits(), "step {step}: factor");
        ref_scaler.update(skip);

        // Per sub-group: predict what happened, then compare.
        let mut counts = [0u32; 4];
        for (sg, (group, _)) in MODEL.iter().enumerate() {
            let (p0, m0, v0, count) = &before[sg];
            let spec_finite =
                kernels::grad_sumsq(&ref_pool, Floats::F32(&spec_grads[sg]), unscale).unwrap().is_finite();
            let applied = complete[sg] && spec_finite;
            let hp_changed = ev.changed_group == Some(*group);
            let outcome = match (skip, applied) {
                (true, true) => Outcome::RolledBack,
                (true, false) => Outcome::Exact,
                (false, true) if late_sg == Some(sg) || hp_changed => Outcome::Redone,
                (false, true) if factor != unscale => Outcome::Rescaled,
                _ => Outcome::Exact,
            };
            let spec_hp = hyper(spec_groups[*group as usize], count + 1);
            let now_hp = hyper(groups[*group as usize], count + 1);
            let (m1, v1) = session.moments(sg as u32).unwrap();
            let p1 = &masters[sg];
            assert_eq!(session.step_count(sg as u32).unwrap(), count + u64::from(!skip), "step {step} sg {sg}: count");

            if outcome == Outcome::Exact {
                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                if !skip {
                    let bufs = kernels::AdamBuffers {
                        param: FloatsMut::F32(&mut p),
                        grad: Floats::F32(&ref_grads[sg]),
                        moments: kernels::MomentsMut::F32 { exp_avg: &mut m, exp_avg_sq: &mut v },
                        copy_out: None,
                    };
                    let opts = UpdateOptions { grad_scale: factor, ..UpdateOptions::default() };
                    kernels::update(&ref_pool, &now_hp, bufs, &opts).unwrap();
                }
                let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    same(p1, &p) && same(&m1, &m) && same(&v1, &v),
                    "step {step} sg {sg}: not bit-exact ({ev_desc})",
                    ev_desc = describe(&ev)
                );
                continue;
            }
            counts[match outcome {
                Outcome::RolledBack => 0,
                Outcome::Rescaled => 1,
                Outcome::Redone => 2,
                Outcome::Exact => unreachable!(),
            }] += 1;
            let (ks, kn) = (Consts::new(&spec_hp), Consts::new(&now_hp));
            for i in 0..p1.len() {
                let (p, m, v) = (exact(p0[i] as f64), exact(m0[i] as f64), exact(v0[i] as f64));
                let g_spec = exact(spec_grads[sg][i] as f64);
                let spec = ref_update(&ks, unscale as f64, p, g_spec, m, v);
                let (want, bound) = match outcome {
                    Outcome::RolledBack => {
                        let back = ref_rollback(&ks, unscale as f64, spec.p, g_spec, spec.m, spec.v);
                        ((p, m, v), (back.p.e, back.m.e, back.v.e))
                    }
                    Outcome::Rescaled => {
                        let via = ref_rescale(&ks, unscale as f64, factor as f64, spec.p, g_spec, spec.m, spec.v);
                        let direct = ref_update(&kn, factor as f64, p, g_spec, m, v);
                        ((direct.p, direct.m, direct.v), (via.p.e, via.m.e, via.v.e))
                    }
                    Outcome::Redone => {
                        let back = ref_rollback(&ks, unscale as f64, spec.p, g_spec, spec.m, spec.v);
                        let perturbed = |x: T, e: f64| T { v: x.v, e };
                        let redo = ref_update(
                            &kn,
                            factor as f64,
                            perturbed(p, back.p.e),
                            exact(ref_grads[sg][i] as f64),
                            perturbed(m, back.m.e),
                            perturbed(v, back.v.e),
                        );
                        let direct = ref_update(&kn, factor as f64, p, exact(ref_grads[sg][i] as f64), m, v);
                        ((direct.p, direct.m, direct.v), (redo.p.e, redo.m.e, redo.v.e))
                    }
                    Outcome::Exact => unreachable!(),
                };
                let ctx = format!("step {step} sg {sg} {outcome:?}");
                assert_close(&format!("p {ctx}"), i, p1[i] as f64, T { v: want.0.v, e: bound.0 }, 2.0);
                assert_close(&format!("m {ctx}"), i, m1[i] as f64, T { v: want.1.v, e: bound.1 }, 2.0);
                assert_close(&format!("v {ctx}"), i, v1[i] as f64, T { v: want.2.v, e: bound.2 }, 2.0);
            }
        }
        assert_eq!(
            [result.rolled_back, result.rescaled, result.redone],
            [counts[0], counts[1], counts[2]],
            "step {step}: {result:?}"
        );
        for key in [
            ("clipped", !skip && clip < 1.0),
            ("skipped", skip),
            ("late", late_sg.is_some()),
            ("missing", ev.missing.is_some()),
            ("changed", ev.changed_group.is_some()),
            ("accumulated", ev.micro_steps > 1),
            ("rolled back", result.rolled_back > 0),
            ("rescaled", result.rescaled > 0),
            ("redone", result.redone > 0),
            ("kept", result.kept > 0),
            ("grew", result.next_loss_scale > loss_scale),
            ("backed off", result.next_loss_scale < loss_scale),
        ] {
            *seen.entry(key.0).or_insert(0) += u32::from(key.1);
        }
    }
    // The scenario must exercise every path, or this test proves less than it claims.
    for (key, n) in &seen {
        assert!(*n > 0, "no step was {key}: {seen:?}");
    }
}

fn describe(ev: &Events) -> String {
    format!(
        "micro {} missing {:?} late {:?} changed {:?} overflow {}",
        ev.micro_steps, ev.missing, ev.late, ev.changed_group, ev.overflow
    )
}
