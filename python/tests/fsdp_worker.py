#!/usr/bin/env python3
"""SuperOffloadAdamW under FSDP2 (torch.distributed.fsdp.fully_shard): the checks of one rank.
Host mode with gloo on the CPU, or CUDA with nccl (one GPU per rank).

Each rank's session steps that rank's local shards (the post-accumulate-grad hooks fire on the
sharded parameters after the reduce-scatter); the global gradient norm and the overflow verdict
come from an all-reduce of local_grad_sumsq over the shard group. Checks, on every rank:

  cores       each rank's optimizer pool got its own share of the CPUs (disjoint; one each where
              the node has a CPU per rank).
  parity      vs torch.optim.AdamW on f32 master weights of an unsharded copy of the model
              trained on the whole global batch (each rank trains on its slice; FSDP averages the
              gradients): mean relative difference of the global loss and of the global norm
              <= --tol, and the loss falls.
  resume      the rank-local state_dict() through torch.save half-way, loaded into a fresh sharded
              model and optimizer: the second half resumes bit for bit.
  dcp_resume  the same through torch.distributed.checkpoint: get_state_dict(model, opt)
              (FQN-keyed, sharded DTensors) saved with dcp.save, dcp.load + set_state_dict.
  skip        a step whose gradient has a NaN on the last rank only: every rank skips it (the
              shards and the moments stay as they were) and the steps after it train on.

On one rank with the shards on the host the gradients are taken from FSDP2's unsharded
parameters before any reduction (superoffload/torch/_fsdp.py); on more, from the reduced shards.
With `--dtype bf16` on the CPU the shards are bf16: the session keeps f32 master weights and
writes the shards as the weights' copy (checked equal to the masters rounded, after every run).
Across world sizes the arithmetic differs (FSDP2 averages per-rank gradients), so the bound is
the parity check's tolerance against the unsharded reference, on every world size.

  python3 fsdp_worker.py [--device cpu|cuda]             # a world of one
  torchrun --nproc_per_node N fsdp_worker.py --json out.json

Used by test_fsdp.py (2 ranks, gloo) and examples/torch_optimizer/run.sh. Needs the superoffload
package. Exits 1 if a check fails on any rank.
"""
import argparse
import io
import json
import math
import os
import socket
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _models import (MasterAdamW, loss_fn, lr_lambda, make_data, make_model, param_groups, rel_diffs,  # noqa: E402
                     train_reference)

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded(seed, device, dtype, mesh):
    from torch.distributed.fsdp import fully_shard
    m = make_model(seed, device, dtype)
    for blk in m.blocks:
        fully_shard(blk, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def make_opt(model, clip, **kw):
    from superoffload.torch import SuperOffloadAdamW
    return SuperOffloadAdamW(param_groups(list(model.named_parameters()), WD), lr=LR, betas=BETAS, eps=EPS,
                             max_grad_norm=clip, model=model, **kw)


def run(model, opt, sched, data, device, rank, world, poison=None):
    """Trains on this rank's slice of each global batch; returns (global mean losses, norms). At
    step `poison` the last rank's loss is multiplied by NaN (its gradients become NaN)."""
    losses, norms = [], []
    for k, (x, y) in enumerate(data):
        b = x.shape[0] // world
        xs, ys = x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)
        loss = loss_fn(model, xs, ys)
        if k == poison and rank == world - 1:
            loss = loss * float("nan")
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        t = loss.detach().float().reshape(1).to(device)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        norms.append(opt.last_step_result()["global_norm"])
    return losses, norms


def local_shards(model):
    return [p.to_local().detach().clone() for p in model.parameters()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8, help="global batch (divisible by the world size)")
    ap.add_argument("--clip", type=float, default=1.3)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["auto", "f32", "bf16"], default="auto",
                    help="the model's (and shards') dtype; auto: bf16 on CUDA, f32 on the CPU")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "fsdp.json") if os.environ.get("OUT") else None)
    args = ap.parse_args()
    if "RANK" not in os.environ:  # plain python3: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}.get(args.dtype, torch.bfloat16 if cuda else torch.float32)
    dist.init_process_group("nccl" if cuda else "gloo", **({"device_id": device} if cuda else {}))
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    mesh = init_device_mesh(device.type, (world,))
    torch.set_num_threads(max(1, min(4, (os.cpu_count() or 1) // world)))
    if args.batch % world:
        sys.exit(f"--batch {args.batch} is not divisible by the world size {world}")
    data = make_data(args.steps, args.batch, 32, 64)
    report = {"rank": rank, "world_size": world, "backend": dist.get_backend(), "checks": {}}
    ok = True

    def check(name, good, detail):
        nonlocal ok
        ok &= bool(good)
        report["checks"][name] = {"pass": bool(good), **detail}
        shown = ", ".join(f"{k}={v}" for k, v in detail.items())
        print(f"[rank {rank}] [{'PASS' if good else 'FAIL'}] {name}: {shown}", flush=True)

    try:
        model = sharded(0, device, dtype, mesh)
        opt = make_opt(model, args.clip)
        if rank == 0:
            print(f"world size {world}, backend {dist.get_backend()}, mode {'CUDA' if cuda else 'host'} {dtype}; "
                  f"distributed norm: {opt.distributed}; rank 0 steps {len(opt.subgroups())} sub-groups of "
                  f"{sum(s[2] for s in opt.subgroups())} local elements", flush=True)
        all_cores = [None] * world
        dist.all_gather_object(all_cores, opt.cores)
        flat = [c for cs in all_cores if cs for c in cs]
        # Every rank a share of its own where the node has a CPU per rank (CI's 2 may run 3 ranks).
        enough = len(os.sched_getaffinity(0)) >= world
        check("cores", (all(all_cores) or not enough) and len(flat) == len(set(flat)), {"cores": all_cores})

        ref_model = make_model(0, device, dtype)
        ref = MasterAdamW(ref_model, LR, BETAS, EPS, WD, args.clip)
        la, na = run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data, device, rank, world)
        lb, nb = train_reference(ref_model, ref, torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda), data, device)
        d, dn = rel_diffs(la, lb), rel_diffs(na, nb)
        check("parity", sum(d) / len(d) <= args.tol and sum(dn) / len(dn) <= args.tol and la[-1] < la[0],
              {"steps": len(d), "mean_rel_loss_diff": f"{sum(d) / len(d):.3e}", "max": f"{max(d):.3e}",
               "mean_rel_norm_diff": f"{sum(dn) / len(dn):.3e}", "clipped_steps": sum(n > args.clip for n in na),
               "first_loss": round(la[0], 4), "last_loss": round(la[-1], 4)})
        report["losses"], report["ref_losses"], report["norms"] = la, lb, na
        if not cuda and dtype != torch.float32:
            opt.synchronize()
            rounded = all(torch.equal(sg.copy, sg.master.to(dtype)) for sg in opt._subgroups)
            check("shard_copies", rounded, {"shards_equal_rounded_masters": rounded})
        opt.close()

        # Half the steps, a checkpoint, the other half; then the same half from the checkpoint
        # in a fresh sharded model and optimizer. Clipped and bit for bit: every step exact.
        half = len(data) // 2
        m1 = sharded(0, device, dtype, mesh)
        o1 = make_opt(m1, args.clip, speculation=False)
        s1 = torch.optim.lr_scheduler.LambdaLR(o1, lr_lambda)
        run(m1, o1, s1, data[:half], device, rank, world)
        buf = io.BytesIO()
        torch.save({"opt": o1.state_dict(), "sched": s1.state_dict()}, buf)
        ckdir = [tempfile.mkdtemp(prefix="so-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(ckdir)
        msd, osd = get_state_dict(m1, o1)  # FQN-keyed, sharded (DTensor) state
        dtensor_state = sum(type(v).__name__ == "DTensor" for st in osd["state"].values() for v in st.values())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckdir[0])
        l1, _ = run(m1, o1, s1, data[half:], device, rank, world)
        w1 = local_shards(m1)

        buf.seek(0)
        ck = torch.load(buf, weights_only=False)
        m2 = sharded(5, device, dtype, mesh)
        o2 = make_opt(m2, args.clip, speculation=False)
        s2 = torch.optim.lr_scheduler.LambdaLR(o2, lr_lambda)
        o2.load_state_dict(ck["opt"])  # restores the master weights, and through them the shards
        s2.load_state_dict(ck["sched"])
        l2, _ = run(m2, o2, s2, data[half:], device, rank, world)
        same = all(torch.equal(a, b) for a, b in zip(w1, local_shards(m2)))
        check("resume", l1 == l2 and same, {"losses_equal": l1 == l2, "local_shards_equal": same})

        m3 = sharded(5, device, dtype, mesh)
        o3 = make_opt(m3, args.clip, speculation=False)
        s3 = torch.optim.lr_scheduler.LambdaLR(o3, lr_lambda)
        msd3, osd3 = get_state_dict(m3, o3)  # the template (a fresh optimizer: torch's lr-0 init step)
        sd = {"model": msd3, "optim": osd3}
        dcp.load(sd, checkpoint_id=ckdir[0])
        set_state_dict(m3, o3, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        s3.load_state_dict(ck["sched"])
        l3, _ = run(m3, o3, s3, data[half:], device, rank, world)
        same = all(torch.equal(a, b) for a, b in zip(w1, local_shards(m3)))
        check("dcp_resume", l1 == l3 and same and dtensor_state > 0,
              {"losses_equal": l1 == l3, "local_shards_equal": same, "dtensor_state_tensors": dtensor_state})
        for o in (o1, o2, o3):
            o.close()

        m4 = sharded(0, device, dtype, mesh)
        o4 = make_opt(m4, args.clip)
        s4 = torch.optim.lr_scheduler.LambdaLR(o4, lr_lambda)
        run(m4, o4, s4, data[:2], device, rank, world)
        o4.synchronize(host=True)
        before = local_shards(m4)
        moments = [t.clone() for st in o4.state_dict()["state"].values() for t in (st["exp_avg"], st["exp_avg_sq"])]
        lp, _ = run(m4, o4, s4, data[2:3], device, rank, world, poison=0)
        skipped = o4.last_step_result()["skipped"]
        o4.synchronize(host=True)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, local_shards(m4)))
        moments_after = [t for st in o4.state_dict()["state"].values() for t in (st["exp_avg"], st["exp_avg_sq"])]
        unchanged &= all(torch.equal(a, b) for a, b in zip(moments, moments_after))
        la4, _ = run(m4, o4, s4, data[3:6], device, rank, world)
        check("skip", bool(skipped) and unchanged and all(math.isfinite(v) for v in la4),
              {"skipped": bool(skipped), "unchanged": unchanged, "losses_after": [round(v, 4) for v in la4]})
        o4.close()
    except Exception as e:
        import traceback
        traceback.print_exc()
        check("exception", False, {"error": repr(e)[:300]})
    flag = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flag)
    report["pass"] = int(flag) == 0
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    if rank == 0:
        print("fsdp_worker:", "all checks passed on every rank" if report["pass"] else "FAILED", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalisation: gloo's run-loop threads may still drop their last
    # Python-owned tensors then, which aborts the process ("terminate called without an active
    # exception" from ProcessGroupGloo::AsyncWork's destructor taking the GIL during Py_Finalize).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["pass"] else 1)


if __name__ == "__main__":
    main()
