#!/usr/bin/env bash
# Builds the PyTorch extension against an installed superoffload and runs the checks:
#   examples/torch_optimizer/run.sh <superoffload-prefix> [--bench | --bench-only] [--no-tests] [-- bench_e2e.py flags...]
#
#   1. the extension (torch.utils.cpp_extension.load with ninja, else g++ directly);
#   2. test_parity.py: ours vs torch.optim.AdamW on f32 masters, speculative vs not bit for bit,
#      state_dict resume bit for bit, accumulation, errors (CUDA mode with bf16 parameters when torch
#      sees a GPU, host mode otherwise);
#   3. test_fsdp.py under FSDP2, world size 1 (nccl on a GPU, gloo on the CPU), and 2 ranks with
#      gloo on the CPU (host mode; torchrun), which any machine can run;
#   4. with --bench: bench_e2e.py (GPU machine; on a machine without a GPU, its --smoke run);
#      --bench-only: the build and the benchmark, no tests.
# Outputs (logs, JSON, the trace PNG) go to $OUT if set, else examples/torch_optimizer/out/.
# Environment: PYTHON (default python3), SO_TORCH_BUILDER=auto|ninja|gxx, SO_TORCH_VERBOSE=1.
# Exits non-zero if the build or any check fails.
set -uo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 <superoffload-prefix> [--bench | --bench-only] [--no-tests] [-- bench_e2e.py flags...]" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="$(cd "$1" 2>/dev/null && pwd)" || { echo "run.sh: no such prefix: $1" >&2; exit 2; }
shift
bench=0 tests=1 bench_args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --bench) bench=1 ;;
        --bench-only) bench=1 tests=0 ;;
        --no-tests) tests=0 ;;
        --) shift; bench_args=("$@"); break ;;
        *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
for f in include/superoffload.h include/superoffload.hpp lib/libsuperoffload.so; do
    [ -e "$prefix/$f" ] || { echo "run.sh: $prefix is not a superoffload install prefix ($f missing)" >&2; exit 2; }
done
py="${PYTHON:-python3}"
out="${OUT:-$here/out}"
mkdir -p "$out"
export SUPEROFFLOAD_PREFIX="$prefix" PYTHONUNBUFFERED=1
cd "$here"
status=0
step() { printf '\n==== %s\n' "$1"; }

step "environment"
"$py" - <<'EOF' 2>&1 | tee "$out/environment.txt"
import os, platform, sys
import torch
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("cpus", os.cpu_count(), platform.processor() or platform.machine())
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "run.sh: '$py' cannot import torch; set PYTHON" >&2; exit 2; }
gpu="$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')"

step "build the extension against $prefix"
if ! "$py" -c '
import json, superoffload_torch as s
e = s.extension()
print(json.dumps(e.build_info), "| libsuperoffload", e.version(), "| cuda:", e.cuda_available())
' 2>&1 | tee "$out/build.log"; then
    echo "run.sh: FAILED to build the extension (see $out/build.log)"
    exit 1
fi

run() {  # name, command...
    local name="$1"; shift
    step "$name"
    "$@" 2>&1 | tee "$out/$name.txt"
    local rc="${PIPESTATUS[0]}"
    if [ "$rc" -ne 0 ]; then echo "run.sh: $name FAILED (exit $rc)"; status=1; fi
}

if [ "$tests" -eq 1 ]; then
    run test_parity "$py" test_parity.py --json "$out/parity.json"
    run test_fsdp_world1 "$py" test_fsdp.py --json "$out/fsdp_world1.json"
    port=$(( 20000 + RANDOM % 20000 ))
    run test_fsdp_gloo_2ranks "$py" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" \
        test_fsdp.py --device cpu --json "$out/fsdp_gloo_2ranks.json"
fi

if [ "$bench" -eq 1 ]; then
    if [ "$gpu" = "1" ]; then
        run bench_e2e "$py" bench_e2e.py --out "$out" ${bench_args[@]+"${bench_args[@]}"}
    else
        echo "run.sh: no GPU: running bench_e2e.py --smoke (code paths only, no meaningful numbers)"
        run bench_e2e_smoke "$py" bench_e2e.py --smoke --out "$out/smoke" ${bench_args[@]+"${bench_args[@]}"}
    fi
fi

echo
if [ "$status" -eq 0 ]; then echo "run.sh: all checks passed (outputs in $out)"; else echo "run.sh: FAILED (outputs in $out)"; fi
exit "$status"
