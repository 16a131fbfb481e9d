#!/usr/bin/env python3
"""End-to-end training benchmark on the GPU machine: a transformers Llama causal LM built from a
config (no download; default TinyLlama-1.1B's shape, ~1.1 B parameters), bf16 on one GPU,
activation checkpointing, batch x sequence >= 32K tokens per step. Same model, same data, side
by side:

  a  ours, the default (speculation auto): SuperOffloadAdamW, sub-groups stepped on the CPU
     during backward when the session's measurements say it pays, else after backward
  s  ours, speculation on: sub-groups always stepped during backward
  b  ours, stepping after backward (speculation off)
  c  torch.optim.AdamW(fused=True) on CPU f32 master copies after backward: gradients copied to
     pinned CPU buffers, cast to f32, clipped, stepped, weights copied back (what users do today)
  d  torch.optim.AdamW(fused=True) on the GPU, nothing offloaded (bf16 parameters and moments)
  e  forward + backward only, no optimizer (the GPU time that the CPU work can hide behind)
  x  ours, the default, with the library's automatic split: up to --gpu-budget-gib of GPU memory
     (default: what mode d's bf16 moments take, 4 bytes per parameter) for the first sub-groups'
     f32 masters and moments, chosen after three measured steps
  h  ours, the default, with the first --gpu-fraction of the parameters (forward order: the
     embedding and first layers) GPU-resident (SuperOffload's ratio < 1); one run per fraction

each without clipping (max_grad_norm 0) and with clipping triggering on every step (max_grad_norm
--clip-max-norm, tiny; --clipped-only runs only these).
Reported per run: s/step (median of --steps timed steps after --warmup), tokens/s, TFLOPS
(6 * N * tokens / time), for ours the fraction of the CPU Adam time hidden
(1 - max(0, t - t_e) / t_cpu_adam, t_cpu_adam measured once with the library's kernel alone on the
same cores), host bytes per parameter and pinned bytes (so_session_pinned_bytes), the last step's
result (kept / rescaled / stepped). Targets: a <= 1.10 x d without clipping, a <= 1.15 x d with
clipping on every step, a >= 1.4 x faster than c. Also writes a timeline of two extra steps of each
of our runs (trace_<run>.json, e.g. trace_a_clip.json) and renders it with bench/trace_plot.py
(.png, and a summary line in the log).

  python3 bench_e2e.py [--layers 22 --hidden 2048 ...] [--seq 2048 --batch 16] [--modes e,d,a,x,h,s,b,c]
  python3 bench_e2e.py --smoke       # tiny model on the CPU: exercises the code paths, no numbers
  scripts/bench.sh e2e [flags]       # the same, from the repository root

Outputs go to --out (default $OUT, else bench-out/). Needs the superoffload package.
"""
import argparse
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))

import torch  # noqa: E402
from support import refuse_renamed  # noqa: E402


def log(*a):
    print(*a, flush=True)


def build_model(args, device, init_device=None):
    """The Llama model of `args`' shape in `args.dtype` on `device`. With `init_device` (a GPU,
    for a model built in host memory) its weights are drawn there: torch draws normals on the
    CPU on one thread (about 200 s for 10 B parameters)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.inter,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.kv_heads, max_position_embeddings=max(args.seq, 2048),
                      attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
    torch.manual_seed(0)
    # Built in its dtype where it runs: a 13 B model's f32 weights alone would not fit on the GPU.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(args.dtype)
    try:
        with torch.device(device if init_device is None else "meta"):
            model = LlamaForCausalLM(cfg)
        if init_device is not None:
            _init_on(model, cfg, device, init_device)
    finally:
        torch.set_default_dtype(default_dtype)
    model.config.use_cache = False
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@torch.no_grad()
def _init_on(model, cfg, device, init_device):
    """transformers' initialisation of a Llama model built on the meta device (normal weights of
    std `initializer_range`, RMSNorm weights 1, the rotary frequencies recomputed), each weight
    drawn on `init_device` in pieces and copied to its storage on `device`."""
    model.to_empty(device=device)
    piece = 1 << 26
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        flat = p.view(-1)
        for start in range(0, flat.numel(), piece):
            part = flat[start:start + piece]
            part.copy_(torch.randn(part.numel(), dtype=torch.float32, device=init_device)
                       .mul_(cfg.initializer_range).to(p.dtype))
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)


class Timer:
    def __init__(self, cuda):
        self.cuda = cuda

    def sync(self):
        if self.cuda:
            torch.cuda.current_stream().synchronize()


def forward_backward(model, batch):
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    return loss.detach()


# Clipped steps after which speculation "auto" stops speculating, after a history of
# unclipped ones (src/session/policy.rs: at least half of the last 8 steps unchanged).
AUTO_POLICY_TURN = 5


# Steps without growth after which the automatic split is taken as settled: the session
# measures 3 steps before it decides (src/session/policy.rs), and places on the next.
SPLIT_SETTLE = 4


def settle_split(opt, step, limit=20):
    """Steps until the automatic split has not grown for SPLIT_SETTLE steps (at most `limit`),
    so that the timed steps come after it; returns how many ran."""
    stable, ran, before = 0, 0, opt.session.device_bytes()
    while stable < SPLIT_SETTLE and ran < limit:
        step()
        ran += 1
        now = opt.session.device_bytes()
        stable, before = (stable + 1 if now == before else 0), now
    return ran


def run_steps(name, step_fn, args, timer):
    """--warmup untimed steps, then --steps timed ones (each ended by a sync of the current
    stream, as a loss.item() would); returns per-step seconds and losses."""
    losses, times = [], []
    for _ in range(args.warmup):
        losses.append(step_fn())
    timer.sync()
    t_start = time.perf_counter()
    for _ in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step_fn())
        timer.sync()
        times.append(time.perf_counter() - t0)
    window = time.perf_counter() - t_start
    losses = [float(x) for x in losses]
    return times, window, losses


def summarise(name, times, window, losses, n_params, tokens, extra=None):
    med = statistics.median(times)
    r = {"s_per_step": round(med, 4), "s_per_step_all": [round(t, 4) for t in times],
         "s_per_step_window_mean": round(window / len(times), 4), "tokens_per_s": round(tokens / med, 1),
         "tflops": round(6 * n_params * tokens / med / 1e12, 1), "losses": [round(x, 5) for x in losses]}
    if extra:
        r.update(extra)
    log(f"  {name:<26} {med:8.4f} s/step  {tokens / med:10.0f} tok/s  {r['tflops']:7.1f} TFLOPS  "
        f"(steps {', '.join(f'{t:.3f}' for t in times)}; loss {losses[-1]:.4f})")
    return r


def cpu_adam_alone(n_params, chunk, cores, dtype):
    """CPU Adam time of one full step over n_params, the library's kernel alone (bf16 gradient,
    f32 master and moments, bf16 copy out: what a session's pass does), on a pool of the same
    cores, over one sub-group-sized set of buffers reused n_params / chunk times."""
    import superoffload
    chunk = min(chunk, n_params)
    pool = superoffload.Pool(0, cores)
    p = torch.randn(chunk) * 0.02
    gdt = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    g = (torch.randn(chunk) * 1e-3).to(gdt)
    m, v = torch.zeros(chunk), torch.zeros(chunk)
    copy = torch.empty(chunk, dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
    reps = n_params / chunk
    times = []
    for i in range(4):
        t0 = time.perf_counter()
        for _ in range(int(reps)):
            superoffload.adam_update(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), chunk, lr=1e-4,
                                     step=i + 1, pool=pool, grad_dtype=str(gdt),
                                     param_copy=copy.data_ptr() if copy is not None else 0,
                                     param_copy_dtype="bf16" if copy is not None else "none")
        dt = time.perf_counter() - t0
        times.append(dt * reps / max(int(reps), 1))
    info = pool.info()
    pool.close()
    return statistics.median(times[1:]), info


def mode_ours(model, batch, args, timer, speculation, clips, results, n_params, tokens, gpu_fraction=0.0,
              gpu_budget=0):
    from superoffload.torch import SuperOffloadAdamW
    t0 = time.perf_counter()
    opt = SuperOffloadAdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            speculation=speculation, sub_group_numel=args.sub_group_numel, cores=args.cores,
                            model=model, max_grad_norm=0.0, gpu_fraction=gpu_fraction, gpu_budget_bytes=gpu_budget)
    setup = time.perf_counter() - t0
    mem = opt.memory()
    key = f"h{gpu_fraction:g}" if gpu_fraction else "x" if gpu_budget else {"auto": "a", "on": "s", "off": "b"}[speculation]
    log(f"  [{key}] session: {len(opt.subgroups())} sub-groups, setup {setup:.1f} s, host "
        f"{mem['host_bytes_per_param']:.2f} B/offloaded param, pinned {mem['pinned_bytes'] / 2**30:.2f} GiB, "
        f"GPU-resident {mem['gpu_resident_params'] / 1e6:.1f} M params ({len(opt.gpu_resident())} tensors)")

    def step():
        loss = forward_backward(model, batch)
        opt.step()
        return loss

    for clip in clips:
        opt.max_grad_norm = clip
        name = f"{key}_{'clip' if clip > 0 else 'noclip'}"
        if clip > 0 and speculation == "auto" and len(clips) > 1:
            # The clipped run follows the unclipped one in the same session: speculation
            # "auto" remembers 8 steps and needs 5 clipped ones to stop speculating. A session
            # clipped from its first step stops after one.
            for _ in range(AUTO_POLICY_TURN):
                step()
        if gpu_budget:
            settled = settle_split(opt, step)
            results[f"{name}_split_device_bytes"] = opt.session.device_bytes()
            log(f"  [{name}] automatic split settled after {settled} steps: the session holds "
                f"{opt.session.device_bytes() / 2**30:.2f} GiB of GPU memory (the optimizer state placed there, "
                "within the budget, and every sub-group's staging buffer)")
        times, window, losses = run_steps(name, step, args, timer)
        r = opt.last_step_result()
        extra = {"setup_s": round(setup, 2), **mem,
                 "last_step": {k: r[k] for k in ("global_norm", "clip_coef", "speculative", "kept", "rescaled",
                                                 "redone", "stepped", "skipped", "device_stepped")}}
        results[name] = summarise(name, times, window, losses, n_params, tokens, extra)
        if args.trace:
            trace_step(opt, step, args, name)
    results[f"{key}_pinned_bytes_peak"] = opt.session.pinned_bytes()
    opt.close()
    del opt
    gc.collect()


def trace_step(opt, step, args, name):
    """Timeline of two extra steps of run `name`, through the second one's finalization: the
    second backward's hand-offs show what they waited for of the first step's work."""
    opt.trace(True)
    step()
    step()
    opt.last_step_result()  # waits until every sub-group is final
    opt.trace(False)
    path = os.path.join(args.out, f"trace_{name}.json")
    opt.save_trace(path)
    png = os.path.join(args.out, f"trace_{name}.png")
    plot = os.path.join(HERE, "..", "..", "bench", "trace_plot.py")
    title = f"SuperOffloadAdamW, one step of run {name}"
    r = subprocess.run([sys.executable, plot, path, png, "--title", title], capture_output=True, text=True)
    log(f"  trace: {path}; " + (r.stdout.strip() if r.returncode == 0 else
                                 f"trace_plot.py failed ({r.returncode}): {(r.stderr or r.stdout).strip()[-300:]}"))


def mode_cpu_torch(model, batch, args, timer, clips, results, n_params, tokens):
    """(c): fused AdamW on CPU f32 master copies, after backward."""
    cuda = timer.cuda
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    pin = dict(pin_memory=True) if cuda else {}
    masters = [p.detach().to("cpu", torch.float32).clone() for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    grad_host = [torch.empty(p.shape, dtype=p.dtype, **pin) for p in params]
    param_host = [torch.empty(p.shape, dtype=p.dtype, **pin) for p in params]
    opt = torch.optim.AdamW(masters, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    setup = time.perf_counter() - t0
    log(f"  [c] fused CPU AdamW on f32 masters: setup {setup:.1f} s, torch threads {torch.get_num_threads()}")
    state = {"clip": 0.0}

    @torch.no_grad()
    def host_step():
        for p, gh in zip(params, grad_host):
            gh.copy_(p.grad, non_blocking=True)
            p.grad = None
        timer.sync()
        for m, gh in zip(masters, grad_host):
            m.grad.copy_(gh)
        if state["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(masters, state["clip"], foreach=True)
        opt.step()
        for p, m, ph in zip(params, masters, param_host):
            ph.copy_(m)
            p.copy_(ph, non_blocking=True)

    def step():
        with torch.enable_grad():
            loss = forward_backward(model, batch)
        host_step()
        return loss

    for clip in clips:
        state["clip"] = clip
        name = f"c_{'clip' if clip > 0 else 'noclip'}"
        times, window, losses = run_steps(name, step, args, timer)
        results[name] = summarise(name, times, window, losses, n_params, tokens, {"setup_s": round(setup, 2)})
    timer.sync()
    del opt, masters, grad_host, param_host
    gc.collect()


def mode_gpu_torch(model, batch, args, timer, clips, results, n_params, tokens):
    """(d): fused AdamW on the GPU (bf16 parameters and moments), clip_grad_norm_ with foreach."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                            fused=timer.cuda)
    state = {"clip": 0.0}

    def step():
        loss = forward_backward(model, batch)
        if state["clip"] > 0:
            torch.nn.utils.clip_grad_norm_(params, state["clip"], foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for clip in clips:
        state["clip"] = clip
        name = f"d_{'clip' if clip > 0 else 'noclip'}"
        times, window, losses = run_steps(name, step, args, timer)
        results[name] = summarise(name, times, window, losses, n_params, tokens)
    del opt
    gc.collect()


def mode_no_optimizer(model, batch, args, timer, results, n_params, tokens):
    def step():
        loss = forward_backward(model, batch)
        for p in model.parameters():
            p.grad = None
        return loss
    times, window, losses = run_steps("e", step, args, timer)
    results["e_fwd_bwd_only"] = summarise("e_fwd_bwd_only", times, window, losses, n_params, tokens)


def parse_cores(s):
    if s in (None, "", "none"):
        return None
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
    if s == "auto":  # leave two cores to the Python thread, the autograd thread and the driver
        return allowed[2:] if len(allowed) >= 8 else None
    out = []
    for part in s.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    model = ap.add_argument_group("model (default: TinyLlama-1.1B's shape)")
    model.add_argument("--layers", type=int, default=22, help="decoder layers (default 22)")
    model.add_argument("--hidden", type=int, default=2048, help="hidden size (default 2048)")
    model.add_argument("--inter", type=int, default=5632, help="MLP intermediate size (default 5632)")
    model.add_argument("--heads", type=int, default=32, help="attention heads (default 32)")
    model.add_argument("--kv-heads", type=int, default=4, help="key/value heads (default 4)")
    model.add_argument("--vocab", type=int, default=32000, help="vocabulary size (default 32000)")
    model.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false",
                       help="keep every activation instead of recomputing them in backward")
    run = ap.add_argument_group("runs")
    run.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    run.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    run.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    run.add_argument("--warmup", type=int, default=2, help="untimed steps before the timed ones (default 2)")
    run.add_argument("--modes", default="e,d,a,x,h,b,c",
                     help="comma list of the modes above, run in this order (default e,d,a,x,h,b,c)")
    run.add_argument("--clip-max-norm", type=float, default=1e-3,
                     help="max_grad_norm of the clipped runs (default 1e-3: tiny, so every step clips)")
    run.add_argument("--clipped-only", action="store_true",
                     help="run each mode with clipping only (default: without clipping, then with it)")
    run.add_argument("--lr", type=float, default=1e-5, help="learning rate of every optimizer (default 1e-5)")
    run.add_argument("--smoke", action="store_true",
                     help="a tiny model on the CPU (f32, host mode): exercises the code paths, no numbers")
    ours = ap.add_argument_group("our optimizer")
    ours.add_argument("--sub-group-numel", type=int, default=1 << 25,
                      help="elements per sub-group (default 33554432)")
    ours.add_argument("--gpu-fraction", default="0.33",
                      help="mode h: comma list of GPU-resident fractions, one run each (default 0.33)")
    ours.add_argument("--gpu-budget-gib", default=None,
                      help="mode x: GPU memory for the automatic split, GiB (default: 4 bytes per parameter)")
    ours.add_argument("--cores", default="auto",
                      help='session pool cores: "auto" (all but the first two), "none" (default pool), or a '
                           "list like 2-15")
    out = ap.add_argument_group("output")
    out.add_argument("--no-trace", dest="trace", action="store_false",
                     help="skip the traced extra step of each of our runs (trace_<run>.json and .png)")
    out.add_argument("--out", default=os.environ.get("OUT") or "bench-out",
                     help="output directory (default: $OUT, else bench-out)")
    refuse_renamed(ap, (("--no-clip-runs", "--clipped-only"), ("--clip", "--clip-max-norm"),
                        ("--no-ckpt", "--no-activation-checkpointing")))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.smoke:
        args.layers, args.hidden, args.inter, args.heads, args.kv_heads, args.vocab = 2, 64, 172, 4, 2, 256
        args.seq, args.batch, args.steps, args.warmup, args.sub_group_numel = 64, 4, 2, 1, 20000
        args.cores = "none"
    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("bench_e2e.py needs a CUDA GPU (use --smoke to exercise it on the CPU)")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    args.dtype = torch.bfloat16 if cuda else torch.float32
    args.cores = parse_cores(args.cores)
    timer = Timer(cuda)
    import superoffload
    t_begin = time.perf_counter()

    model = build_model(args, device)
    n_params = sum(p.numel() for p in model.parameters())
    tokens = args.seq * args.batch
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(device)
    clips = [args.clip_max_norm] if args.clipped_only else [0.0, args.clip_max_norm]
    header = {"device": torch.cuda.get_device_name(device) if cuda else "cpu (smoke)", "torch": torch.__version__,
              "superoffload": superoffload.__version__, "params": n_params,
              "tokens_per_step": tokens, "seq": args.seq, "batch": args.batch, "layers": args.layers,
              "hidden": args.hidden, "activation_checkpointing": args.activation_checkpointing, "session_cores": args.cores,
              "cpus": os.cpu_count(), "clip": args.clip_max_norm, "steps": args.steps, "warmup": args.warmup}
    log(json.dumps(header))
    results = {"config": header}

    t_adam, pool_info = cpu_adam_alone(n_params, args.sub_group_numel, args.cores, args.dtype)
    results["cpu_adam_alone_s"] = round(t_adam, 4)
    results["cpu_adam_pool"] = pool_info
    log(f"  CPU Adam alone (library kernel, {pool_info['threads']} threads, {pool_info['isa']}): {t_adam:.4f} s/step")

    modes = args.modes.split(",")
    for mname in modes:
        log(f"== mode {mname}")
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        if mname == "e":
            mode_no_optimizer(model, batch, args, timer, results, n_params, tokens)
        elif mname == "d":
            mode_gpu_torch(model, batch, args, timer, clips, results, n_params, tokens)
        elif mname in ("a", "s", "b"):
            speculation = {"a": "auto", "s": "on", "b": "off"}[mname]
            mode_ours(model, batch, args, timer, speculation, clips, results, n_params, tokens)
        elif mname == "h":
            if not cuda:
                log("  skipped: GPU-resident parameters need CUDA (not in --smoke)")
                continue
            for frac in (float(f) for f in args.gpu_fraction.split(",")):
                mode_ours(model, batch, args, timer, "auto", clips, results, n_params, tokens, gpu_fraction=frac)
        elif mname == "x":
            if not cuda:
                log("  skipped: the automatic split needs CUDA (not in --smoke)")
                continue
            budget = int(float(args.gpu_budget_gib) * 2**30) if args.gpu_budget_gib else 4 * n_params
            log(f"  GPU budget {budget / 2**30:.2f} GiB")
            mode_ours(model, batch, args, timer, "auto", clips, results, n_params, tokens, gpu_budget=budget)
        elif mname == "c":
            mode_cpu_torch(model, batch, args, timer, clips, results, n_params, tokens)
        else:
            sys.exit(f"unknown mode {mname}")
        if cuda:
            results.setdefault("gpu_peak_gib", {})[mname] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)

    # Hidden CPU Adam time and targets.
    s = {k: v["s_per_step"] for k, v in results.items() if isinstance(v, dict) and "s_per_step" in v}
    e = s.get("e_fwd_bwd_only")
    summary = {}
    ours_runs = [k for k in s if k[0] in "asbhx" and k.endswith("clip")]
    for k in ours_runs:
        if e:
            exposed = max(0.0, s[k] - e)
            summary[f"{k}_exposed_s"] = round(exposed, 4)
            t_cpu = t_adam * results[k].get("params", n_params) / n_params  # h: the offloaded share only
            summary[f"{k}_cpu_adam_hidden_fraction"] = round(max(0.0, 1 - exposed / t_cpu), 3)
    targets = {}
    # The README's targets: the 1.1B default model, and the 2.8B model (CPU Adam about as long
    # as a backward), where everything offloaded has less GPU time to hide behind.
    large = n_params > 2e9
    goal_a = {"noclip": "<= 1.15" if large else "<= 1.04", "clip": "report" if large else "<= 1.10"}
    goal_x = "<= 1.05" if large else "<= 1.02"
    for c in ("noclip", "clip"):
        if f"a_{c}" in s and f"d_{c}" in s:
            targets[f"a_over_d_{c}"] = (round(s[f"a_{c}"] / s[f"d_{c}"], 3), goal_a[c])
    for k in ours_runs:
        if k[0] in "sb" and f"d_{k.split('_')[1]}" in s:
            targets[f"{k}_over_d"] = (round(s[k] / s[f"d_{k.split('_')[1]}"], 3), "report")
        if k.startswith("x") and f"d_{k.split('_')[1]}" in s:
            targets[f"{k}_over_d"] = (round(s[k] / s[f"d_{k.split('_')[1]}"], 3), goal_x)
        if k.startswith("h") and f"d_{k.split('_')[1]}" in s:
            goal = "<= 1.15" if k.endswith("_clip") else "<= 1.10"
            targets[f"{k}_over_d"] = (round(s[k] / s[f"d_{k.split('_')[1]}"], 3), goal)
    for c in ("noclip", "clip"):
        if f"a_{c}" in s and f"c_{c}" in s:
            targets[f"c_over_a_{c}"] = (round(s[f"c_{c}"] / s[f"a_{c}"], 3), ">= 1.4")
    for k, (v, goal) in targets.items():
        if goal == "report":
            summary[k] = {"value": v}
            continue
        op, lim = goal.split()
        met = v <= float(lim) if op == "<=" else v >= float(lim)
        summary[k] = {"value": v, "target": goal, "met": met}
    results["summary"] = summary
    results["total_runtime_s"] = round(time.perf_counter() - t_begin, 1)
    log("== summary")
    for k, v in summary.items():
        log(f"  {k}: {v}")
    log(f"  total runtime {results['total_runtime_s']} s")
    with open(os.path.join(args.out, "bench_e2e.json"), "w") as f:
        json.dump(results, f, indent=1)
    log(f"wrote {os.path.join(args.out, 'bench_e2e.json')}")


if __name__ == "__main__":
    main()
