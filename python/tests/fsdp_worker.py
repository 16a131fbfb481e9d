#!/usr/bin/env python3
"""One rank of the FSDP2 checks (run by test_fsdp.py through torch.distributed.run, or by hand:
`torchrun --nproc_per_node 2 fsdp_worker.py --json out.json`). Host mode with gloo on the CPU,
or CUDA with nccl (--device cuda, one GPU per rank).

  parity   SuperOffloadAdamW on fully_shard'ed TinyGPT vs torch.optim.AdamW on an unsharded copy
           (each rank trains on its slice of the global batch): mean relative loss difference
           <= 1e-3, the same global norms.
  dcp      torch.distributed.checkpoint: get_state_dict(model, opt) (FQN-keyed, sharded DTensors)
           saved half-way with dcp.save, dcp.load + set_state_dict into a fresh sharded model and
           optimizer: the second half resumes bit for bit.
  cores    each rank's optimizer pool got its own share of the CPUs.
"""
import argparse
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _models import MasterAdamW, loss_fn, lr_lambda, make_data, make_model, param_groups, rel_diffs  # noqa: E402

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


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


def run(model, opt, sched, data, device, rank, world):
    losses, norms = [], []
    for x, y in data:
        b = x.shape[0] // world
        xs, ys = x[rank * b:(rank + 1) * b].to(device), y[rank * b:(rank + 1) * b].to(device)
        loss = loss_fn(model, xs, ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        t = loss.detach().float().reshape(1).to(device)
        dist.all_reduce(t)
        losses.append(float(t) / world)
        norms.append(opt.last_step_result()["global_norm"])
    return losses, norms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--clip", type=float, default=1.3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
        torch.use_deterministic_algorithms(True, warn_only=True)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    dist.init_process_group("nccl" if cuda else "gloo")
    from torch.distributed.device_mesh import init_device_mesh
    import torch.distributed.checkpoint as dcp
    mesh = init_device_mesh(device.type, (world,))
    torch.set_num_threads(1)
    data = make_data(args.steps, 8, 32, 64)
    report = {"rank": rank, "world": world, "checks": {}}
    ok = True

    def check(name, good, detail):
        nonlocal ok
        ok &= bool(good)
        report["checks"][name] = {"pass": bool(good), **detail}
        print(f"[rank {rank}] [{'PASS' if good else 'FAIL'}] {name}: {detail}", flush=True)

    try:
        model = sharded(0, device, dtype, mesh)
        opt = make_opt(model, args.clip)
        cores = opt.cores
        all_cores = [None] * world
        dist.all_gather_object(all_cores, cores)
        flat = [c for cs in all_cores if cs for c in cs]
        check("cores", all(all_cores) and len(flat) == len(set(flat)), {"cores": all_cores})
        ref_model = make_model(0, device, dtype)
        ref = MasterAdamW(ref_model, LR, BETAS, EPS, WD, args.clip)
        la, na = run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda), data, device, rank, world)
        lb, nb = [], []
        rs = torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda)
        for x, y in data:
            loss = loss_fn(ref_model, x.to(device), y.to(device))
            loss.backward()
            ref.step()
            rs.step()
            lb.append(loss.item())
            nb.append(ref.last_norm)
        d, dn = rel_diffs(la, lb), rel_diffs(na, nb)
        check("parity", sum(d) / len(d) <= 1e-3 and sum(dn) / len(dn) <= 1e-3 and la[-1] < la[0],
              {"mean_rel_loss_diff": sum(d) / len(d), "mean_rel_norm_diff": sum(dn) / len(dn),
               "clipped": sum(n > args.clip for n in na)})
        opt.close()

        half = len(data) // 2
        ckdir = tempfile.mkdtemp(prefix="so-dcp-") if rank == 0 else None
        box = [ckdir]
        dist.broadcast_object_list(box)
        ckdir = box[0]
        m1 = sharded(0, device, dtype, mesh)
        o1 = make_opt(m1, args.clip, speculation=False)  # clipped + bit for bit: every step exact
        s1 = torch.optim.lr_scheduler.LambdaLR(o1, lr_lambda)
        run(m1, o1, s1, data[:half], device, rank, world)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        msd, osd = get_state_dict(m1, o1)  # FQN-keyed, sharded (DTensor) state
        dtensor_state = sum(type(v).__name__ == "DTensor" for st in osd["state"].values() for v in st.values())
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckdir)
        sched_state = s1.state_dict()
        l1, _ = run(m1, o1, s1, data[half:], device, rank, world)
        w1 = [p.to_local().detach().clone() for p in m1.parameters()]
        m2 = sharded(5, device, dtype, mesh)
        o2 = make_opt(m2, args.clip, speculation=False)
        s2 = torch.optim.lr_scheduler.LambdaLR(o2, lr_lambda)
        msd2, osd2 = get_state_dict(m2, o2)  # the template (a fresh optimizer: torch's lr-0 init step)
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, checkpoint_id=ckdir)
        set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        s2.load_state_dict(sched_state)
        l2, _ = run(m2, o2, s2, data[half:], device, rank, world)
        w2 = [p.to_local().detach().clone() for p in m2.parameters()]
        same = all(torch.equal(a, b) for a, b in zip(w1, w2))
        check("dcp_resume", l1 == l2 and same and dtensor_state > 0,
              {"losses_equal": l1 == l2, "shards_equal": same, "dtensor_state_tensors": dtensor_state})
        for o in (o1, o2):
            o.close()
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
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if report["pass"] else 1)  # no interpreter teardown under gloo (see examples/torch_optimizer)


if __name__ == "__main__":
    main()
