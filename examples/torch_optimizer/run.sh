#!/usr/bin/env bash
# Runs the checks of SuperOffloadAdamW (the superoffload package's superoffload.torch) in an
# ordinary PyTorch training loop:
#   examples/torch_optimizer/run.sh [--wheel <superoffload wheel>] [--bench | --bench-only] [--no-tests] [-- bench_e2e.py flags...]
#
#   0. the package: already importable by $PYTHON (pip install . / pip install <wheel>), or
#      --wheel: installed from that wheel into a private directory (pip --no-deps --target; no
#      Rust, compiler or network needed);
#   1. test_parity.py: ours vs torch.optim.AdamW on f32 masters, speculative vs not bit for bit,
#      state_dict resume bit for bit, accumulation, GPU-resident part, errors (CUDA mode with bf16
#      parameters when torch sees a GPU, host mode otherwise);
#   2. the package tests' FSDP2 worker (python/tests/fsdp_worker.py), world size 1 (nccl on a GPU,
#      gloo on the CPU), and 2 ranks with gloo on the CPU (host mode; torchrun), which any machine
#      can run;
#   3. with --bench: bench_e2e.py (GPU machine; on a machine without a GPU, its --smoke run);
#      --bench-only: the benchmark, no tests.
# Outputs (logs, JSON, the trace PNG) go to $OUT if set, else examples/torch_optimizer/out/.
# Environment: PYTHON (default python3). Exits non-zero if any check fails.
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
bench=0 tests=1 bench_args=() wheel=""
while [ $# -gt 0 ]; do
    case "$1" in
        --wheel) shift; wheel="$1" ;;
        --bench) bench=1 ;;
        --bench-only) bench=1 tests=0 ;;
        --no-tests) tests=0 ;;
        --) shift; bench_args=("$@"); break ;;
        *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
out="${OUT:-$here/out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if [ -n "$wheel" ]; then
    site="$(mktemp -d)/site"
    "$py" -m pip install -q --no-deps --no-index --target "$site" "$wheel" || { echo "run.sh: cannot install $wheel" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
cd "$here"
fsdp_worker="$here/../../python/tests/fsdp_worker.py"
status=0
example_step "environment"
"$py" - <<'PY' 2>&1 | tee "$out/environment.txt"
import os, platform, sys
import torch, superoffload
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpu:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
print("superoffload", superoffload.__version__, superoffload.library_path(), "| cuda:", superoffload.cuda_available())
print("cpus", os.cpu_count(), platform.processor() or platform.machine())
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "run.sh: '$py' cannot import torch and superoffload (install the package, or pass --wheel)" >&2; exit 2; }
gpu="$("$py" -c 'import torch; print(int(torch.cuda.is_available()))')"

run() {  # name, command...
    local name="$1"; shift
    example_step "$name"
    "$@" 2>&1 | tee "$out/$name.txt"
    local rc="${PIPESTATUS[0]}"
    if [ "$rc" -ne 0 ]; then echo "run.sh: $name FAILED (exit $rc)"; status=1; fi
}

if [ "$tests" -eq 1 ]; then
    run test_parity "$py" test_parity.py --json "$out/parity.json"
    run test_fsdp_world1 "$py" "$fsdp_worker" --json "$out/fsdp_world1.json"
    port=$(( 20000 + RANDOM % 20000 ))
    run test_fsdp_gloo_2ranks "$py" -m torch.distributed.run --nproc_per_node 2 --master_port "$port" \
        "$fsdp_worker" --device cpu --json "$out/fsdp_gloo_2ranks.json"
fi

if [ "$bench" -eq 1 ]; then
    if [ "$gpu" = "1" ]; then
        run bench_e2e "$py" bench_e2e.py --out "$out" ${bench_args[@]+"${bench_args[@]}"}
    else
        echo "run.sh: no GPU: running bench_e2e.py --smoke (code paths only, no meaningful numbers)"
        run bench_e2e_smoke "$py" bench_e2e.py --smoke --out "$out/smoke" ${bench_args[@]+"${bench_args[@]}"}
    fi
fi

example_exit "$status" "outputs in $out"
