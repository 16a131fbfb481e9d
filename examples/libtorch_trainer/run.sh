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
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
example_prefix "[trainer flags...]" "$@"
shift
example_require_module torch "set PYTHON to an interpreter that can"
torch_cmake="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
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

example_cmake_build "-DCMAKE_PREFIX_PATH=$torch_cmake;$prefix" ${extra[@]+"${extra[@]}"}
bin="$build/so_torch_trainer"

status=0
example_step "in-process checks"
"$bin" --ckpt "$build/ckpt" "$@" || status=$?

example_step "resume across processes"
rm -rf "$build/xckpt"
if "$bin" --save-at half --ckpt "$build/xckpt" --losses-out "$build/losses_full.txt" --log-every 1000 "$@" &&
   "$bin" --resume "$build/xckpt" --losses-out "$build/losses_resumed.txt" --log-every 1000 "$@" &&
   "$bin" --compare "$build/losses_full.txt" "$build/losses_resumed.txt"; then
    echo "resume across processes: PASS"
else
    echo "resume across processes: FAIL"
    status=1
fi
example_exit "$status"
