//! Stateful property-based fuzzer of the session's C API.
//!
//! Random sequences of calls (create with good and bad options, groups, sub-groups with
//! good and bad descriptions, steps with micro-steps, gradients right and wrong, late,
//! twice, missing, NaN/inf, hyperparameter changes, clipping that triggers or not, absurd
//! norms and loss scales, results, ticket waits and queries, saves, loads of good,
//! truncated, bit-flipped and foreign checkpoints, removal, repartitioning, destruction)
//! go through the exported `extern "C"` functions (`tests/fuzz/api.rs`); after every call
//! `tests/fuzz/model/` checks the status, the out-parameters, that refusals change
//! nothing, step counts and results, and the weights and moments against a plain reference.
//!
//! CI: a fixed set of seeds (`cargo test --test session_fuzz`). Long runs:
//!
//! ```text
//! SO_FUZZ_SECONDS=600 cargo test --release --test session_fuzz -- --nocapture   # random seeds
//! SO_FUZZ_SEED=1234 cargo test --test session_fuzz -- --nocapture               # one sequence
//! SO_FUZZ_OPS=2000   (operations per sequence; default 200)
//! ```
//!
//! A failure prints the seed, the failure and the sequence, shrunk by deleting operations
//! while it still fails.

mod common;
mod fuzz;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fuzz::api;
use fuzz::generate::Gen;
use fuzz::model::{Stats, World};
use fuzz::ops::Op;

/// Sequences in a CI run, and operations per sequence.
const CI_SEQUENCES: u64 = 1000;
const DEFAULT_OPS: usize = 200;

struct Run {
    ops: Vec<Op>,
    failure: Option<String>,
    stats: Stats,
    calls: u64,
}

fn panic_message(payload: Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".into())
}

/// Seconds a sequence may take before it counts as hung (a ticket that never completes, a
/// deadlock): `SO_FUZZ_HANG_SECONDS`, default 60 (a sequence takes well under a second).
fn hang_seconds() -> u64 {
    env_u64("SO_FUZZ_HANG_SECONDS").unwrap_or(60)
}

/// Runs `f` on a thread of its own: `None` if it has not finished after `secs` seconds (the
/// thread is then left behind, stuck).
fn within<T: Send + 'static>(secs: u64, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(Duration::from_secs(secs)).ok()
}

/// One sequence, with a hang detector: a sequence stuck in a call fails with the operation.
fn run_seed_guarded(seed: u64, max_ops: usize, dir: &std::path::Path) -> Run {
    let log = Arc::new(Mutex::new(Vec::new()));
    let (log2, dir2) = (log.clone(), dir.to_path_buf());
    let secs = hang_seconds();
    within(secs, move || run_seed(seed, max_ops, &dir2, &log2)).unwrap_or_else(|| {
        let ops = log.lock().unwrap().clone();
        let failure =
            format!("hang: operation {} has not returned after {secs} s: {:?}", ops.len() - 1, ops.last().unwrap());
        Run { ops, failure: Some(failure), stats: Stats::default(), calls: 0 }
    })
}

/// Generates and runs one sequence (each operation also goes to `log` before it runs).
fn run_seed(seed: u64, max_ops: usize, dir: &std::path::Path, log: &Mutex<Vec<Op>>) -> Run {
    let calls0 = api::calls();
    let mut world = World::new(dir.join(format!("seq{seed}")));
    let mut generator = Gen::new(seed);
    let mut ops = Vec::new();
    let mut failure = None;
    for _ in 0..max_ops {
        let op = generator.next(&world);
        ops.push(op.clone());
        log.lock().unwrap().push(op.clone());
        if let Err(e) = apply(&mut world, &op) {
            failure = Some(e);
            break;
        }
    }
    let failure = finish(&mut world, failure);
    Run { ops, failure, stats: world.stats, calls: api::calls() - calls0 }
}

/// Runs a given sequence; its failure, if any.
fn replay(ops: &[Op], dir: &std::path::Path, tag: u64) -> Option<String> {
    let mut world = World::new(dir.join(format!("replay{tag}")));
    let failure = ops.iter().find_map(|op| apply(&mut world, op).err());
    finish(&mut world, failure)
}

/// Applies one operation: its failure, a panic included.
fn apply(world: &mut World, op: &Op) -> Result<(), String> {
    catch_unwind(AssertUnwindSafe(|| world.apply(op)))
        .unwrap_or_else(|p| Err(format!("test panicked: {}", panic_message(p))))
}

/// Ends a sequence: the end-of-sequence checks unless an operation failed already, then the
/// world's sessions and files go. The sequence's failure, if any.
fn finish(world: &mut World, failure: Option<String>) -> Option<String> {
    let failure = failure.or_else(|| {
        catch_unwind(AssertUnwindSafe(|| world.finish())).map_or_else(
            |p| Some(format!("test panicked at the end: {}", panic_message(p))),
            |r| r.err().map(|e| format!("at the end of the sequence: {e}")),
        )
    });
    world.abandon();
    let _ = std::fs::remove_dir_all(&world.dir);
    failure
}

/// The first word of a failure (which call or check failed), to keep shrinking on the
/// same failure.
fn kind(failure: &str) -> String {
    failure.split([':', '(']).next().unwrap_or("").to_string()
}

/// Deletes chunks of operations while the sequence still fails the same way.
fn shrink(ops: Vec<Op>, failure: &str, dir: &std::path::Path) -> (Vec<Op>, String) {
    let deadline = Instant::now() + Duration::from_secs(120);
    let want = kind(failure);
    let mut best = ops;
    let mut best_failure = failure.to_string();
    let mut chunk = best.len() / 2;
    let mut tag = 0;
    while chunk >= 1 && Instant::now() < deadline {
        let mut i = 0;
        let mut progressed = false;
        while i < best.len() && Instant::now() < deadline {
            let mut candidate = best.clone();
            let end = (i + chunk).min(candidate.len());
            candidate.drain(i..end);
            tag += 1;
            let (ops, dir2) = (candidate.clone(), dir.to_path_buf());
            let outcome = within(hang_seconds().min(15), move || replay(&ops, &dir2, tag))
                .unwrap_or_else(|| Some("hang: a replay did not finish".into()));
            match outcome {
                Some(f) if kind(&f) == want => {
                    best = candidate;
                    best_failure = f;
                    progressed = true;
                }
                _ => i += chunk,
            }
        }
        if !progressed {
            chunk /= 2;
        }
    }
    (best, best_failure)
}

fn report_failure(seed: u64, run: &Run, dir: &std::path::Path) -> String {
    let failure = run.failure.clone().unwrap();
    eprintln!("\nFUZZ FAILURE, seed {seed}, after {} operations:\n  {failure}", run.ops.len());
    eprintln!("reproduce: SO_FUZZ_SEED={seed} cargo test --test session_fuzz -- --nocapture");
    let (small, small_failure) = shrink(run.ops.clone(), &failure, dir);
    eprintln!("shrunk to {} operations (failure: {small_failure}):", small.len());
    for (i, op) in small.iter().enumerate() {
        eprintln!("  {i:4}: {op:?}");
    }
    format!("seed {seed}: {failure}")
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.parse().unwrap_or_else(|_| panic!("{name} must be an integer")))
}

#[test]
fn session_api_fuzz() {
    let dir = fuzz::scratch_dir("fuzz");
    let ops = env_u64("SO_FUZZ_OPS").map_or(DEFAULT_OPS, |n| n as usize);
    let seconds = env_u64("SO_FUZZ_SECONDS");
    let one_seed = env_u64("SO_FUZZ_SEED");
    let start = Instant::now();
    let mut total = Stats::default();
    let (mut sequences, mut calls, mut op_count) = (0u64, 0u64, 0u64);
    let mut failures = Vec::new();
    let mut seed = one_seed.unwrap_or(0);
    if seconds.is_some() && one_seed.is_none() {
        seed = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
        eprintln!("long mode: seeds from {seed}");
    }
    loop {
        let done = match (seconds, one_seed) {
            (Some(s), _) => start.elapsed() >= Duration::from_secs(s),
            (None, Some(_)) => sequences >= 1,
            (None, None) => sequences >= CI_SEQUENCES,
        };
        if done {
            break;
        }
        if seconds.is_some() && sequences % 100 == 0 {
            eprintln!("[{:5.0} s] sequence {sequences}, seed {seed}", start.elapsed().as_secs_f64());
        }
        let run = run_seed_guarded(seed, ops, &dir);
        sequences += 1;
        calls += run.calls;
        op_count += run.ops.len() as u64;
        total.add(&run.stats);
        if run.failure.is_some() {
            failures.push(report_failure(seed, &run, &dir));
            if seconds.is_none() || failures.len() >= 5 {
                break;
            }
        } else if one_seed.is_some() {
            for (i, op) in run.ops.iter().enumerate() {
                eprintln!("  {i:4}: {op:?}");
            }
        }
        seed = seed.wrapping_add(1);
    }
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "session fuzz: {sequences} sequences, {op_count} operations, {calls} C calls in {:.1} s\n  {total:?}",
        start.elapsed().as_secs_f64()
    );
    assert!(failures.is_empty(), "{} failing sequence(s):\n{}", failures.len(), failures.join("\n"));
    if one_seed.is_none() && seconds.is_none() {
        // The CI run must exercise what it claims to.
        for (what, n) in [
            ("steps", total.steps),
            ("skipped", total.skipped),
            ("clipped", total.clipped),
            ("kept", total.kept),
            ("rescaled", total.rescaled),
            ("rolled back", total.rolled_back),
            ("redone", total.redone),
            ("stepped", total.stepped),
            ("late", total.late),
            ("lazy", total.lazy),
            ("saves", total.saves),
            ("loads accepted", total.loads_ok),
            ("loads refused", total.loads_refused),
            ("repartitions", total.repartitions),
            ("bound checks", total.bound_checks),
        ] {
            assert!(n > 0, "no {what} in the CI run: {total:?}");
        }
    }
}
