# Shared preamble of the examples' run.sh scripts: source it, do not run it.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/../common.sh"
#
# It sets here (the sourcing script's directory) and py ($PYTHON, default python3), and defines:
#   example_step TITLE              a "==== TITLE" section line
#   example_prefix USAGE ARG...     checks that ARG (the first argument of run.sh) is an install
#                                   prefix of superoffload and sets prefix (absolute) and build
#                                   ($BUILD_DIR, default build/ next to the script); USAGE is the
#                                   rest of the usage line
#   example_require_module MODULE HINT
#                                   exits 2 unless $py can import MODULE, saying HINT
#   example_cmake_build ARG...      configures here/ into build/ (Release, ARG...) and builds it
#   example_exit STATUS [NOTE]      the closing verdict line, then exits with STATUS
# It sets no shell options: each script sets its own.

here="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
py="${PYTHON:-python3}"

example_step() { printf '\n==== %s\n' "$1"; }

example_prefix() {
    local usage="$1"
    shift
    if [ $# -lt 1 ]; then
        echo "usage: $0 <superoffload-prefix> $usage" >&2
        exit 2
    fi
    prefix="$(cd "$1" && pwd)" || { echo "run.sh: no such prefix: $1" >&2; exit 2; }
    [ -f "$prefix/lib/cmake/SuperOffload/SuperOffloadConfig.cmake" ] ||
        { echo "run.sh: $prefix has no lib/cmake/SuperOffload (install superoffload there first)" >&2; exit 2; }
    build="${BUILD_DIR:-$here/build}"
}

example_require_module() {
    "$py" -c "import $1" ||
        { echo "run.sh: '$py' cannot import $1; $2" >&2; exit 2; }
}

example_cmake_build() {
    cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release "$@"
    cmake --build "$build" -j "$(nproc 2>/dev/null || echo 2)"
}

example_exit() {
    echo
    if [ "$1" -eq 0 ]; then
        echo "run.sh: all checks passed${2:+ ($2)}"
    else
        echo "run.sh: FAILED (status $1${2:+; $2})"
    fi
    exit "$1"
}
