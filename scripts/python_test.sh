#!/usr/bin/env bash
# The Python package's checks on a CPU machine (the GPU ones are python/tests/gpu_checks.py):
#   1. builds the wheel as the README says, with python/build_wheel.sh (`pip wheel .`, then
#      auditwheel's verdict and its manylinux tag; the library from the CMake build of
#      scripts/test.sh when it exists, else cargo builds it);
#   2. installs it into a fresh virtual environment and, with nothing but that environment on
#      PATH (no Rust, no compiler), runs the torch-free layer tests (header mirrors, ctypes
#      session, errors, checkpoints, core shares);
#   3. unless SO_PY_JAX=0: installs the [jax] extra (jax's CPU build, optax) into that environment
#      with the README's command and runs the JAX tests (parity with optax per step, skipped
#      steps, loss scaling, resume) and the README's JAX quick start;
#   4. unless SO_PY_TORCH=0: installs torch (CPU use of PyPI's wheel) into that environment, then
#      the package's [hf] extra with the README's command (transformers, accelerate), runs every
#      Python snippet of README.md and python/README.md there (scripts/check_snippets.py; those
#      that need a GPU are skipped) and the torch tests (host mode: parity, speculation, resume,
#      migration, accumulation, bf16 moments, FSDP2 + DCP with 2 gloo ranks, Hugging Face
#      Trainer) and bench/peers.py's harness on the CPU (one rank, two FSDP2 ranks).
#
# Step 4 needs about 9 GiB of disk while pip installs (5.6 GiB once installed): with less
# than SO_PY_TORCH_MIN_FREE_GIB (10) free it says so and exits 77 after step 3.
#
# Environment: PYTHON (default python3), SO_PY_WORK (default target/python-test), SO_PY_JAX (1),
# SO_PY_TORCH (1), SO_BUILD_DIR (build: where scripts/test.sh's CMake build is), SO_PY_REBUILD=1 (let cargo
# build the library even if the CMake build has one), SO_PY_TORCH_SPEC (default "torch"),
# PIP_FIND_LINKS etc. as for pip.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
root="$so_root"
py="${PYTHON:-python3}"
work="${SO_PY_WORK:-$root/target/python-test}"
start=$(date +%s)
section() { printf '\n==== %s (+%ss) ====\n' "$1" "$(( $(date +%s) - start ))"; }

rm -rf "$work"
mkdir -p "$work/dist"

section "wheel (python/build_wheel.sh)"
build_dir="${SO_BUILD_DIR:-build}"
case "$build_dir" in /*) ;; *) build_dir="$root/$build_dir" ;; esac
prebuilt="$build_dir/cargo/release/libsuperoffload.so"
if [ "${SO_PY_REBUILD:-0}" != 1 ] && [ -f "$prebuilt" ]; then
    echo "library from the CMake build: $prebuilt"
    export SUPEROFFLOAD_PREBUILT_LIBRARY="$prebuilt"
fi
PYTHON="$py" bash "$root/python/build_wheel.sh" "$work/dist"
unset SUPEROFFLOAD_PREBUILT_LIBRARY
wheel="$(ls "$work"/dist/superoffload-*.whl)"

section "fresh environment: the wheel + pytest"
"$py" -m venv "$work/venv"
venv="$work/venv"
"$venv/bin/pip" install -q "$wheel" pytest
# Nothing but the environment on PATH: no cargo, no cc, no nvcc.
isolated() { env -i HOME="$work" PATH="$venv/bin" LANG=C.UTF-8 "$@"; }
isolated python -c 'import shutil; missing = [t for t in ("cargo", "rustc", "cc", "gcc", "nvcc") if shutil.which(t)]; assert not missing, missing; import superoffload; print("superoffload", superoffload.__version__, "from", superoffload.library_path())'

section "torch-free layer tests"
isolated python -m pytest -q -p no:cacheprovider "$root/python/tests/test_layer.py"

if [ "${SO_PY_JAX:-1}" = 1 ]; then
    section "jax and optax (the [jax] extra), the JAX tests"
    t0=$(date +%s)
    # The README's install command, beside the wheel: its [jax] extra brings jax (the CPU build
    # from the package index) and optax. The tests run with nothing but the environment on PATH:
    # importing superoffload.jax registers the library's own XLA FFI handlers, no compiler.
    (cd "$work" && "$venv/bin/pip" install -q --find-links dist "superoffload[jax]")
    echo "installed in $(( $(date +%s) - t0 )) s"
    isolated python -c 'import jax, optax, superoffload.jax; print("jax", jax.__version__, "optax", optax.__version__, "on", jax.default_backend())'
    isolated python -m pytest -q -p no:cacheprovider -rA "$root/python/tests/test_jax.py"
    # The README's JAX quick start in this environment (jax, no torch: the torch blocks are skipped).
    (cd "$root" && isolated python scripts/check_snippets.py --lang python --work "$work/snippets-jax" README.md)
fi

if [ "${SO_PY_TORCH:-1}" = 1 ]; then
    section "torch, transformers, accelerate"
    free_gib="$(so_free_gib "$work")"
    min_free_gib="${SO_PY_TORCH_MIN_FREE_GIB:-10}"
    echo "free disk at $work: $free_gib GiB"
    if [ "$free_gib" -lt "$min_free_gib" ]; then
        echo "SKIPPED: the torch tests: $free_gib GiB free, installing torch, transformers and accelerate needs $min_free_gib"
        exit 77
    fi
    t0=$(date +%s)
    "$venv/bin/pip" install -q ${SO_PY_TORCH_SPEC:-torch}
    # The README's install command, beside the wheel: its [hf] extra brings transformers and
    # accelerate (torch, installed above as SO_PY_TORCH_SPEC asks, satisfies the extra).
    (cd "$work" && "$venv/bin/pip" install -q --find-links dist "superoffload[hf]")
    echo "installed in $(( $(date +%s) - t0 )) s; environment size $(du -sh "$venv" | cut -f1)"
    isolated python -c 'import torch, transformers, accelerate; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__)'

    section "README snippets (Python), in the fresh environment (scripts/check_snippets.py)"
    (cd "$root" && isolated python scripts/check_snippets.py --lang python --work "$work/snippets")

    section "torch tests"
    isolated python -m pytest -q -p no:cacheprovider --ignore="$root/python/tests/test_jax.py" "$root/python/tests"
fi

section "Python checks passed"
