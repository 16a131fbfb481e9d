#!/usr/bin/env python3
"""Checks the install sizes docs/library.md states against an install tree.

    scripts/check_sizes.py --prefix DIR [--tolerance 0.15]

docs/library.md says "the install tree is X MB, the shared library Y MB, the static library
Z MB" (MB = 10^6 bytes). The install tree is measured as `du -sb` does (the apparent size of
every file, link and directory), the shared library as the file lib/libsuperoffload.so.<version>
and the static library as lib/libsuperoffload.a. Exit status 1 when a size is not stated or
differs from the measured one by more than the tolerance (a fraction of the measured size):
then update docs/library.md with the sizes printed. scripts/test.sh runs it after its install.
"""
import argparse
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "library.md")
STATED = {
    "install tree": r"the install tree is ([\d.]+) MB",
    "shared library": r"the shared library ([\d.]+) MB",
    "static library": r"the static library ([\d.]+) MB",
}


def tree_bytes(top):
    total = os.lstat(top).st_size
    for dirpath, dirnames, filenames in os.walk(top):
        total += sum(os.lstat(os.path.join(dirpath, n)).st_size for n in dirnames + filenames)
    return total


def measured(prefix):
    lib = os.path.join(prefix, "lib")
    shared = [p for p in glob.glob(os.path.join(lib, "libsuperoffload.so.*")) if not os.path.islink(p)]
    if len(shared) != 1:
        raise SystemExit(f"check_sizes: expected one lib/libsuperoffload.so.<version> file in {prefix}, got {shared}")
    return {
        "install tree": tree_bytes(prefix),
        "shared library": os.path.getsize(shared[0]),
        "static library": os.path.getsize(os.path.join(lib, "libsuperoffload.a")),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--tolerance", type=float, default=0.15)
    args = ap.parse_args()
    text = " ".join(open(DOC, encoding="utf-8").read().split())  # the sentence may wrap anywhere
    failed = []
    for what, size in measured(args.prefix).items():
        m = re.search(STATED[what], text)
        if not m:
            failed.append(f"{what}: docs/library.md does not state it as {STATED[what]!r}")
            continue
        stated = float(m.group(1)) * 1e6
        off = abs(stated - size) / size
        verdict = "ok" if off <= args.tolerance else "FAILED"
        print(f"{what}: {size / 1e6:.1f} MB measured, {stated / 1e6:.1f} MB stated ({off:.0%} off): {verdict}")
        if verdict != "ok":
            failed.append(f"{what}: {stated / 1e6:.1f} MB stated, {size / 1e6:.1f} MB measured")
    for f in failed:
        print(f"FAILED: {f} (tolerance {args.tolerance:.0%}): update docs/library.md")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
