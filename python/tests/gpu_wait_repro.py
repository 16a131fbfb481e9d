#!/usr/bin/env python3
"""Reproducer (GPU machine) of a deadlock seen with ABI 1: on the legacy default stream, a
device-to-host read (`.cpu()`, `model.state_dict()` then `.cpu()`) issued right behind
so_ticket_enqueue_wait for a step's final tickets that are not complete yet never returns.
Per-module forward waits followed by `loss.item()` and a side stream do not hang.
SuperOffloadAdamW.synchronize() therefore waits on the host first; this script bypasses that.

    python3 gpu_wait_repro.py MODE      # MODE: direct, direct_host, direct_side, loop, loop_item,
                                        #       loop_state, loop_item_side  (run each under `timeout`)

Seen on the H200 machine (torch 2.11, driver 580): direct and loop_state hang; the others pass.
so_ticket_enqueue_wait now waits on the calling thread for a ticket still pending, so the
stream never waits for work not yet queued: every mode is expected to pass.
"""
import os, sys, time, torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _models import loss_fn, make_data, make_model, param_groups
from superoffload.torch import SuperOffloadAdamW
mode = sys.argv[1]
dev = torch.device("cuda", 0)
if mode.endswith("_side"):
    s = torch.cuda.Stream(); torch.cuda.set_stream(s)
data = make_data(12, 16, 32, 64)
m = make_model(0, dev, torch.bfloat16)
opt = SuperOffloadAdamW(param_groups(list(m.named_parameters()), 0.1), lr=3e-3, max_grad_norm=1.0, model=m, sub_group_numel=20000)
t0 = time.time()
if mode.startswith("direct"):
    x, y = data[0][0].to(dev), data[0][1].to(dev)
    loss_fn(m, x, y).backward(); opt.step()
    if "host" in mode:
        opt.synchronize(host=True)
    else:  # the GPU-side waits alone, as synchronize() did before it waited on the host first
        opt.session.enqueue_wait_final(opt._waits.all_sgs, torch.cuda.current_stream(dev).cuda_stream)
    print(mode, "read", [p.detach().float().cpu().sum().item() for p in m.parameters()][:2], flush=True)
elif mode.startswith("loop"):
    for x, y in data:
        loss = loss_fn(m, x.to(dev), y.to(dev)); loss.backward(); opt.step()
        if "item" in mode: print(round(loss.item(), 4), end=" ", flush=True)
        if "state" in mode:  # the model hook's GPU-side waits alone, then a read
            opt._waits.pending.clear()
            opt.session.enqueue_wait_final(opt._waits.all_sgs, torch.cuda.current_stream(dev).cuda_stream)
            print(float(m.head.weight.detach().float().cpu().sum()), end=" ", flush=True)
    torch.cuda.synchronize()
    print(mode, "loss", loss.item(), opt.last_step_result()["global_norm"], flush=True)
print(mode, "OK", round(time.time() - t0, 2), flush=True)
opt.close()
