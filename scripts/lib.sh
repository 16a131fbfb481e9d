# Shared preamble of the scripts in scripts/: source it, do not run it.
#
#   . "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
#
# It moves to the repository root (so_root holds its path) and defines:
#   so_log MSG...            a "==== MSG" line on stderr
#   so_jobs                  parallel jobs: $SO_JOBS, else the number of CPUs
#   so_abs PATH              PATH made absolute against the repository root
#   so_can_install           whether apt-get can be run here (as root, or through sudo)
#   so_apt_install PKG...    apt-get install PKG... (as root or through sudo); fails with a
#                            message when that is impossible
#   so_require CMD[=PKG]...  installs, with apt-get, the package of every missing command
#                            (PKG defaults to CMD), or fails saying what is missing
#   so_find_cargo            puts cargo on PATH (from ~/.cargo/bin if needed), or fails
#   so_cargo_target_dir      cargo's target directory of this workspace
#   so_free_gib PATH         whole GiB free on the file system of PATH
#   so_cmake_at_least VER    fails unless cmake is at least VER
#   so_gpu_setup "$@"        the arguments of the GPU-machine scripts, <prefix> [output dir]
#                            [parts]: sets prefix (absolute), out (created), parts, threads,
#                            and LD_LIBRARY_PATH, PYTHONUNBUFFERED
#   so_want PART             whether PART is among the selected parts (all, or a comma list)
#   so_step MSG              a "==== MSG ====" line on stdout (the GPU scripts' sections)
# It sets no shell options: each script sets its own (set -euo pipefail, or -uo where one
# failing part must not stop the others).

so_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$so_root"

so_log() { printf '\n==== %s\n' "$*" >&2; }

so_jobs() { echo "${SO_JOBS:-$(nproc 2>/dev/null || echo 2)}"; }

so_abs() {
    case "$1" in
        /*) echo "$1" ;;
        *) echo "$so_root/$1" ;;
    esac
}

so_sudo=()
so_can_install() {
    command -v apt-get >/dev/null 2>&1 || return 1
    if [ "$(id -u)" -eq 0 ]; then
        so_sudo=()
    elif command -v sudo >/dev/null 2>&1; then
        so_sudo=(sudo)
    else
        return 1
    fi
}

so_apt_updated=0
so_apt_install() {
    if ! so_can_install; then
        echo "error: $* needed, and this user can neither apt-get install nor sudo (install: $*)" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    if [ "$so_apt_updated" = 0 ]; then
        "${so_sudo[@]}" apt-get update -qq
        so_apt_updated=1
    fi
    "${so_sudo[@]}" apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

so_require() {
    local missing=() spec cmd pkg
    for spec in "$@"; do
        cmd="${spec%%=*}"
        pkg="${spec#*=}"
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        so_log "installing ${missing[*]} with apt-get"
        so_apt_install "${missing[@]}"
    fi
}

so_find_cargo() {
    if ! command -v "${CARGO:-cargo}" >/dev/null 2>&1; then
        if [ -x "$HOME/.cargo/bin/cargo" ]; then
            export PATH="$HOME/.cargo/bin:$PATH"
        else
            echo "error: cargo not found (install a Rust toolchain, e.g. with rustup)" >&2
            return 1
        fi
    fi
}

so_cargo_target_dir() {
    local dir
    dir="$("${CARGO:-cargo}" metadata --format-version 1 --no-deps 2>/dev/null |
        sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')"
    echo "${dir:-$so_root/target}"
}

so_free_gib() { df -Pk "$1" | awk 'NR == 2 { print int($4 / 1048576) }'; }

so_cmake_at_least() {
    local have
    have="$(cmake --version | head -n 1 | sed 's/[^0-9.]*//')"
    if [ "$(printf '%s\n%s\n' "$have" "$1" | sort -V | head -n 1)" != "$1" ]; then
        echo "error: cmake $have is too old: the projects need $1 or newer" >&2
        return 1
    fi
}

so_gpu_setup() {
    if [ "$#" -lt 1 ] || [ ! -d "$1" ]; then
        echo "usage: $0 <install prefix> [output dir] [parts]" >&2
        return 2
    fi
    prefix="$(cd "$1" && pwd)"
    out="$(so_abs "${2:-${OUT:-gpu-out}}")"
    parts=",${3:-all},"
    threads="$(nproc)"
    mkdir -p "$out"
    export PYTHONUNBUFFERED=1 LD_LIBRARY_PATH="$prefix/lib:${LD_LIBRARY_PATH:-}"
}

so_want() { [[ "$parts" == ",all," || "$parts" == *",$1,"* ]]; }

so_step() { printf '\n==== %s ====\n' "$1"; }
