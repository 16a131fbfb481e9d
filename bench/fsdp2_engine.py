#!/usr/bin/env python3
"""GPU: FSDP2's CPU offload engine alone: forward and backward, no optimizer, against the GPU's own

What an optimizer over FSDP2's CPUOffloadPolicy cannot go below: the model of bench/peers.py
(same shape, batch, activation checkpointing), one rank, each system in this process one after
the other, --passes forward-and-backward passes each, the gradients dropped as backward
produces them (so nothing is reduced or offloaded after it). The systems:

  gpu                the model on the GPU, bf16
  offload            fully_shard per decoder layer and at the root, CPUOffloadPolicy (pinned
                     shards of --shard-dtype), MixedPrecisionPolicy(param_dtype=bf16)
  offload-prefetch   the same, each layer prefetching the next two in forward and the two
                     before it in backward (set_modules_to_forward_prefetch / _backward_):
                     at one rank FSDP2's prefetch only marks a group, its copy still runs
                     on the compute stream when the group is needed
  offload-read-ahead the same as offload, with superoffload's ShardPrefetcher: the next
                     group's shards copied to the GPU on a stream of their own while the
                     current group computes (what SuperOffloadAdamW installs at one rank)

Prints every pass's seconds and the steady median, and writes --json. With --profile, one more
pass under torch.profiler: the GPU's busy time (the union of every kernel and copy), the pass's
span, and milliseconds per kind (kernels, and copies host to device, device to host, device to
device), which say whether the offload's gathers are exposed or only add work beside the
compute.

  python3 bench/fsdp2_engine.py --model 2.8b
  python3 bench/fsdp2_engine.py --model 2.8b --shard-dtype f32 --systems offload
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from peers_systems import E2E_DIR, MODELS, Context  # noqa: E402

SYSTEMS = ("gpu", "offload", "offload-prefetch", "offload-read-ahead")
PREFETCH_DEPTH = 2


def build(ctx, system, shard_dtype):
    if system == "gpu":
        return ctx.build_model()
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    model = ctx.build_model(dtype=shard_dtype)
    ctx.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=None),
                    offload_policy=CPUOffloadPolicy(pin_memory=True))
    if system == "offload-prefetch":
        layers = list(model.model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 1 + PREFETCH_DEPTH])
            layer.set_modules_to_backward_prefetch(layers[max(0, i - PREFETCH_DEPTH):i][::-1])
    if system == "offload-read-ahead":
        from superoffload.torch import _fsdp
        _fsdp.ShardPrefetcher(_fsdp.fsdp_modules(model), {}, ctx.device, wait=lambda sgs: None)
    torch.cuda.empty_cache()
    return model


def drop_gradients(model, system):
    """Every gradient set to None as soon as backward accumulated it: FSDP2 then reduces and
    offloads nothing. Its unsharded parameters exist once a first forward gathered them."""
    if system == "gpu":
        params = list(model.parameters())
    else:
        from superoffload.torch import _fsdp
        params = [fp._unsharded_param for fm in _fsdp.fsdp_modules(model) for fp in fm.fsdp_params]
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))


def profile_pass(ctx, model):
    """One forward and backward under torch.profiler: busy and span milliseconds, and per kind."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ctx.forward_backward(model)
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    intervals, by_kind = [], {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        start, end = e.time_range.start, e.time_range.end
        intervals.append((start, end))
        name = e.name.lower()
        kind = next((k for k in ("htod", "dtoh", "dtod") if k in name.replace(" ", "")), None)
        kind = f"memcpy {kind}" if "memcpy" in name and kind else ("memcpy" if "memcpy" in name else "kernel")
        by_kind[kind] = by_kind.get(kind, 0.0) + (end - start) / 1e3
    intervals.sort()
    busy, current = 0.0, None
    for start, end in intervals:
        if current is None or start > current[1]:
            busy += (current[1] - current[0]) if current else 0.0
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    busy += (current[1] - current[0]) if current else 0.0
    span = (intervals[-1][1] - intervals[0][0]) if intervals else 0.0
    return {"gpu_busy_ms": round(busy / 1e3, 1), "span_ms": round(span / 1e3, 1),
            "by_kind_ms": {k: round(v, 1) for k, v in sorted(by_kind.items())}}


def run(ctx, system, shard_dtype, passes, profiled):
    model = build(ctx, system, shard_dtype)
    times = []
    for i in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        ctx.forward_backward(model)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
        if i == 0:
            drop_gradients(model, system)
    steady = statistics.median(times[2:]) if len(times) > 2 else times[-1]
    row = {"system": system, "shard_dtype": str(shard_dtype).replace("torch.", ""), "times_s": [round(t, 4) for t in times],
           "steady_s": round(steady, 4), "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2)}
    if profiled:
        row["profile"] = profile_pass(ctx, model)
    del model
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="2.8b", choices=list(MODELS))
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    ap.add_argument("--shard-dtype", choices=("bf16", "f32"), default="bf16")
    ap.add_argument("--passes", type=int, default=8, help="forward and backward passes per system (default 8)")
    ap.add_argument("--profile", action="store_true", help="one more pass under torch.profiler (see above)")
    ap.add_argument("--json", help="where the rows go")
    args = ap.parse_args()
    systems = args.systems.split(",")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems: {', '.join(sorted(unknown))}")
    if not torch.cuda.is_available():
        print("fsdp2_engine.py: no GPU")
        sys.exit(77)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    sys.path.insert(0, E2E_DIR)
    ctx = Context(args.model, settle=False)
    shard_dtype = torch.bfloat16 if args.shard_dtype == "bf16" else torch.float32
    rows = []
    for system in systems:
        row = run(ctx, system, shard_dtype, args.passes, args.profile)
        rows.append(row)
        print(json.dumps(row), flush=True)
    gpu = next((r["steady_s"] for r in rows if r["system"] == "gpu"), None)
    for r in rows:
        ratio = f", {r['steady_s'] / gpu:.3f}x the GPU's" if gpu else ""
        print(f"{r['system']}: {r['steady_s']:.3f} s{ratio}, peak {r['peak_gib']} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
