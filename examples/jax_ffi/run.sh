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
. "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
example_prefix "[train_mlp.py flags...]" "$@"
shift
example_require_module jax "set PYTHON to an interpreter that can"
example_require_module superoffload "pip install . (or the wheel) first"
backend="$("$py" -c 'import jax; print(jax.default_backend())')"
echo "run.sh: jax $("$py" -c 'import jax; print(jax.__version__)'), default backend $backend"

example_cmake_build "-DJAX_FFI_INCLUDE_DIR=$("$py" -c 'import jax; print(jax.ffi.include_dir())')" \
    "-DCMAKE_PREFIX_PATH=$prefix"
lib="$build/libso_jax_ffi.so"

platforms=(auto)
if [ "$backend" = "gpu" ]; then platforms+=(cpu); fi
status=0
for platform in "${platforms[@]}"; do
    for variant in "--max-norm 1.0" "--max-norm 0" "--max-norm 1.0 --no-speculation"; do
        example_step "platform $platform, $variant"
        # shellcheck disable=SC2086
        "$py" "$here/train_mlp.py" --lib "$lib" --platform "$platform" $variant "$@" || status=1
    done
done
example_exit "$status"
