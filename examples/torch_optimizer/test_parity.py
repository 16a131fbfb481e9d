#!/usr/bin/env python3
"""Checks SuperOffloadAdamW in an ordinary PyTorch training loop (a tiny GPT, two interleaved
param groups, a LambdaLR schedule changing the LR every step, gradient clipping):

  parity        N steps of ours (speculative) vs torch.optim.AdamW on f32 master weights, same
                init and data: mean relative loss difference <= 1e-3 (--tol).
  speculation   clipping never triggering (max_grad_norm 1e6): speculative and non-speculative
                sessions give bit-identical losses and weights; every speculative step is kept
                (none redone: the schedule's LR reaches the session before backward).
  resume        state_dict() (through torch.save) half-way, loaded into a fresh model and
                optimizer: the second half resumes bit for bit.
  accumulation  accumulation_steps=2 (gradients accumulate in p.grad) vs the reference.
  gpu_resident  gpu_fraction=0.3 (the first parameters stepped on the GPU, the rest offloaded):
                parity vs the reference with clipping, and a resume bit for bit (CUDA mode);
                in host mode, the clear refusal.
  errors        library errors arrive as SuperOffloadError with the library's message.

Mode: CUDA (bf16 parameters on the GPU, f32 masters on the host) when torch sees a GPU, else
host mode (f32 parameters on the CPU); --device cpu|cuda forces one. Needs the superoffload package
(`pip install .` at the repository root, or its wheel). Exits 1 if a check fails; --json writes the
numbers (default $OUT/parity.json).
"""
import argparse
import io
import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (CUDA mode)
# The tiny GPT, data and reference AdamW are the package tests' own.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "tests"))

import torch  # noqa: E402

from _models import (MasterAdamW, backward_batch, loss_fn, lr_lambda, make_data, make_model,  # noqa: E402
                     param_groups, rel_diffs, train_reference)

LR, BETAS, EPS, WD = 3e-3, (0.9, 0.95), 1e-8, 0.1


def ours(model, *, speculation=True, max_norm=1.0, sub_group_numel=20000, **kw):
    from superoffload.torch import SuperOffloadAdamW
    return SuperOffloadAdamW(param_groups(list(model.named_parameters()), WD), lr=LR, betas=BETAS, eps=EPS,
                             max_grad_norm=max_norm, speculation=speculation, sub_group_numel=sub_group_numel,
                             model=model, **kw)


def train(model, opt, sched, batches, device, accumulation=1):
    """One optimizer step per batch; returns (losses, step results)."""
    losses, results = [], []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        total = backward_batch(model, x, y, accumulation)
        opt.step()
        sched.step()
        losses.append(total)
        results.append(opt.last_step_result() if hasattr(opt, "last_step_result") else None)
    return losses, results


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def check(report, name, ok, detail):
    report["checks"][name] = {"pass": bool(ok), **detail}
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: " + ", ".join(f"{k}={v}" for k, v in detail.items()), flush=True)
    return ok


def test_parity(args, report, device, dtype, data):
    m_ours, m_ref = make_model(0, device, dtype), make_model(0, device, dtype)
    opt = ours(m_ours, max_norm=args.clip)
    ref = MasterAdamW(m_ref, LR, BETAS, EPS, WD, args.clip)
    s_ours = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    s_ref = torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda)
    la, results = train(m_ours, opt, s_ours, data, device)
    lb, _ = train_reference(m_ref, ref, s_ref, data, device)
    d = rel_diffs(la, lb)
    mean_rel = sum(d) / len(d)
    clipped = sum(1 for r in results if r["clip_coef"] < 1.0)
    wdiff = max(float((p.float() - q.float()).abs().max()) for p, q in zip(m_ours.parameters(), m_ref.parameters()))
    sub = opt.subgroups()
    report["parity"] = {"losses_ours": la, "losses_torch": lb, "rel_diff": d, "subgroups": len(sub),
                        "clipped_steps": clipped, "max_abs_weight_diff": wdiff,
                        "norms_ours": [r["global_norm"] for r in results]}
    print(f"  sub-groups: {len(sub)} ({', '.join(str(s[2]) for s in sub)} elements)")
    print("  step  loss(ours)      loss(torch)     rel.diff  norm   clip")
    for i in list(range(0, len(la), max(1, len(la) // 10))) + [len(la) - 1]:
        print(f"  {i:4d}  {la[i]:.9f}  {lb[i]:.9f}  {d[i]:.2e}  {results[i]['global_norm']:.3f}  "
              f"{results[i]['clip_coef']:.3f}")
    ok = check(report, "parity", mean_rel <= args.tol and clipped > 0 and la[-1] < la[0],
               {"steps": len(la), "mean_rel_diff": f"{mean_rel:.3e}", "max_rel_diff": f"{max(d):.3e}",
                "tol": args.tol, "clipped_steps": clipped, "first_loss": round(la[0], 4), "last_loss": round(la[-1], 4),
                "max_abs_weight_diff": f"{wdiff:.2e}"})
    opt.close()
    return ok


def test_speculation(args, report, device, dtype, data):
    runs = {}
    for spec in (True, False):
        m = make_model(0, device, dtype)
        opt = ours(m, speculation=spec, max_norm=1e6)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        losses, results = train(m, opt, sched, data, device)
        runs[spec] = (losses, snapshot(m), results, len(opt.subgroups()))
        opt.close()
    (la, wa, ra, n), (lb, wb, rb, _) = runs[True], runs[False]
    same_loss = la == lb
    same_w = all(torch.equal(p, q) for p, q in zip(wa, wb))
    # kept, or (not started at step()) cancelled and stepped exactly: the same bits without clipping
    kept = all(r["kept"] + r["stepped"] == n and r["redone"] == 0 and r["rescaled"] == 0 for r in ra)
    stepped = all(r["stepped"] == n for r in rb)
    return check(report, "speculation_bit_identical", same_loss and same_w and kept and stepped,
                 {"steps": len(la), "losses_equal": same_loss, "weights_equal": same_w,
                  "all_speculative_kept": kept, "non_speculative_all_stepped": stepped,
                  "first_mismatch": next((i for i, (x, y) in enumerate(zip(la, lb)) if x != y), None)})


def test_resume(args, report, device, dtype, data):
    half = len(data) // 2
    m = make_model(0, device, dtype)
    # Clipping active: speculation off, so every step is exact the same way in both runs (with
    # speculation, a step rescaled in one run may be cancelled and stepped exactly in the other,
    # depending on timing, and the two differ by rounding).
    opt = ours(m, max_norm=args.clip, speculation=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    train(m, opt, sched, data[:half], device)
    buf = io.BytesIO()
    torch.save({"model": m.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}, buf)
    ckpt_bytes = buf.tell()
    la, _ = train(m, opt, sched, data[half:], device)
    wa = snapshot(m)
    opt.close()

    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    m2 = make_model(7, device, dtype)  # another init: everything must come from the checkpoint
    opt2 = ours(m2, max_norm=args.clip, speculation=False)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda)
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    sched2.load_state_dict(sd["sched"])
    lb, _ = train(m2, opt2, sched2, data[half:], device)
    wb = snapshot(m2)
    same_w = all(torch.equal(p, q) for p, q in zip(wa, wb))
    opt2.close()
    return check(report, "resume_bit_identical", la == lb and same_w,
                 {"saved_at_step": half, "resumed_steps": len(lb), "losses_equal": la == lb, "weights_equal": same_w,
                  "checkpoint_bytes": ckpt_bytes})


def test_accumulation(args, report, device, dtype, data):
    data = data[:12]
    m_ours, m_ref = make_model(0, device, dtype), make_model(0, device, dtype)
    opt = ours(m_ours, max_norm=args.clip, accumulation_steps=2)
    s_ours = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    la, _ = train(m_ours, opt, s_ours, data, device, accumulation=2)
    ref = MasterAdamW(m_ref, LR, BETAS, EPS, WD, args.clip)
    s_ref = torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda)
    lb = []
    for x, y in data:
        x, y = x.to(device), y.to(device)
        total = backward_batch(m_ref, x, y, 2)
        ref.step()
        s_ref.step()
        lb.append(total)
    d = rel_diffs(la, lb)
    opt.close()
    return check(report, "accumulation_parity", sum(d) / len(d) <= args.tol,
                 {"steps": len(d), "micro_steps": 2, "mean_rel_diff": f"{sum(d) / len(d):.3e}"})


def test_gpu_resident(args, report, device, dtype, data):
    if device.type != "cuda":
        try:
            ours(make_model(0, device, dtype), gpu_fraction=0.3)
            refusal = None
        except ValueError as e:
            refusal = str(e)
        return check(report, "gpu_resident_refused_in_host_mode", refusal is not None and "CUDA" in refusal,
                     {"message": repr((refusal or "no error")[:100])})
    m_ours, m_ref = make_model(0, device, dtype), make_model(0, device, dtype)
    opt = ours(m_ours, max_norm=args.clip, gpu_fraction=0.3, speculation=False)
    names = opt.gpu_resident()
    ref = MasterAdamW(m_ref, LR, BETAS, EPS, WD, args.clip)
    s_ours = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    s_ref = torch.optim.lr_scheduler.LambdaLR(ref.opt, lr_lambda)
    half = len(data) // 2
    la, results = train(m_ours, opt, s_ours, data[:half], device)
    buf = io.BytesIO()
    torch.save({"model": m_ours.state_dict(), "opt": opt.state_dict(), "sched": s_ours.state_dict()}, buf)
    tail, tail_results = train(m_ours, opt, s_ours, data[half:], device)
    la, results = la + tail, results + tail_results
    wa = snapshot(m_ours)
    lb, _ = train_reference(m_ref, ref, s_ref, data, device)
    d = rel_diffs(la, lb)
    mean_rel = sum(d) / len(d)
    clipped = sum(1 for r in results if r["clip_coef"] < 1.0)
    gpu_stepped = all(r["device_stepped"] > 0 for r in results)
    opt.close()

    buf.seek(0)
    sd = torch.load(buf, weights_only=False)
    m2 = make_model(7, device, dtype)
    opt2 = ours(m2, max_norm=args.clip, gpu_fraction=0.3, speculation=False)
    s2 = torch.optim.lr_scheduler.LambdaLR(opt2, lr_lambda)
    m2.load_state_dict(sd["model"])
    opt2.load_state_dict(sd["opt"])
    s2.load_state_dict(sd["sched"])
    lr_, _ = train(m2, opt2, s2, data[half:], device)
    same_w = all(torch.equal(p, q) for p, q in zip(wa, snapshot(m2)))
    opt2.close()
    try:
        ours(make_model(0, device, dtype), gpu_fraction=0.3).load_state_dict(
            ours(make_model(0, device, dtype)).state_dict())
        mismatch = None
    except ValueError as e:
        mismatch = str(e)
    # the state dict is per parameter: loading it into another split works (library placement)
    mismatch = mismatch or "loads across splits"
    return check(report, "gpu_resident", mean_rel <= args.tol and clipped > 0 and gpu_stepped and lr_ == tail
                 and same_w and mismatch is not None,
                 {"gpu_resident": len(names), "first": names[0] if names else None, "steps": len(la),
                  "mean_rel_diff": f"{mean_rel:.3e}", "clipped_steps": clipped, "gpu_part_stepped": gpu_stepped,
                  "resume_losses_equal": lr_ == tail, "resume_weights_equal": same_w,
                  "ratio_mismatch_refused": mismatch is not None})


def test_errors(args, report, device, dtype, data):
    from superoffload import SuperOffloadError
    m = make_model(0, device, dtype)
    opt = ours(m)
    x, y = data[0][0].to(device), data[0][1].to(device)
    loss_fn(m, x, y).backward()
    try:
        opt.state_dict()
        mid = "no error"
    except RuntimeError as e:
        mid = str(e)
    opt.step()
    sd = opt.state_dict()
    before = snapshot(m)
    bad = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
    bad["state"][0] = dict(sd["state"][0], exp_avg=torch.zeros(3))
    try:
        opt.load_state_dict(bad)
        refused = None
    except ValueError as e:
        refused = str(e)
    unchanged = all(torch.equal(p, q) for p, q in zip(before, snapshot(m)))
    try:
        opt.session.grad_copy(0, 0, 1)
        lib_error = None
    except SuperOffloadError as e:
        lib_error = e
    opt.close()
    ok = ("between backward and step" in mid and refused is not None and unchanged and lib_error is not None
          and lib_error.status_name == "SO_STATUS_NULL_ARGUMENT")
    return check(report, "errors", ok, {"state_dict_mid_step": repr(mid[:80]),
                                        "bad_state_refused": repr((refused or "")[:120]),
                                        "weights_unchanged_after_refused_load": unchanged,
                                        "library_error": repr(str(lib_error)[:100]) if lib_error else None})


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--clip", type=float, default=1.3, help="max_grad_norm of the parity and resume runs")
    ap.add_argument("--tol", type=float, default=1e-3, help="mean relative loss difference allowed vs torch")
    ap.add_argument("--json", default=os.path.join(os.environ["OUT"], "parity.json") if os.environ.get("OUT") else None)
    ap.add_argument("--only", help="comma list of parity,speculation,resume,accumulation,gpu_resident,errors")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.use_deterministic_algorithms(True, warn_only=True)  # bit-identity needs a deterministic backward
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    import superoffload
    print(f"superoffload {superoffload.__version__} ({superoffload.library_path()}); torch {torch.__version__}; mode: "
          f"{'CUDA, bf16 params on ' + torch.cuda.get_device_name(device) if cuda else 'host, f32 params on the CPU'}",
          flush=True)
    data = make_data(args.steps, args.batch, 32, 64)
    report = {"mode": "cuda" if cuda else "host", "torch": torch.__version__, "checks": {}}
    tests = {"parity": test_parity, "speculation": test_speculation, "resume": test_resume,
             "accumulation": test_accumulation, "gpu_resident": test_gpu_resident, "errors": test_errors}
    chosen = args.only.split(",") if args.only else list(tests)
    ok = True
    for name in chosen:
        t0 = time.perf_counter()
        try:
            ok &= tests[name](args, report, device, dtype, data)
        except Exception as e:  # a crash is a failure with its traceback
            import traceback
            traceback.print_exc()
            ok &= check(report, name, False, {"exception": repr(e)[:300]})
        print(f"  ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    report["pass"] = bool(ok)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print("test_parity:", "all checks passed" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
