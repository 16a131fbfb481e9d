#!/bin/sh
# expect_refused.sh <program> <soname>: passes if the dynamic loader refuses to start <program>
# because no <soname> (the library it records as NEEDED) is in LD_LIBRARY_PATH; fails if the
# program runs, or exits for any other reason.
out="$("$1" 2>&1)"
rc=$?
printf '%s\n' "$out"
if [ "$rc" -eq 0 ]; then
    echo "FAIL: $1 ran against the library in $LD_LIBRARY_PATH"
    exit 1
fi
case "$out" in
*"$2: cannot open shared object file"*)
    echo "refused by the loader, as it should be: no $2 in $LD_LIBRARY_PATH"
    exit 0
    ;;
esac
echo "FAIL: $1 exited with status $rc, not refused by the loader for want of $2"
exit 1
