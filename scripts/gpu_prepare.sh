#!/usr/bin/env bash
# Builds, on a machine with Rust, what the GPU machine's scripts run against (that machine has
# CMake, g++, CUDA and PyTorch but no Rust toolchain), into one directory small enough to carry:
#   <dir>/prefix         the library installed, release, stripped (benchmarks, trainers)
#   <dir>/prefix-faults  the same with the CUDA fault switches (-DSO_FAULT_INJECTION=ON): the
#                        gpu_ fault tests run against it (scripts/gpu_run.sh)
#   <dir>/wheel          the Python package's wheel (bench/peers.py, python/tests/gpu_checks.py)
# Then, on the GPU machine, from the repository root with <dir> carried:
#   SO_GPU_FAULT_PREFIX=<dir>/prefix-faults scripts/gpu_run.sh <dir>/prefix
#   python3 -m pip install --no-deps --target /tmp/site <dir>/wheel/*.whl   (PYTHONPATH=/tmp/site)
# Usage: scripts/gpu_prepare.sh [dir]   (default: out/gpu)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

dir="$(so_abs "${1:-out/gpu}")"
jobs="$(so_jobs)"
so_require cmake make c++=g++ cc=gcc
so_find_cargo
rm -rf "$dir/prefix" "$dir/prefix-faults" "$dir/wheel"
for variant in prefix prefix-faults; do
    faults=OFF
    [ "$variant" = prefix-faults ] && faults=ON
    so_log "$variant: configure, build and install (fault injection $faults)"
    cmake -S "$so_root" -B "$dir/build-$variant" -DCMAKE_BUILD_TYPE=Release -DSO_BUILD_TESTS=OFF \
        -DSO_FAULT_INJECTION="$faults" >/dev/null
    cmake --build "$dir/build-$variant" -j "$jobs"
    cmake --install "$dir/build-$variant" --prefix "$dir/$variant" --strip >/dev/null
done
so_log "wheel"
bash "$so_root/python/build_wheel.sh" "$dir/wheel" >/dev/null
du -sh "$dir/prefix" "$dir/prefix-faults" "$dir/wheel"
