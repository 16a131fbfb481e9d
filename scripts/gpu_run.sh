#!/usr/bin/env bash
# Everything measured on the GPU machine, in one go, against an install prefix built
# elsewhere (that machine has CMake, g++, CUDA, PyTorch and JAX but no Rust toolchain;
# scripts/gpu_prepare.sh builds what it needs):
#   1. the ctest suite built against the prefix (gpu_ tests run there, not skipped), or against
#      $SO_GPU_FAULT_PREFIX, a prefix built with -DSO_FAULT_INJECTION=ON, where given: the CUDA
#      fault tests then run too (without fault switches they are skipped);
#   2. the kernel benchmark (N = 1e8, 16 threads) and ours vs torch.optim.AdamW(fused=True);
#   3. the CUDA transport benchmarks (copies in pieces, overlap with a GPU backward).
# Usage: scripts/gpu_run.sh <prefix> [output dir] [parts]   (default: gpu-out; parts: all, or a
# comma list of ctest,bench,torch,cuda)
set -uo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
so_gpu_setup "$@" || exit

so_step "machine"
{ nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader
  grep -m1 'model name' /proc/cpuinfo; echo "cpus: $threads"; } | tee "$out/machine.txt"

if so_want ctest; then
so_step "ctest against the installed prefix"
test_prefix="$(cd "${SO_GPU_FAULT_PREFIX:-$prefix}" && pwd)"
echo "ctest against $test_prefix" > "$out/ctest.log"
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DSO_PREBUILT_DIR="$test_prefix" >> "$out/ctest.log" 2>&1 &&
  cmake --build build-gpu -j "$threads" >> "$out/ctest.log" 2>&1
LD_LIBRARY_PATH="$test_prefix/lib:$LD_LIBRARY_PATH" ctest --test-dir build-gpu --output-on-failure -j 4 2>&1 |
  tee -a "$out/ctest.log" | tail -40
fi

if so_want bench; then
so_step "kernel benchmark ($threads threads, N = 1e8)"
"$prefix/bin/superoffload-bench" --threads "$threads" --json "$out/bench.json" 2>&1 | tee "$out/bench.txt"
fi

if so_want torch; then
so_step "ours vs torch.optim.AdamW(fused=True)"
python3 bench/torch_compare.py --lib "$prefix/lib/libsuperoffload.so" --threads "$threads" --json "$out/torch.json" 2>&1 |
  tee "$out/torch.txt" | tail -30
fi

if so_want cuda; then
so_step "CUDA transport"
cores=$(seq -s, 2 $((threads - 1)))
# The overlap benchmark in three regimes: the default (next forward longer than CPU Adam), a
# backward about as long as the CPU Adam work (where hiding the optimizer matters most), and a
# long backward.
python3 bench/cuda_bench.py --lib "$prefix/lib/libsuperoffload.so" --cores "$cores" --json "$out/cuda.json" 2>&1 |
  tee "$out/cuda.txt"
python3 bench/cuda_bench.py --lib "$prefix/lib/libsuperoffload.so" --cores "$cores" --only overlap \
  --forward-matmuls 1 --backward-matmuls 2 --json "$out/cuda_balanced.json" 2>&1 | tee "$out/cuda_balanced.txt"
python3 bench/cuda_bench.py --lib "$prefix/lib/libsuperoffload.so" --cores "$cores" --only overlap \
  --forward-matmuls 1 --backward-matmuls 6 --json "$out/cuda_long_backward.json" 2>&1 | tee "$out/cuda_long_backward.txt"
fi
