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
import ctypes
import json
import math
import os
import platform
import statistics
import struct
import sys
import time

from support import import_abi

# ---------------------------------------------------------------------------------------------
# The C ABI: the superoffload package's declarations (superoffload._abi)
# ---------------------------------------------------------------------------------------------

_abi = import_abi()
Status, DType, AdamMode, Isa = _abi.Status, _abi.DType, _abi.AdamMode, _abi.Isa
ISA_CODES = {isa.name.lower(): isa for isa in Isa}


class SoError(RuntimeError):
    """A failed library call: `status` plus the library's message."""

    def __init__(self, status, message):
        super().__init__(f"{message} (status {status})")
        self.status = status
        self.message = message


class Lib:
    """libsuperoffload through ctypes. Pointers are plain ints (data_ptr() or addressof)."""

    def __init__(self, path):
        if not os.path.exists(path):
            raise SystemExit(f"error: library not found: {path} (build it with `cargo build --release`)")
        self.path = os.path.abspath(path)
        self.so = ctypes.CDLL(self.path)
        so = self.so
        missing = _abi.bind(so)
        if "so_abi_version" in missing:
            raise SystemExit(f"error: {self.path} has no so_abi_version: it is not libsuperoffload")
        abi = so.so_abi_version()
        if abi != _abi.ABI_VERSION:
            raise SystemExit(f"error: {self.path} has ABI version {abi}; the superoffload package ({_abi.__file__}) "
                             f"declares ABI {_abi.ABI_VERSION}: use a library and a package of the same version")
        if missing:
            raise SystemExit(f"error: {self.path} lacks {', '.join(missing)}, though it has ABI version {abi}")
        self.version = so.so_version_string().decode()
        # The defaults carry the library's sizeof: they must equal the package's, or its
        # declarations do not match the library's header.
        for name, (cls, _) in _abi.FUNCTIONS.items():
            if name.endswith("_default") and "struct_size" in cls.field_names():
                got = getattr(so, name)().struct_size
                if got != ctypes.sizeof(cls):
                    raise SystemExit(
                        f"error: {name}: the library's struct_size is {got}, superoffload._abi.{cls.__name__} has "
                        f"{ctypes.sizeof(cls)}; the package's declarations do not match the library's header")

    # -- errors -------------------------------------------------------------------------------
    def last_error(self):
        n = self.so.so_last_error_message(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.so.so_last_error_message(buf, n + 1)
        return buf.value.decode(errors="replace")

    def check(self, status):
        if status != Status.OK:
            msg = self.last_error() or self.so.so_status_str(status).decode()
            raise SoError(status, msg)

    # -- structs ------------------------------------------------------------------------------
    def hparams(self, step, lr=1e-3, weight_decay=0.01, mode=AdamMode.ADAMW, betas=None, eps=None):
        hp = self.so.so_adam_hparams_default()
        hp.mode, hp.lr, hp.weight_decay, hp.step = mode, lr, weight_decay, step
        if betas is not None:
            hp.beta1, hp.beta2 = betas
        if eps is not None:
            hp.eps = eps
        return hp

    def buffers(self, n, p, g, m, v, grad_dtype=DType.F32, copy=None, copy_dtype=DType.NONE,
                param_dtype=DType.F32, moment_dtype=DType.F32):
        b = self.so.so_adam_buffers_default()
        b.numel, b.param, b.grad, b.exp_avg, b.exp_avg_sq = n, p, g, m, v
        b.param_dtype, b.grad_dtype, b.moment_dtype = param_dtype, grad_dtype, moment_dtype
        b.param_copy, b.param_copy_dtype = copy, copy_dtype
        return b

    def options(self, grad_scale=1.0, check_finite=False):
        o = self.so.so_update_options_default()
        o.grad_scale, o.check_finite = grad_scale, check_finite
        return o

    # -- pools --------------------------------------------------------------------------------
    def pool_create(self, threads, cores=None, isa="auto"):
        opts = self.so.so_pool_options_default()
        opts.num_threads = threads
        opts.isa = ISA_CODES[isa]
        keep = None
        if cores:
            keep = (ctypes.c_uint32 * len(cores))(*cores)
            opts.cores, opts.num_cores = keep, len(cores)
        out = ctypes.c_void_p()
        self.check(self.so.so_pool_create(ctypes.byref(opts), ctypes.byref(out)))
        del keep  # the library copied the list
        return out.value

    def pool_destroy(self, pool):
        self.so.so_pool_destroy(pool)

    def pool_info(self, pool):
        info = _abi.new(_abi.PoolInfo)
        self.check(self.so.so_pool_get_info(pool, ctypes.byref(info)))
        return {
            "isa": self.so.so_isa_name(info.isa).decode(),
            "threads": info.num_threads,
            "pinned": bool(info.pinned),
        }

    # -- kernels (arguments prepared once, so the timed call is only the C call) -------------
    def update(self, pool, hp, bufs, opts=None, want_sumsq=False):
        out = ctypes.c_double(0.0)
        self.check(self.so.so_adam_update(pool, ctypes.byref(hp), ctypes.byref(bufs),
                                          ctypes.byref(opts) if opts is not None else None,
                                          ctypes.byref(out) if want_sumsq else None))
        return out.value if want_sumsq else None

    def rollback(self, pool, hp, bufs, grad_scale=1.0):
        self.check(self.so.so_adam_rollback(pool, ctypes.byref(hp), ctypes.byref(bufs), grad_scale))

    def rescale(self, pool, hp, bufs, old_scale, new_scale):
        self.check(self.so.so_adam_rescale(pool, ctypes.byref(hp), ctypes.byref(bufs), old_scale, new_scale))

    def grad_sumsq(self, pool, grad, dtype, n, scale=1.0):
        out = ctypes.c_double(0.0)
        self.check(self.so.so_grad_sumsq(pool, grad, dtype, n, scale, ctypes.byref(out)))
        return out.value


# ---------------------------------------------------------------------------------------------
# Timing and reporting (shared by the torch run and the self-test)
# ---------------------------------------------------------------------------------------------


def run_interleaved(ops, warmup, iters, gap_s):
    """ops: list of (name, fn). Each repetition runs every fn once, in order, each timed on its
    own after a short pause (so that one side's spinning worker threads have gone to sleep
    before the other side starts). Returns {name: [ms, ...]} of the timed repetitions."""
    samples = {name: [] for name, _ in ops}
    for rep in range(warmup + iters):
        for name, fn in ops:
            if fn is None:
                continue
            if gap_s > 0:
                time.sleep(gap_s)
            t0 = time.perf_counter_ns()
            fn()
            ms = (time.perf_counter_ns() - t0) / 1e6
            if rep >= warmup:
                samples[name].append(ms)
    return samples


def summarize(samples):
    return {name: {"ms_median": statistics.median(s), "ms_min": min(s), "samples_ms": s}
            for name, s in samples.items() if s}


def print_table(rows, n):
    print(f"{'op':<44} {'ms(med)':>9} {'ms(min)':>9} {'Gparam/s':>9} {'ratio':>22}")
    for label, st, ratio in rows:
        r = "" if ratio is None else f"{ratio[0]:.3f} {ratio[1]}"
        print(f"{label:<44} {st['ms_median']:>9.3f} {st['ms_min']:>9.3f} {n / st['ms_median'] / 1e6:>9.3f} {r:>22}")


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


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


def max_diffs(ours, ref, atol, rtol=1e-5):
    """(max abs diff, max rel diff, elements outside atol + rtol*|ref|) of two float tensors."""
    import torch

    d = (ours.double() - ref.double()).abs()
    rel = d / ref.double().abs().clamp_min(1e-30)
    bad = int((d > atol + rtol * ref.double().abs()).sum())
    return float(d.max()), float(rel.max()), bad


# ---------------------------------------------------------------------------------------------
# The PyTorch comparison
# ---------------------------------------------------------------------------------------------


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
        ("ours so_adam_rescale 1 -> 0.5, fp32", res["ours_rescale"], (ratios["ours_rescale_over_ours_update"], "x ours upd")),
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


# ---------------------------------------------------------------------------------------------
# Self-test of the ctypes layer, without PyTorch
# ---------------------------------------------------------------------------------------------


def bf16_bits(x):
    """float -> bfloat16 bits, round to nearest even (NaN -> 0x7FC0), as the library does."""
    u = struct.unpack("<I", struct.pack("<f", x))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return 0x7FC0
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def bf16_value(bits):
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def ref_adamw(p, g, m, v, step, lr, wd, b1=0.9, b2=0.999, eps=1e-8, scale=1.0):
    """torch's AdamW formula in float64."""
    g = g * scale
    p = p * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    p = p - lr / bc1 * m / (math.sqrt(v) / math.sqrt(bc2) + eps)
    return p, m, v


def excess(ours, ref, rtol=1e-5):
    """max over (p, m, v) of |ours - ref| / (atol + rtol |ref|): <= 1 means within the bound."""
    return max(abs(o - r) / (a + rtol * abs(r)) for o, r, a in zip(ours, ref, (ATOL_P, ATOL_M, ATOL_V)))


def selftest(args, lib):
    import random

    failures = []

    def expect(cond, what):
        if not cond:
            failures.append(what)
            print(f"  FAIL: {what}")

    print(f"selftest: superoffload {lib.version} ({lib.path}), ABI {lib.so.so_abi_version()}")
    expect(lib.so.so_status_str(Status.OK).decode() == "success", "so_status_str(OK)")
    expect(lib.so.so_isa_name(3).decode() == "avx512", "so_isa_name")
    hp = lib.so.so_adam_hparams_default()
    expect((hp.mode, hp.step, hp.bias_correction) == (AdamMode.ADAMW, 1, True), "hparams default")
    expect(abs(hp.lr - 1e-3) < 1e-9 and abs(hp.weight_decay - 0.01) < 1e-9 and abs(hp.beta2 - 0.999) < 1e-7,
           "hparams default values")
    expect(lib.so.so_update_options_default().grad_scale == 1.0, "update options default")
    b = lib.so.so_adam_buffers_default()
    expect(b.numel == 0 and b.param is None and b.param_dtype == DType.F32 and b.param_copy_dtype == 0,
           "buffers default")

    threads = min(args.threads, os.cpu_count() or 1)
    pool = lib.pool_create(threads, args.cores, args.isa)
    try:
        info = lib.pool_info(pool)
        expect(info["threads"] == threads, "pool threads")
        expect(lib.pool_info(None)["threads"] >= 1, "default pool info")
        try:
            lib.pool_create(1, [100000])
            expect(False, "pool with a bad core must fail")
        except SoError as e:
            expect(e.status == Status.INVALID_ARGUMENT and "so_pool_create" in e.message, "bad core error")

        n = args.selftest_n
        rnd = random.Random(3)
        F = ctypes.c_float * n
        U16 = ctypes.c_uint16 * n
        p0 = [f32(rnd.gauss(0, 0.02)) for _ in range(n)]
        g0 = [f32(rnd.gauss(0, 1)) for _ in range(n)]
        m0 = [f32(rnd.gauss(0, 0.01)) for _ in range(n)]
        v0 = [f32(1e-4 + 0.01 * rnd.gauss(0, 1) ** 2) for _ in range(n)]
        gb = [bf16_bits(rnd.gauss(0, 1)) for _ in range(n)]
        p, g, m, v = F(*p0), F(*g0), F(*m0), F(*v0)
        g16, copy = U16(*gb), U16()
        addr = ctypes.addressof
        step, lr, wd = 5, 1e-3, 0.01

        # f32 update vs the float64 reference
        bufs = lib.buffers(n, addr(p), addr(g), addr(m), addr(v))
        sumsq = lib.update(pool, lib.hparams(step, lr, wd), bufs, lib.options(), want_sumsq=True)
        expect(abs(sumsq - sum(x * x for x in g0)) <= 1e-9 * sumsq, "sum of squares")
        expect(lib.grad_sumsq(pool, addr(g), DType.F32, n) == sumsq, "so_grad_sumsq = update's sum")
        worst = 0.0
        for i in range(n):
            rp, rm, rv = ref_adamw(p0[i], g0[i], m0[i], v0[i], step, lr, wd)
            worst = max(worst, excess((p[i], m[i], v[i]), (rp, rm, rv)))
        print(f"  f32 update vs float64 reference: worst |d| / (atol + 1e-5 |ref|) = {worst:.3f}")
        expect(worst <= 1.0, "f32 update matches the reference")

        # rescale 1 -> 0.5 equals the direct step on 0.5 g; rollback restores the start
        hp5 = lib.hparams(step, lr, wd)
        lib.rescale(pool, hp5, bufs, 1.0, 0.5)
        worst = 0.0
        for i in range(n):
            rp, rm, rv = ref_adamw(p0[i], g0[i], m0[i], v0[i], step, lr, wd, scale=0.5)
            worst = max(worst, excess((p[i], m[i], v[i]), (rp, rm, rv)))
        print(f"  rescale 1 -> 0.5 vs direct step:  worst |d| / (atol + 1e-5 |ref|) = {worst:.3f}")
        expect(worst <= 1.0, "rescale matches the direct step")
        lib.rollback(pool, hp5, bufs, 0.5)
        worst = max(excess((p[i], m[i], v[i]), (p0[i], m0[i], v0[i]), rtol=1e-4) for i in range(n))
        print(f"  rollback vs the starting state:   worst |d| / (atol + 1e-4 |ref|) = {worst:.3f}")
        expect(worst <= 1.0, "rollback restores the state")

        # bf16 gradient with scale and bf16 copy-out
        for i in range(n):
            p[i], m[i], v[i] = p0[i], m0[i], v0[i]
        bb = lib.buffers(n, addr(p), addr(g16), addr(m), addr(v), grad_dtype=DType.BF16,
                         copy=addr(copy), copy_dtype=DType.BF16)
        lib.update(pool, lib.hparams(step, lr, wd), bb, lib.options(grad_scale=0.5))
        worst, copies_ok = 0.0, True
        for i in range(n):
            rp, rm, rv = ref_adamw(p0[i], bf16_value(gb[i]), m0[i], v0[i], step, lr, wd, scale=0.5)
            worst = max(worst, excess((p[i], m[i], v[i]), (rp, rm, rv)))
            copies_ok &= copy[i] == bf16_bits(p[i])
        print(f"  bf16 grad + scale vs reference:   worst |d| / (atol + 1e-5 |ref|) = {worst:.3f}")
        expect(worst <= 1.0, "bf16 update matches the reference")
        expect(copies_ok, "bf16 copy-out is the rounded parameter")

        # errors carry a status and the library's message
        try:
            lib.update(pool, lib.hparams(1), lib.buffers(n, None, addr(g), addr(m), addr(v)))
            expect(False, "NULL param must fail")
        except SoError as e:
            expect(e.status == Status.NULL_ARGUMENT and "so_adam_update" in e.message, "NULL param error")
        g[7] = float("inf")
        before = list(p)
        try:
            lib.update(pool, lib.hparams(1), bufs, lib.options(check_finite=True))
            expect(False, "non-finite gradient must be refused")
        except SoError as e:
            expect(e.status == Status.NON_FINITE, "non-finite status")
        expect(list(p) == before, "refused step modified nothing")
        g[7] = g0[7]

        # the timing and report code, on our ops only
        hp_t = lib.hparams(2, lr, wd)
        ops = [("ours_f32", lambda: lib.update(pool, hp_t, bufs)),
               ("ours_rescale", lambda: lib.rescale(pool, hp_t, bufs, 1.0, 0.5)),
               ("ours_rollback", lambda: lib.rollback(pool, hp_t, bufs, 0.5)),
               ("ours_bf16", lambda: lib.update(pool, hp_t, bb, lib.options(grad_scale=0.5)))]
        res = summarize(run_interleaved(ops, 1, 3, 0.0))
        print()
        print_table([("ours so_adam_update, fp32", res["ours_f32"], None),
                     ("ours so_adam_rescale", res["ours_rescale"],
                      (res["ours_rescale"]["ms_median"] / res["ours_f32"]["ms_median"], "x ours upd")),
                     ("ours so_adam_rollback", res["ours_rollback"],
                      (res["ours_rollback"]["ms_median"] / res["ours_f32"]["ms_median"], "x ours upd")),
                     ("ours bf16 grad + scale + bf16 copy", res["ours_bf16"], None)], n)
        expect(all(math.isfinite(x) for x in list(p) + list(m) + list(v)), "finite after the timing runs")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"tool": "bench/torch_compare.py --selftest", "ours": {"version": lib.version,
                           "pool": info}, "n": n, "results": res, "failures": failures}, f, indent=2)
            print(f"json: {args.json}")
    finally:
        lib.pool_destroy(pool)

    print(f"\nselftest: {'FAILED: ' + '; '.join(failures) if failures else 'ok'}")
    return 1 if failures else 0


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
