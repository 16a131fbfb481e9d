#!/usr/bin/env bash
# Checks the C and C++ sources against .clang-format (clang-format 14, Debian 12's), or with
# --fix rewrites them. The files: every tracked *.c, *.cc, *.cpp, *.h and *.hpp but the headers
# cbindgen generated (include/superoffload.h and the earlier release's in c_tests/old_header/);
# the C++ wrapper's headers are included.
#
#   scripts/check_format.sh          # exit 0: formatted; 1: not (the diffs are printed);
#                                    # 77: skipped, clang-format 14 is not installed
#   scripts/check_format.sh --fix    # formats the files in place
#
# Other clang-format versions format some constructs differently, so only version 14 is
# used: `clang-format-14`, or `clang-format` if that is version 14 (override with
# CLANG_FORMAT=/path/to/clang-format-14).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

want_major=14
fix=0
case "${1:-}" in
    --fix) fix=1 ;;
    "") ;;
    *)
        echo "usage: scripts/check_format.sh [--fix]" >&2
        exit 2
        ;;
esac

cf=""
for cand in "${CLANG_FORMAT:-}" clang-format-$want_major clang-format; do
    [ -n "$cand" ] || continue
    command -v "$cand" >/dev/null 2>&1 || continue
    major="$("$cand" --version | sed -n 's/.*clang-format version \([0-9]*\).*/\1/p')"
    if [ "$major" = "$want_major" ]; then
        cf="$cand"
        break
    fi
    echo "check_format: $cand is version ${major:-unknown}, not $want_major: not used" >&2
done
if [ -z "$cf" ]; then
    echo "SKIPPED: clang-format $want_major not found (Debian: apt-get install clang-format-$want_major)"
    exit 77
fi

if [ -d .git ] || git rev-parse --git-dir >/dev/null 2>&1; then
    mapfile -t files < <(git ls-files '*.c' '*.cc' '*.cpp' '*.h' '*.hpp' |
        grep -vx -e 'include/superoffload\.h' -e 'c_tests/old_header/superoffload-.*\.h')
else
    mapfile -t files < <(find c_tests demo examples include -type f \( -name '*.c' -o -name '*.cc' -o -name '*.cpp' \
        -o -name '*.h' -o -name '*.hpp' \) ! -path include/superoffload.h ! -path 'c_tests/old_header/superoffload-*.h' |
        sort)
fi
if [ "${#files[@]}" -eq 0 ]; then
    echo "check_format: no C/C++ files found" >&2
    exit 1
fi

if [ "$fix" = 1 ]; then
    "$cf" -i --style=file "${files[@]}"
    echo "check_format: formatted ${#files[@]} files with $("$cf" --version)"
    exit 0
fi

bad=0
for f in "${files[@]}"; do
    if ! "$cf" --style=file "$f" | diff -u --label "$f" --label "$f (clang-format)" "$f" -; then
        bad=$((bad + 1))
    fi
done
if [ "$bad" -ne 0 ]; then
    echo "check_format: $bad of ${#files[@]} files are not formatted (scripts/check_format.sh --fix)" >&2
    exit 1
fi
echo "check_format: ${#files[@]} files formatted ($("$cf" --version))"
