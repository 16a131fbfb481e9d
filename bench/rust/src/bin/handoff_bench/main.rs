//! `handoff_bench`: what one gradient hand-off costs the training thread.
//!
//! A training framework hands the session one gradient per parameter, thousands of times a
//! step, from its backward hooks; each call must stay in microseconds and must not allocate.
//! This benchmark registers many small slices (default 10,000 slices of 64-1024 f32 elements
//! in 300 sub-groups), hands all of them over each step in backward order, and times every
//! call, through the Rust API (`Session::grad_copy`) and the C API
//! (`superoffload::ffi::session::so_session_grad_copy`, the exported function itself), each
//! with its own session, on alternating steps. A third pass per step copies the same bytes
//! with a plain `copy_from_slice` into buffers of the same layout, timed the same way.
//!
//! Per call, overhead = hand-off time - the median plain-copy time of the same slice. Reported:
//! median, p99 and max overhead over all calls, separately for the calls that complete a
//! sub-group (which queue its speculative step on the CPU-Adam thread and return a ticket)
//! and the others. The target is <= 10 us per call.
//!
//! Allocations: a counting global allocator counts, per thread, every alloc, alloc_zeroed
//! and realloc. Reported: allocations made by the training thread inside the hand-offs of
//! a step where no sub-group gets a late gradient (the target is 0), which calls made them,
//! and, for information, allocations made by every other thread in the same window (the
//! CPU-Adam thread and the pool running speculative steps). One final step hands one slice
//! over twice (a late gradient) to show the allocation the library documents for that case.

mod api;
mod baseline;
mod counters;
mod model;
mod report;

use superoffload_bench::*;

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;

use superoffload::kernels::{Pool, PoolOptions};

use api::Api;
use baseline::{plain_copies, timer_ns};
use model::{Rng, model};

const USAGE: &str = "\
handoff_bench: per-call cost and allocations of gradient hand-offs (Session::grad_copy and
so_session_grad_copy) for many small slices

USAGE: handoff_bench [OPTIONS]

OPTIONS:
  --slices N        slices (parameters) per step (default 10000)
  --subgroups G     sub-groups they are spread over, contiguously (default 300)
  --min-elems A     smallest slice, f32 elements (default 64)
  --max-elems B     largest slice (default 1024); sizes are uniform in [A, B]
  --steps S         measured steps per API (default 20)
  --warmup W        unmeasured steps per API first (default 3)
  --no-speculation  sessions without speculation (completing calls queue a sum of squares)
  --pool-cores LIST cores of the sessions' pools (default: every CPU this process may run
                    on except the training core)
  --train-core C    core of the training thread (default: the first allowed CPU)
  --json PATH       also write the results as JSON to PATH (- for stdout)
  -h, --help        this text";

struct Args {
    slices: usize,
    subgroups: usize,
    min: usize,
    max: usize,
    steps: usize,
    warmup: usize,
    speculation: bool,
    cores: Cores,
    json: Option<String>,
}

fn parse_args(cli: &mut Cli) -> Result<Args, String> {
    let mut a = Args {
        slices: 10_000,
        subgroups: 300,
        min: 64,
        max: 1024,
        steps: 20,
        warmup: 3,
        speculation: true,
        cores: Cores::default(),
        json: None,
    };
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--slices" => a.slices = cli.count()?,
            "--subgroups" => a.subgroups = cli.count()?,
            "--min-elems" => a.min = cli.count()?,
            "--max-elems" => a.max = cli.count()?,
            "--steps" => a.steps = cli.count()?,
            "--warmup" => a.warmup = cli.count()?,
            "--no-speculation" => a.speculation = !cli.switch()?,
            "--json" => a.json = Some(cli.value()?),
            f if a.cores.take_flag(cli, f)? => {}
            _ => return Err(cli.unknown()),
        }
    }
    if a.subgroups == 0 || a.slices < a.subgroups {
        return Err("need at least one sub-group and at least one slice per sub-group".into());
    }
    if a.min == 0 || a.min > a.max {
        return Err("need 1 <= --min-elems <= --max-elems".into());
    }
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    Ok(a)
}

fn run(a: Args) -> Result<(), String> {
    let (train_core, pool_cores) = a.cores.resolve()?;
    let m = model(&a);
    let mut rng = Rng(777);
    let grads: Vec<Vec<f32>> = m.slices.iter().map(|s| (0..s.2).map(|_| rng.small()).collect()).collect();
    let total_elems: usize = m.sg_numel.iter().sum();

    // Pools and sessions are created while this thread may run on the pool's cores only, so
    // that the sessions' CPU-Adam threads (which inherit that mask) stay off the training
    // core; the pools check their cores against the calling thread's mask, so they come first.
    let pool = Arc::new(
        Pool::new(&PoolOptions { cores: Some(pool_cores.clone()), ..PoolOptions::default() })
            .map_err(|e| e.to_string())?,
    );
    pin_current_thread(&pool_cores)?;
    let mut rust_api = Api::new_rust(&m, &pool, a.speculation)?;
    let mut c_api = Api::new_c(&m, &pool_cores, a.speculation)?; // its own pool, on the same cores
    pin_current_thread(&[train_core])?;

    println!(
        "handoff_bench: {} slices of {}-{} f32 elements (mean {:.0}) in {} sub-groups, {:.1} MB of gradients per step",
        a.slices,
        a.min,
        a.max,
        total_elems as f64 / a.slices as f64,
        a.subgroups,
        (total_elems * 4) as f64 / 1e6
    );
    println!(
        "training thread on core {train_core}, pools on cores {pool_cores:?}; speculation {}; {} measured steps per API after {} warm-up",
        if a.speculation { "on" } else { "off" },
        a.steps,
        a.warmup
    );

    let expected = a.subgroups;
    for s in 0..a.warmup + a.steps {
        let measure = s >= a.warmup;
        rust_api.step(&grads, measure, expected)?;
        c_api.step(&grads, measure, expected)?;
    }
    let (copy_ns, copy_step_ms) = plain_copies(&m, &grads, a.steps);
    let timer = timer_ns();

    let calls = report::call_table(&a, [&rust_api, &c_api], &copy_ns, &copy_step_ms, timer);

    // A late gradient: the documented allocation.
    let (late_allocs, redone, late_dt) = rust_api.late_step(&grads, 0)?;
    let late_sg_numel = m.sg_numel[m.slices[0].0];
    println!(
        "late gradient (slice 0 again after its sub-group of {} elements completed): {} allocation(s) on the training thread, {:.1} us; sub-groups redone at step(): {} (0 without speculation: nothing to undo)",
        late_sg_numel,
        late_allocs,
        late_dt.as_secs_f64() * 1e6,
        redone
    );
    let met = calls.worst_p99 <= 10.0;
    println!();
    println!(
        "target: overhead <= 10 us per call (p99 of all calls): {} (worst p99 {:.3} us); no allocation on the training thread: {}",
        if met { "met" } else { "NOT met" },
        calls.worst_p99,
        if calls.any_alloc { "NOT met" } else { "met" }
    );
    let mut json = calls.json;
    write!(
        json,
        "],\"late_gradient_allocs\":{},\"late_gradient_redone\":{},\"target_us\":10,\"overhead_target_met\":{},\"no_alloc_target_met\":{}}}",
        late_allocs, redone, met, !calls.any_alloc
    )
    .unwrap();
    if let Some(path) = &a.json {
        write_json(path, &json)?;
    }
    Ok(())
}

fn main() -> ExitCode {
    main_with("handoff_bench", USAGE, parse_args, run)
}
