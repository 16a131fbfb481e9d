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
# (default: build/ next to this script). The prefix must hold the component torch, built against
# this torch (the top-level CMakeLists.txt, with torch's CMake config on CMAKE_PREFIX_PATH).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
example_prefix "[trainer flags...]" "$@"
shift
example_require_module torch "set PYTHON to an interpreter that can"
torch_cmake="$("$py" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
example_cmake_build "-DCMAKE_PREFIX_PATH=$torch_cmake;$prefix"
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
