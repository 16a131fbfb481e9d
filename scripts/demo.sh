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
#   SO_JOBS          parallel build jobs (default: the number of CPUs)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root="$(pwd)"
prefix="${SO_DEMO_PREFIX:-dist}"
build="${SO_DEMO_BUILD:-out/demo}"
jobs="${SO_JOBS:-$(nproc 2>/dev/null || echo 2)}"
case "$prefix" in /*) ;; *) prefix="$root/$prefix" ;; esac
case "$build" in /*) ;; *) build="$root/$build" ;; esac

log() { printf '\n==== %s\n' "$*" >&2; }

# ---------------------------------------------------------------- tools
missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v make >/dev/null 2>&1 || missing+=(make)
if ! command -v c++ >/dev/null 2>&1 && ! command -v g++ >/dev/null 2>&1; then missing+=(g++); fi
if ! command -v cc >/dev/null 2>&1 && ! command -v gcc >/dev/null 2>&1; then missing+=(gcc); fi
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]} with apt-get"
    if [ "$(id -u)" -eq 0 ]; then
        sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        sudo=(sudo)
    else
        echo "error: ${missing[*]} missing, and this user can neither apt-get install nor sudo" >&2
        exit 1
    fi
    if ! command -v apt-get >/dev/null 2>&1; then
        echo "error: ${missing[*]} missing and there is no apt-get; install them and run again" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    "${sudo[@]}" apt-get update -qq
    "${sudo[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "error: cargo not found (install a Rust toolchain, e.g. with rustup)" >&2
        exit 1
    fi
fi
cmake_version="$(cmake --version | head -n 1 | sed 's/[^0-9.]*//')"
if [ "$(printf '%s\n3.22\n' "$cmake_version" | sort -V | head -n 1)" != 3.22 ]; then
    echo "error: cmake $cmake_version is too old: the projects need 3.22 or newer" >&2
    exit 1
fi

# ---------------------------------------------------------------- superoffload -> prefix
log "superoffload: configure, build (cargo, release) and install into $prefix"
cmake -S "$root" -B "$build/root" -DCMAKE_BUILD_TYPE=Release -DSO_BUILD_TESTS=OFF >/dev/null
cmake --build "$build/root" -j "$jobs"
cmake --install "$build/root" --prefix "$prefix" >/dev/null

# ---------------------------------------------------------------- demo/ against the prefix
log "demo: configure against $prefix and build"
cmake -S "$root/demo" -B "$build/demo" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
cmake --build "$build/demo" -j "$jobs"

log "run: superoffload-demo $*"
exec "$build/demo/superoffload-demo" "$@"
