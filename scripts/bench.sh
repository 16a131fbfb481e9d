#!/usr/bin/env bash
# The one entry point of every benchmark in this repository:
#
#   scripts/bench.sh --list            # the benchmarks and tools, one line each
#   scripts/bench.sh <name> --help     # that benchmark's flags
#   scripts/bench.sh <name> [ARGS]     # runs it; ARGS go to it unchanged
#
# e.g.
#   scripts/bench.sh kernels --threads 16 --cores 0-15 --json bench.json
#   scripts/bench.sh session
#   scripts/bench.sh cuda --lib dist/lib/libsuperoffload.so --only overlap --cores 2,3,4,5
#   scripts/bench.sh e2e --modes d,a,x --clipped-only
#   scripts/bench.sh libtorch --bin build-gpu/bench/libtorch/so_llama_bench
#
# It runs from the repository root: relative paths in ARGS are taken from there. The Rust
# programs (bench/rust) are built in release mode with cargo first; with SO_BENCH_PREFIX set
# to an install prefix, its bin/ programs run instead and no cargo is needed. The Python ones
# run with $PYTHON (default python3) and need what their --help says (torch, a GPU, the
# superoffload package); the shell ones (sh:) run the programs of the CMake build their --help
# names. Figures measured with them are in docs/performance.md.
#
# Environment:
#   SO_BENCH_PREFIX   install prefix whose bin/ holds the Rust programs (no build)
#   PYTHON            the Python interpreter (default python3)
#   session only:
#   SO_OVERLAP_ARGS   extra arguments for every overlap_bench run
#   SO_HANDOFF_ARGS   extra arguments for every handoff_bench run
#   SO_BENCH_OUT      where the JSON results go (default: out/session_bench)
# Timings on a machine shared with other work are noisy: read medians, repeat runs.
set -euo pipefail
shopt -s inherit_errexit # a failed build inside $(...) stops the script
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

py="${PYTHON:-python3}"

# name | kind (rust program, python script or the session set) | what it measures
benchmarks() {
    cat <<'EOF'
kernels|rust:superoffload-bench|CPU Adam kernels (update, rollback, rescale, checks), N = 1e8, against their memory floor
overlap|rust:overlap_bench|host mode: step time of a simulated training loop, speculation and clipping on and off
handoff|rust:handoff_bench|host mode: the training thread's cost and allocations per gradient hand-off
session|set|overlap three times (CPU Adam below and above the forward time; a copy published, CPU Adam the bottleneck) and handoff twice (speculation on, off)
torch-compare|py:bench/torch_compare.py|the kernels vs torch.optim.AdamW(fused=True) on the same tensors (--selftest: no torch)
pool-contention|py:bench/pool_contention.py|one kernel update while other processes or PCIe copies share the pool's cores
cuda|py:bench/cuda_bench.py|GPU: gradient copies in pieces, a synthetic layered backward overlapped with the session, the device Adam kernel
e2e|py:examples/torch_optimizer/bench_e2e.py|GPU: a 1.1B Llama-style model trained end to end, ours vs torch AdamW (--smoke: CPU)
libtorch|sh:bench/libtorch/run.sh|GPU: a 1.1B Llama-style model trained from C++, superoffload::torch::AdamW vs torch's fused AdamW, clipping and not
jax-llama|py:bench/jax_llama.py|GPU: a 1.1B Llama-style model in plain JAX, superoffload.jax vs optax.adamw, one process per system (--smoke: CPU)
pin-rate|py:bench/pin_rate.py|GPU: page-locking host memory, and copies to the device from pageable and from pinned memory
EOF
    if [ -f bench/peers.py ]; then
        printf 'peers|py:bench/peers.py|%s\n' "$(docline bench/peers.py)"
        printf 'peers-profile|py:bench/peers_profile.py|%s\n' "$(docline bench/peers_profile.py)"
        printf 'fsdp2-engine|py:bench/fsdp2_engine.py|%s\n' "$(docline bench/fsdp2_engine.py)"
    fi
    cat <<'EOF'
overlap-table|py:bench/overlap_table.py|tool: the overlap results of cuda --json files as a Markdown table
trace-plot|py:bench/trace_plot.py|tool: a session trace (Chrome JSON) rendered as a PNG timeline, with a summary
EOF
}

# The first line of a Python file's docstring.
docline() {
    local line
    line="$(sed -n '/"""/{s/.*"""//;s/"""$//;p;q}' "$1")"
    echo "${line:-see $1}"
}

list() {
    benchmarks | awk -F'|' '{ printf "  %-16s %s\n", $1, $3 }'
}

usage() {
    echo "usage: scripts/bench.sh --list | <name> [ARGS] | <name> --help"
    echo
    list
}

rust_program() {
    local bin="$1"
    if [ -n "${SO_BENCH_PREFIX:-}" ]; then
        echo "$SO_BENCH_PREFIX/bin/$bin"
        return
    fi
    so_find_cargo
    "${CARGO:-cargo}" build --release --locked -p superoffload-bench --bin "$bin" >&2
    echo "$(so_cargo_target_dir)/release/$bin"
}

session_set() {
    if [ "$#" -gt 0 ]; then
        echo "scripts/bench.sh session takes no arguments (SO_OVERLAP_ARGS, SO_HANDOFF_ARGS: see the header)" >&2
        exit 2
    fi
    local overlap handoff out="${SO_BENCH_OUT:-out/session_bench}"
    overlap="$(rust_program overlap_bench)"
    handoff="$(rust_program handoff_bench)"
    mkdir -p "$out"
    # shellcheck disable=SC2086 # word splitting of the extra arguments is intended
    {
        echo "==== overlap_bench: CPU Adam below the forward time (defaults)"
        "$overlap" --json "$out/overlap.json" ${SO_OVERLAP_ARGS:-}
        echo
        echo "==== overlap_bench: CPU Adam above the forward time (--fwd-ms 0.5 --bwd-ms 1.5)"
        "$overlap" --fwd-ms 0.5 --bwd-ms 1.5 --json "$out/overlap_adam_bound.json" ${SO_OVERLAP_ARGS:-}
        echo
        echo "==== overlap_bench: a copy published, CPU Adam the step's bottleneck (--publish --fwd-ms 0.2 --bwd-ms 0.3)"
        "$overlap" --publish --fwd-ms 0.2 --bwd-ms 0.3 --steps 20 --block 40 --refill 20 \
            --json "$out/overlap_publish.json" ${SO_OVERLAP_ARGS:-}
        echo
        echo "==== handoff_bench: speculation on (defaults)"
        "$handoff" --json "$out/handoff.json" ${SO_HANDOFF_ARGS:-}
        echo
        echo "==== handoff_bench: speculation off"
        "$handoff" --no-speculation --json "$out/handoff_nospec.json" ${SO_HANDOFF_ARGS:-}
        echo
        echo "JSON results in $out/"
    }
}

case "${1:-}" in
    --list)
        list
        exit 0
        ;;
    -h | --help)
        usage
        exit 0
        ;;
    "")
        usage >&2
        exit 2
        ;;
esac

name="$1"
shift
entry="$(benchmarks | awk -F'|' -v n="$name" '$1 == n { print $2 }')"
case "$entry" in
    rust:*)
        program="$(rust_program "${entry#rust:}")"
        exec "$program" "$@"
        ;;
    py:*) exec "$py" "${entry#py:}" "$@" ;;
    sh:*) exec bash "${entry#sh:}" "$@" ;;
    set)
        if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
            echo "scripts/bench.sh session: overlap_bench with its defaults, with --fwd-ms 0.5 --bwd-ms 1.5 and with"
            echo "--publish --fwd-ms 0.2 --bwd-ms 0.3 (40-step blocks, the first 20 not measured), then handoff_bench"
            echo "with its defaults and with --no-speculation; JSON results in"
            echo "\$SO_BENCH_OUT (default out/session_bench). Extra arguments for every run of one program:"
            echo "SO_OVERLAP_ARGS, SO_HANDOFF_ARGS. Their flags: scripts/bench.sh overlap --help,"
            echo "scripts/bench.sh handoff --help."
            exit 0
        fi
        session_set "$@"
        ;;
    *)
        echo "scripts/bench.sh: no benchmark named '$name'" >&2
        usage >&2
        exit 2
        ;;
esac
