#!/usr/bin/env python3
"""CUDA transport benchmarks, on a machine with a GPU and PyTorch (which only drives the GPU
work; every optimizer and transport operation is the library's, through its C ABI).

copies   Bandwidth of device-to-host gradient copies in 16 MiB pieces vs whole tensors, and
         how long a small device-to-host copy on another stream (a `.item()`) waits when
         issued right behind 4 x 103 MB of bf16 gradient copies.
overlap  A synthetic layered backward (GPU matmuls producing each layer's gradient), with the
         session stepping sub-groups speculatively during backward vs stepping after backward;
         with and without clipping on every step; weights cast to bf16 on the GPU (f32 sent)
         vs on the CPU (bf16 copy sent). Step time against max(GPU time, CPU Adam time).
device-adam
         The GPU Adam kernel of device-placed sub-groups alone (the overlap benchmark's layers,
         f32 master weights and moments, bf16 gradients and weights): each launch's time from
         torch.profiler, and its bandwidth at the 28 bytes an element moves.

  python3 bench/cuda_bench.py --lib dist/lib/libsuperoffload.so [--json out.json]

Needs the superoffload Python package for the C ABI's ctypes declarations (only its `_abi`
module: the package's bundled library is not loaded, `--lib` is): the installed package (`pip
install` it) or, run from a source checkout, the checkout's python/ directory (bench/../python).
Installed with the library (share/superoffload/bench/), the script needs the pip-installed package.
"""
import argparse
import ctypes as C
import json
import os
import statistics
import sys
import tempfile
import time

from support import import_abi, refuse_renamed

_abi = import_abi()
DType, NormSource, Placement, Speculation = _abi.DType, _abi.NormSource, _abi.Placement, _abi.Speculation


class Lib:
    def __init__(self, path):
        self.c = C.CDLL(path)
        c = self.c
        missing = _abi.bind(c)
        if "so_abi_version" in missing:
            sys.exit(f"{path} has no so_abi_version: it is not libsuperoffload")
        abi = c.so_abi_version()
        if abi != _abi.ABI_VERSION:
            sys.exit(f"{path} has ABI version {abi}; the superoffload package ({_abi.__file__}) declares ABI "
                     f"{_abi.ABI_VERSION}: use a library and a package of the same version")
        if missing:
            sys.exit(f"{path} lacks {', '.join(missing)}, though it has ABI version {abi}")
        for name, (struct, _) in _abi.FUNCTIONS.items():
            if name.endswith("_default") and "struct_size" in struct.field_names():
                got = getattr(c, name)().struct_size
                if got != C.sizeof(struct):
                    sys.exit(f"{name}: struct_size {got} but superoffload._abi.{struct.__name__} has "
                             f"{C.sizeof(struct)}")

    def check(self, status, what):
        if status:
            buf = C.create_string_buffer(1024)
            self.c.so_last_error_message(buf, 1024)
            raise RuntimeError(f"{what}: {self.c.so_status_str(status).decode()}: {buf.value.decode()}")


class Session:
    """A CUDA session with one group and one single-slice sub-group per (master, param)."""

    def __init__(self, lib, masters, params, *, speculation="auto", piece_bytes=16 << 20, copy_bf16=False, cores=None,
                 gpu_budget=0, placement=Placement.HOST):
        self.lib, c = lib, lib.c
        o = c.so_session_options_default()
        o.grad_dtype = o.accum_dtype = DType.BF16
        o.speculation = Speculation[speculation.upper()]
        o.gpu_budget_bytes = gpu_budget
        o.copy_dtype = DType.BF16 if copy_bf16 else DType.NONE
        if cores:
            self._cores = (C.c_uint32 * len(cores))(*cores)
            o.cores, o.num_cores = self._cores, len(cores)
        co = c.so_cuda_options_default()
        co.piece_bytes = piece_bytes
        self.h = C.c_void_p()
        lib.check(c.so_session_create_cuda(C.byref(o), C.byref(co), C.byref(self.h)), "so_session_create_cuda")
        g = C.c_uint32()
        hp = c.so_group_hparams_default()
        lib.check(c.so_session_add_group(self.h, C.byref(hp), C.byref(g)), "add_group")
        self.names = []
        for k, (m, p) in enumerate(zip(masters, params)):
            name = f"layer{k}".encode()
            self.names.append(name)
            sl = _abi.SliceDesc(name, 0, m.numel())
            d = c.so_subgroup_desc_default()
            d.master, d.numel, d.slices, d.num_slices = m.data_ptr(), m.numel(), C.pointer(sl), 1
            d.device_param, d.device_param_dtype = p.data_ptr(), DType.BF16
            d.placement = placement
            sg = C.c_uint32()
            lib.check(c.so_session_add_subgroup(self.h, C.byref(d), C.byref(sg)), "add_subgroup")
        s = C.c_void_p()
        lib.check(c.so_session_copy_stream(self.h, C.byref(s)), "copy_stream")
        self.copy_stream_ptr = s.value or 0

    def begin(self):
        self.lib.check(self.lib.c.so_session_begin_step(self.h, C.c_float(1.0), 1), "begin_step")

    def grad(self, k, t, stream_ptr):
        self.lib.check(self.lib.c.so_session_grad_device(self.h, k, t.data_ptr(), t.numel(), DType.BF16,
                                                         stream_ptr, None), "grad_device")

    def step(self, max_norm):
        a = self.lib.c.so_step_args_default()
        a.max_norm, a.norm_source = max_norm, NormSource.LOCAL
        t = C.c_uint64()
        self.lib.check(self.lib.c.so_session_step(self.h, C.byref(a), C.byref(t)), "step")
        return t.value

    def result(self, ticket):
        r = _abi.new(_abi.StepResult)
        self.lib.check(self.lib.c.so_session_step_result(self.h, ticket, -1, C.byref(r)), "step_result")
        return r

    def final_ticket(self, k):
        t = C.c_uint64()
        self.lib.check(self.lib.c.so_session_final_ticket(self.h, k, C.byref(t)), "final_ticket")
        return t.value

    def gpu_wait(self, ticket, stream_ptr):
        self.lib.check(self.lib.c.so_ticket_enqueue_wait(self.h, ticket, stream_ptr), "enqueue_wait")

    def set_compute_stream(self, stream_ptr):
        self.lib.check(self.lib.c.so_session_set_compute_stream(self.h, stream_ptr), "set_compute_stream")

    def close(self):
        self.lib.c.so_session_destroy(self.h)


def ms(seconds):
    return round(seconds * 1e3, 3)


def copies(lib, torch, args):
    n = 103_000_000 // 2  # 103 MB of bf16 per gradient
    grads = [torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(4)]
    params = [torch.empty(n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    masters = [torch.zeros(n) for _ in range(4)]
    side = torch.cuda.Stream()
    tiny = torch.ones(1, device="cuda")
    out = {}
    for mode, piece in (("whole", 1 << 40), ("pieces", 16 << 20)):
        s = Session(lib, masters, params, speculation="off", piece_bytes=piece, cores=args.cores)
        copy_stream = torch.cuda.ExternalStream(s.copy_stream_ptr)
        bw, waits = [], []
        for rep in range(args.copy_reps + 2):
            s.begin()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for k in range(4):
                s.grad(k, grads[k], side.cuda_stream)
            t1 = time.perf_counter()
            tiny.item()  # the host sync behind the queued copies
            t2 = time.perf_counter()
            copy_stream.synchronize()
            t3 = time.perf_counter()
            lib.check(lib.c.so_ticket_wait(s.h, s.step(0.0), -1), "wait")
            if rep >= 2:
                waits.append(t2 - t1)
                bw.append(4 * n * 2 / (t3 - t0) / 1e9)
        s.close()
        out[mode] = {"copy_GBps_median": round(statistics.median(bw), 2), "item_wait_ms_median": ms(statistics.median(waits)),
                     "item_wait_ms_all": [ms(w) for w in waits]}
    out["pieces_over_whole_bandwidth"] = round(out["pieces"]["copy_GBps_median"] / out["whole"]["copy_GBps_median"], 3)
    return out


def overlap(lib, torch, args):
    L, P, D = args.layers, args.params_per_layer, 8192
    cols = P // D
    params = [torch.randn(D, cols, device="cuda").to(torch.bfloat16) * 0.02 for _ in range(L)]
    masters = [p.float().cpu().flatten() for p in params]
    x = torch.randn(D, D, device="cuda").to(torch.bfloat16)
    w = torch.randn(D, D, device="cuda").to(torch.bfloat16) * 0.01
    compute = torch.cuda.current_stream()

    def layer_work(k, repeats):
        y = x
        for _ in range(repeats):
            y = torch.mm(y, w)
        return torch.mm(y, params[k])  # D x cols: exactly P values

    def gpu_only():
        for k in range(L):
            layer_work(k, args.forward_matmuls)
        for k in reversed(range(L)):
            layer_work(k, args.backward_matmuls)

    def time_loop(body, steps):
        for _ in range(2):
            body()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            body()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / steps

    t_gpu = time_loop(gpu_only, args.steps)
    # CPU Adam alone: the same sub-groups stepped by the session's kernels, one pass each.
    t_adam = cpu_adam_time(lib, masters, torch)

    results = {"layers": L, "params_per_layer": P, "gpu_fwd_bwd_ms": ms(t_gpu), "cpu_adam_ms": ms(t_adam)}
    # The automatic split may keep up to all but one layer's state on the GPU.
    budget = (L - 1) * P * 14
    modes = [
        ("auto", "auto", 0.0, 0), ("auto_clip_every_step", "auto", 1e-3, 0),
        ("on", "on", 0.0, 0), ("on_clip_every_step", "on", 1e-3, 0),
        ("after_backward", "off", 0.0, 0), ("after_backward_clip", "off", 1e-3, 0),
        ("auto_split", "auto", 0.0, budget), ("auto_split_clip", "auto", 1e-3, budget),
    ]
    print(f"overlap: GPU forward+backward {ms(t_gpu)} ms, CPU Adam {ms(t_adam)} ms", file=sys.stderr, flush=True)

    def run_mode(name, spec, clip, gpu_budget):
        s = Session(lib, masters, params, speculation=spec, cores=args.cores, gpu_budget=gpu_budget)
        s.set_compute_stream(compute.cuda_stream)
        copy_stream = torch.cuda.ExternalStream(s.copy_stream_ptr)
        state = {"ticket": 0, "results": []}

        def train_step():
            for k in range(L):  # forward: layer k waits only for sub-group k's weights
                s.gpu_wait(s.final_ticket(k), compute.cuda_stream)
                layer_work(k, args.forward_matmuls)
            s.begin()
            for k in reversed(range(L)):  # backward: hand each layer's gradient over as it is produced
                g = layer_work(k, args.backward_matmuls).flatten()
                g.record_stream(copy_stream)
                s.grad(k, g, compute.cuda_stream)
            if state["ticket"]:
                state["results"].append(s.result(state["ticket"]))
            state["ticket"] = s.step(clip)

        def device_bytes():
            out = C.c_size_t()
            lib.check(lib.c.so_session_device_bytes(s.h, C.byref(out)), "device_bytes")
            return out.value

        # The automatic split is chosen after three measured steps and grows while the
        # optimizer stays exposed: warm up until it has not grown for four steps.
        stable, warm = 0, 0
        while gpu_budget and stable < 4 and warm < 24:
            before = device_bytes()
            train_step()
            stable, warm = (stable + 1 if device_bytes() == before else 0), warm + 1
        t = time_loop(train_step, args.steps)
        r = s.result(state["ticket"])
        timed = state["results"][-(args.steps - 1):]
        dev_bytes = device_bytes()
        s.close()
        return t, {
            "rescaled": r.rescaled, "kept": r.kept, "stepped": r.stepped, "cancelled": r.cancelled,
            "speculative": r.speculative, "device_stepped": r.device_stepped, "clip_coef": round(r.clip_coef, 4),
            "final_pass_elements": r.final_pass_elements,
            "forward_wait_ms_mean": ms(statistics.mean(x.forward_wait_s for x in timed)) if timed else None,
            "device_bytes": dev_bytes,
        }

    # Rounds run the modes in turn, so a drift of the machine's speed spreads over all of them;
    # a mode's step time is the median of its rounds, its counts those of the last round.
    times = {}
    for _ in range(args.rounds):
        for name, spec, clip, gpu_budget in modes:
            if args.modes and name not in args.modes:
                continue
            t, details = run_mode(name, spec, clip, gpu_budget)
            times.setdefault(name, []).append(t)
            t = statistics.median(times[name])
            results[name] = {"step_ms": ms(t), "vs_max_gpu_adam": round(t / max(t_gpu, t_adam), 3),
                             "step_ms_rounds": [ms(x) for x in times[name]], **details}
            print(f"overlap {name}: {results[name]}", file=sys.stderr, flush=True)
    for name in ("auto", "on", "auto_split"):
        clipped = f"{name}_clip_every_step" if name != "auto_split" else "auto_split_clip"
        if not all(m in results for m in (name, clipped, "after_backward", "after_backward_clip")):
            continue
        results[f"{name}_clip_over_after_backward_clip"] = round(
            results[clipped]["step_ms"] /
            results["after_backward_clip"]["step_ms"], 3)
        results[f"{name}_over_after_backward"] = round(results[name]["step_ms"] / results["after_backward"]["step_ms"], 3)
    return results


def device_adam(lib, torch, args):
    from torch.profiler import ProfilerActivity, profile
    L, P = args.layers, args.params_per_layer
    masters = [torch.randn(P) * 0.02 for _ in range(L)]
    params = [m.to("cuda", torch.bfloat16) for m in masters]
    grads = [(torch.randn(P, device="cuda") * 1e-3).to(torch.bfloat16) for _ in range(L)]
    s = Session(lib, masters, params, speculation="off", cores=args.cores, placement=Placement.DEVICE)
    stream = torch.cuda.current_stream().cuda_stream

    def step():
        s.begin()
        for k in reversed(range(L)):
            s.grad(k, grads[k], stream)
        t = s.step(0.0)
        lib.check(lib.c.so_ticket_wait(s.h, t, -1), "wait")
        return s.result(t)

    for _ in range(3):
        r = step()
    if r.device_stepped != L:
        raise RuntimeError(f"device-adam: {r.device_stepped} of {L} sub-groups stepped on the GPU")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    s.close()
    with tempfile.TemporaryDirectory() as d:
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        with open(os.path.join(d, "trace.json")) as f:
            events = json.load(f)["traceEvents"]
    us = [e["dur"] for e in events if e.get("cat") == "kernel" and e.get("name") == "so_adam_step"]
    if len(us) != L * args.steps:
        raise RuntimeError(f"device-adam: the profile holds {len(us)} so_adam_step launches, not {L * args.steps}")
    median = statistics.median(us)
    return {"layers": L, "params_per_layer": P, "launches": len(us), "kernel_us_median": round(median, 1),
            "kernel_us_min": round(min(us), 1), "GBps_median": round(28 * P / median / 1e3, 1)}


def cpu_adam_time(lib, masters, torch):
    c = lib.c
    hp = c.so_adam_hparams_default()
    state = []
    for m in masters:
        p, g16 = m.clone(), torch.zeros(m.numel(), dtype=torch.bfloat16)
        mm, vv = torch.zeros_like(m), torch.zeros_like(m)
        b = c.so_adam_buffers_default()
        b.numel, b.param, b.grad, b.exp_avg, b.exp_avg_sq = m.numel(), p.data_ptr(), g16.data_ptr(), mm.data_ptr(), vv.data_ptr()
        b.grad_dtype = DType.BF16
        state.append((b, p, g16, mm, vv))
    times = []
    for rep in range(4):
        t0 = time.perf_counter()
        for b, *_ in state:
            lib.check(c.so_adam_update(None, C.byref(hp), C.byref(b), None, None), "so_adam_update")
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--lib", required=True, help="path to libsuperoffload.so")
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--only", choices=["copies", "overlap", "device-adam"],
                    help="run only this benchmark (default: all three)")
    ap.add_argument("--copy-reps", type=int, default=9, help="copies: timed repetitions (default 9)")
    ap.add_argument("--layers", type=int, default=8, help="overlap, device-adam: layers, one sub-group each (default 8)")
    ap.add_argument("--params-per-layer", type=int, default=8192 * 3072,
                    help="overlap, device-adam: parameters per layer (default 25165824)")
    ap.add_argument("--forward-matmuls", type=int, default=3,
                    help="overlap: GPU work per layer in the forward, in 8192 x 8192 bf16 matmuls (default 3)")
    ap.add_argument("--backward-matmuls", type=int, default=6,
                    help="overlap: GPU work per layer in the backward, in 8192 x 8192 bf16 matmuls (default 6)")
    ap.add_argument("--steps", type=int, default=8, help="overlap, device-adam: timed steps (per mode) (default 8)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="overlap: run every mode this many times, in turn; report the median (default 1)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=None,
                    help="overlap: comma list of the modes to run, of auto, auto_clip_every_step, on, "
                         "on_clip_every_step, after_backward, after_backward_clip, auto_split, auto_split_clip "
                         "(default: all)")
    ap.add_argument("--cores", type=lambda s: [int(c) for c in s.split(",")] if s else None, default=None,
                    help="comma list of cores for the session's pool (default: the default pool)")
    refuse_renamed(ap, (("--fwd-mm", "--forward-matmuls"), ("--bwd-mm", "--backward-matmuls")))
    args = ap.parse_args()
    import torch
    if not torch.cuda.is_available():
        sys.exit("no CUDA device")
    lib = Lib(args.lib)
    out = {"device": torch.cuda.get_device_name(0)}
    if args.only in (None, "copies"):
        out["copies"] = copies(lib, torch, args)
        print(json.dumps(out["copies"], indent=1), flush=True)
    if args.only in (None, "overlap"):
        out["overlap"] = overlap(lib, torch, args)
        print(json.dumps(out["overlap"], indent=1), flush=True)
    if args.only in (None, "device-adam"):
        out["device_adam"] = device_adam(lib, torch, args)
        print(json.dumps(out["device_adam"], indent=1), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
