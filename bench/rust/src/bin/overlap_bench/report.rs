//! The results: a table of the modes, the checks of their behaviour and of the clipping
//! target, and the JSON document.

use std::fmt::Write as _;

use superoffload_bench::{json_num, median, percentile, sorted, write_json};

use crate::Args;
use crate::modes::{Kind, Mode};

/// Prints the table of the modes and the verdicts, and writes the JSON document with
/// `--json`; `cpu` holds the CPU Adam times of a step alone (`cpu_adam_alone`).
pub fn report(a: &Args, train_core: usize, pool_cores: &[usize], modes: &[Mode], cpu: &[f64; 4]) -> Result<(), String> {
    // Table.
    let nominal_fwd = a.fwd.as_secs_f64() * 1e3 * a.layers as f64;
    println!();
    println!(
        "{:<12} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>6} {:>6}  kept/resc/stepped",
        "mode",
        "step",
        "p90",
        "wait",
        "preempt",
        "adj",
        "fwd+bwd",
        "fwd",
        "bwd",
        "hand-off",
        "CPU Adam",
        "ratio",
        "adj"
    );
    let mut json = String::new();
    write!(
        json,
        "{{\"layers\":{},\"elems\":{},\"fwd_ms_per_layer\":{},\"bwd_ms_per_layer\":{},\"publish\":{},\"train_core\":{},\"pool_cores\":{:?},\"modes\":[",
        a.layers,
        a.elems,
        json_num(a.fwd.as_secs_f64() * 1e3),
        json_num(a.bwd.as_secs_f64() * 1e3),
        a.publish,
        train_core,
        pool_cores
    )
    .unwrap();
    let mut medians = Vec::new();
    let mut adjusted = Vec::new();
    for (i, m) in modes.iter().enumerate() {
        let (step, p90, wait, preempt, busy, fwd, bwd, handoff) = (
            median(&m.step_ms),
            percentile(&sorted(m.step_ms.clone()), 0.9),
            median(&m.wait_ms),
            median(&m.preempt_ms),
            median(&m.busy_ms),
            median(&m.fwd_ms),
            median(&m.bwd_ms),
            median(&m.handoff_ms),
        );
        let step_adj = median(&m.step_ms.iter().zip(&m.preempt_ms).map(|(s, p)| s - p).collect::<Vec<_>>());
        let busy_adj = median(&m.busy_ms.iter().zip(&m.preempt_ms).map(|(s, p)| s - p).collect::<Vec<_>>());
        let cpu_i = cpu[m.kind.cpu_index()];
        let ratio = step / busy.max(cpu_i);
        let ratio_adj = step_adj / busy_adj.max(cpu_i);
        let per = |x: u64| x as f64 / m.steps.max(1) as f64;
        println!(
            "{:<12} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>7.2} {:>8.2} {:>8.2} {:>6.3} {:>6.3}  {:.0}/{:.0}/{:.0}{}",
            m.kind.name(),
            step,
            p90,
            wait,
            preempt,
            step_adj,
            busy,
            fwd,
            bwd,
            handoff,
            cpu_i,
            ratio,
            ratio_adj,
            per(m.kept),
            per(m.rescaled),
            per(m.stepped),
            if m.other > 0 { format!(" ({} rolled back/redone/skipped!)", m.other) } else { String::new() }
        );
        if i > 0 {
            json.push(',');
        }
        write!(
            json,
            "{{\"mode\":\"{}\",\"step_ms\":{},\"step_p90_ms\":{},\"wait_ms\":{},\"preempted_ms\":{},\"step_adjusted_ms\":{},\"fwd_bwd_ms\":{},\"fwd_ms\":{},\"bwd_ms\":{},\"handoff_ms\":{},\"cpu_adam_ms\":{},\"ratio\":{},\"ratio_adjusted\":{},\"kept_per_step\":{},\"rescaled_per_step\":{},\"stepped_per_step\":{},\"clipped_steps\":{},\"steps\":{}}}",
            m.kind.name(),
            json_num(step),
            json_num(p90),
            json_num(wait),
            json_num(preempt),
            json_num(step_adj),
            json_num(busy),
            json_num(fwd),
            json_num(bwd),
            json_num(handoff),
            json_num(cpu_i),
            json_num(ratio),
            json_num(ratio_adj),
            json_num(per(m.kept)),
            json_num(per(m.rescaled)),
            json_num(per(m.stepped)),
            m.clipped,
            m.steps
        )
        .unwrap();
        medians.push(step);
        adjusted.push(step_adj);
    }
    println!(
        "(ms, medians over {} steps per mode. step: forward + backward + step(), one loop iteration; wait: the training",
        a.steps
    );
    println!(
        " thread waiting for the optimizer; preempt: the training thread off its CPU outside the waits (wall - thread CPU"
    );
    println!(
        " time: other processes on its core); adj: step - preempt; fwd+bwd: step - wait; bwd includes the hand-offs"
    );
    println!(
        " (time in grad_copy); CPU Adam: that mode's kernels alone for one step, nothing else running; ratio: step /"
    );
    println!(" max(fwd+bwd, CPU Adam), 1 = perfect overlap; adj: the same without the preempted time)");

    let behaved = modes_behaved(a, modes);

    let clip_ratio = medians[1] / medians[0];
    let clip_ratio_adj = adjusted[1] / adjusted[0];
    let applies = cpu[0] <= nominal_fwd;
    let met = clip_ratio <= 1.15;
    let met_adj = clip_ratio_adj <= 1.15;
    let verdict = |m: bool| {
        if !applies {
            "does not apply: CPU Adam exceeds the forward"
        } else if m {
            "met"
        } else {
            "NOT met"
        }
    };
    println!();
    println!(
        "clipped / unclipped step, speculation on: {:.3} ({}), {:.3} without preempted time ({}); target <= 1.15 when CPU Adam {:.2} ms <= forward {:.2} ms",
        clip_ratio,
        verdict(met),
        clip_ratio_adj,
        verdict(met_adj),
        cpu[0],
        nominal_fwd
    );
    // Modes come in pairs, unclipped then clipped: modes `num` and `num + 1` over `den` and `den + 1`.
    let ratios = |what: &str, num: usize, den: usize| {
        println!(
            "{what}: {:.3} unclipped, {:.3} clipped ({:.3} and {:.3} without preempted time)",
            medians[num] / medians[den],
            medians[num + 1] / medians[den + 1],
            adjusted[num] / adjusted[den],
            adjusted[num + 1] / adjusted[den + 1]
        )
    };
    ratios("speculation off / on", 2, 0);
    ratios("automatic speculation / off", 4, 2);
    write!(
        json,
        "],\"clipped_over_unclipped\":{},\"clipped_over_unclipped_adjusted\":{},\"target\":1.15,\"target_applies\":{},\"target_met\":{},\"target_met_adjusted\":{},\"modes_behaved\":{}}}",
        json_num(clip_ratio),
        json_num(clip_ratio_adj),
        applies,
        met,
        met_adj,
        behaved
    )
    .unwrap();
    if let Some(path) = &a.json {
        write_json(path, &json)?;
    }
    Ok(())
}

/// Whether each mode's steps went as its settings intend; prints a warning for each mode
/// that did not.
fn modes_behaved(a: &Args, modes: &[Mode]) -> bool {
    // Expected behaviour of each mode.
    let mut behaved = true;
    for m in modes {
        let l = (a.layers as u64) * m.steps;
        let ok = match m.kind {
            // A speculative step that had not started at step() is cancelled and stepped once.
            Kind::Spec | Kind::Auto => m.kept + m.stepped == l,
            Kind::SpecClip => m.rescaled + m.stepped == l && m.clipped == m.steps,
            Kind::NoSpec => m.stepped == l,
            Kind::NoSpecClip | Kind::AutoClip => m.stepped + m.rescaled == l && m.clipped == m.steps,
        } && m.other == 0;
        if !ok {
            behaved = false;
            println!(
                "warning: mode {} did not behave as intended (kept {}, rescaled {}, stepped {}, other {}, clipped {} of {} steps)",
                m.kind.name(),
                m.kept,
                m.rescaled,
                m.stepped,
                m.other,
                m.clipped,
                m.steps
            );
        }
    }
    behaved
}
