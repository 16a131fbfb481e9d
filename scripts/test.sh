#!/usr/bin/env bash
# The test command of this repository (CI runs it through .ci/run), in this order:
#
#   0. the device kernels (PTX text) assembled with ptxas from NVIDIA's pip wheel, no GPU
#      needed (scripts/check_ptx.sh);
#   1. style: `cargo fmt --check`, `cargo clippy --workspace --all-targets -D warnings`,
#      `cargo doc` without warnings and the C/C++ sources against .clang-format
#      (scripts/check_format.sh);
#   2. `cargo test --workspace` (the library and the benchmark crate), then the
#      reproducibility harness, which needs the `fault-injection` feature;
#   3. the CMake build and the ctest suite in c_tests/;
#   4. the install (stripped) into <build>/install, with its size, checked against the sizes
#      docs/library.md states (scripts/check_sizes.py, within 15 %);
#   5. against that install: the main job (scripts/demo.sh, a short run), the README's C
#      quick start and docs/cpp.md's C++ program, their CMake projects and programs as written
#      (scripts/check_snippets.py);
#   6. the ctest suite once more, every test under valgrind memcheck (errors fatal);
#   7. the C/C++ tests built with AddressSanitizer and UndefinedBehaviorSanitizer
#      (-fsanitize=address,undefined -fno-sanitize-recover=all) against the installed library,
#      and run. The Rust library itself is not instrumented (that needs a nightly rustc):
#      ASan still checks every heap block the library allocates through malloc (bounds of
#      what the tests access, double frees, leaks at exit), not the library's own accesses;
#   8. the Python package (scripts/python_test.sh): the wheel, its install into a fresh virtual
#      environment without Rust or a compiler, the torch-free layer tests, then torch,
#      transformers and accelerate, the READMEs' Python snippets and the host-mode torch,
#      FSDP2 and Trainer tests;
#   9. the libtorch component (SuperOffload::torch) against the torch of that environment and
#      the install of step 4 (SO_PREBUILT_DIR): built, its ctest torch_adamw, installed into
#      that prefix, then the README's libtorch quick start built and run against it.
#
# Runs on a fresh Debian machine with a Rust toolchain (rustfmt included), gcc/g++ and
# pkg-config. What is missing of cmake, valgrind and clang-format-14 is installed with
# apt-get (as root or through sudo; cmake is required, the other two are optional). A part
# whose tool is missing or cannot be installed is skipped, and said so in a line starting
# with SKIPPED and in the summary at the end. GPU tests skip (exit 77) without a GPU.
#
# Environment:
#   SO_BUILD_DIR        CMake build directory (default: build)
#   SO_JOBS             parallel build and test jobs (default: the number of CPUs)
#   SO_SKIP_CARGO_TEST=1  skip `cargo test` (only the CMake/ctest parts)
#   SO_INSTALL_TOOLS=0  install no optional tool (valgrind, clang-format-14)
#   SO_SKIP=LIST        skip parts, a comma list of: ptx, style, clippy, valgrind, sanitize, python,
#                       libtorch
#   SO_FREE_DISK=1      remove cargo's debug target (target/debug) once the Rust tests have run:
#                       no later part uses it, and the torch install needs the room (.ci/run)
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

build_dir="$(so_abs "${SO_BUILD_DIR:-build}")"
jobs="$(so_jobs)"
start=$(date +%s)
last=$start
last_name=""
timings=()
skipped=()

section() {
    local now
    now=$(date +%s)
    if [ -n "$last_name" ]; then timings+=("$(printf '%5ss  %s' "$((now - last))" "$last_name")"); fi
    last=$now
    last_name="$1"
    printf '\n==== %s (+%ss) ====\n' "$1" "$((now - start))"
}
skip() {
    echo "SKIPPED: $*"
    skipped+=("$*")
}
wanted() { [[ ",${SO_SKIP:-}," != *",$1,"* ]]; }
# Runs a part whose exit code 77 means it cannot run here: then it is skipped, saying WHY.
run_or_skip() {
    local why="$1" rc=0
    shift
    "$@" || rc=$?
    case $rc in
        0) ;;
        77) skip "$why" ;;
        *) exit "$rc" ;;
    esac
}

section "Tools"
so_require cmake
if [ "${SO_INSTALL_TOOLS:-1}" != 0 ] && so_can_install; then
    optional=()
    command -v valgrind >/dev/null 2>&1 || optional+=(valgrind)
    command -v clang-format-14 >/dev/null 2>&1 || command -v clang-format >/dev/null 2>&1 || optional+=(clang-format-14)
    if [ "${#optional[@]}" -gt 0 ]; then
        t0=$(date +%s)
        if so_apt_install "${optional[@]}"; then
            echo "installed ${optional[*]} in $(($(date +%s) - t0)) s"
        else
            echo "could not install ${optional[*]}; the parts that need them are skipped"
        fi
    fi
fi
echo "free disk at $so_root: $(so_free_gib "$so_root") GiB"
cargo --version
cmake --version | head -n 1
${CC:-cc} --version | head -n 1
${CXX:-c++} --version | head -n 1
if command -v valgrind >/dev/null 2>&1; then valgrind --version; else echo "valgrind: not found"; fi
if command -v pkg-config >/dev/null 2>&1; then echo "pkg-config $(pkg-config --version)"; else echo "pkg-config: not found (its check will be skipped)"; fi

# ---------------------------------------------------------------- style
if wanted ptx; then
    section "PTX: the device kernels assemble (scripts/check_ptx.sh)"
    ptx_args=()
    if [ "${SO_INSTALL_TOOLS:-1}" != 0 ]; then ptx_args=(--install); fi
    run_or_skip "PTX check: no ptxas" bash scripts/check_ptx.sh "${ptx_args[@]}"
fi

if wanted style; then
    section "Style: cargo fmt --check"
    if cargo fmt --version >/dev/null 2>&1; then
        cargo fmt --all --check
        echo "cargo fmt: formatted"
    else
        skip "cargo fmt --check: rustfmt is not installed (rustup component add rustfmt)"
    fi
fi

# The lints are the [workspace.lints] table of Cargo.toml; every warning is an error.
if wanted clippy; then
    section "Lint: cargo clippy --workspace --all-targets -D warnings"
    if cargo clippy --version >/dev/null 2>&1; then
        cargo clippy --workspace --all-targets --locked -j "$jobs" -- -D warnings
        # The fault-injection build (its switches, the reproducibility harness's chunk hook).
        cargo clippy --all-targets --locked --features fault-injection -j "$jobs" -- -D warnings
        echo "cargo clippy: clean"
        # The API docs: every intra-doc link resolves, no rustdoc warning.
        RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --lib --locked -j "$jobs"
        echo "cargo doc: clean"
    else
        skip "cargo clippy: clippy is not installed (rustup component add clippy)"
    fi
else
    skip "cargo clippy (SO_SKIP)"
fi

if wanted style; then
    section "Style: clang-format (scripts/check_format.sh)"
    run_or_skip "clang-format check: clang-format 14 not installed" bash scripts/check_format.sh
else
    skip "style checks (SO_SKIP)"
fi

# ---------------------------------------------------------------- Rust tests
if [ "${SO_SKIP_CARGO_TEST:-0}" != 1 ]; then
    section "cargo test --workspace"
    cargo test --workspace --locked -j "$jobs"
    section "cargo test: reproducibility under injected delays (--features fault-injection)"
    cargo test --locked --features fault-injection -j "$jobs" --test reproducibility
    if [ "${SO_FREE_DISK:-0}" = 1 ]; then
        debug_target="$(so_cargo_target_dir)/debug"
        echo "SO_FREE_DISK=1: removing $debug_target ($(du -sh "$debug_target" | cut -f1))"
        rm -rf "$debug_target"
        echo "free disk now: $(so_free_gib "$so_root") GiB"
    fi
else
    skip "cargo test (SO_SKIP_CARGO_TEST=1)"
fi

# ---------------------------------------------------------------- CMake build and ctest
section "CMake configure ($build_dir)"
cmake -S . -B "$build_dir" -DCMAKE_BUILD_TYPE=Release

section "CMake build"
cmake --build "$build_dir" -j "$jobs"

section "ctest"
ctest --test-dir "$build_dir" --output-on-failure -j "$jobs"

# ---------------------------------------------------------------- install
section "Install into $build_dir/install"
prefix="$build_dir/install"
rm -rf "$prefix"
cmake --install "$build_dir" --prefix "$prefix" >/dev/null
(cd "$prefix" && du -ab . | sort -k2 | awk '$1 > 65536 && !/\/$/ { printf "%9.2f MB  %s\n", $1 / 1e6, $2 }')
echo "install tree: $(du -sb "$prefix" | awk '{ printf "%.2f MB", $1 / 1e6 }') in $(find "$prefix" -type f | wc -l) files"
python3 scripts/check_sizes.py --prefix "$prefix"    # the sizes docs/library.md states

# ---------------------------------------------------------------- the main job and the C quick start
# Against the install above: the library is not built a second time.
section "Main job: scripts/demo.sh against $prefix"
SO_PREBUILT_DIR="$prefix" SO_DEMO_BUILD="$build_dir/demo" bash scripts/demo.sh --steps 40

section "README's C quick start and docs/cpp.md against $prefix (scripts/check_snippets.py)"
rm -rf "$build_dir/snippets"
python3 scripts/check_snippets.py --lang sh,cmake,c,cpp --prefix "$prefix" --work "$build_dir/snippets"

# ---------------------------------------------------------------- valgrind
# build_consumer is left out: it runs cmake and a compiler, and its programs are the API
# tests' subset; every other test (gpu_ ones skip at once without a GPU) runs under memcheck.
if ! wanted valgrind; then
    skip "ctest under valgrind (SO_SKIP)"
elif command -v valgrind >/dev/null 2>&1; then
    section "ctest under valgrind memcheck (SO_VALGRIND=1)"
    SO_VALGRIND=1 ctest --test-dir "$build_dir" --output-on-failure -j "$jobs" -E '^build_consumer$'
else
    skip "ctest under valgrind: valgrind is not installed"
fi

# ---------------------------------------------------------------- sanitizers
if ! wanted sanitize; then
    skip "ASan+UBSan build of the C/C++ tests (SO_SKIP)"
else
    section "ASan+UBSan build of the C/C++ tests ($build_dir/sanitize)"
    probe_dir="$(mktemp -d)"
    printf 'int main(void) { return 0; }\n' > "$probe_dir/probe.c"
    if ${CC:-cc} -fsanitize=address,undefined "$probe_dir/probe.c" -o "$probe_dir/probe" 2>/dev/null &&
        "$probe_dir/probe"; then
        rm -rf "$probe_dir"
        cmake -S . -B "$build_dir/sanitize" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSO_PREBUILT_DIR="$prefix" \
            -DSO_SANITIZE=address,undefined
        cmake --build "$build_dir/sanitize" -j "$jobs"
        section "ctest, ASan+UBSan"
        ctest --test-dir "$build_dir/sanitize" --output-on-failure -j "$jobs" -E '^build_consumer$'
    else
        rm -rf "$probe_dir"
        skip "ASan+UBSan: ${CC:-cc} cannot build and run a -fsanitize=address,undefined program (libasan/libubsan missing?)"
    fi
fi

# ---------------------------------------------------------------- Python package
if ! wanted python; then
    skip "Python package (SO_SKIP)"
else
    section "Python package: wheel, fresh environment, layer and torch tests (scripts/python_test.sh)"
    run_or_skip "Python torch tests: too little free disk for torch (scripts/python_test.sh said why above)" \
        env SO_BUILD_DIR="$build_dir" bash scripts/python_test.sh
fi

# ---------------------------------------------------------------- the libtorch component
# Against the torch that scripts/python_test.sh installed and the install above: no second
# library build, three libtorch translation units (the component, its test, the Llama
# benchmark) and the quick start's.
torch_python="${SO_PY_WORK:-$so_root/target/python-test}/venv/bin/python"
if ! wanted libtorch; then
    skip "libtorch component (SO_SKIP)"
elif [ ! -x "$torch_python" ] || ! "$torch_python" -c 'import torch' 2>/dev/null; then
    skip "libtorch component: no torch in the Python test environment ($torch_python)"
else
    section "libtorch component: SuperOffload::torch against the test environment's torch, its ctest, the Llama benchmark on the CPU, the README's libtorch quick start"
    torch_cmake="$("$torch_python" -c 'import torch; print(torch.utils.cmake_prefix_path)')"
    cmake -S . -B "$build_dir/torch" -DCMAKE_BUILD_TYPE=Release -DSO_PREBUILT_DIR="$prefix" \
        -DSO_TORCH_BENCH=ON -DCMAKE_PREFIX_PATH="$torch_cmake"
    cmake --build "$build_dir/torch" -j "$jobs" --target superoffload_torch torch_adamw_test so_llama_bench
    ctest --test-dir "$build_dir/torch" --output-on-failure -R '^torch_adamw$'
    # The GPU benchmark's program on the CPU, small shapes: it runs, and both optimizers agree.
    bash bench/libtorch/run.sh --bin "$build_dir/torch/bench/libtorch/so_llama_bench" --out "$build_dir/llama-cpu" \
        --max-loss-diff 1e-5 --device cpu --steps 4 --warmup 1 --batch 2 --seq 32 --layers 2 --hidden 64 \
        --intermediate 128 --heads 4 --kv-heads 2 --vocab 256
    cmake --install "$build_dir/torch" --prefix "$prefix" >/dev/null
    rm -rf "$build_dir/snippets-torch"
    # That environment's python3 first on PATH: the quick start asks it for torch's CMake config.
    PATH="$(dirname "$torch_python"):$PATH" "$torch_python" scripts/check_snippets.py --lang sh,cmake,c,cpp \
        --prefix "$prefix" --work "$build_dir/snippets-torch" README.md
fi

section "Summary"
for t in "${timings[@]}"; do echo "$t"; done
echo "total: $(($(date +%s) - start)) s"
if [ "${#skipped[@]}" -gt 0 ]; then
    echo "skipped parts:"
    for s in "${skipped[@]}"; do echo "  - $s"; done
fi
echo "All tests passed"
