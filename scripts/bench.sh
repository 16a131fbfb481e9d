#!/usr/bin/env bash
# The main benchmark: builds superoffload-bench (the workspace member bench/rust) in release
# mode and runs it with its defaults (N = 1e8 elements, one thread per available CPU, widest
# ISA, 10 timed repetitions after 3 warm-up), on this machine. Extra arguments go to the
# benchmark, e.g.
#   scripts/bench.sh --threads 16 --cores 0-15 --json bench.json
#   scripts/bench.sh --n 2e7 --isa avx2
# Needs a Rust toolchain (cargo) and about 2 GB of free memory at the default N. Without
# Rust, run an installed superoffload-bench (<prefix>/bin) directly.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

so_find_cargo
cargo build --release --locked -p superoffload-bench --bin superoffload-bench
exec "$(so_cargo_target_dir)/release/superoffload-bench" "$@"
