#!/usr/bin/env bash
# Builds the superoffload XLA FFI handlers against an installed superoffload and the JAX of
# $PYTHON (default python3), then trains the MLP with them and checks it against optax:
#   examples/jax_ffi/run.sh <superoffload-prefix> [train_mlp.py flags...]
# Runs: clipping at 1.0 (speculative), no clipping, speculation off; on JAX's default
# platform (CUDA session on a GPU, host session on the CPU) and, when that is a GPU, on the
# CPU platform as well. Exits non-zero if any run fails.
# train_mlp.py imports the superoffload Python package (its ctypes mirrors and header parser check
# the example's ctypes structs): install it (`pip install .` at the root, or the wheel).
# Environment: PYTHON, BUILD_DIR (default: build/ next to this script).
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: $0 <superoffload-prefix> [train_mlp.py flags...]" >&2
    exit 2
fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
prefix="$(cd "$1" && pwd)" || { echo "run.sh: no such prefix: $1" >&2; exit 2; }
shift
[ -f "$prefix/lib/cmake/SuperOffload/SuperOffloadConfig.cmake" ] ||
    { echo "run.sh: $prefix has no lib/cmake/SuperOffload (install superoffload there first)" >&2; exit 2; }
py="${PYTHON:-python3}"
build="${BUILD_DIR:-$here/build}"
inc="$("$py" -c 'import jax; print(jax.ffi.include_dir())')" ||
    { echo "run.sh: '$py' cannot import jax; set PYTHON to an interpreter that can" >&2; exit 2; }
backend="$("$py" -c 'import jax; print(jax.default_backend())')"
"$py" -c 'import superoffload' ||
    { echo "run.sh: '$py' cannot import the superoffload package; pip install . (or the wheel) first" >&2; exit 2; }
echo "run.sh: jax $("$py" -c 'import jax; print(jax.__version__)'), default backend $backend"

cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release "-DJAX_FFI_INCLUDE_DIR=$inc" "-DCMAKE_PREFIX_PATH=$prefix"
cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
lib="$build/libso_jax_ffi.so"

platforms=(auto)
if [ "$backend" = "gpu" ]; then platforms+=(cpu); fi
status=0
for platform in "${platforms[@]}"; do
    for variant in "--max-norm 1.0" "--max-norm 0" "--max-norm 1.0 --no-speculation"; do
        echo
        echo "==== platform $platform, $variant"
        # shellcheck disable=SC2086
        "$py" "$here/train_mlp.py" --lib "$lib" --platform "$platform" $variant "$@" || status=1
    done
done
echo
if [ "$status" -eq 0 ]; then echo "run.sh: all runs passed"; else echo "run.sh: FAILED"; fi
exit "$status"
