//! Soak: one host-mode session of five sub-groups (two param groups, bf16
//! gradients accumulated in f32, the built-in loss scaler, a bf16 copy of the weights, one
//! sub-group with a caller gradient buffer) runs many steps through the C API with random
//! clipping (triggering on about half the steps), caller overflows, inf gradients, late,
//! repeated and missing gradients, micro-step accumulation, LR schedules, hyperparameter
//! changes during backward, caller-given norms, saves, loads (also of corrupted files) and
//! steps that begin before the previous one was looked at. The model of `tests/fuzz` checks
//! every call; the weights and moments are compared with the plain reference at every save,
//! after every load and at the end. Resident memory (`/proc/self/statm`) and open file
//! descriptors (`/proc/self/fd`) must stay flat after a warm-up.
//!
//! CI: 1,500 steps. `SO_SOAK_STEPS=10000 cargo test --test session_soak -- --nocapture` for
//! the long run.

mod common;
mod fuzz;

use std::time::Instant;

use common::Rng;
use fuzz::api;
use fuzz::model::{Phase, World};
use fuzz::ops::*;
use fuzz::reference;
use superoffload::session::LossScalerOptions;

const CI_STEPS: u64 = 1500;
/// Allowed growth of resident memory after the warm-up.
const RSS_SLACK_BYTES: u64 = 16 << 20;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf has no preconditions.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").expect("/proc/self/fd").count()
}

/// (group, slice sizes, caller gradient buffer) per sub-group.
const LAYOUT: &[(u32, &[usize], bool)] = &[
    (0, &[3000, 64], false),
    (0, &[1200], false),
    (1, &[2048, 2048, 400], true),
    (1, &[800], false),
    (0, &[5000, 1000], false),
];

fn schedule(group: u32, step: u64) -> [f64; 5] {
    let warmup = ((step + 1) as f64 / 100.0).min(1.0);
    let decay = 0.5 + 0.5 * (step as f64 / 3000.0).cos();
    match group {
        0 => [1e-3 * warmup * decay, 0.9, 0.999, 1e-8, 0.01],
        _ => [5e-4 * warmup * decay, 0.85, 0.995, 1e-6, 0.0],
    }
}

fn apply(w: &mut World, op: Op, calls: &mut u64) {
    let before = api::calls();
    if let Err(e) = w.apply(&op) {
        panic!("soak: {op:?}: {e}");
    }
    *calls += api::calls() - before;
}

#[test]
fn session_soak() {
    let steps = std::env::var("SO_SOAK_STEPS").map_or(CI_STEPS, |v| v.parse().expect("SO_SOAK_STEPS"));
    let dir = fuzz::scratch_dir("soak");
    let mut w = World::new(dir.join("soak"));
    let mut rng = Rng::new(7);
    let mut calls = 0;
    let start = Instant::now();
    let create = CreateSpec {
        null_options: false,
        null_out: false,
        size_delta: 0,
        mode: api::MODE_ADAMW,
        bias_correction: true,
        moment: api::DT_F32,
        grad: api::DT_BF16,
        accum: api::DT_F32,
        speculation: api::SPEC_ON,
        limit: 0,
        amsgrad: false,
        scaler: Some(ScalerSpec {
            size_ok: true,
            options: LossScalerOptions {
                init_scale: 1024.0,
                growth_factor: 2.0,
                backoff_factor: 0.5,
                growth_interval: 40,
                hysteresis: 2,
                min_scale: 1.0,
            },
        }),
        copy: api::DT_BF16,
        pool: PoolSpec::Default,
        gpu_budget: 0,
    };
    apply(&mut w, Op::Create(create), &mut calls);
    for g in 0..2 {
        apply(
            &mut w,
            Op::AddGroup { hp: HpSpec { hp: schedule(g, 0), bad: HpBad::None }, null_out: false },
            &mut calls,
        );
    }
    let mut name = 0;
    for (i, (group, sizes, caller)) in LAYOUT.iter().enumerate() {
        let mut offset = 0;
        let slices = sizes
            .iter()
            .map(|&n| {
                name += 1;
                let s = SliceSpec { name: NameSpec::Named(format!("w{name}")), offset, numel: n };
                offset += n;
                s
            })
            .collect();
        let spec = SgSpec {
            group: *group,
            numel: offset,
            master_dtype: api::DT_F32,
            slices,
            caller_grad: *caller,
            seed: 100 + i as u64,
            bad: SgBad::None,
            placement: api::PLACE_HOST,
        };
        apply(&mut w, Op::AddSubgroup(spec), &mut calls);
    }
    let nslices = w.sess.as_ref().unwrap().slices.len() as u32;
    let caller_slices: Vec<u32> = {
        let s = w.sess.as_ref().unwrap();
        (0..nslices).filter(|&i| s.sgs[s.slices[i as usize].sg as usize].as_ref().unwrap().grad_buf.is_some()).collect()
    };

    let warmup = (steps / 10).clamp(20, 500);
    let (mut rss0, mut fds0, mut rss_max, mut fds_max) = (0, 0, 0, 0);
    let mut counts = [0u64; 8];
    let mut last_save = None;
    for step in 0..steps {
        if step == warmup {
            rss0 = rss_bytes();
            fds0 = open_fds();
        }
        if step >= warmup && step % 50 == 0 {
            rss_max = rss_max.max(rss_bytes());
            fds_max = fds_max.max(open_fds());
        }
        // LR schedule between steps.
        for g in 0..2 {
            apply(
                &mut w,
                Op::SetGroup { group: g, hp: HpSpec { hp: schedule(g, step), bad: HpBad::None } },
                &mut calls,
            );
        }
        let micro_steps = if rng.below(10) == 0 { 2 } else { 1 };
        apply(&mut w, Op::BeginStep { loss_scale: 0.0, micro_steps, settle: rng.below(2) == 0 }, &mut calls);
        let magnitude = 10f64.powf(rng.range(-3.0, -0.5));
        let missing = (rng.below(12) == 0).then(|| rng.below(nslices as usize) as u32);
        let inf_step = rng.below(40) == 0;
        for micro in 0..micro_steps {
            if micro > 0 {
                apply(&mut w, Op::NextMicro, &mut calls);
            }
            for slice in (0..nslices).rev() {
                if missing == Some(slice) {
                    continue;
                }
                let special = if inf_step && slice == 0 { Special::Inf(rng.below(64)) } else { Special::None };
                let fill = Fill { seed: rng.next_u64(), magnitude, special };
                let op = if caller_slices.contains(&slice) && rng.below(2) == 0 {
                    Op::GradWritten { slice, fill, add: micro > 0 }
                } else {
                    let n = w.sess.as_ref().unwrap().slices[slice as usize].range.len();
                    Op::GradCopy { slice, numel: n, fill, bad: GradBad::None }
                };
                apply(&mut w, op, &mut calls);
                if rng.below(50) == 0 {
                    // The same gradient hook firing twice.
                    let n = w.sess.as_ref().unwrap().slices[slice as usize].range.len();
                    let fill = Fill { seed: rng.next_u64(), magnitude, special: Special::None };
                    apply(&mut w, Op::GradCopy { slice, numel: n, fill, bad: GradBad::None }, &mut calls);
                }
            }
        }
        if rng.below(12) == 0 {
            // A late gradient, after its sub-group's speculative step.
            let slice = rng.below(nslices as usize) as u32;
            let n = w.sess.as_ref().unwrap().slices[slice as usize].range.len();
            let fill = Fill { seed: rng.next_u64(), magnitude, special: Special::None };
            apply(&mut w, Op::GradCopy { slice, numel: n, fill, bad: GradBad::None }, &mut calls);
            counts[0] += 1;
        }
        if rng.below(20) == 0 {
            // Hyperparameters changed during backward: speculative steps are redone.
            let g = rng.below(2) as u32;
            let mut hp = schedule(g, step);
            hp[3] *= 2.0;
            apply(&mut w, Op::SetGroup { group: g, hp: HpSpec { hp, bad: HpBad::None } }, &mut calls);
        }
        let given = rng.below(5) == 0;
        if given {
            apply(&mut w, Op::LocalSumsq { timeout_ns: -1, null_out: false }, &mut calls);
        }
        let norm = {
            let s = w.sess.as_ref().unwrap();
            let unscale = (1.0 / s.s as f64) as f32;
            s.live_sgs().map(|sg| reference::sumsq(&sg.g, unscale)).sum::<f64>().sqrt()
        };
        let max_norm = if rng.below(2) == 0 || !norm.is_finite() { 0.0 } else { norm * rng.range(0.3, 1.5) };
        let overflow = rng.below(33) == 0;
        let args = ArgsSpec {
            null_args: false,
            bad_size: false,
            null_out: false,
            max_norm,
            norm_source: if given { api::NORM_GIVEN } else { api::NORM_LOCAL },
            given: norm,
            overflow,
        };
        apply(&mut w, Op::Step(args), &mut calls);
        counts[1] += (max_norm > 0.0 && max_norm < norm) as u64;
        counts[2] += overflow as u64;
        counts[3] += inf_step as u64;
        counts[4] += missing.is_some() as u64;
        if step % 50 == 49 {
            let slot = ((step / 50) % 2) as u8;
            apply(&mut w, Op::Save(SaveTarget::Slot(slot)), &mut calls);
            last_save = Some(slot);
            counts[5] += 1;
        }
        if step % 120 == 119
            && let Some(slot) = last_save
        {
            // Back to the latest checkpoint: weights, moments, counts, scaler.
            apply(&mut w, Op::Load(LoadSource::Slot(slot)), &mut calls);
            apply(&mut w, Op::Observe, &mut calls);
            counts[6] += 1;
        }
        if step % 300 == 299
            && let Some(slot) = last_save
        {
            apply(&mut w, Op::Load(LoadSource::Flipped(slot, rng.next_u64())), &mut calls);
            apply(&mut w, Op::Load(LoadSource::Truncated(slot, rng.next_u64())), &mut calls);
            counts[7] += 1;
        }
        assert_eq!(w.sess.as_ref().unwrap().phase, Phase::Idle);
    }
    apply(&mut w, Op::Settle, &mut calls);
    apply(&mut w, Op::Observe, &mut calls);
    let (rss1, fds1) = (rss_bytes(), open_fds());
    let stats = w.stats;
    apply(&mut w, Op::Destroy, &mut calls);
    let _ = std::fs::remove_dir_all(&dir);
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "soak: {steps} steps, {calls} C calls in {:.1} s; RSS {:.1} MiB after {warmup} steps, {:.1} MiB at the end \
         (max {:.1}); open fds {fds0} -> {fds1} (max {fds_max})\n  late {} clipped {} overflow {} inf {} missing {} \
         saves {} loads {} corrupted loads {}\n  {stats:?}",
        start.elapsed().as_secs_f64(),
        mb(rss0),
        mb(rss1),
        mb(rss_max.max(rss1)),
        counts[0],
        counts[1],
        counts[2],
        counts[3],
        counts[4],
        counts[5],
        counts[6],
        counts[7],
    );
    assert!(
        rss_max.max(rss1) <= rss0 + RSS_SLACK_BYTES,
        "resident memory grew from {:.1} MiB to {:.1} MiB",
        mb(rss0),
        mb(rss_max.max(rss1))
    );
    assert!(fds1 <= fds0 && fds_max <= fds0, "open file descriptors grew: {fds0} -> {fds1} (max {fds_max})");
    assert!(stats.rescaled > 0 && stats.rolled_back > 0 && stats.redone > 0 && stats.loads_ok > 0, "{stats:?}");
}
