#!/bin/sh
# Runs one ctest program: run_test.sh <kind> <program> [arguments...]
#
# - leak_* tests always run under valgrind memcheck (skipped, exit 77, where valgrind is
#   missing);
# - with SO_VALGRIND=1 in the environment every test runs under valgrind memcheck (e.g.
#   `SO_VALGRIND=1 ctest --test-dir build`; valgrind must then be installed);
# - with SO_TEST_SANITIZED=1 (set by CMake for a build with SO_SANITIZE) valgrind is never
#   used: AddressSanitizer and valgrind do not run together, and LeakSanitizer checks leaks.
#
# Under valgrind, every memcheck error (invalid read or write, use of uninitialised values,
# bad free) and every definite or indirect leak fails the test with exit status 99. Leaks
# "still reachable" at exit (the library's default pool, thread-local buffers) and "possibly
# lost" ones (the stacks of threads still running at exit) are not errors. Suppressions, each
# with its reason, are in valgrind.supp next to this script.
kind="$1"
shift

if [ "${SO_TEST_SANITIZED:-0}" = 1 ]; then
    exec "$@"
fi
if [ "$kind" != leak ] && [ "${SO_VALGRIND:-0}" != 1 ]; then
    exec "$@"
fi
if ! command -v valgrind >/dev/null 2>&1; then
    if [ "$kind" = leak ]; then
        echo "valgrind not found: skipping $1"
        exit 77
    fi
    echo "SO_VALGRIND=1 but valgrind is not installed" >&2
    exit 1
fi
exec valgrind --quiet --error-exitcode=99 --leak-check=full --show-leak-kinds=definite,indirect \
    --errors-for-leak-kinds=definite,indirect \
    --suppressions="$(dirname "$0")/valgrind.supp" "$@"
