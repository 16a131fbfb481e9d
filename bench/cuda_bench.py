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

  python3 bench/cuda_bench.py --lib dist/lib/libsuperoffload.so [--json out.json]
"""
import argparse
import ctypes as C
import json
import statistics
import sys
import time

SO_DTYPE_F32, SO_DTYPE_BF16 = 1, 2
SO_NORM_LOCAL = 1
SO_SPECULATION = {"off": 0, "on": 1, "auto": 2}


class SessionOptions(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("pool", C.c_void_p), ("cores", C.POINTER(C.c_uint32)),
                ("num_cores", C.c_size_t), ("mode", C.c_uint32), ("bias_correction", C.c_bool),
                ("moment_dtype", C.c_uint32), ("grad_dtype", C.c_uint32), ("accum_dtype", C.c_uint32),
                ("speculation", C.c_uint32), ("host_memory_limit", C.c_uint64), ("amsgrad", C.c_bool),
                ("loss_scaler", C.c_void_p), ("copy_dtype", C.c_uint32), ("gpu_budget_bytes", C.c_uint64)]


class GroupHparams(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("lr", C.c_double), ("beta1", C.c_double),
                ("beta2", C.c_double), ("eps", C.c_double), ("weight_decay", C.c_double)]


class SliceDesc(C.Structure):
    _fields_ = [("name", C.c_char_p), ("offset", C.c_size_t), ("numel", C.c_size_t)]


class SubgroupDesc(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("group", C.c_uint32), ("master", C.c_void_p),
                ("master_dtype", C.c_uint32), ("numel", C.c_size_t), ("grad", C.c_void_p),
                ("slices", C.POINTER(SliceDesc)), ("num_slices", C.c_size_t),
                ("device_param", C.c_uint64), ("device_param_dtype", C.c_uint32), ("exp_avg", C.c_void_p),
                ("exp_avg_sq", C.c_void_p), ("placement", C.c_uint32)]


class StepArgs(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("max_norm", C.c_double), ("norm_source", C.c_uint32),
                ("global_norm", C.c_double), ("overflow", C.c_bool)]


class StepResult(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("serial", C.c_uint64), ("skipped", C.c_bool),
                ("global_norm", C.c_double), ("clip_coef", C.c_double), ("grad_factor", C.c_float),
                ("loss_scale", C.c_float), ("next_loss_scale", C.c_float), ("speculative", C.c_uint32),
                ("late_gradients", C.c_uint32), ("kept", C.c_uint32), ("rescaled", C.c_uint32),
                ("rolled_back", C.c_uint32), ("redone", C.c_uint32), ("stepped", C.c_uint32),
                ("skip_reason", C.c_uint32), ("cancelled", C.c_uint32), ("device_stepped", C.c_uint32),
                ("device_subgroups", C.c_uint32), ("final_pass_elements", C.c_uint64), ("forward_wait_s", C.c_double)]


class CudaOptions(C.Structure):
    _fields_ = [("struct_size", C.c_size_t), ("device", C.c_int32), ("piece_bytes", C.c_size_t)]


class Lib:
    def __init__(self, path):
        self.c = C.CDLL(path)
        c = self.c
        c.so_status_str.restype = C.c_char_p
        for name, struct in [("so_session_options_default", SessionOptions), ("so_group_hparams_default", GroupHparams),
                             ("so_subgroup_desc_default", SubgroupDesc), ("so_step_args_default", StepArgs),
                             ("so_cuda_options_default", CudaOptions)]:
            getattr(c, name).restype = struct
            got = getattr(c, name)().struct_size
            if got != C.sizeof(struct):
                sys.exit(f"{name}: struct_size {got} but this script's layout has {C.sizeof(struct)}")
        c.so_session_grad_device.argtypes = [C.c_void_p, C.c_uint32, C.c_uint64, C.c_size_t, C.c_uint32, C.c_void_p,
                                             C.POINTER(C.c_uint64)]
        c.so_ticket_enqueue_wait.argtypes = [C.c_void_p, C.c_uint64, C.c_void_p]
        c.so_ticket_wait.argtypes = [C.c_void_p, C.c_uint64, C.c_int64]
        c.so_session_step_result.argtypes = [C.c_void_p, C.c_uint64, C.c_int64, C.POINTER(StepResult)]
        c.so_session_device_bytes.argtypes = [C.c_void_p, C.POINTER(C.c_size_t)]

    def check(self, status, what):
        if status:
            buf = C.create_string_buffer(1024)
            self.c.so_last_error_message(buf, 1024)
            raise RuntimeError(f"{what}: {self.c.so_status_str(status).decode()}: {buf.value.decode()}")


class Session:
    """A CUDA session with one group and one single-slice sub-group per (master, param)."""

    def __init__(self, lib, masters, params, *, speculation="auto", piece_bytes=16 << 20, copy_bf16=False, cores=None,
                 gpu_budget=0):
        self.lib, c = lib, lib.c
        o = c.so_session_options_default()
        o.grad_dtype = o.accum_dtype = SO_DTYPE_BF16
        o.speculation = SO_SPECULATION[speculation]
        o.gpu_budget_bytes = gpu_budget
        o.copy_dtype = SO_DTYPE_BF16 if copy_bf16 else 0
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
            sl = SliceDesc(name, 0, m.numel())
            d = c.so_subgroup_desc_default()
            d.master, d.numel, d.slices, d.num_slices = m.data_ptr(), m.numel(), C.pointer(sl), 1
            d.device_param, d.device_param_dtype = p.data_ptr(), SO_DTYPE_BF16
            sg = C.c_uint32()
            lib.check(c.so_session_add_subgroup(self.h, C.byref(d), C.byref(sg)), "add_subgroup")
        s = C.c_void_p()
        lib.check(c.so_session_copy_stream(self.h, C.byref(s)), "copy_stream")
        self.copy_stream_ptr = s.value or 0

    def begin(self):
        self.lib.check(self.lib.c.so_session_begin_step(self.h, C.c_float(1.0), 1), "begin_step")

    def grad(self, k, t, stream_ptr):
        self.lib.check(self.lib.c.so_session_grad_device(self.h, k, t.data_ptr(), t.numel(), SO_DTYPE_BF16,
                                                         stream_ptr, None), "grad_device")

    def step(self, max_norm):
        a = self.lib.c.so_step_args_default()
        a.max_norm, a.norm_source = max_norm, SO_NORM_LOCAL
        t = C.c_uint64()
        self.lib.check(self.lib.c.so_session_step(self.h, C.byref(a), C.byref(t)), "step")
        return t.value

    def result(self, ticket):
        r = StepResult()
        r.struct_size = C.sizeof(StepResult)
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
            layer_work(k, args.fwd_mm)
        for k in reversed(range(L)):
            layer_work(k, args.bwd_mm)

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
    for name, spec, clip, gpu_budget in modes:
        s = Session(lib, masters, params, speculation=spec, cores=args.cores, gpu_budget=gpu_budget)
        s.set_compute_stream(compute.cuda_stream)
        copy_stream = torch.cuda.ExternalStream(s.copy_stream_ptr)
        state = {"ticket": 0, "results": []}

        def train_step():
            for k in range(L):  # forward: layer k waits only for sub-group k's weights
                s.gpu_wait(s.final_ticket(k), compute.cuda_stream)
                layer_work(k, args.fwd_mm)
            s.begin()
            for k in reversed(range(L)):  # backward: hand each layer's gradient over as it is produced
                g = layer_work(k, args.bwd_mm).flatten()
                g.record_stream(copy_stream)
                s.grad(k, g, compute.cuda_stream)
            if state["ticket"]:
                state["results"].append(s.result(state["ticket"]))
            state["ticket"] = s.step(clip)

        # The automatic split is chosen after three measured steps: warm up past it.
        for _ in range(4 if gpu_budget else 0):
            train_step()
        t = time_loop(train_step, args.steps)
        r = s.result(state["ticket"])
        timed = state["results"][-(args.steps - 1):]
        dev_bytes = C.c_size_t()
        lib.check(lib.c.so_session_device_bytes(s.h, C.byref(dev_bytes)), "device_bytes")
        s.close()
        results[name] = {
            "step_ms": ms(t), "vs_max_gpu_adam": round(t / max(t_gpu, t_adam), 3),
            "rescaled": r.rescaled, "kept": r.kept, "stepped": r.stepped, "cancelled": r.cancelled,
            "speculative": r.speculative, "device_stepped": r.device_stepped, "clip_coef": round(r.clip_coef, 4),
            "final_pass_elements": r.final_pass_elements,
            "forward_wait_ms_mean": ms(statistics.mean(x.forward_wait_s for x in timed)) if timed else None,
            "device_bytes": dev_bytes.value,
        }
    for name in ("auto", "on", "auto_split"):
        results[f"{name}_clip_over_after_backward_clip"] = round(
            results[f"{name}_clip_every_step" if name != "auto_split" else "auto_split_clip"]["step_ms"] /
            results["after_backward_clip"]["step_ms"], 3)
        results[f"{name}_over_after_backward"] = round(results[name]["step_ms"] / results["after_backward"]["step_ms"], 3)
    return results


def cpu_adam_time(lib, masters, torch):
    c = lib.c
    c.so_adam_hparams_default.restype = type("H", (C.Structure,), {"_fields_": [
        ("struct_size", C.c_size_t), ("mode", C.c_uint32), ("lr", C.c_double), ("beta1", C.c_double),
        ("beta2", C.c_double), ("eps", C.c_double), ("weight_decay", C.c_double), ("bias_correction", C.c_bool),
        ("step", C.c_uint64)]})
    buf_t = type("B", (C.Structure,), {"_fields_": [
        ("struct_size", C.c_size_t), ("numel", C.c_size_t), ("param", C.c_void_p), ("grad", C.c_void_p),
        ("exp_avg", C.c_void_p), ("exp_avg_sq", C.c_void_p), ("param_copy", C.c_void_p), ("param_dtype", C.c_uint32),
        ("grad_dtype", C.c_uint32), ("moment_dtype", C.c_uint32), ("param_copy_dtype", C.c_uint32)]})
    c.so_adam_buffers_default.restype = buf_t
    hp = c.so_adam_hparams_default()
    state = []
    for m in masters:
        p, g16 = m.clone(), torch.zeros(m.numel(), dtype=torch.bfloat16)
        mm, vv = torch.zeros_like(m), torch.zeros_like(m)
        b = c.so_adam_buffers_default()
        b.numel, b.param, b.grad, b.exp_avg, b.exp_avg_sq = m.numel(), p.data_ptr(), g16.data_ptr(), mm.data_ptr(), vv.data_ptr()
        b.grad_dtype = SO_DTYPE_BF16
        state.append((b, p, g16, mm, vv))
    times = []
    for rep in range(4):
        t0 = time.perf_counter()
        for b, *_ in state:
            lib.check(c.so_adam_update(None, C.byref(hp), C.byref(b), None, None), "so_adam_update")
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--json")
    ap.add_argument("--only", choices=["copies", "overlap"])
    ap.add_argument("--copy-reps", type=int, default=9)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--params-per-layer", type=int, default=8192 * 3072)
    ap.add_argument("--fwd-mm", type=int, default=3)
    ap.add_argument("--bwd-mm", type=int, default=6)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cores", type=lambda s: [int(c) for c in s.split(",")] if s else None, default=None,
                    help="comma-separated cores for the session's pool (default: the default pool)")
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
