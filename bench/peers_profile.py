#!/usr/bin/env python3
"""GPU: one system of bench/peers.py under torch.profiler: GPU busy time, kernels, the optimizer's stretch, gaps

Builds the system as bench/peers.py does (same model, batch and hyperparameters; --system one of
its systems), lets it settle as the timed runs there do, takes --warmup more steps, then records
--steps steps with torch.profiler (CPU and CUDA activity; no synchronisation inside the window,
so the host runs ahead of the GPU as in training). From the trace it reports:

  wall_s          seconds from one step's start to the next (the host's view)
  gpu_busy_ms     the union of every kernel, copy and memset interval in the window, per step
  streams         kernels, copies and memsets per stream: count and milliseconds
  kernels         the --top names by total time (name, stream, count, milliseconds)
  optimizer       the stretches of optimizer kernels (so_adam_step, torch's multi_tensor_apply),
                  and between two of them the forward and backward: its span and the busy time
                  of the compute stream (the stream with the most GPU time)
  gaps            the --top longest intervals in which the GPU ran nothing, with their neighbours
  compute_idle    per step, the compute stream's gaps above 0.1 ms, and the part of them in
                  which no stream ran (the GPU waited for the host)

  python3 bench/peers_profile.py --system ours --model 2.8b                    # GPU, 2 steps
  python3 bench/peers_profile.py --system torch-gpu-adamw --model 2.8b --clip 1e-3
  python3 bench/peers_profile.py --device cpu --model tiny --system ours       # the harness, no GPU

Writes profile_<system>_<clip>.json.gz (the Chrome trace, for chrome://tracing or Perfetto) and
summary_<system>_<clip>.json to --out (default $OUT/profile, else bench-out/profile).
"""
import argparse
import gzip
import json
import os
import shutil
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

OPTIMIZER_KERNELS = ("so_adam_step", "multi_tensor_apply_kernel")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_MARK = "peers_profile_step"


def busy_and_gaps(events):
    """The union of the events' intervals (us) and the intervals between them, longest first."""
    busy, gaps, end, last = 0.0, [], None, None
    for e in events:
        start, stop = e["ts"], e["ts"] + e["dur"]
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, end, last["name"], e["name"]))
            busy += stop - start
            end, last = stop, e
        elif stop > end:
            busy += stop - end
            end, last = stop, e
    gaps.sort(reverse=True)
    return busy, gaps


def stretches(events, names, join_us=5000.0):
    """Intervals covered by events whose name contains one of `names`, joined across gaps below join_us."""
    out = []
    for e in events:
        if not any(n in e["name"] for n in names):
            continue
        if out and e["ts"] - out[-1][1] < join_us:
            out[-1][1] = max(out[-1][1], e["ts"] + e["dur"])
        else:
            out.append([e["ts"], e["ts"] + e["dur"]])
    return out


def ms(us):
    return round(us / 1e3, 2)


def summarise(trace, wall, top):
    events = trace["traceEvents"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES and "dur" in e), key=lambda e: e["ts"])
    marks = sorted((e for e in events if e.get("name") == STEP_MARK and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    summary = {"wall_s": [round(w, 4) for w in wall], "device_events": len(device)}
    if not device:
        return summary
    t0 = marks[0]["ts"] if marks else device[0]["ts"]
    busy, gaps = busy_and_gaps(device)
    summary["gpu_busy_ms"] = ms(busy / len(wall))
    streams, kernels = {}, {}
    for e in device:
        s = streams.setdefault(str(e.get("tid")), [0, 0.0])
        s[0] += 1
        s[1] += e["dur"]
        k = kernels.setdefault((e["name"], str(e.get("tid"))), [0, 0.0])
        k[0] += 1
        k[1] += e["dur"]
    summary["streams"] = {s: {"count": n, "ms": ms(t)} for s, (n, t) in streams.items()}
    summary["kernels"] = [{"name": name[:120], "stream": s, "count": n, "ms": ms(t)}
                          for (name, s), (n, t) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]]
    compute = max(streams, key=lambda s: streams[s][1])
    found = stretches(device, OPTIMIZER_KERNELS)
    between = []
    for (_, end), (start, _) in zip(found, found[1:]):
        on_compute = sum(e["dur"] for e in device if str(e.get("tid")) == compute and end <= e["ts"] < start)
        between.append({"span_ms": ms(start - end), "compute_stream_busy_ms": ms(on_compute)})
    summary["optimizer"] = {"compute_stream": compute,
                            "stretches_ms": [[ms(a - t0), ms(b - t0), ms(b - a)] for a, b in found],
                            "forward_and_backward": between}
    summary["gaps"] = [{"ms": ms(g), "at_ms": ms(at - t0), "after": a[:80], "before": b[:80]}
                       for g, at, a, b in gaps[:top]]
    summary["compute_idle"] = compute_idle(device, compute, len(wall))
    return summary


def compute_idle(device, compute, steps, min_us=100.0):
    """Per step: the compute stream's gaps longer than min_us, and the part of them in which
    no other stream ran either (the GPU waited for the host), in ms."""
    others = [(e["ts"], e["ts"] + e["dur"]) for e in device if str(e.get("tid")) != compute]
    idle = alone = 0.0
    end = None
    for e in device:
        if str(e.get("tid")) != compute:
            continue
        if end is not None and e["ts"] - end > min_us:
            idle += e["ts"] - end
            covered, last = 0.0, end
            for a, b in others:  # sorted by start: the union of their overlap with the gap
                a, b = max(a, last), min(b, e["ts"])
                if b > a:
                    covered += b - a
                    last = b
            alone += e["ts"] - end - covered
        end = max(end or 0.0, e["ts"] + e["dur"])
    return {"gaps_ms": ms(idle / steps), "gpu_idle_ms": ms(alone / steps)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--system", default="ours", help="a system of bench/peers.py (default ours)")
    ap.add_argument("--model", default="2.8b", help="a model of bench/peers.py (default 2.8b)")
    ap.add_argument("--batch", type=int, default=0, help="sequences a step (default: the model's)")
    ap.add_argument("--micro-batches", type=int, default=1, help="backward passes a step (as bench/peers.py's)")
    ap.add_argument("--clip", type=float, default=0.0, help="max_grad_norm (default 0: no clipping)")
    ap.add_argument("--warmup", type=int, default=3, help="steps after settling, before the window (default 3)")
    ap.add_argument("--steps", type=int, default=2, help="steps recorded (default 2)")
    ap.add_argument("--top", type=int, default=12, help="kernels and gaps listed (default 12)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "bench-out", "profile"))
    args = ap.parse_args()
    # One rank of its own: the FSDP2 systems initialise a process group.
    from peers_runner import free_port
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1"),
                       ("MASTER_PORT", str(free_port()))):
        os.environ.setdefault(var, value)

    import torch
    from peers_systems import E2E_DIR, MODELS, SYSTEMS, Context
    sys.path.insert(0, E2E_DIR)
    if args.system not in SYSTEMS or args.model not in MODELS:
        ap.error(f"--system is one of {', '.join(SYSTEMS)}; --model one of {', '.join(MODELS)}")
    ctx = Context(args.model, batch=args.batch, device=args.device, clips=[args.clip],
                  micro_batches=args.micro_batches)
    trainer = SYSTEMS[args.system][1](ctx)
    trainer.set_clip(args.clip)
    trainer.before_phase(first=True)
    for _ in range(args.warmup):
        trainer.step()
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if ctx.cuda else [])
    wall = []
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            t = time.perf_counter()
            with torch.profiler.record_function(STEP_MARK):
                trainer.step()
            wall.append(time.perf_counter() - t)
        if ctx.cuda:
            torch.cuda.synchronize(ctx.device)
    trainer.close()

    os.makedirs(args.out, exist_ok=True)
    stem = f"{args.system}_{args.clip:g}"
    raw = os.path.join(args.out, f"profile_{stem}.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    summary = {"system": args.system, "model": args.model, "clip": args.clip, "steps": args.steps,
               **summarise(trace, wall, args.top)}
    with open(os.path.join(args.out, f"summary_{stem}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
