//! Each benchmark program runs to its end on a tiny configuration, as `scripts/bench.sh` runs
//! it (numbers aside): a library change that breaks a program's expectations fails here, not
//! on the GPU machine.

use std::process::Command;

fn runs(program: &str, args: &[&str]) {
    let out = Command::new(program).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{program} {}: {}\n{text}", args.join(" "), out.status);
}

#[test]
fn the_kernel_benchmark_runs() {
    runs(env!("CARGO_BIN_EXE_superoffload-bench"), &["--n", "1e4", "--threads", "2", "--iters", "1", "--warmup", "0"]);
}

#[test]
fn the_overlap_benchmark_runs_with_and_without_publication() {
    let small =
        ["--layers", "2", "--elems", "16k", "--fwd-ms", "0.5", "--bwd-ms", "0.5", "--steps", "3", "--block", "2"];
    runs(env!("CARGO_BIN_EXE_overlap_bench"), &small);
    runs(env!("CARGO_BIN_EXE_overlap_bench"), &[&small[..], &["--publish"]].concat());
}

#[test]
fn the_handoff_benchmark_runs_with_and_without_speculation() {
    let small = ["--slices", "300", "--subgroups", "10", "--steps", "2", "--warmup", "1"];
    runs(env!("CARGO_BIN_EXE_handoff_bench"), &small);
    runs(env!("CARGO_BIN_EXE_handoff_bench"), &[&small[..], &["--no-speculation"]].concat());
}
