#!/bin/sh
# Runs one leak_* test program under valgrind. Definite and indirect leaks, and every
# memcheck error (invalid read/write, uninitialised use), fail the test. Exits 77 (ctest
# reports the test as skipped) where valgrind is not installed.
if ! command -v valgrind >/dev/null 2>&1; then
    echo "valgrind not found: skipping $1"
    exit 77
fi
exec valgrind --quiet --leak-check=full --show-leak-kinds=definite,indirect \
    --errors-for-leak-kinds=definite,indirect --error-exitcode=1 "$@"
