"""bench/torch_compare.py --selftest: the ctypes layer without PyTorch (every entry point, error
path, reference checks against a float64 AdamW written here, the timing and report code) on plain
ctypes buffers."""
import ctypes
import json
import math
import os
import struct

from torch_compare_lib import AdamMode, DType, SoError, Status
from torch_compare_pytorch import ATOL_M, ATOL_P, ATOL_V
from torch_compare_timing import print_table, run_interleaved, summarize


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
