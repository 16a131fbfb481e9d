#!/usr/bin/env python3
"""How the CPU Adam kernel holds up when its cores are shared: one update of --numel elements
(bf16 gradient, f32 master and moments, bf16 copy written in the same pass) on a pool pinned to
--cores, timed alone, with a busy process on cores outside the pool, with busy processes on
cores of the pool (what a training thread or the autograd thread landing there does), and
while 1 GiB copies run both ways over PCIe (CUDA only: the host memory the link takes).

  SUPEROFFLOAD_LIBRARY=path/to/libsuperoffload.so python3 bench/pool_contention.py [--json out.json]

Prints one JSON line: per condition [median ms, max ms] of --reps updates after two warm-ups.
Run it once per library build to compare builds side by side.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def copy_loop():
    """The child process: 1 GiB pinned host-to-device and device-to-host copies, forever."""
    import torch
    src = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    print("ready", flush=True)
    while True:
        with torch.cuda.stream(up):
            dev.copy_(src, non_blocking=True)
        with torch.cuda.stream(down):
            dst.copy_(dev, non_blocking=True)
        up.synchronize()
        down.synchronize()


def busy(cores):
    """One spinning process pinned to each of `cores`."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"],
                             preexec_fn=lambda c=c: os.sched_setaffinity(0, {c})) for c in cores]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=1 << 25, help="elements of the update (default 33554432)")
    ap.add_argument("--cores", default="2-15", help="the pool's cores, a-b (default 2-15)")
    ap.add_argument("--reps", type=int, default=12, help="timed updates per condition (default 12)")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--copy-loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.copy_loop:
        copy_loop()
        return
    import torch
    import superoffload
    lo, _, hi = args.cores.partition("-")
    cores = list(range(int(lo), int(hi or lo) + 1))
    outside = [c for c in sorted(os.sched_getaffinity(0)) if c not in cores][:2]
    pool = superoffload.Pool(0, cores)
    n = args.numel
    p, g = torch.randn(n) * 0.02, (torch.randn(n) * 1e-3).to(torch.bfloat16)
    m, v, copy = torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)

    def measure():
        times = []
        for i in range(args.reps + 2):
            t0 = time.perf_counter()
            superoffload.adam_update(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, lr=1e-4, step=i + 1,
                                     pool=pool, grad_dtype="bf16", param_copy=copy.data_ptr(),
                                     param_copy_dtype="bf16")
            times.append((time.perf_counter() - t0) * 1e3)
        return [round(statistics.median(times[2:]), 2), round(max(times[2:]), 2)]

    out = {"library": superoffload.library_path(), "numel": n, "pool_cores": args.cores, "alone": measure()}
    for name, spin in [(f"busy_outside_{'_'.join(map(str, outside))}", outside),
                       (f"busy_pool_core_{cores[len(cores) // 2]}", [cores[len(cores) // 2]])]:
        if not spin:
            continue
        procs = busy(spin)
        time.sleep(0.3)
        out[name] = measure()
        for proc in procs:
            proc.kill()
    if torch.cuda.is_available():
        child = subprocess.Popen([sys.executable, __file__, "--copy-loop"], stdout=subprocess.PIPE, text=True,
                                 preexec_fn=lambda: os.sched_setaffinity(0, set(outside) or {0}))
        child.stdout.readline()
        time.sleep(0.5)
        out["pcie_copies_both_ways"] = measure()
        child.kill()
    print(json.dumps(out), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
