#!/usr/bin/env bash
# The main benchmark: builds superoffload-bench in release mode and runs it with its defaults
# (N = 1e8 elements, one thread per available CPU, widest ISA, 10 timed repetitions after 3
# warm-up), on this machine. Extra arguments go to the benchmark, e.g.
#   scripts/bench.sh --threads 16 --cores 0-15 --json bench.json
#   scripts/bench.sh --n 2e7 --isa avx2
# Needs a Rust toolchain (cargo) and about 2 GB of free memory at the default N.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v cargo >/dev/null 2>&1; then
    echo "scripts/bench.sh: cargo not found; install a Rust toolchain (https://rustup.rs)," >&2
    echo "or run an installed superoffload-bench directly." >&2
    exit 1
fi

cargo build --release --locked --bin superoffload-bench
target_dir="${CARGO_TARGET_DIR:-target}"
exec "$target_dir/release/superoffload-bench" "$@"
