#!/usr/bin/env python3
"""Runs the fenced code blocks of the READMEs and docs/cpp.md as they are written, so that what
they show works.

    scripts/check_snippets.py [--lang LIST] [--prefix DIR] [--gpu] [--work DIR] [FILE.md ...]

FILE.md defaults to README.md, python/README.md and docs/cpp.md. The blocks are taken in
document order:

- ```python: run on its own by this interpreter, in a fresh directory;
- ```c, ```cpp and ```cmake: written to the file that a comment before the block names (below);
- ```sh: run with `bash -euo pipefail` in the work directory, where `dist` is a link to --prefix
  (an install of superoffload made by `cmake --install`): a README command that uses the install
  finds it where the README says it is. Without --prefix these blocks are skipped.

An HTML comment on the line before a block says more about it (several separated by ";"):

    <!-- snippet: gpu -->               needs CUDA: run where torch sees a GPU, else SKIPPED (a python
                                        block's syntax is still checked)
    <!-- snippet: requires jax -->      a python block that imports an optional package: run where this
                                        interpreter can import it, else SKIPPED (its syntax still checked)
    <!-- snippet: file app/main.c -->   written to that path in the work directory, not run
    <!-- snippet: covered by WHERE -->  not run here: WHERE runs the same steps (printed as COVERED)
    <!-- snippet: not run: WHY -->      a documented command no test runs, and why (printed as NOT RUN)

Options:
    --lang LIST   only blocks of these languages, a comma list of python, sh, c, cpp, cmake (default: all)
    --prefix DIR  the install prefix the sh blocks use as `dist`
    --gpu         a GPU is expected: a block marked gpu fails instead of being skipped without CUDA
    --work DIR    where the blocks run (default: a temporary directory, removed at the end)

Exit status 0 when every block that ran passed; each skipped or covered block is listed.
scripts/test.sh runs the sh, c, cpp and cmake blocks against its install, scripts/python_test.sh the
python blocks in its fresh environment; on a GPU machine with the wheel installed:
`python3 scripts/check_snippets.py --lang python --gpu`.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_FILES = ["README.md", "python/README.md", "docs/cpp.md"]
LANGUAGES = ("python", "sh", "c", "cpp", "cmake")
BLOCK_TIMEOUT_S = 900
FENCE = re.compile(r"^```(\S*)\s*$")
DIRECTIVE = re.compile(r"^<!--\s*snippet:(.*?)-->\s*$")


class Block:
    def __init__(self, path, line, lang, code, directives):
        self.path, self.line, self.lang, self.code = path, line, lang, code
        self.gpu, self.file, self.covered_by, self.not_run = False, None, None, None
        self.requires = []
        for d in directives:
            if d == "gpu":
                self.gpu = True
            elif d.startswith("requires "):
                self.requires += d[len("requires "):].split()
            elif d.startswith("file "):
                self.file = d[len("file "):].strip()
            elif d.startswith("covered by "):
                self.covered_by = d[len("covered by "):].strip()
            elif d.startswith("not run:"):
                self.not_run = d[len("not run:"):].strip()
            else:
                raise SystemExit(f"{self.where()}: unknown snippet directive {d!r}")
        if lang in ("c", "cpp", "cmake") and not self.file and not self.covered_by:
            raise SystemExit(f"{self.where()}: a {lang} block needs <!-- snippet: file PATH --> before it")

    def where(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"

    def title(self):
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        first = first.split("  #")[0].split("  /*")[0].rstrip()
        return f"{self.where()} {self.lang} block ({first[:60]})"


def blocks_of(path):
    """The fenced blocks of a Markdown file, each with the directives of the comment before it."""
    lines = open(path, encoding="utf-8").read().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise SystemExit(f"{path}:{start + 1}: a fence that is never closed")
        if lang not in LANGUAGES:
            raise SystemExit(f"{path}:{start + 1}: a ```{lang} block; the languages checked are {', '.join(LANGUAGES)}")
        prev = next((lines[j].strip() for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        d = DIRECTIVE.match(prev)
        directives = [x.strip() for x in d.group(1).split(";") if x.strip()] if d else []
        out.append(Block(path, start + 1, lang, "\n".join(lines[start + 1:end]) + "\n", directives))
        i = end + 1
    return out


def cuda_missing():
    """Why this interpreter cannot run CUDA code, or None when it can."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    rc = subprocess.run([sys.executable, "-c", probe], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    if rc == 0:
        return None
    return "torch.cuda.is_available() is False" if rc == 3 else "torch cannot be imported"


def missing_modules(names):
    """The modules of `names` this interpreter cannot import."""
    return [n for n in names if subprocess.run([sys.executable, "-c", f"import {n}"], stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL).returncode != 0]


def run(cmd, cwd):
    try:
        return subprocess.run(cmd, cwd=cwd, timeout=BLOCK_TIMEOUT_S).returncode
    except subprocess.TimeoutExpired:
        print(f"timed out after {BLOCK_TIMEOUT_S} s")
        return 1


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", default=DEFAULT_FILES)
    ap.add_argument("--lang", default=",".join(LANGUAGES))
    ap.add_argument("--prefix")
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--work")
    args = ap.parse_args()
    langs = set(args.lang.split(","))
    if not langs <= set(LANGUAGES):
        ap.error(f"--lang: {', '.join(sorted(langs - set(LANGUAGES)))} is not one of {', '.join(LANGUAGES)}")
    blocks = [b for f in args.files for b in blocks_of(os.path.join(ROOT, f)) if b.lang in langs]

    work = os.path.abspath(args.work) if args.work else tempfile.mkdtemp(prefix="snippets-")
    os.makedirs(work, exist_ok=True)
    if args.prefix:
        dist = os.path.join(work, "dist")
        if os.path.lexists(dist):
            os.remove(dist)
        os.symlink(os.path.abspath(args.prefix), dist)

    no_cuda = cuda_missing() if any(b.gpu for b in blocks) else None
    ran, failed, skipped, covered, not_run = 0, [], [], [], []
    for n, b in enumerate(blocks):
        if b.not_run:
            not_run.append(f"{b.title()}: {b.not_run}")
            print(f"NOT RUN: {not_run[-1]}")
            continue
        if b.covered_by:
            print(f"COVERED: {b.title()}: by {b.covered_by}")
            covered.append(b)
            continue
        if b.file:
            path = os.path.join(work, b.file)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(b.code)
            print(f"wrote {b.file} from {b.where()}")
            continue
        absent = missing_modules(b.requires) if b.requires else []
        if (b.gpu and no_cuda and not args.gpu) or absent:
            why = f"needs {', '.join(absent)} (not importable here)" if absent else f"needs a GPU ({no_cuda})"
            skipped.append(f"{b.title()}: {why}")
            print(f"SKIPPED: {skipped[-1]}")
            if b.lang == "python":  # not run here, but it must parse
                try:
                    compile(b.code, b.where(), "exec")
                except SyntaxError as e:
                    failed.append(f"{b.title()}: {e}")
                    print(f"FAILED: {failed[-1]}")
            continue
        if b.lang == "sh" and not args.prefix:
            skipped.append(f"{b.title()}: needs an install of superoffload (--prefix)")
            print(f"SKIPPED: {skipped[-1]}")
            continue
        print(f"\n==== {b.title()}", flush=True)
        if b.gpu and no_cuda:
            print(f"--gpu, but {no_cuda}")
            rc = 1
        elif b.lang == "python":
            scratch = os.path.join(work, f"python-{n}")
            os.makedirs(scratch, exist_ok=True)
            script = os.path.join(scratch, "snippet.py")
            with open(script, "w", encoding="utf-8") as f:
                f.write(b.code)
            rc = run([sys.executable, script], scratch)
        else:
            rc = run(["bash", "-euo", "pipefail", "-c", b.code], work)
        ran += 1
        if rc != 0:
            failed.append(f"{b.title()}: exit status {rc}")
            print(f"FAILED: {failed[-1]}")

    if not args.work:
        shutil.rmtree(work)
    print(f"\nsnippets: {ran} ran, {len(failed)} failed, {len(covered)} covered elsewhere, {len(not_run)} not run, "
          f"{len(skipped)} skipped")
    for s in not_run:
        print(f"  NOT RUN: {s}")
    for s in skipped:
        print(f"  SKIPPED: {s}")
    for s in failed:
        print(f"  FAILED: {s}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
