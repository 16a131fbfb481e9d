//! The per-call table of both APIs next to the plain copies, and a summary per API.

use std::fmt::Write as _;

use superoffload_bench::{json_num, median, percentile, sorted};

use crate::Args;
use crate::api::Api;

/// What the per-call table found.
pub struct CallReport {
    /// The JSON document up to the APIs' array, which is still open.
    pub json: String,
    /// The worst p99 overhead of the two APIs, us.
    pub worst_p99: f64,
    /// Whether the training thread allocated in a measured hand-off.
    pub any_alloc: bool,
}

/// Prints the per-call times and overheads of `apis` (overhead: call time - `copy_ns`, the
/// median plain-copy time of the same slice) and a summary per API: its step time next to
/// `copy_step_ms`, allocations and context switches; `timer` is the timer's own cost in ns,
/// part of every time.
pub fn call_table(a: &Args, apis: [&Api; 2], copy_ns: &[f64], copy_step_ms: &[f64], timer: f64) -> CallReport {
    println!();
    println!(
        "{:<22} {:>8} {:>8} {:>9} {:>8} {:>8} {:>8} {:>9} {:>10} {:>18}",
        "per call (us)",
        "median",
        "p99",
        "max",
        "ovh mean",
        "ovh med",
        "ovh p99",
        "ovh max",
        "> 10 us",
        "not preempted"
    );
    let copy_sorted = sorted(copy_ns.iter().map(|x| x / 1e3).collect());
    println!(
        "{:<22} {:>8.3} {:>8.3} {:>9.3} {:>8} {:>8} {:>8} {:>9} {:>10} {:>18}",
        "plain copy",
        percentile(&copy_sorted, 0.5),
        percentile(&copy_sorted, 0.99),
        copy_sorted.last().copied().unwrap_or(f64::NAN),
        "-",
        "-",
        "-",
        "-",
        "-",
        "-"
    );
    let mut json = String::new();
    write!(
        json,
        "{{\"slices\":{},\"subgroups\":{},\"min_elems\":{},\"max_elems\":{},\"speculation\":{},\"steps\":{},\"timer_ns\":{},\"plain_copy_step_ms\":{},\"apis\":[",
        a.slices,
        a.subgroups,
        a.min,
        a.max,
        a.speculation,
        a.steps,
        json_num(timer),
        json_num(median(copy_step_ms))
    )
    .unwrap();
    let mut worst_p99: f64 = 0.0;
    let mut any_alloc = false;
    let mut summaries = Vec::new();
    for (k, api) in apis.into_iter().enumerate() {
        let total = sorted(api.calls.iter().map(|c| c.1 / 1e3).collect());
        let ovh = |filter: &dyn Fn(bool) -> bool| {
            sorted(api.calls.iter().filter(|c| filter(c.2)).map(|c| (c.1 - copy_ns[c.0]) / 1e3).collect())
        };
        let over_unpreempted = |filter: &dyn Fn(bool) -> bool| {
            let calls: Vec<_> = api.calls.iter().filter(|c| filter(c.2) && !c.3).collect();
            let over = calls.iter().filter(|c| (c.1 - copy_ns[c.0]) / 1e3 > 10.0).count();
            let max = calls.iter().map(|c| (c.1 - copy_ns[c.0]) / 1e3).fold(0.0f64, f64::max);
            format!("{over}/{} max {max:.0}", calls.len())
        };
        let all = ovh(&|_| true);
        let completing = ovh(&|x| x);
        let other = ovh(&|x| !x);
        let row = |label: &str, t: Option<&Vec<f64>>, o: &Vec<f64>, unpreempted: String| {
            let (m, p, x) = match t {
                Some(t) => (
                    format!("{:.3}", percentile(t, 0.5)),
                    format!("{:.3}", percentile(t, 0.99)),
                    format!("{:.1}", t.last().copied().unwrap_or(f64::NAN)),
                ),
                None => ("".into(), "".into(), "".into()),
            };
            let mean = o.iter().sum::<f64>() / o.len().max(1) as f64;
            let over = o.iter().filter(|&&x| x > 10.0).count();
            println!(
                "{:<22} {:>8} {:>8} {:>9} {:>8.3} {:>8.3} {:>8.3} {:>9.1} {:>10} {:>18}",
                label,
                m,
                p,
                x,
                mean,
                percentile(o, 0.5),
                percentile(o, 0.99),
                o.last().copied().unwrap_or(f64::NAN),
                format!("{over}/{}", o.len()),
                unpreempted
            );
        };
        row(api.name, Some(&total), &all, over_unpreempted(&|_| true));
        row(
            &format!("  completing ({}/step)", completing.len() / a.steps.max(1)),
            None,
            &completing,
            over_unpreempted(&|x| x),
        );
        row("  other", None, &other, over_unpreempted(&|x| !x));
        worst_p99 = worst_p99.max(percentile(&all, 0.99));
        let mine_total: u64 = api.my_allocs.iter().sum();
        let other_total: u64 = api.other_allocs.iter().sum();
        any_alloc |= mine_total > 0;
        let step_med = median(&api.step_ms);
        let step_min = sorted(api.step_ms.clone())[0];
        summaries.push(format!(
            "{}: time in the hand-offs of a step {:.2} ms median, {:.2} ms min (plain copies: {:.2} ms median); training-thread allocations in the hand-offs: {} per step \
             (total {} over {} steps: {} in {} completing calls, {} in {} other calls); other threads in the same window: {:.1} per step; \
             context switches of the training thread in the hand-offs: {:.2} voluntary (blocked) and {:.2} involuntary (preempted) per step",
            api.name,
            step_med,
            step_min,
            median(copy_step_ms),
            if api.my_allocs.iter().all(|&x| x == api.my_allocs[0]) { api.my_allocs[0].to_string() } else { format!("{:?}", api.my_allocs) },
            mine_total,
            a.steps,
            api.alloc_count.0,
            api.alloc_calls.0,
            api.alloc_count.1,
            api.alloc_calls.1,
            other_total as f64 / a.steps as f64,
            api.switches.0 as f64 / a.steps as f64,
            api.switches.1 as f64 / a.steps as f64
        ));
        if k > 0 {
            json.push(',');
        }
        write!(
            json,
            "{{\"api\":\"{}\",\"call_us_median\":{},\"call_us_p99\":{},\"overhead_us_median\":{},\"overhead_us_p99\":{},\"overhead_us_max\":{},\"overhead_us_mean\":{},\"calls_over_10us\":{},\"completing_overhead_us_median\":{},\"completing_overhead_us_p99\":{},\"other_overhead_us_median\":{},\"other_overhead_us_p99\":{},\"step_handoff_ms\":{},\"train_thread_allocs_per_step\":{},\"allocs_in_completing_calls\":{},\"allocs_in_other_calls\":{},\"other_thread_allocs_per_step\":{},\"voluntary_switches_per_step\":{},\"involuntary_switches_per_step\":{}}}",
            api.name,
            json_num(percentile(&total, 0.5)),
            json_num(percentile(&total, 0.99)),
            json_num(percentile(&all, 0.5)),
            json_num(percentile(&all, 0.99)),
            json_num(all.last().copied().unwrap_or(f64::NAN)),
            json_num(all.iter().sum::<f64>() / all.len().max(1) as f64),
            all.iter().filter(|&&x| x > 10.0).count(),
            json_num(percentile(&completing, 0.5)),
            json_num(percentile(&completing, 0.99)),
            json_num(percentile(&other, 0.5)),
            json_num(percentile(&other, 0.99)),
            json_num(step_med),
            json_num(mine_total as f64 / a.steps as f64),
            api.alloc_count.0,
            api.alloc_count.1,
            json_num(other_total as f64 / a.steps as f64),
            json_num(api.switches.0 as f64 / a.steps as f64),
            json_num(api.switches.1 as f64 / a.steps as f64)
        )
        .unwrap();
    }
    println!("(overhead = call time - median plain-copy time of the same slice; timer pair {timer:.0} ns, in both;");
    println!(
        " > 10 us: calls whose overhead exceeds 10 us, of all calls and of those during which the thread was not preempted)"
    );
    println!();
    for s in &summaries {
        println!("{s}");
    }
    CallReport { json, worst_p99, any_alloc }
}
