#!/usr/bin/env bash
# Builds the session benchmarks (release; the workspace member bench/rust) and runs them with defaults sized for a 2-core
# machine (training thread on one core, the session pool on the other):
#
#   overlap_bench  step time of a simulated training loop with speculation on/off and
#                  clipping on/off, next to the CPU Adam time alone; run twice: with the
#                  CPU Adam time of a step below the forward time (the binary's defaults),
#                  and with it above (short forward/backward: where speculation matters)
#   handoff_bench  per-call cost and allocations of gradient hand-offs (Rust and C API),
#                  with speculation on and off
#
# Usage:
#   scripts/session_bench.sh                   # everything
#   scripts/session_bench.sh overlap [ARGS]    # overlap_bench once, with ARGS
#   scripts/session_bench.sh handoff [ARGS]    # handoff_bench once, with ARGS
#   scripts/session_bench.sh --help            # both benchmarks' flags
#
# Environment:
#   SO_OVERLAP_ARGS   extra arguments for every overlap_bench run of the full set
#   SO_HANDOFF_ARGS   extra arguments for every handoff_bench run of the full set
#   SO_BENCH_OUT      where the JSON results go (default: out/session_bench)
# Timings on a machine shared with other work are noisy: read medians, repeat runs.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

so_find_cargo
out="${SO_BENCH_OUT:-out/session_bench}"
cargo build --release --locked -p superoffload-bench --bin overlap_bench --bin handoff_bench >&2
bin="$(so_cargo_target_dir)/release"
mkdir -p "$out"

case "${1:-all}" in
    -h|--help)
        "$bin/overlap_bench" --help
        echo
        "$bin/handoff_bench" --help
        ;;
    overlap)
        shift
        "$bin/overlap_bench" "$@"
        ;;
    handoff)
        shift
        "$bin/handoff_bench" "$@"
        ;;
    all)
        # shellcheck disable=SC2086 # word splitting of the extra arguments is intended
        {
            echo "==== overlap_bench: CPU Adam below the forward time (defaults)"
            "$bin/overlap_bench" --json "$out/overlap.json" ${SO_OVERLAP_ARGS:-}
            echo
            echo "==== overlap_bench: CPU Adam above the forward time (--fwd-ms 0.5 --bwd-ms 1.5)"
            "$bin/overlap_bench" --fwd-ms 0.5 --bwd-ms 1.5 --json "$out/overlap_adam_bound.json" ${SO_OVERLAP_ARGS:-}
            echo
            echo "==== handoff_bench: speculation on (defaults)"
            "$bin/handoff_bench" --json "$out/handoff.json" ${SO_HANDOFF_ARGS:-}
            echo
            echo "==== handoff_bench: speculation off"
            "$bin/handoff_bench" --no-speculation --json "$out/handoff_nospec.json" ${SO_HANDOFF_ARGS:-}
            echo
            echo "JSON results in $out/"
        }
        ;;
    *)
        echo "usage: scripts/session_bench.sh [all | overlap [ARGS] | handoff [ARGS] | --help]" >&2
        exit 2
        ;;
esac
