"""GPU: a 1.1B Llama-style model in plain JAX, superoffload.jax vs optax.adamw, one process per system (--smoke: CPU).

TinyLlama's shape by default (22 layers, hidden 2048, intermediate 5632, 32 heads, 4 KV heads, vocab
32000, RMSNorm, SwiGLU, rotary positions, jax.nn.dot_product_attention), bf16 compute, sequence 2048,
8 x 2048 tokens per optimizer step, random tokens. Systems:

  optax  optax.adamw with its state on the GPU: f32 parameters, cast to bf16 in the forward
         (the step donates its parameters and state);
  ours   superoffload.jax.adamw: bf16 parameters on the GPU, f32 master weights and moments in host
         memory, stepped by the CPU-Adam thread during backward.

Each (system, clipping) pair runs in a process of its own (the parent starts them and collects their
JSON); clipping "none" never clips, "every" clips every step (max_grad_norm 1e-3, far below the
gradient norm). Every step's time is printed, and the JSON holds them all, with the model TFLOPS of
the median step after the warm-up (6 N per token plus attention's 12 L d s, the causal mask not
discounted, recomputation not counted).

  python bench/jax_llama.py --steps 12 --json out/jax_llama.json         # both systems, both clip modes
  python bench/jax_llama.py --systems ours --clip every --layers 44      # one configuration
  python bench/jax_llama.py --smoke                                      # a tiny model on the CPU
  python bench/jax_llama.py --largest --json out/jax_largest.json        # the deepest model each trains

--largest: per system, the most layers (at the given width) with which a step clipping every step
runs (out of device or host memory, it does not; a probe past --timeout ends the search with an
error, as it tells nothing of the memory), one process per depth, up to
--largest-max-layers: --layers and twice that give the peak device and host bytes per layer, the
tighter limit predicts the deepest, and probes from there bisect until the depth that ran and the
first that did not are within 2 % of each other.
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import time

SYSTEMS = ("optax", "ours")
CLIP_MODES = {"none": None, "every": 1e-3}


def parse():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--systems", default="optax,ours", help="comma-separated: optax, ours")
    p.add_argument("--clip", default="none,every", help="comma-separated: none, every")
    p.add_argument("--steps", type=int, default=12, help="timed steps after the warm-up")
    p.add_argument("--warmup", type=int, default=2, help="steps not timed (the first compiles)")
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--remat", action="store_true", help="recompute each layer in backward (jax.checkpoint)")
    p.add_argument("--attention", default=None, choices=[None, "xla", "cudnn"],
                   help="jax.nn.dot_product_attention's implementation (default: JAX chooses)")
    p.add_argument("--cores", default=None, help="ours: CPU cores for the session's pool, e.g. 0-15")
    p.add_argument("--moment-dtype", default="f32", choices=["f32", "bf16"],
                   help="ours: the moments' dtype in host memory (default f32, as optax's)")
    p.add_argument("--gpu-budget", default="0",
                   help="ours: gpu_budget_bytes, \"auto\" or bytes (default 0: all state in host memory)")
    p.add_argument("--wait", default="forward", choices=["forward", "step"],
                   help="ours: where each step reads the updated weights (default: in the next forward)")
    p.add_argument("--ours-mem-fraction", type=float, default=None,
                   help="ours: XLA_PYTHON_CLIENT_MEM_FRACTION (default 0.95, as optax's), less to leave the "
                        "session's GPU budget room")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="ours: the session's timeline of the timed steps, DIR/trace_jax_ours_<clip>.json "
                        "(bench/trace_plot.py renders it)")
    p.add_argument("--timeout", type=int, default=900, help="seconds each child process may run")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU (checks the script)")
    p.add_argument("--largest", action="store_true", help="search the most layers each system trains (see above)")
    p.add_argument("--largest-max-layers", type=int, default=512, help="--largest: the deepest model tried")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--probe-layers", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.smoke:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 64, 128, 4, 2
        args.vocab, args.seq, args.batch, args.steps, args.warmup = 256, 32, 2, 3, 1
    if args.probe_layers:
        args.layers = args.probe_layers
    return args


def cores(spec):
    if not spec:
        return None
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


# ---- the model ----------------------------------------------------------------------------------

def init_params(args, dtype, seed=0):
    """A list in forward order: the embedding, each layer, the final norm and the output head."""
    import jax
    import jax.numpy as jnp
    h, f, hd = args.hidden, args.intermediate, args.hidden // args.heads
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 4 + 7 * args.layers))

    def dense(shape, scale=0.02):
        return (jax.random.normal(next(keys), shape, jnp.float32) * scale).astype(dtype)

    layers = [{"attn_norm": jnp.ones(h, dtype), "wq": dense((h, args.heads * hd)),
               "wk": dense((h, args.kv_heads * hd)), "wv": dense((h, args.kv_heads * hd)),
               "wo": dense((args.heads * hd, h)), "mlp_norm": jnp.ones(h, dtype), "w_gate": dense((h, f)),
               "w_up": dense((h, f)), "w_down": dense((f, h))} for _ in range(args.layers)]
    return [{"embed": dense((args.vocab, h))}, *layers, {"norm": jnp.ones(h, dtype), "head": dense((h, args.vocab))}]


def make_loss(args):
    import jax
    import jax.numpy as jnp
    hd = args.hidden // args.heads
    inv = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    angles = jnp.arange(args.seq, dtype=jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)

    def rms_norm(x, w):
        x32 = x.astype(jnp.float32)
        return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype) * w

    def rotary(x):  # [B, S, N, hd]
        a, b = x[..., : hd // 2].astype(jnp.float32), x[..., hd // 2:].astype(jnp.float32)
        c, s = cos[None, :, None, :], sin[None, :, None, :]
        return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1).astype(x.dtype)

    def block(x, p):
        bsz = x.shape[0]
        y = rms_norm(x, p["attn_norm"])
        q = rotary((y @ p["wq"]).reshape(bsz, args.seq, args.heads, hd))
        k = rotary((y @ p["wk"]).reshape(bsz, args.seq, args.kv_heads, hd))
        v = (y @ p["wv"]).reshape(bsz, args.seq, args.kv_heads, hd)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=args.attention)
        x = x + o.reshape(bsz, args.seq, args.heads * hd) @ p["wo"]
        y = rms_norm(x, p["mlp_norm"])
        return x + (jax.nn.silu(y @ p["w_gate"]) * (y @ p["w_up"])) @ p["w_down"]

    if args.remat:
        block = jax.checkpoint(block)

    def loss_fn(params, tokens):
        params = jax.tree.map(lambda w: w.astype(jnp.bfloat16), params)  # bf16 compute
        x = params[0]["embed"][tokens[:, :-1]]
        for p in params[1:-1]:
            x = block(x, p)
        logits = rms_norm(x, params[-1]["norm"]) @ params[-1]["head"]
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))

    return loss_fn


def model_flops_per_step(args, n_params):
    tokens = args.batch * args.seq
    non_embedding = n_params - args.vocab * args.hidden  # the lookup is no matrix product
    return 6 * non_embedding * tokens + 12 * args.layers * args.hidden * args.seq * tokens


# ---- one system in this process -----------------------------------------------------------------

def run_child(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    system, clip = args.child.split(":")
    max_grad_norm = CLIP_MODES[clip]
    loss_fn = make_loss(args)
    device = jax.devices()[0]
    rng = np.random.default_rng(0)
    batches = [jax.device_put(rng.integers(0, args.vocab, (args.batch, args.seq + 1), dtype=np.int32), device)
               for _ in range(4)]
    metrics = None
    if system == "optax":
        import optax
        params = jax.device_put(init_params(args, jnp.float32), device)  # committed, as the step's outputs
        tx = optax.adamw(3e-4, weight_decay=0.01)
        if max_grad_norm:
            tx = optax.chain(optax.clip_by_global_norm(max_grad_norm), tx)
        state = jax.device_put(tx.init(params), device)

        def optax_step(params, state, tokens):
            loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
            updates, state = tx.update(grads, state, params)
            return loss, optax.apply_updates(params, updates), state

        # Donated, as ours' parameters are: a training loop keeps no step's inputs, and XLA then
        # updates the parameters and moments in place instead of holding both copies.
        step = jax.jit(optax_step, donate_argnums=(0, 1))
    else:
        import superoffload.jax as sojax
        params = jax.device_put(init_params(args, jnp.bfloat16), device)
        budget = args.gpu_budget if args.gpu_budget == "auto" else int(args.gpu_budget)
        opt = sojax.adamw(3e-4, weight_decay=0.01, max_grad_norm=max_grad_norm, cores=cores(args.cores),
                          moment_dtype=args.moment_dtype, gpu_budget_bytes=budget, wait=args.wait)
        state = opt.init(params)
        step = jax.jit(lambda p, s, t: opt.step(loss_fn, p, s, t), donate_argnums=(0,))
        metrics = opt.metrics
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    times, losses, clip_coefs = [], [], []
    for i in range(args.warmup + args.steps):
        if metrics is not None and args.trace and i == args.warmup:
            opt.session.trace(True)
        start = time.perf_counter()
        loss, params, state = step(params, state, batches[i % len(batches)])
        jax.block_until_ready((loss, params))
        took = time.perf_counter() - start
        losses.append(float(loss))
        extra = ""
        if metrics is not None:
            m = metrics(state)
            clip_coefs.append(m["clip_coef"])
            extra = (f" clip_coef {m['clip_coef']:.3g} speculative {m['speculative']} kept {m['kept']} "
                     f"device-stepped {m['device_stepped']}")
        if i >= args.warmup:
            times.append(took)
        print(f"{system} clip={clip} step {i}{' (warm-up)' if i < args.warmup else ''}: {took * 1e3:.1f} ms "
              f"loss {float(loss):.4f}{extra}", flush=True)
    median = float(np.median(times))
    flops = model_flops_per_step(args, n_params)
    stats = device.memory_stats() or {}
    result = {"system": system, "clip": clip, "max_grad_norm": max_grad_norm, "params": n_params,
              "tokens_per_step": args.batch * args.seq, "step_s": times, "median_step_s": median,
              "model_tflops": flops / median / 1e12, "losses": losses, "clip_coefs": clip_coefs,
              "peak_device_bytes": stats.get("peak_bytes_in_use"), "device_bytes_limit": stats.get("bytes_limit"),
              "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
              "host_bytes_total": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
              "device": device.device_kind, "jax": jax.__version__}
    print(f"{system} clip={clip}: {n_params / 1e9:.3f} B parameters, median step {median * 1e3:.1f} ms, "
          f"{result['model_tflops']:.1f} model TFLOPS, peak device memory "
          f"{(result['peak_device_bytes'] or 0) / 2**30:.1f} GiB", flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    if metrics is not None:
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            opt.session.save_trace(os.path.join(args.trace, f"trace_jax_ours_{clip}.json"))
        opt.close()


# ---- the parent: one child process per configuration --------------------------------------------

def without_json(argv):
    """The command line for a child: the parent's, less --json (the parent writes the file)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def run_config(args, passthrough, system, clip, extra=(), echo=True):
    """One child process: (its result, or None; a failure record, or None)."""
    env = dict(os.environ)
    env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    if system == "ours" and args.ours_mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(args.ours_mem_fraction)
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, __file__, *passthrough, *extra, "--child", f"{system}:{clip}"]
    print(f"== {system}, clipping {clip}: {' '.join(cmd)}", flush=True)
    try:
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=args.timeout)
        output, code = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        output, code = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    result = None
    for line in output.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
        elif echo:
            print(line, flush=True)
    if code != 0:
        print(f"FAILED {system} clip={clip}: exit {code}", flush=True)
        return None, {"system": system, "clip": clip, "exit": code, "tail": output[-2000:]}
    return result, None


def deepest(runs, first, most, tolerance=0.02):
    """The most layers (at most `most`) for which `runs(layers)` (a probe's result, or None where it
    did not run) runs, from two probes: `first` layers and twice that give the device's and the
    host's peak bytes per layer, the tighter of the two limits predicts the depth, and probes
    from there bisect until the depth that ran and the first that did not are within `tolerance`
    of each other. Returns (the deepest that ran, the shallowest that did not or None, its
    result)."""
    results = {}

    def probe(layers):
        if layers not in results:
            results[layers] = runs(layers)
        return results[layers] is not None

    good, bad = 0, None
    for layers in (first, min(2 * first, most)):
        if probe(layers):
            good = layers
        else:
            bad = layers
            break
    if bad is None and good < most:
        (l1, r1), (l2, r2) = (first, results[first]), (good, results[good])
        limits = []
        for used, limit in (("peak_device_bytes", "device_bytes_limit"), ("peak_host_bytes", "host_bytes_total")):
            per_layer = (r2[used] - r1[used]) / max(l2 - l1, 1)
            if per_layer > 0 and r2.get(limit):
                limits.append(l2 + (r2[limit] - r2[used]) / per_layer)
        predicted = min(most, int(min(limits))) if limits else most
        step = max(1, int(predicted * tolerance))
        if predicted > good and probe(predicted):
            good = predicted  # then up, by steps that double, to the first that does not run
            while good < most and probe(min(most, good + step)):
                good, step = min(most, good + step), 2 * step
            bad = None if good >= most else min(most, good + step)
        elif predicted > good:
            bad = predicted  # then down, likewise, to the first that runs
            while bad - step > good and not probe(bad - step):
                bad, step = bad - step, 2 * step
            if bad - step > good:
                good = bad - step
    while bad is not None and bad - good > max(1, int(good * tolerance)):
        mid = (good + bad) // 2
        good, bad = (mid, bad) if probe(mid) else (good, mid)
    return good, bad, results.get(good)


def largest(args, passthrough, systems):
    """Per system, the deepest model (layers at the given width) whose clipped step runs."""
    found = []
    for system in systems:
        def runs(layers):
            extra = ["--probe-layers", str(layers), "--steps", "1", "--warmup", "1"]
            result, failure = run_config(args, passthrough, system, "every", extra, echo=False)
            if failure is not None and failure["exit"] == "timeout":
                # A probe cut short says nothing of the memory the depth needs.
                raise SystemExit(f"{system}: {layers} layers ran past --timeout {args.timeout} s; the first step "
                                 "compiles the model, the longer the deeper it is: give a longer --timeout")
            peak = f", peak {result['peak_device_bytes'] / 2**30:.1f} GiB on the device, " \
                   f"{result['peak_host_bytes'] / 2**30:.1f} GiB of host RSS" if result else ""
            print(f"{system}: {layers} layers {'ran' if result else 'did not run'}{peak}", flush=True)
            return result

        good, bad, best = deepest(runs, args.layers, args.largest_max_layers)
        found.append({"system": system, "layers": good, "first_that_did_not_run": bad,
                      "capped": good == args.largest_max_layers, "params": best["params"] if best else 0,
                      "peak_device_bytes": best["peak_device_bytes"] if best else None,
                      "peak_host_bytes": best["peak_host_bytes"] if best else None})
    for f in found:
        print(f"{f['system']:>5}: {f['layers']}{'+' if f['capped'] else ''} layers, {f['params'] / 1e9:.3f} B "
              f"parameters (did not run: {f['first_that_did_not_run']})", flush=True)
    return found


def main():
    args = parse()
    if args.child:
        if args.smoke:
            os.environ["JAX_PLATFORMS"] = "cpu"
        run_child(args)
        return 0
    systems = args.systems.split(",")
    for system in systems:
        if system not in SYSTEMS:
            raise SystemExit(f"unknown system {system!r}; choose from {SYSTEMS}")
    passthrough = without_json(sys.argv[1:])
    if args.largest:
        found = largest(args, passthrough, systems)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
                           "largest": found}, f, indent=1)
        return 0
    results, failures = [], []
    for system in systems:
        for clip in args.clip.split(","):
            if clip not in CLIP_MODES:
                raise SystemExit(f"unknown clip mode {clip!r}; choose from {tuple(CLIP_MODES)}")
            result, failure = run_config(args, passthrough, system, clip)
            if result is not None:
                results.append(result)
            if failure is not None:
                failures.append(failure)
    for r in results:
        print(f"{r['system']:>5} clip={r['clip']:<5} median {r['median_step_s'] * 1e3:8.1f} ms "
              f"{r['model_tflops']:6.1f} TFLOPS  steps (ms): " + " ".join(f"{t * 1e3:.0f}" for t in r["step_s"]))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"config": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
                       "results": results, "failures": failures}, f, indent=1)
        print(f"wrote {args.json}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
