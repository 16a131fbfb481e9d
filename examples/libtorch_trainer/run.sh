#!/usr/bin/env bash
# Configures, builds and runs the libtorch trainer against an installed superoffload:
#   examples/libtorch_trainer/run.sh <superoffload-prefix> [trainer flags...]
# 1. the in-process checks (parity with torch::optim::AdamW, speculative vs non-speculative
#    bit for bit, resume from a checkpoint bit for bit);
# 2. a resume across processes: one process trains and checkpoints half-way, a second one
#    resumes from the checkpoint; their per-step losses must be bit-identical.
# CUDA mode is used when torch sees a GPU (the trainer decides), CPU mode otherwise.
# Exits non-zero if any check fails.
#
# Environment: PYTHON (default python3: only used to find torch's CMake config), BUILD_DIR
# (default: build/ next to this script), SO_CUDA_EXTRA_INCLUDE (CUDA headers for a CUDA build
# of torch on a machine without a CUDA toolkit; see CMakeLists.txt).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 <superoffload-prefix> [trainer flags...]" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="$(cd "$1" && pwd)" || { echo "run.sh: no such prefix: $1" >&2; exit 2; }
shift
[ -f "$prefix/lib/cmake/SuperOffload/SuperOffloadConfig.cmake" ] ||
    { echo "run.sh: $prefix has no lib/cmake/SuperOffload (install superoffload there first)" >&2; exit 2; }
py="${PYTHON:-python3}"
build="${BUILD_DIR:-$here/build}"
torch_cmake="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')" ||
    { echo "run.sh: '$py' cannot import torch; set PYTHON to an interpreter that can" >&2; exit 2; }
torch_cuda="$("$py" -c 'import torch; print(torch.version.cuda or "")')"

extra=()
if [ -n "$torch_cuda" ]; then
    nvcc=""
    for cand in "${CUDACXX:-}" "$(command -v nvcc 2>/dev/null || true)" "${CUDA_HOME:-/nonexistent}/bin/nvcc" \
                /usr/local/cuda/bin/nvcc; do
        if [ -n "$cand" ] && [ -x "$cand" ]; then nvcc="$cand"; break; fi
    done
    if [ -n "$nvcc" ]; then
        # torch's CMake config enables the CUDA language: it needs nvcc.
        export CUDACXX="$nvcc" PATH="$(dirname "$nvcc"):$PATH"
        echo "run.sh: torch is a CUDA $torch_cuda build; nvcc: $nvcc"
    else
        site="$("$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')"
        incs="${SO_CUDA_EXTRA_INCLUDE:-}"
        for d in "$site"/nvidia/*/include "$site"/nvidia/cuda_runtime/include /usr/local/cuda/include; do
            if [ -f "$d/cuda_runtime_api.h" ]; then incs="${incs:+$incs;}$d"; fi
        done
        echo "run.sh: torch is a CUDA $torch_cuda build but there is no nvcc: configuring with a torch::cudart stand-in (headers: ${incs:-none})"
        extra+=(-DSO_TORCH_CUDA_SHIM=ON "-DSO_CUDA_INCLUDE_DIRS=$incs")
    fi
fi

cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release "-DCMAKE_PREFIX_PATH=$torch_cmake;$prefix" ${extra[@]+"${extra[@]}"}
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
bin="$build/so_torch_trainer"

status=0
echo
echo "==== in-process checks"
"$bin" --ckpt "$build/ckpt" "$@" || status=$?

echo
echo "==== resume across processes"
rm -rf "$build/xckpt"
if "$bin" --save-at half --ckpt "$build/xckpt" --losses-out "$build/losses_full.txt" --log-every 1000 "$@" &&
   "$bin" --resume "$build/xckpt" --losses-out "$build/losses_resumed.txt" --log-every 1000 "$@" &&
   "$bin" --compare "$build/losses_full.txt" "$build/losses_resumed.txt"; then
    echo "resume across processes: PASS"
else
    echo "resume across processes: FAIL"
    status=1
fi

echo
if [ "$status" -eq 0 ]; then echo "run.sh: all checks passed"; else echo "run.sh: FAILED (status $status)"; fi
exit "$status"
