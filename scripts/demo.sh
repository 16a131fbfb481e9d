#!/usr/bin/env bash
# The demo trainer, from a fresh checkout: builds superoffload with its CMake project,
# installs it into an ignored prefix (dist/), configures and builds the stand-alone project
# demo/ against that install (find_package(SuperOffload CONFIG)), and runs it.
#
#   scripts/demo.sh                      # defaults: under a minute on 2 cores
#   scripts/demo.sh --steps 50 --threads 2 --cores 1   # arguments go to the demo
#   scripts/demo.sh --help               # the demo's flags
#
# Needs a Rust toolchain (cargo on PATH or in ~/.cargo/bin). On Debian/Ubuntu it installs
# what else is missing (cmake, make, g++) with apt-get, as root or through sudo.
#
# Environment:
#   SO_DEMO_PREFIX   install prefix of superoffload (default: dist)
#   SO_DEMO_BUILD    build directory, holding root/ and demo/ (default: out/demo)
#   SO_PREBUILT_DIR  an install prefix that already holds superoffload (from `cmake --install`,
#                    e.g. scripts/test.sh's <build>/install): the demo is built against it, and
#                    superoffload is neither built nor installed (no Rust needed)
#   SO_JOBS          parallel build jobs (default: the number of CPUs)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

build="$(so_abs "${SO_DEMO_BUILD:-out/demo}")"
jobs="$(so_jobs)"
root="$so_root"

# ---------------------------------------------------------------- tools
so_require cmake make c++=g++ cc=gcc
so_cmake_at_least 3.22

# ---------------------------------------------------------------- superoffload -> prefix
if [ -n "${SO_PREBUILT_DIR:-}" ]; then
    prefix="$(so_abs "$SO_PREBUILT_DIR")"
    so_log "superoffload: the install at $prefix (SO_PREBUILT_DIR)"
else
    prefix="$(so_abs "${SO_DEMO_PREFIX:-dist}")"
    so_find_cargo
    so_log "superoffload: configure, build (cargo, release) and install into $prefix"
    cmake -S "$root" -B "$build/root" -DCMAKE_BUILD_TYPE=Release -DSO_BUILD_TESTS=OFF >/dev/null
    cmake --build "$build/root" -j "$jobs"
    cmake --install "$build/root" --prefix "$prefix" >/dev/null
fi

# ---------------------------------------------------------------- demo/ against the prefix
so_log "demo: configure against $prefix and build"
cmake -S "$root/demo" -B "$build/demo" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/demo" -j "$jobs"

so_log "run: superoffload-demo $*"
exec "$build/demo/superoffload-demo" "$@"
