#!/usr/bin/env bash
# The trainers and the remaining GPU measurements, on the GPU machine, against an install
# prefix built elsewhere: the libtorch C++ trainer, the JAX FFI custom call and superoffload.jax
# on CUDA, the PyTorch extension (parity, FSDP2, end-to-end benchmark), the gpu_ ctest output in
# full, the overlap benchmark with a backward longer than the forward, and the host-mode
# session benchmarks on all cores.
# Usage: scripts/gpu_examples.sh <prefix> [output dir] [parts: all | comma list of
#        libtorch,jax,torch,e2e,gputests,overlap,host]
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
so_gpu_setup "$@" || exit
# The Python package loads the prefix's library (examples/torch_optimizer takes no prefix).
export SUPEROFFLOAD_LIBRARY="$prefix/lib/libsuperoffload.so"

# run_example NAME SECONDS LINES RUN_SH [ARG...]: runs an example's run.sh into $out/NAME.txt,
# its exit status last, and shows the last LINES lines.
run_example() {
  local name="$1" secs="$2" lines="$3"
  shift 3
  timeout "$secs" bash "$@" > "$out/$name.txt" 2>&1; echo "exit $?" >> "$out/$name.txt"
  tail -"$lines" "$out/$name.txt"
}

if so_want libtorch; then
  so_step "libtorch trainer"
  # The component torch, built against this machine's torch and installed into the prefix.
  if [ ! -f "$prefix/lib/cmake/SuperOffload/SuperOffloadTorchTargets.cmake" ]; then
    torch_cmake="$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    { cmake -S . -B build-gpu-torch -DCMAKE_BUILD_TYPE=Release -DSO_PREBUILT_DIR="$prefix" -DSO_BUILD_TESTS=OFF \
        -DCMAKE_PREFIX_PATH="$torch_cmake" && cmake --build build-gpu-torch -j "$threads" &&
      cmake --install build-gpu-torch --prefix "$prefix"; } > "$out/libtorch_component.txt" 2>&1 ||
      tail -20 "$out/libtorch_component.txt"
  fi
  run_example libtorch 300 25 examples/libtorch_trainer/run.sh "$prefix"
fi
if so_want jax; then
  so_step "JAX FFI"
  run_example jax 240 20 examples/jax_ffi/run.sh "$prefix"
  so_step "superoffload.jax on the CUDA platform (python/tests/gpu_jax.py)"
  timeout 300 env PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" python3 python/tests/gpu_jax.py \
    > "$out/gpu_jax.txt" 2>&1; echo "exit $?" >> "$out/gpu_jax.txt"
  tail -12 "$out/gpu_jax.txt"
fi
if so_want torch; then
  so_step "PyTorch extension: parity and FSDP2"
  run_example torch_ext 300 25 examples/torch_optimizer/run.sh
fi
if so_want e2e; then
  so_step "PyTorch extension: end-to-end benchmark"
  run_example e2e 420 40 examples/torch_optimizer/run.sh --bench-only
fi
if so_want gputests; then
  so_step "gpu_ tests, verbose"
  if [ ! -d build-gpu ]; then
    cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSO_PREBUILT_DIR="$prefix" > /dev/null && cmake --build build-gpu -j "$threads" > /dev/null
  fi
  ctest --test-dir build-gpu -R 'gpu_' -V 2>&1 | grep -vE '^(UpdateCTestConfiguration|Parse|Added|Test project|Constructing|Checking|test [0-9]+$)' > "$out/gputests.txt"
  grep -E 'Passed|Failed|Skipped|tests passed' "$out/gputests.txt"
fi
if so_want overlap; then
  so_step "overlap benchmark, backward longer than forward"
  cores=$(seq -s, 2 $((threads - 1)))
  timeout 240 python3 bench/cuda_bench.py --lib "$prefix/lib/libsuperoffload.so" --cores "$cores" --only overlap \
    --forward-matmuls 1 --backward-matmuls 6 --json "$out/cuda_long_backward.json" > "$out/cuda_long_backward.txt" 2>&1
  tail -60 "$out/cuda_long_backward.txt"
fi
if so_want host; then
  so_step "host-mode session benchmarks ($threads cores)"
  for b in overlap_bench handoff_bench; do
    if [ -x "$prefix/bin/$b" ]; then timeout 180 "$prefix/bin/$b" 2>&1 | tee "$out/$b.txt" | tail -25; fi
  done
fi
