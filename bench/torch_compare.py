#!/usr/bin/env python3
"""superoffload vs PyTorch's fused CPU AdamW: same tensors, same thread count, one process.

Loads libsuperoffload through ctypes with the C ABI's declarations of the superoffload Python
package (`superoffload._abi`: structs initialised from the library's so_*_default() functions,
sizes and ABI version checked), then times, interleaving repetitions (torch, ours, torch, ours,
...) after a warm-up:

  f32 job   torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, fused=True).step()
            vs so_adam_update on the same p, p.grad, exp_avg, exp_avg_sq (torch's own state
            tensors).
  bf16 job  torch: torch.mul(g_bf16, 0.5, out=p.grad) (bf16 -> fp32 grad, scaled), the fused
            step, p_bf16.copy_(p); ours: one so_adam_update with the bf16 gradient,
            grad_scale 0.5 and the bf16 parameter copy written in the same pass.
  ours only so_adam_rescale (1 -> 0.5) and so_adam_rollback (f32 grads), chained after our f32
            update, so they run on exactly the state they are meant for.

Before timing, one step from identical states is compared element-wise (f32 and bf16 jobs);
the script exits with status 3 if ours and torch's differ by more than rtol 1e-5 (+ a tiny
atol). Rounding differs by design (torch uses lerp and its own operation order).

Without PyTorch, `--selftest` runs the whole ctypes layer (every entry point, error path,
reference checks against a float64 AdamW written here, the timing and report code) on plain
ctypes buffers.

Usage:
  python3 bench/torch_compare.py --lib target/release/libsuperoffload.so --threads 16 --n 1e8 \\
      --json out.json
  python3 bench/torch_compare.py --lib target/release/libsuperoffload.so --selftest

Needs the superoffload Python package for the ABI declarations (only its `_abi` module: neither
the package's bundled library nor torch is loaded for it): the installed package (`pip install`
it) or, run from a source checkout, the checkout's python/ directory (bench/../python). Installed
with the library (share/superoffload/bench/), the script needs the pip-installed package.
"""

import argparse
import math
import os
import sys

from torch_compare_lib import ISA_CODES, Lib
from torch_compare_pytorch import torch_main
from torch_compare_selftest import selftest


def parse_count(s):
    s = s.replace("_", "")
    x = float(s)
    if not math.isfinite(x) or x < 1 or x != int(x):
        raise argparse.ArgumentTypeError(f"{s!r} is not a positive whole number")
    return int(x)


def parse_cores(s):
    cores = []
    for part in s.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            cores.extend(range(int(a), int(b) + 1))
        else:
            cores.append(int(part))
    return cores


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    default_lib = os.environ.get("SUPEROFFLOAD_LIB",
                                 os.path.join(here, "..", "target", "release", "libsuperoffload.so"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=default_lib, help="path to libsuperoffload.so (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=16, help="threads for torch and for our pool (default 16)")
    ap.add_argument("--cores", type=parse_cores, default=None, help="pin our pool's threads, e.g. 0-15")
    ap.add_argument("--isa", choices=sorted(ISA_CODES), default="auto", help="our pool's instruction set")
    ap.add_argument("--n", type=parse_count, default=100_000_000, help="elements (default 1e8)")
    ap.add_argument("--iters", type=int, default=10, help="timed repetitions, >= 10 recommended (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    ap.add_argument("--gap-ms", type=float, default=20.0,
                    help="pause before each timed call, so idle worker threads stop spinning (default 20)")
    ap.add_argument("--check-n", type=parse_count, default=10_000_000,
                    help="elements of the one-step numerics check (default 1e7, at most --n)")
    ap.add_argument("--json", default=None, help="write the results as JSON here")
    ap.add_argument("--selftest", action="store_true", help="test the ctypes layer without PyTorch")
    ap.add_argument("--selftest-n", type=parse_count, default=3000, help="elements in --selftest (default 3000)")
    args = ap.parse_args()
    if args.threads < 1 or args.iters < 1 or args.warmup < 0:
        ap.error("--threads and --iters must be >= 1, --warmup >= 0")
    if args.cores and len(args.cores) != args.threads:
        ap.error(f"--cores lists {len(args.cores)} cores but --threads is {args.threads}")

    lib = Lib(args.lib)
    if args.selftest:
        return selftest(args, lib)
    return torch_main(args, lib)


if __name__ == "__main__":
    sys.exit(main())
