#!/usr/bin/env bash
# The test command of this repository: the Rust tests, then the CMake build and the ctest
# suite in c_tests/. Runs on a fresh Debian machine with a Rust toolchain, gcc/g++,
# valgrind and pkg-config; installs cmake if it is missing.
#
# Environment:
#   SO_BUILD_DIR   CMake build directory (default: build)
#   SO_JOBS        parallel build and test jobs (default: the number of CPUs)
#   SO_SKIP_CARGO_TEST=1  skip `cargo test` (only the CMake/ctest part)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

build_dir="${SO_BUILD_DIR:-build}"
jobs="${SO_JOBS:-$(nproc 2>/dev/null || echo 2)}"
start=$(date +%s)

section() {
    printf '\n==== %s (+%ss) ====\n' "$1" "$(( $(date +%s) - start ))"
}

section "Tools"
if ! command -v cmake >/dev/null 2>&1; then
    echo "cmake not found; installing it with apt-get"
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "error: cmake is missing and this user can neither apt-get install nor sudo" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends cmake >/dev/null
fi
cargo --version
cmake --version | head -n 1
${CC:-cc} --version | head -n 1
${CXX:-c++} --version | head -n 1
if command -v valgrind >/dev/null 2>&1; then valgrind --version; else echo "valgrind: not found (leak tests will be skipped)"; fi
if command -v pkg-config >/dev/null 2>&1; then echo "pkg-config $(pkg-config --version)"; else echo "pkg-config: not found (its check will be skipped)"; fi

if [ "${SO_SKIP_CARGO_TEST:-0}" != 1 ]; then
    section "cargo test"
    cargo test --locked -j "$jobs"
fi

section "CMake configure ($build_dir)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release

section "CMake build"
cmake --build "$build_dir" -j "$jobs"

section "ctest"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"

section "All tests passed"
