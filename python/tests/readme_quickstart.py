#!/usr/bin/env python3
"""Runs the first ```python block under "## Quick start" of python/README.md (so the README's
quick start is what gets tested). Exit status: the block's."""
import re
import sys

text = open(sys.argv[1] if len(sys.argv) > 1 else "python/README.md", encoding="utf-8").read()
section = text.split("## Quick start", 1)[1]
code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
print(code)
exec(compile(code, "README.md quick start", "exec"), {"__name__": "__main__"})
