//! `overlap_bench`: how well a session hides CPU Adam behind a (simulated) training loop.
//!
//! The training thread, pinned to a core outside the session pool's cores, runs L layers of
//! busy work (a fixed amount of its own CPU time per layer) per pass: a forward where layer k first waits for sub-group k's final ticket of
//! the previous step, then a backward (last layer first) that hands each layer's gradient to
//! the session (`grad_copy`, one slice per sub-group of P f32 elements) as soon as the layer
//! "finishes", then `step()`. Four modes run side by side, each with its own session on one
//! shared pool, in interleaved blocks of consecutive steps (so that machine noise hits all
//! of them alike; the first steps of each block refill the pipeline and are not counted):
//!
//! - `spec`: speculation on, no clipping: every speculative step is kept;
//! - `spec+clip`: speculation on, clipping on every step (max_norm = half the norm): every
//!   sub-group is rescaled at step(), in forward order, while the forward runs;
//! - `nospec`: speculation off ("step after backward"): all Adam work at step();
//! - `nospec+clip`: the same with clipping.
//!
//! Per mode: median step time (forward + backward + step(), one loop iteration), the
//! training thread's median wait for the optimizer per step, the median forward+backward
//! time without the waits (busy work and hand-offs), the backward time, the CPU Adam time of
//! a step alone (the kernels the session runs for that mode, on the same pool and
//! sub-group sizes, with no simulated compute and nothing else running), and the ratio
//! step / max(forward+backward, CPU Adam), which is 1 for perfect overlap.
//!
//! The target: a clipped step at most 1.15 x an unclipped one when the CPU Adam time of a
//! step is at most the forward time.
//!
//! With `--publish` each session has a transport that takes a bf16 copy of the weights and
//! sends it nowhere, as a CUDA session publishes to the GPU: a final pass may then publish
//! the copy first and write the master weights and moments after it, and the session chooses
//! for which sub-groups (`session/state_after.rs`). The previous step's result is read after
//! the backward, whose hand-offs waited for those state passes.

mod cpu_adam;
mod modes;
mod report;
mod workload;

use superoffload_bench::*;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use superoffload::kernels::{Pool, PoolOptions};

use cpu_adam::cpu_adam_alone;
use modes::{Kind, Mode};
use workload::gauss;

const USAGE: &str = "\
overlap_bench: step time of a simulated training loop with a superoffload session, with and
without speculation and clipping, next to the CPU Adam time alone

USAGE: overlap_bench [OPTIONS]

OPTIONS:
  --layers L        layers, one sub-group each (default 8)
  --elems P         f32 elements per layer (default 1m = 1048576; also 512k, 1e6, 1_000_000)
  --fwd-ms F        forward busy time per layer in ms (default 3)
  --bwd-ms B        backward busy time per layer in ms (default 6)
  --steps N         measured steps per mode (default 20)
  --block K         consecutive steps per mode per round; the first --refill of each block
                    are not measured (default 6)
  --refill R        steps per block that refill the pipeline, not measured (default 1)
  --pool-cores LIST cores of the session pool, e.g. 1 or 2-5 (default: every CPU this
                    process may run on except the training core)
  --train-core C    core of the training thread (default: the first CPU this process may
                    run on)
  --adam-thread W   where the sessions' CPU-Adam threads may run: pool (the pool's cores,
                    default), unpinned (any allowed CPU) or training (the training core,
                    what a session created by an already pinned training thread gets)
  --publish         give each session a transport that takes a bf16 copy of the weights
                    (and sends it nowhere), as a CUDA session does: final passes may
                    publish the copy before writing the master weights and moments
                    (the CPU Adam column stays that of one update per step)
  --bf16-moments    keep the sessions' moments in bf16 (speculation then writes the weights'
                    copy alone ahead; the CPU Adam column stays that of f32 moments)
  --json PATH       also write the results as JSON to PATH (- for stdout)
  -h, --help        this text

Memory: 16 x P x L bytes per mode (master, session gradient, two moments), 4 x P x L for
the gradients, 12 x P x L for the CPU Adam measurement: about 670 MB with the defaults.

The defaults (on a 2-core machine: the training thread on one core, a one-thread pool on
the other) put the CPU Adam time of a step somewhat below the forward time, the case the
1.15 target is about; --fwd-ms 0.5 --bwd-ms 1.5 shows the opposite case.";

struct Args {
    layers: usize,
    elems: usize,
    fwd: Duration,
    bwd: Duration,
    steps: usize,
    block: usize,
    refill: usize,
    cores: Cores,
    adam_thread: AdamThread,
    publish: bool,
    bf16_moments: bool,
    json: Option<String>,
}

/// Where the sessions' CPU-Adam threads may run (they inherit the creating thread's mask).
#[derive(Clone, Copy, PartialEq, Debug)]
enum AdamThread {
    Pool,
    Unpinned,
    Training,
}

fn parse_args(cli: &mut Cli) -> Result<Args, String> {
    let mut a = Args {
        layers: 8,
        elems: 1024 * 1024,
        fwd: Duration::from_millis(3),
        bwd: Duration::from_millis(6),
        steps: 20,
        block: 6,
        refill: 1,
        cores: Cores::default(),
        adam_thread: AdamThread::Pool,
        publish: false,
        bf16_moments: false,
        json: None,
    };
    while let Some(flag) = cli.next_flag() {
        match flag.as_str() {
            "--layers" => a.layers = cli.count()?,
            "--elems" => a.elems = cli.count()?,
            "--fwd-ms" => a.fwd = cli.millis()?,
            "--bwd-ms" => a.bwd = cli.millis()?,
            "--steps" => a.steps = cli.count()?,
            "--block" => a.block = cli.count()?,
            "--refill" => a.refill = cli.count()?,
            "--adam-thread" => {
                a.adam_thread = cli.choice(&[
                    ("pool", AdamThread::Pool),
                    ("unpinned", AdamThread::Unpinned),
                    ("training", AdamThread::Training),
                ])?
            }
            "--publish" => a.publish = cli.switch()?,
            "--bf16-moments" => a.bf16_moments = cli.switch()?,
            "--json" => a.json = Some(cli.value()?),
            f if a.cores.take_flag(cli, f)? => {}
            _ => return Err(cli.unknown()),
        }
    }
    if a.layers == 0 || a.elems == 0 || a.steps == 0 {
        return Err("--layers, --elems and --steps must be at least 1".into());
    }
    if a.block <= a.refill {
        return Err(format!("--block ({}) must be larger than --refill ({})", a.block, a.refill));
    }
    Ok(a)
}

fn run(a: Args) -> Result<(), String> {
    let (train_core, pool_cores) = a.cores.resolve()?;
    // The pool is created before the training thread pins itself: the library checks pool
    // cores against the calling thread's affinity mask. Each session's CPU-Adam thread
    // inherits the mask of the thread that creates the session: with --adam-thread pool
    // (the default) the sessions are created while this thread is restricted to the pool's
    // cores, so those threads stay off the training core.
    let pool = Arc::new(
        Pool::new(&PoolOptions { cores: Some(pool_cores.clone()), ..PoolOptions::default() })
            .map_err(|e| format!("pool: {e}"))?,
    );
    let grads: Vec<Vec<f32>> =
        (0..a.layers).map(|k| (0..a.elems).map(|i| 0.01 * gauss(200 + k as u64, i)).collect()).collect();
    let sumsq: f64 = grads.iter().flat_map(|g| g.iter()).map(|&x| x as f64 * x as f64).sum();
    let max_norm = 0.5 * sumsq.sqrt(); // clip coefficient ~0.5 on every clipped step
    let saved_mask = allowed_cpus();
    match a.adam_thread {
        AdamThread::Pool => pin_current_thread(&pool_cores)?,
        AdamThread::Training => pin_current_thread(&[train_core])?,
        AdamThread::Unpinned => {}
    }
    let mut modes: Vec<Mode> = Kind::ALL.iter().map(|&k| Mode::new(k, &pool, &a)).collect::<Result<_, _>>()?;
    pin_current_thread(&saved_mask)?;
    pin_current_thread(&[train_core])?;

    println!(
        "overlap_bench: {} layers x {} f32 elements ({:.1} MB of master weights), forward {:.2} ms + backward {:.2} ms per layer{}",
        a.layers,
        a.elems,
        (a.layers * a.elems * 4) as f64 / 1e6,
        a.fwd.as_secs_f64() * 1e3,
        a.bwd.as_secs_f64() * 1e3,
        [(a.publish, ", a bf16 copy published"), (a.bf16_moments, ", bf16 moments")]
            .iter()
            .filter_map(|&(on, words)| on.then_some(words))
            .collect::<String>()
    );
    println!(
        "training thread on core {train_core}; session pool: {} thread(s) on cores {:?}, {}; {} measured steps per mode in blocks of {} (first {} not measured)",
        pool.num_threads(),
        pool_cores,
        pool.isa().name(),
        a.steps,
        a.block,
        a.refill
    );

    let cpu = cpu_adam_alone(&pool, &a, &grads, 5)?;

    // Interleaved blocks.
    let per_block = a.block - a.refill;
    let rounds = a.steps.div_ceil(per_block);
    for _ in 0..rounds {
        for mode in modes.iter_mut() {
            mode.run_block(&a, &grads, max_norm)?;
        }
    }

    report::report(&a, train_core, &pool_cores, &modes, &cpu)
}

fn main() -> ExitCode {
    main_with("overlap_bench", USAGE, parse_args, run)
}
