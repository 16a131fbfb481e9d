#!/usr/bin/env python3
"""A JAX MLP whose Adam optimizer runs in a superoffload session, through XLA FFI custom calls
(libso_jax_ffi.so, built from so_jax_ffi.cc), checked against optax.

The model: an MLP (tanh) regressing a fixed random teacher network's outputs on fresh
Gaussian inputs (the same batches in every run). The optimizer, per step, inside one jitted
function: value_and_grad; one `so_grad` FFI call per parameter that hands its gradient to the
session (speculative steps of a layer's sub-group start as soon as its weight and bias are in);
one `so_step` FFI call that ends the step (clipping, learning-rate schedule, exact
finalization) and returns the new parameters. Each layer is one sub-group (slices `l<k>.w`,
`l<k>.b`); the trainer, its session and its sub-groups are set up from Python through the
library's C entries (ctypes), and the trainer's address reaches the handlers as an FFI
attribute.

The check: the same training with optax (clip_by_global_norm + adamw with the same schedule,
hyperparameters, init and batches): per-step losses must agree to a mean relative difference
<= --tol, the final parameters closely; and the parameters so_step returned must equal the
session's master weights bit for bit. Exit status 0 on success, 1 if a check fails.

  python3 examples/jax_ffi/train_mlp.py --lib build/libso_jax_ffi.so [--platform auto|cpu|cuda]
"""
import argparse
import ctypes as C
import os
import sys
import time

import numpy as np


class Options(C.Structure):
    _fields_ = [("cuda", C.c_int32), ("speculation", C.c_int32), ("lr", C.c_double), ("beta1", C.c_double),
                ("beta2", C.c_double), ("eps", C.c_double), ("weight_decay", C.c_double), ("warmup", C.c_int64),
                ("total_steps", C.c_int64), ("min_lr_ratio", C.c_double), ("max_norm", C.c_double)]


class Result(C.Structure):
    _fields_ = [("serial", C.c_uint64), ("skipped", C.c_int32), ("global_norm", C.c_double), ("clip_coef", C.c_double),
                ("speculative", C.c_uint32), ("kept", C.c_uint32), ("rescaled", C.c_uint32),
                ("rolled_back", C.c_uint32), ("redone", C.c_uint32), ("stepped", C.c_uint32)]


def check_mirrors():
    """The two ctypes Structures above against so_jax_ffi.cc's typedefs (names, order, types), with
    the superoffload package's header parser, the one that keeps its own ctypes mirrors of
    superoffload.h honest; then the library the package loads must have the header's ABI."""
    import superoffload
    from superoffload import _header
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "so_jax_ffi.cc"), encoding="utf-8") as f:
        problems = _header.compare_structs(_header.parse(f.read()), {"sojax_options": Options, "sojax_result": Result})
    problems += _header.check()  # the package's mirrors of superoffload.h
    if problems:
        sys.exit("train_mlp.py: ctypes mirrors differ from the C sources:\n  " + "\n  ".join(problems))
    return superoffload.__version__


class Lib:
    """The FFI library: its handlers (for jax.ffi) and its C entries (ctypes)."""

    def __init__(self, path):
        self.c = c = C.CDLL(os.path.abspath(path))
        c.sojax_last_error.restype = C.c_char_p
        c.sojax_options_size.restype = c.sojax_result_size.restype = C.c_size_t
        if c.sojax_options_size() != C.sizeof(Options) or c.sojax_result_size() != C.sizeof(Result):
            sys.exit("train_mlp.py: the ctypes layouts do not match libso_jax_ffi's structs (sizes "
                     f"{c.sojax_options_size()}/{c.sojax_result_size()} vs {C.sizeof(Options)}/{C.sizeof(Result)})")
        c.sojax_create.argtypes = [C.POINTER(Options), C.POINTER(C.c_int64)]
        c.sojax_add_subgroup.argtypes = [C.c_int64, C.c_size_t, C.POINTER(C.c_char_p), C.POINTER(C.c_size_t),
                                         C.POINTER(C.c_float), C.c_uint64, C.POINTER(C.c_uint32)]
        c.sojax_last_result.argtypes = [C.c_int64, C.POINTER(Result)]
        c.sojax_read_master.argtypes = [C.c_int64, C.c_uint32, C.POINTER(C.c_float), C.c_size_t]
        c.sojax_destroy.argtypes = [C.c_int64]
        c.sojax_destroy.restype = None

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{what}: {self.c.sojax_last_error().decode()}")


class Trainer:
    """A superoffload session with one sub-group per layer; `handle` is the FFI attribute."""

    def __init__(self, lib, layers, args, cuda, jax):
        self.lib, c = lib, lib.c
        o = Options(cuda=int(cuda), speculation=0 if args.no_speculation else 1, lr=args.lr, beta1=args.b1,
                    beta2=args.b2, eps=args.eps, weight_decay=args.wd, warmup=args.warmup, total_steps=args.steps,
                    min_lr_ratio=args.min_lr_ratio, max_norm=args.max_norm)
        h = C.c_int64()
        lib.check(c.sojax_create(C.byref(o), C.byref(h)), "sojax_create")
        self.handle = h.value
        self.device_buffers = []  # CUDA: where the session publishes each layer's weights (kept alive here)
        self.slice_ids, self.sizes = [], []
        for k, (w, b) in enumerate(layers):
            flat = np.concatenate([w.ravel(), b.ravel()]).astype(np.float32)
            dev_ptr = 0
            if cuda:
                buf = jax.device_put(flat, jax.devices("gpu")[0])
                buf.block_until_ready()
                self.device_buffers.append(buf)
                dev_ptr = buf.unsafe_buffer_pointer()
            names = (C.c_char_p * 2)(f"l{k}.w".encode(), f"l{k}.b".encode())
            numels = (C.c_size_t * 2)(w.size, b.size)
            out = (C.c_uint32 * 2)()
            lib.check(c.sojax_add_subgroup(self.handle, 2, names, numels,
                                           flat.ctypes.data_as(C.POINTER(C.c_float)), dev_ptr, out),
                      "sojax_add_subgroup")
            self.slice_ids += list(out)
            self.sizes.append(flat.size)
        if self.slice_ids != list(range(len(self.slice_ids))):
            raise RuntimeError(f"unexpected slice ids {self.slice_ids}")

    def result(self):
        r = Result()
        self.lib.check(self.lib.c.sojax_last_result(self.handle, C.byref(r)), "sojax_last_result")
        return r

    def master(self, k):
        out = np.empty(self.sizes[k], np.float32)
        self.lib.check(self.lib.c.sojax_read_master(self.handle, k, out.ctypes.data_as(C.POINTER(C.c_float)), out.size),
                       "sojax_read_master")
        return out

    def close(self):
        self.lib.c.sojax_destroy(self.handle)  # waits for queued work; then the device buffers may go


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", required=True, help="libso_jax_ffi.so")
    ap.add_argument("--platform", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--sizes", default="32,256,256,8", help="layer widths, input to output")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--b1", type=float, default=0.9)
    ap.add_argument("--b2", type=float, default=0.999)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--wd", type=float, default=1e-2)
    ap.add_argument("--max-norm", type=float, default=1.0, help="clip the global gradient norm (0: no clipping)")
    ap.add_argument("--tol", type=float, default=1e-3, help="mean relative loss difference allowed vs optax")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-speculation", action="store_true")
    args = ap.parse_args()

    if args.platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import optax

    backend = jax.default_backend()
    cuda = backend == "gpu"
    if args.platform == "cuda" and not cuda:
        sys.exit(f"--platform cuda: JAX's default backend is {backend!r}")
    if cuda:
        version = str(getattr(getattr(jax.devices()[0], "client", None), "platform_version", "cuda"))
        if "rocm" in version.lower():
            sys.exit(f"the GPU backend is ROCm ({version}); superoffload's device transport is CUDA only")

    so_version = check_mirrors()
    lib = Lib(args.lib)
    jax.ffi.register_ffi_target("so_grad", jax.ffi.pycapsule(lib.c.SoJaxGradCpu), platform="cpu")
    jax.ffi.register_ffi_target("so_step", jax.ffi.pycapsule(lib.c.SoJaxStepCpu), platform="cpu")
    if cuda:
        jax.ffi.register_ffi_target("so_grad", jax.ffi.pycapsule(lib.c.SoJaxGradCuda), platform="CUDA")
        jax.ffi.register_ffi_target("so_step", jax.ffi.pycapsule(lib.c.SoJaxStepCuda), platform="CUDA")

    sizes = [int(s) for s in args.sizes.split(",")]
    rng = np.random.default_rng(args.seed)
    layers = [(rng.standard_normal((a, b)).astype(np.float32) / np.sqrt(a), np.zeros(b, np.float32))
              for a, b in zip(sizes[:-1], sizes[1:])]
    teacher = [rng.standard_normal((sizes[0], 64)).astype(np.float32) / np.sqrt(sizes[0]),
               rng.standard_normal((64, sizes[-1])).astype(np.float32) / 8.0]

    def batch(step):
        r = np.random.default_rng(10_000 + step)
        x = r.standard_normal((args.batch, sizes[0])).astype(np.float32)
        y = np.tanh(x @ teacher[0]) @ teacher[1] + 0.01 * r.standard_normal((args.batch, sizes[-1])).astype(np.float32)
        return x, y.astype(np.float32)

    def loss_fn(params, x, y):
        h = x
        for i in range(0, len(params) - 2, 2):
            h = jnp.tanh(h @ params[i] + params[i + 1])
        out = h @ params[-2] + params[-1]
        return jnp.mean((out - y) ** 2)

    init = [jnp.asarray(a) for wb in layers for a in wb]
    n_params = sum(int(a.size) for a in init)
    print(f"superoffload {so_version}; jax {jax.__version__} on {backend} ({jax.devices()[0].device_kind}); MLP {sizes}, {n_params} parameters in "
          f"{len(layers)} sub-groups; batch {args.batch}, {args.steps} steps, lr {args.lr} (warm-up {args.warmup}, "
          f"cosine), clip {args.max_norm}, weight decay {args.wd}; "
          f"{'CUDA' if cuda else 'host'} session{'' if not args.no_speculation else ' without speculation'}", flush=True)

    # ---- superoffload through FFI ----
    trainer = Trainer(lib, layers, args, cuda, jax)
    attr = np.int64(trainer.handle)

    def session_step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        handed = [jax.ffi.ffi_call("so_grad", jax.ShapeDtypeStruct(g.shape, g.dtype), has_side_effect=True,
                                   input_output_aliases={0: 0})(g, trainer=attr, slice=np.int64(i))
                  for i, g in enumerate(grads)]
        new = jax.ffi.ffi_call("so_step", [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in params],
                               has_side_effect=True)(*handed, trainer=attr)
        return loss, list(new)

    step_fn = jax.jit(session_step)
    params = list(init)
    losses_so, stats = [], {"clipped": 0, "speculative": 0, "kept": 0, "rescaled": 0, "redone": 0, "stepped": 0}
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step)
        loss, params = step_fn(params, x, y)
        jax.block_until_ready(params)  # so_step has run (and, on CUDA, its copies are done)
        losses_so.append(float(loss))
        r = trainer.result()
        if r.serial != step + 1:
            raise RuntimeError(f"step {step}: the session's latest step is #{r.serial}, expected #{step + 1}")
        if r.skipped:
            raise RuntimeError(f"step {step} was skipped (non-finite gradient?)")
        stats["clipped"] += r.clip_coef < 1.0
        for k in ("speculative", "kept", "rescaled", "redone", "stepped"):
            stats[k] += getattr(r, k)
        if step % 10 == 0 or step == args.steps - 1:
            print(f"  [session] step {step:3d}  loss {losses_so[-1]:.6f}  norm {r.global_norm:.4f}  clip {r.clip_coef:.3f}",
                  flush=True)
    jax.block_until_ready(params)
    t_so = time.perf_counter() - t0
    final_so = [np.asarray(p) for p in params]
    masters = [trainer.master(k) for k in range(len(layers))]
    # CUDA: the persistent device buffers hold the last published weights.
    published_ok = all(np.array_equal(np.asarray(d).view(np.uint32), m.view(np.uint32))
                       for d, m in zip(trainer.device_buffers, masters))
    print(f"  [session] {t_so:.1f} s; steps clipped {stats['clipped']} of {args.steps}; speculative {stats['speculative']}, "
          f"kept {stats['kept']}, rescaled {stats['rescaled']}, redone {stats['redone']}, "
          f"stepped at step() {stats['stepped']}", flush=True)
    trainer.close()

    # ---- optax ----
    def schedule(count):
        s = count.astype(jnp.float32)
        warm = args.lr * (s + 1.0) / args.warmup
        t = jnp.clip((s - args.warmup) / max(1, args.steps - 1 - args.warmup), 0.0, 1.0)
        lo = args.lr * args.min_lr_ratio
        return jnp.where(s < args.warmup, warm, lo + 0.5 * (args.lr - lo) * (1.0 + jnp.cos(jnp.pi * t)))

    adamw = optax.adamw(schedule, b1=args.b1, b2=args.b2, eps=args.eps, weight_decay=args.wd)
    opt = optax.chain(optax.clip_by_global_norm(args.max_norm), adamw) if args.max_norm > 0 else adamw

    @jax.jit
    def optax_step(params, state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, state = opt.update(grads, state, params)
        return loss, optax.apply_updates(params, updates), state

    params = list(init)
    state = opt.init(params)
    losses_ox = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = batch(step)
        loss, params, state = optax_step(params, state, x, y)
        losses_ox.append(float(loss))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"  [optax]   step {step:3d}  loss {losses_ox[-1]:.6f}", flush=True)
    t_ox = time.perf_counter() - t0
    final_ox = [np.asarray(p) for p in params]
    print(f"  [optax]   {t_ox:.1f} s", flush=True)

    # ---- checks ----
    a, b = np.array(losses_so), np.array(losses_ox)
    rel = np.abs(a - b) / np.maximum(np.abs(b), 1e-12)
    wdiff = max(float(np.max(np.abs(p - q))) for p, q in zip(final_so, final_ox))
    wscale = max(float(np.max(np.abs(q))) for q in final_ox)
    learned = a[-5:].mean() < 0.5 * a[:5].mean()
    flat_so = [np.concatenate([final_so[2 * k].ravel(), final_so[2 * k + 1].ravel()]) for k in range(len(layers))]
    same_as_master = all(np.array_equal(f.view(np.uint32), m.view(np.uint32)) for f, m in zip(flat_so, masters))
    print(f"parity over {args.steps} steps: loss relative difference mean {rel.mean():.3g}, max {rel.max():.3g} "
          f"(tolerance: mean <= {args.tol:g}); final parameters max |diff| {wdiff:.3g} (largest |param| {wscale:.3g})")
    print(f"first/last loss: session {a[0]:.6f} -> {a[-1]:.6f}, optax {b[0]:.6f} -> {b[-1]:.6f}; "
          f"learning: {'ok' if learned else 'NOT LEARNING'}")
    print(f"parameters returned by so_step equal the session's master weights bit for bit: {same_as_master}")
    if cuda:
        print(f"published device weights equal the master weights bit for bit: {published_ok}")
    speculated = stats["speculative"] > 0 if not args.no_speculation else stats["stepped"] == args.steps * len(layers)
    ok = bool(rel.mean() <= args.tol) and learned and same_as_master and published_ok and speculated
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
