"""bench/torch_compare.py's comparison with PyTorch: one step from identical states compared
element-wise, then ours and torch.optim.AdamW(fused=True) timed on the same tensors. torch is
imported when the comparison runs: the self-test, which runs without it, shares the bound of the
numerics check (ATOL_P, ATOL_M, ATOL_V)."""
import json
import os
import platform
import sys

from torch_compare_lib import DType
from torch_compare_timing import cpu_model, print_table, run_interleaved, summarize


def torch_main(args, lib):
    try:
        import torch
    except ImportError:
        raise SystemExit("error: PyTorch is not installed here; run with --selftest to test the ctypes layer only")

    torch.set_num_threads(args.threads)
    if torch.get_num_threads() != args.threads:
        raise SystemExit(f"error: torch.set_num_threads({args.threads}) left {torch.get_num_threads()} threads")
    n, T = args.n, args.threads
    lr, wd = 1e-3, 0.01
    print(f"machine: {cpu_model()}, {os.cpu_count()} CPUs; python {platform.python_version()}")
    print(f"torch:   {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")

    pool = lib.pool_create(T, args.cores, args.isa)
    try:
        info = lib.pool_info(pool)
        print(f"ours:    superoffload {lib.version} ({lib.path}), pool isa {info['isa']}, "
              f"{info['threads']} threads, {'pinned' if info['pinned'] else 'unpinned'}")
        if info["threads"] != T:
            raise SystemExit(f"error: our pool has {info['threads']} threads, torch {T}")
        print(f"size:    N = {n} ({n:.3e}); {args.iters} timed repetitions after {args.warmup} warm-up, "
              f"interleaved, {args.gap_ms} ms pause before each")
        return run_torch(args, lib, torch, pool, info, n, T, lr, wd)
    finally:
        lib.pool_destroy(pool)


def init_state(torch, n, seed):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen) * 0.02
    g = torch.randn(n, generator=gen)
    m0 = torch.randn(n, generator=gen) * 0.01
    v0 = torch.randn(n, generator=gen).square_().mul_(0.01).add_(1e-4)
    g16 = torch.randn(n, generator=gen).to(torch.bfloat16)
    return p0, g, m0, v0, g16


def make_torch_opt(torch, p, lr, wd):
    """A fused AdamW on p whose state tensors exist (after one throw-away step)."""
    opt = torch.optim.AdamW([p], lr=lr, weight_decay=wd, fused=True)
    if not opt.defaults.get("fused"):
        raise SystemExit("error: this torch build did not honour fused=True")
    opt.step()
    st = opt.state[p]
    for key in ("step", "exp_avg", "exp_avg_sq"):
        if key not in st:
            raise SystemExit(f"error: torch's AdamW state has no {key!r}: {sorted(st)}")
    return opt, st


def check_ptr(t, name):
    import torch  # noqa: F401

    if not t.is_contiguous() or t.device.type != "cpu":
        raise SystemExit(f"error: {name} is not a contiguous CPU tensor")
    if t.data_ptr() % t.element_size():
        raise SystemExit(f"error: {name} is misaligned")
    return t.data_ptr()


# Absolute slack of the numerics check, on top of rtol 1e-5: a few ulps of the terms that can
# cancel (|p| ~ 0.1 for p, (1 - beta1) |g| ~ 0.5 for m; v has no cancellation).
ATOL_P, ATOL_M, ATOL_V = 1e-8, 1e-7, 1e-12


def torch_one_step(torch, p0, m0, v0, grad_fn, step, hp, bf16_copy):
    """One fused AdamW step of torch from (p0, m0, v0) at `step`; returns (p, m, v, copy or None)."""
    n = p0.numel()
    p_t = p0.clone().requires_grad_(True)
    p_t.grad = torch.zeros(n)
    opt = torch.optim.AdamW([p_t], lr=hp["lr"], betas=hp["betas"], eps=hp["eps"], weight_decay=hp["weight_decay"],
                            fused=True)
    opt.step()  # creates the state
    st = opt.state[p_t]
    with torch.no_grad():
        p_t.copy_(p0)
        st["exp_avg"].copy_(m0)
        st["exp_avg_sq"].copy_(v0)
        st["step"].fill_(step - 1)
        grad_fn(p_t.grad)
    opt.step()
    copy = None
    if bf16_copy:
        copy = torch.empty(n, dtype=torch.bfloat16)
        with torch.no_grad():
            copy.copy_(p_t)
    return p_t.detach(), st["exp_avg"], st["exp_avg_sq"], copy


def max_diffs(ours, ref, atol, rtol=1e-5):
    """(max abs diff, max rel diff, elements outside atol + rtol*|ref|) of two float tensors."""
    import torch

    d = (ours.double() - ref.double()).abs()
    rel = d / ref.double().abs().clamp_min(1e-30)
    bad = int((d > atol + rtol * ref.double().abs()).sum())
    return float(d.max()), float(rel.max()), bad


def compare(torch, ours, ref, n):
    res = {}
    for name, o, r, atol in zip(("param", "exp_avg", "exp_avg_sq"), ours[:3], ref[:3], (ATOL_P, ATOL_M, ATOL_V)):
        a, rel, bad = max_diffs(o, r, atol)
        res[name] = {"max_abs": a, "max_rel": rel, "outside_bound": bad}
    if ours[3] is not None:
        differ = int((ours[3].view(torch.int16) != ref[3].view(torch.int16)).sum())
        res["param_bf16_copy"] = {"elements_differing": differ, "of": n}
    return res


def numerics(args, lib, torch, pool, lr, wd):
    """One step from identical states, ours vs torch, f32 and bf16 jobs (not timed), both given
    the same (double) hyperparameters."""
    n = min(args.n, args.check_n)
    p0, g, m0, v0, g16 = init_state(torch, n, seed=7)
    step = 5  # a step with non-trivial bias correction

    # ours, once per job
    ours = {}
    p_o, m_o, v_o = p0.clone(), m0.clone(), v0.clone()
    bufs = lib.buffers(n, check_ptr(p_o, "p"), check_ptr(g, "g"), check_ptr(m_o, "m"), check_ptr(v_o, "v"))
    lib.update(pool, lib.hparams(step, lr, wd), bufs)
    ours["f32"] = (p_o, m_o, v_o, None)
    p_o, m_o, v_o = p0.clone(), m0.clone(), v0.clone()
    copy_o = torch.empty(n, dtype=torch.bfloat16)
    bufs = lib.buffers(n, p_o.data_ptr(), check_ptr(g16, "g16"), m_o.data_ptr(), v_o.data_ptr(),
                       grad_dtype=DType.BF16, copy=check_ptr(copy_o, "copy"), copy_dtype=DType.BF16)
    lib.update(pool, lib.hparams(step, lr, wd), bufs, lib.options(grad_scale=0.5))
    ours["bf16"] = (p_o, m_o, v_o, copy_o)

    hparam_sets = {"hparams": {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd}}
    out = {"n": n, "step": step, "atol": {"param": ATOL_P, "exp_avg": ATOL_M, "exp_avg_sq": ATOL_V}, "rtol": 1e-5}
    for key, hp in hparam_sets.items():
        ref_f32 = torch_one_step(torch, p0, m0, v0, lambda gr: gr.copy_(g), step, hp, False)
        ref_bf16 = torch_one_step(torch, p0, m0, v0, lambda gr: torch.mul(g16, 0.5, out=gr), step, hp, True)
        res = {"torch_hparams": {"lr": hp["lr"], "betas": list(hp["betas"]), "eps": hp["eps"],
                                 "weight_decay": hp["weight_decay"]},
               "f32": compare(torch, ours["f32"], ref_f32, n), "bf16": compare(torch, ours["bf16"], ref_bf16, n)}
        ok = all(v["outside_bound"] == 0 for job in ("f32", "bf16") for k, v in res[job].items()
                 if k != "param_bf16_copy")
        # A bf16 copy may differ where the f32 params straddle a rounding boundary: rare.
        ok = ok and res["bf16"]["param_bf16_copy"]["elements_differing"] <= max(10, n // 10000)
        res["within_bound"] = ok
        out[key] = res
        del ref_f32, ref_bf16
    out["pass"] = out["hparams"]["within_bound"]

    print(f"\nnumerics: one step from identical states, N = {n}, step {step}; bound |d| <= atol + 1e-5 |torch| "
          f"(atol p {ATOL_P:g}, m {ATOL_M:g}, v {ATOL_V:g})")
    for key, title in (("hparams", "torch given the same hyperparameters (betas 0.9, 0.999, eps 1e-8)"),):
        res = out[key]
        print(f"  {title}:")
        for job in ("f32", "bf16"):
            for k, v in res[job].items():
                if k == "param_bf16_copy":
                    print(f"    {job:<5} {k:<16} {v['elements_differing']} of {v['of']} bf16 values differ")
                else:
                    print(f"    {job:<5} {k:<16} max abs {v['max_abs']:.3e}  max rel {v['max_rel']:.3e}  "
                          f"outside bound {v['outside_bound']}")
        print(f"    -> {'within the bound' if res['within_bound'] else 'OUTSIDE the bound'}")
    print(f"  -> {'PASS' if out['pass'] else 'FAIL'}")
    return out


def run_torch(args, lib, torch, pool, info, n, T, lr, wd):
    num = numerics(args, lib, torch, pool, lr, wd)

    p, g, m0, v0, g16 = init_state(torch, n, seed=1)
    p.requires_grad_(True)
    p.grad = g
    opt, st = make_torch_opt(torch, p, lr, wd)  # one step on p: still a realistic parameter
    m, v = st["exp_avg"], st["exp_avg_sq"]
    with torch.no_grad():
        m.copy_(m0)
        v.copy_(v0)
    del m0, v0
    g32 = p.grad  # the fp32 gradient buffer torch steps on
    g_bf16_scaled = torch.empty(n)  # torch's fp32 landing buffer for the bf16 job
    copy_t = torch.empty(n, dtype=torch.bfloat16)
    copy_o = torch.empty(n, dtype=torch.bfloat16)
    ptr = {k: check_ptr(t, k) for k, t in
           [("p", p), ("g", g32), ("m", m), ("v", v), ("g16", g16), ("copy_o", copy_o)]}
    f32_bufs = lib.buffers(n, ptr["p"], ptr["g"], ptr["m"], ptr["v"])
    bf16_bufs = lib.buffers(n, ptr["p"], ptr["g16"], ptr["m"], ptr["v"], grad_dtype=DType.BF16,
                            copy=ptr["copy_o"], copy_dtype=DType.BF16)
    bf16_opts = lib.options(grad_scale=0.5)
    counter = {"step": 1}
    hp_cur = {}

    def torch_f32():
        p.grad = g32
        opt.step()

    def torch_bf16():
        with torch.no_grad():
            torch.mul(g16, 0.5, out=g_bf16_scaled)
        p.grad = g_bf16_scaled
        opt.step()
        with torch.no_grad():
            copy_t.copy_(p)

    def ours_f32():
        counter["step"] += 1
        hp_cur["hp"] = lib.hparams(counter["step"], lr, wd)
        lib.update(pool, hp_cur["hp"], f32_bufs)

    def ours_rescale():  # the step just taken on g, rescaled to 0.5 g
        lib.rescale(pool, hp_cur["hp"], f32_bufs, 1.0, 0.5)

    def ours_rollback():  # undoes that (rescaled) step
        lib.rollback(pool, hp_cur["hp"], f32_bufs, 0.5)

    def ours_bf16():
        counter["step"] += 1
        lib.update(pool, lib.hparams(counter["step"], lr, wd), bf16_bufs, bf16_opts)

    ops = [("torch_f32", torch_f32), ("ours_f32", ours_f32), ("ours_rescale", ours_rescale),
           ("ours_rollback", ours_rollback), ("torch_bf16", torch_bf16), ("ours_bf16", ours_bf16)]
    samples = run_interleaved(ops, args.warmup, args.iters, args.gap_ms / 1e3)
    for name, t in [("p", p), ("exp_avg", m), ("exp_avg_sq", v)]:
        if not bool(torch.isfinite(t).all()):
            raise SystemExit(f"error: {name} has non-finite values after the runs")
    res = summarize(samples)
    med = {k: s["ms_median"] for k, s in res.items()}
    ratios = {
        "ours_f32_over_torch_f32": med["ours_f32"] / med["torch_f32"],
        "ours_bf16_over_torch_bf16": med["ours_bf16"] / med["torch_bf16"],
        "ours_rollback_over_ours_update": med["ours_rollback"] / med["ours_f32"],
        "ours_rescale_over_ours_update": med["ours_rescale"] / med["ours_f32"],
        "ours_rollback_over_torch_f32": med["ours_rollback"] / med["torch_f32"],
        "ours_rescale_over_torch_f32": med["ours_rescale"] / med["torch_f32"],
    }
    print()
    print_table([
        ("torch fused AdamW step, fp32", res["torch_f32"], None),
        ("ours so_adam_update, fp32", res["ours_f32"], (ratios["ours_f32_over_torch_f32"], "x torch")),
        ("torch bf16 grad -> fp32, step, bf16 copy", res["torch_bf16"], None),
        ("ours bf16 grad + scale + bf16 copy", res["ours_bf16"], (ratios["ours_bf16_over_torch_bf16"], "x torch")),
        ("ours so_adam_rescale 1 -> 0.5, fp32", res["ours_rescale"],
         (ratios["ours_rescale_over_ours_update"], "x ours upd")),
        ("ours so_adam_rollback, fp32", res["ours_rollback"], (ratios["ours_rollback_over_ours_update"], "x ours upd")),
    ], n)
    print(f"\nrescale / torch fp32 step {ratios['ours_rescale_over_torch_f32']:.3f}; "
          f"rollback / torch fp32 step {ratios['ours_rollback_over_torch_f32']:.3f}")

    report = {
        "tool": "bench/torch_compare.py",
        "machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads(),
                  "cpu_capability": torch.backends.cpu.get_cpu_capability()},
        "ours": {"version": lib.version, "library": lib.path, "pool": info, "cores": args.cores},
        "n": n, "iters": args.iters, "warmup": args.warmup, "gap_ms": args.gap_ms,
        "lr": lr, "weight_decay": wd,
        "results": res, "ratios": ratios, "numerics": num,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"json: {args.json}")
    if not num["pass"]:
        print("error: ours and torch disagree beyond the bound (see numerics above)", file=sys.stderr)
        return 3
    return 0
