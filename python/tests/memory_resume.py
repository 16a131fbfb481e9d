#!/usr/bin/env python3
"""Peak memory of resuming SuperOffloadAdamW from a checkpoint of N parameters (host mode, CPU).

    python3 python/tests/memory_resume.py [--params 1e8] [--dir DIR]

Saves `torch.save(opt.state_dict())` after one step in a child process, then, in a fresh child:
builds the same model and optimizer (the baseline: parameters = f32 masters, the session's
moments and gradient buffers), and resumes the way SuperOffloadTrainer does
(`torch.load(..., mmap=True, weights_only=True)` + `opt.load_state_dict`), sampling
/proc/self/status every 2 ms. Reports, relative to the state restored (master + exp_avg +
exp_avg_sq = 12 bytes per parameter): the peak increase of anonymous memory (RssAnon: what the
resume really needs), of file-backed resident pages (RssFile: the mapped checkpoint, reclaimable
page cache) and of the total (VmRSS), and whether the resumed weights and a next step equal
those of the saving process. Target: anonymous peak increase <= 10 % of the state.
SO_MEM_PYTHON_ONLY=1 skips the library's so_session_load (measures the Python path alone).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time


def status():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[k] = int(v.split()[0]) * 1024
    return out


def build(n):
    import torch
    torch.manual_seed(0)
    width = 4096
    layers = max(1, round(n / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    return model, sum(p.numel() for p in model.parameters())


def make_opt(model):
    from superoffload.torch import SuperOffloadAdamW
    return SuperOffloadAdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0, model=model, sub_group_numel=1 << 24)


def one_step(model, opt, seed):
    import torch
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 4096, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.synchronize()


def child_save(n, path):
    import torch
    model, numel = build(n)
    opt = make_opt(model)
    one_step(model, opt, 1)
    torch.save(opt.state_dict(), path)
    one_step(model, opt, 2)
    torch.save({"weights": [p.detach() for p in model.parameters()]}, path + ".after")
    print(json.dumps({"params": numel}))


def child_load(n, path):
    import torch
    model, numel = build(n)
    opt = make_opt(model)
    base = status()
    peak = dict(base)
    done = threading.Event()

    def sample():
        while not done.is_set():
            s = status()
            for k, v in s.items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.002)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    if os.environ.get("SO_MEM_PYTHON_ONLY") == "1":
        # the Python side alone: the library's load of the written file is skipped here
        from superoffload import _core
        _core.Session.load = lambda self, path: None
    t0 = time.perf_counter()
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    opt.load_state_dict(state)
    del state
    dt = time.perf_counter() - t0
    done.set()
    th.join()
    s = status()
    for k, v in s.items():
        peak[k] = max(peak.get(k, 0), v)
    if os.environ.get("SO_MEM_PYTHON_ONLY") == "1":
        print(json.dumps({"params": numel, "state_bytes": numel * 12, "load_s": round(dt, 2), "baseline": base,
                          "peak": peak, "resumed_step_bit_identical": None,
                          "peak_increase": {k: peak[k] - base.get(k, 0) for k in ("RssAnon", "RssFile", "VmRSS")}}))
        return
    # the model's weights were restored through the masters; one more step matches the saver's
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # prove the weights come from the checkpoint: reload them from the masters
    opt.load_state_dict(torch.load(path, map_location="cpu", weights_only=True, mmap=True))
    one_step(model, opt, 2)
    after = torch.load(path + ".after", weights_only=True)["weights"]
    same = all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), after))
    state_bytes = numel * 12
    print(json.dumps({"params": numel, "state_bytes": state_bytes, "load_s": round(dt, 2),
                      "baseline": base, "peak": peak,
                      "peak_increase": {k: peak[k] - base.get(k, 0) for k in ("RssAnon", "RssFile", "VmRSS")},
                      "resumed_step_bit_identical": same}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=1e8)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--child", choices=["save", "load"])
    ap.add_argument("--path")
    a = ap.parse_args()
    n = int(a.params)
    if a.child == "save":
        return child_save(n, a.path)
    if a.child == "load":
        return child_load(n, a.path)
    d = tempfile.mkdtemp(prefix="so-mem-", dir=a.dir)
    path = os.path.join(d, "optimizer.pt")
    me = [sys.executable, os.path.abspath(__file__), "--params", str(n), "--path", path]
    subprocess.run(me + ["--child", "save"], check=True)
    r = subprocess.run(me + ["--child", "load"], check=True, capture_output=True, text=True)
    res = json.loads(r.stdout.strip().splitlines()[-1])
    inc, st = res["peak_increase"], res["state_bytes"]
    gib = 2 ** 30
    print(f"parameters {res['params']:,}; state restored (master + moments, 12 B/param) {st / gib:.2f} GiB; "
          f"checkpoint file {os.path.getsize(path) / gib:.2f} GiB; load {res['load_s']} s")
    for k, what in (("RssAnon", "anonymous"), ("RssFile", "file-backed (mapped checkpoint, page cache)"),
                    ("VmRSS", "total resident")):
        print(f"  peak increase during the resume, {what}: {inc[k] / gib:.3f} GiB = {inc[k] / st:.1%} of the state")
    print(f"  baseline before the resume (model + optimizer): RSS {res['baseline']['VmRSS'] / gib:.2f} GiB")
    ok = inc["RssAnon"] <= 0.10 * st
    print(f"  anonymous peak <= 10% of the state: {ok}; resumed step bit-identical: {res['resumed_step_bit_identical']}")
    if os.environ.get("SO_MEM_PYTHON_ONLY") == "1":
        print("  (SO_MEM_PYTHON_ONLY=1: the library's so_session_load was skipped: the Python path alone)")
        res["resumed_step_bit_identical"] = True
    for f in (path, path + ".after"):
        os.remove(f)
    os.rmdir(d)
    sys.exit(0 if ok and res["resumed_step_bit_identical"] else 1)


if __name__ == "__main__":
    main()
