#!/usr/bin/env python3
"""GPU: ours against torch AdamW, torchao, DeepSpeed (ZeRO-3 offload, SuperOffload) and FSDP2 offload, one process each

Every system trains the same transformers Llama (built from a config, no download; bf16,
activation checkpointing) on the same random tokens (fixed seed) with the same hyperparameters
(AdamW, lr 1e-5, betas 0.9/0.95, eps 1e-8, weight decay 0.1), in a process of its own (this
script with --worker), without clipping and with clipping on every step (max_grad_norm tiny):

  torch-gpu-adamw      torch.optim.AdamW(fused=True) on the GPU, bf16 parameters and moments
                       (the baseline "d": every ratio is to its uncapped row)
  ours                 SuperOffloadAdamW(model.parameters(), model=model, max_grad_norm=...),
                       the package's defaults
  ours-offload-all     ours, gpu_budget_bytes=0: everything offloaded
  ours-spec-off        ours, speculation="off", everything offloaded
  ours-defaults-spec-off  ours, the defaults but speculation="off" (GPU-resident sub-groups
                       stepped after the decision rather than during backward)
  ours-bf16-moments    ours, moment_dtype="bf16", everything offloaded
  ours-budget-auto     ours, gpu_budget="auto" (under --mem-cap-gib: gpu_budget_bytes = the cap
                       less one step's peak and 1 GiB, as the automatic budget reads the GPU's
                       free memory, which torch's per-process cap does not lower)
  torchao-offload      torchao.optim.CPUOffloadOptimizer(params, torch.optim.AdamW): bf16
                       parameters and moments on the CPU, fused CPU AdamW after backward; it does
                       not clip, so the clipped run scales the host gradients in a step pre-hook
                       of each per-parameter optimizer by the norm of the GPU gradients
  torchao-offload-grads  the same with offload_gradients=True (its memory mode: no gradient
                       stays on the GPU, so nothing clips; its clipped rows say so)
  ds-zero3-offload     DeepSpeed ZeRO-3, offload_optimizer {device: cpu, pin_memory: true}, AdamW
                       (DeepSpeedCPUAdam), top-level gradient_clipping
  torch-fsdp2-offload  FSDP2 fully_shard per decoder layer and at the root, with
                       CPUOffloadPolicy and MixedPrecisionPolicy(bf16 params): fused CPU AdamW on
                       f32 masters after backward, clip_grad_norm_ on the CPU
  torch-fsdp2-gpu-adamw  FSDP2 as above on bf16 parameters, no offload: torch AdamW(fused) on the
                       GPU shards (the baseline of --ranks above 1)
  ours-fsdp2           FSDP2 as above on bf16 parameters, SuperOffloadAdamW's defaults stepping
                       each rank's shards on that rank's share of the cores
  ds-superoffload      DeepSpeed ZeRO-3 + offload_optimizer.super_offload, as DeepSpeed's
                       SuperOffload examples configure it (ratio 0.9, cpuadam_cores_perc 0.9,
                       sub_group_size = reduce_bucket_size = 4e8, overlap_comm off)

Models: 1.1b (TinyLlama's shape: 22 x 2048, intermediate 5632, 32 heads, 4 KV heads, batch 16 x
seq 2048 = 32K tokens a step), 2.8b (26 x 3072, intermediate 8192, 24 heads, 8 KV heads, batch 8
x 2048 = 16K tokens), and for capacity 7b (Llama-2-7B's shape: 32 x 4096, intermediate 11008),
8b (Llama-3-8B's: 32 x 4096, intermediate 14336, 8 KV heads, a 128K vocabulary), 10b (48 x
4096) and 13b (Llama-2-13B's: 40 x 5120, intermediate 13824), each batch 8 x 2048 (--batch
overrides it); tiny (2 x 64, for --device cpu: the harness, no numbers). Models are built in
bf16 on the GPU directly (no f32 copy at init).

--ranks N (N > 1; the three FSDP2 systems only) starts every worker as N processes, one per GPU
(NCCL; gloo with --device cpu), each on its own data: the tables then hold N times the tokens a
step, and their baseline is torch-fsdp2-gpu-adamw with as many ranks.

Per row: the median s/step of --steps timed steps after --warmup, its ratio to the uncapped
baseline row of the same model, clipping and ranks, model TFLOPS ((6 N + 12 layers hidden seq)
tokens / s, recomputation not counted), GPU memory as torch's peak (allocated) plus the device
bytes our session holds outside torch's allocator (metrics()["device_bytes"]; 0 for the others,
whose GPU memory is all torch's; the largest of the ranks), the worker's peak host RSS (and per
parameter), rank 0's loss after the last step, and the error of a failed run (a worker the
kernel kills for host memory is a row too). With --mem-cap-gib each worker first calls
torch.cuda.set_per_process_memory_fraction, and ours, once its session has provisioned, lowers
that fraction by the session's device bytes, so that torch's allocations and the session's
share the cap; an out-of-memory error is a result (status oom), not a crash. With several
models, peers.md ends with the capacity table: per system and cap, the largest model that ran.
A system that errs or times out is not run again for the later models and caps
(--retry-failed runs it anyway).

The clipped run follows the unclipped one in the same process (DeepSpeed: its ZeRO optimizer's
clip_grad, which gradient_clipping sets, is switched between the runs). Before the timed steps:
ours with an automatic split steps until the split has settled, and ours with speculation auto
takes the steps after which it stops speculating on clipped steps (bench_e2e.py's constants);
--no-settle times the steps right after --warmup instead (how soon the defaults settle).

Workers run in the order the targets need them: the baselines, ours everything offloaded, ours
with the automatic budget, torchao, ours with speculation off, ours' defaults, bf16 moments,
DeepSpeed ZeRO-3, FSDP2, SuperOffload; each system for every model and cap in turn. --budget-s
(default 480 s) starts no worker after that and leaves 'skipped' rows: a second command with
--systems for the rest and --baseline (the first run's peers.json, for its torch-gpu-adamw rows)
completes the tables.

  python3 bench/peers.py                                   # both models, every system (see --budget-s)
  python3 bench/peers.py --systems ds-zero3-offload,torch-fsdp2-offload --baseline first/peers.json
  python3 bench/peers.py --models 2.8b --mem-cap-gib 24,48 \\
      --systems torch-gpu-adamw,ours-offload-all,ours-budget-auto,torchao-offload,ds-zero3-offload
  python3 bench/peers.py --models 2.8b --ranks 2 --systems torch-fsdp2-gpu-adamw,ours-fsdp2
  python3 bench/peers.py --device cpu --models tiny --systems torch-gpu-adamw,ours   # CPU dry run
  python3 bench/peers.py --device cpu --models tiny --ranks 2 --systems torch-fsdp2-gpu-adamw,ours-fsdp2

Writes peers.json, peers.md (one table per model and cap) and peers.log (every worker's output)
to --out (default $OUT/peers, else bench-out/peers), after every worker, and prints the tables.
Needs torch, transformers and the superoffload package; torchao and DeepSpeed for their rows
(bench/peers_setup.sh installs them from carried wheels on the GPU machine).
"""
import argparse
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
E2E_DIR = os.path.join(HERE, "..", "examples", "torch_optimizer")

MODELS = {
    "1.1b": dict(layers=22, hidden=2048, inter=5632, heads=32, kv_heads=4, vocab=32000, seq=2048, batch=16),
    "2.8b": dict(layers=26, hidden=3072, inter=8192, heads=24, kv_heads=8, vocab=32000, seq=2048, batch=8),
    # Llama-2-7B's shape.
    "7b": dict(layers=32, hidden=4096, inter=11008, heads=32, kv_heads=32, vocab=32000, seq=2048, batch=8),
    # Llama-3-8B's shape: its 128K vocabulary and 8 KV heads.
    "8b": dict(layers=32, hidden=4096, inter=14336, heads=32, kv_heads=8, vocab=128256, seq=2048, batch=8),
    # Llama-2-7B's layers, 48 of them.
    "10b": dict(layers=48, hidden=4096, inter=11008, heads=32, kv_heads=32, vocab=32000, seq=2048, batch=8),
    # Llama-2-13B's shape.
    "13b": dict(layers=40, hidden=5120, inter=13824, heads=40, kv_heads=40, vocab=32000, seq=2048, batch=8),
    "tiny": dict(layers=2, hidden=64, inter=172, heads=4, kv_heads=2, vocab=256, seq=64, batch=4),
}
HPARAMS = dict(lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
GIB = 1 << 30
# Left free within a memory cap when our budget is derived from it.
CAP_HEADROOM_BYTES = GIB


def log(*a):
    print(*a, flush=True)


class Unsupported(Exception):
    """A setting the system cannot run (its row says why; the worker goes on)."""


def model_flops_per_token(spec, params):
    """Model FLOPs per token of a training step: 6 N plus the attention's 12 layers hidden seq
    (recomputation not counted)."""
    return 6 * params + 12 * spec["layers"] * spec["hidden"] * spec["seq"]


def is_oom(exc):
    text = str(exc).lower()
    # torch's allocator, CUDA's runtime ("out of memory") and driver (CUDA_ERROR_OUT_OF_MEMORY).
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in text or "out_of_memory" in text


# ---------------------------------------------------------------------------------------------
# Worker: one system, one model, one cap; the clip settings in turn
# ---------------------------------------------------------------------------------------------


class Context:
    """What every system shares: the model's shape, the device, the batch, the cap, the ranks."""

    def __init__(self, args):
        import bench_e2e
        self.e2e = bench_e2e
        self.spec = dict(MODELS[args.model], **({"batch": args.batch} if args.batch else {}))
        self.cuda = args.device == "cuda"
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        if self.cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.cap_bytes = int(args.cap_gib * GIB) if args.cap_gib else 0
        self.clips = args.clips
        self.settle = not args.no_settle
        # Data parallel: each rank its own tokens.
        generator = torch.Generator().manual_seed(self.rank)
        shape = (self.spec["batch"], self.spec["seq"])
        self.batch = torch.randint(0, self.spec["vocab"], shape, generator=generator).to(self.device)

    def build_model(self, dtype=None):
        shape = argparse.Namespace(**self.spec, dtype=dtype or self.dtype, activation_checkpointing=True)
        return self.e2e.build_model(shape, self.device)

    def init_distributed(self):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.cuda else "gloo")

    def fully_shard(self, model, **policies):
        """FSDP2 over every rank: each decoder layer, then the root."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        self.init_distributed()
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, **policies)
        fully_shard(model, mesh=mesh, **policies)
        return model

    def largest_of_ranks(self, value):
        if self.world == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def budget_within_cap(self, model):
        """The cap less the peak of one forward and backward without an optimizer, less a headroom."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self.e2e.forward_backward(model, self.batch)
        for p in model.parameters():
            p.grad = None
        peak = torch.cuda.max_memory_allocated(self.device)
        return max(0, self.cap_bytes - peak - CAP_HEADROOM_BYTES)


class Trainer:
    """One system's training loop on the shared model and batch."""

    def __init__(self, ctx):
        self.ctx = ctx
        self.max_norm = 0.0
        self.config = {}
        self.steps_taken = 0

    def set_clip(self, max_norm):
        self.max_norm = max_norm

    def before_phase(self, first):
        """Steps that the measurement must not include (a policy or placement settling)."""

    def device_bytes(self):
        """GPU memory held outside torch's allocator."""
        return 0

    def parameter_count(self):
        return sum(p.numel() for p in self.model.parameters())

    def step(self):
        """Forward, backward and the optimizer step; returns the loss."""
        self.steps_taken += 1
        return self.train_step()

    def train_step(self):
        raise NotImplementedError

    def close(self):
        pass


class TorchGpuAdamW(Trainer):
    def __init__(self, ctx, sharded=False):
        super().__init__(ctx)
        self.model = ctx.build_model()
        if sharded:
            ctx.fully_shard(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, fused=True, **HPARAMS)
        self.config = {"optimizer": "torch.optim.AdamW(fused=True)", "state": str(ctx.dtype),
                       "fsdp2_ranks": ctx.world if sharded else None}

    def train_step(self):
        loss = self.ctx.e2e.forward_backward(self.model, self.ctx.batch)
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class Ours(Trainer):
    def __init__(self, ctx, options, sharded=False):
        from superoffload.torch import SuperOffloadAdamW
        super().__init__(ctx)
        self.model = ctx.build_model()
        if sharded:
            ctx.fully_shard(self.model)
        options = dict(options)
        if ctx.cap_bytes and options.get("gpu_budget") == "auto":
            del options["gpu_budget"]
            options["gpu_budget_bytes"] = ctx.budget_within_cap(self.model)
        self.max_norm = ctx.clips[0]
        self.opt = SuperOffloadAdamW(self.model.parameters(), model=self.model, max_grad_norm=self.max_norm,
                                     **HPARAMS, **options)
        # An explicit zero budget offloads everything; any other may place sub-groups on the GPU
        # after a few measured steps.
        self.splits = options.get("gpu_budget_bytes") != 0
        self.speculation_auto = options.get("speculation", "auto") == "auto"
        self.config = {**options, "subgroups": len(self.opt.subgroups()), "cores": self.opt.cores}

    def set_clip(self, max_norm):
        self.max_norm = max_norm
        self.opt.max_grad_norm = max_norm

    def before_phase(self, first):
        settle = self.ctx.settle
        if settle and first and self.splits:
            self.config["split_settled_after_steps"] = self.ctx.e2e.settle_split(self.opt, self.step)
        elif settle and not first and self.speculation_auto:
            for _ in range(self.ctx.e2e.AUTO_POLICY_TURN):
                self.step()
        if first and self.ctx.cap_bytes:
            # The session provisioned at its first step: torch's allocator gets what its device
            # memory leaves of the cap.
            if not self.steps_taken:
                self.step()
            total = torch.cuda.get_device_properties(self.ctx.device).total_memory
            left = max(0, self.ctx.cap_bytes - self.device_bytes())
            torch.cuda.set_per_process_memory_fraction(left / total, self.ctx.device)
        if first:
            self.config["memory"] = {k: v for k, v in self.opt.memory().items() if k != "params"}

    def device_bytes(self):
        return self.opt.metrics()["device_bytes"]

    def train_step(self):
        loss = self.ctx.e2e.forward_backward(self.model, self.ctx.batch)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def close(self):
        self.opt.close()


class TorchaoOffload(Trainer):
    def __init__(self, ctx, offload_gradients=False):
        import torchao
        from torchao.optim import CPUOffloadOptimizer
        super().__init__(ctx)
        self.model = ctx.build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.offload_gradients = offload_gradients
        self.opt = CPUOffloadOptimizer(self.params, torch.optim.AdamW, offload_gradients=offload_gradients,
                                       **HPARAMS)
        self.host_grad_scale = 1.0
        for host_opt in self.opt.optim_dict.values():
            host_opt.register_step_pre_hook(self._scale_host_grads)
        # Parameters below its minimal size stay on the GPU, stepped there by its d_opt.
        self.gpu_params = [p for group in self.opt.d_param_groups for p in group["params"]]
        self.config = {"torchao": torchao.__version__, "offloaded_tensors": len(self.opt.optim_dict),
                       "gpu_tensors": len(self.gpu_params), "offload_gradients": offload_gradients}

    def set_clip(self, max_norm):
        if max_norm and self.offload_gradients:
            raise Unsupported("offload_gradients=True leaves no gradient on the GPU to take the norm of, and "
                              "CPUOffloadOptimizer does not clip")
        self.max_norm = max_norm

    def _scale_host_grads(self, host_opt, args, kwargs):
        if self.host_grad_scale < 1.0:
            for group in host_opt.param_groups:
                for p in group["params"]:
                    p.grad.mul_(self.host_grad_scale)

    def train_step(self):
        loss = self.ctx.e2e.forward_backward(self.model, self.ctx.batch)
        if self.max_norm:
            # The host gradients were copied during backward: the GPU ones give the norm, the
            # pre-hook scales the host copies as each per-parameter optimizer steps.
            grads = [p.grad for p in self.params if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads, foreach=True)
            torch.nn.utils.clip_grads_with_norm_(self.gpu_params, self.max_norm, norm, foreach=True)
            self.host_grad_scale = min(1.0, self.max_norm / (float(norm) + 1e-6))
        else:
            self.host_grad_scale = 1.0
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class DeepSpeedZero3(Trainer):
    def __init__(self, ctx, super_offload):
        import deepspeed
        super().__init__(ctx)
        model = ctx.build_model()
        offload = {"device": "cpu", "pin_memory": True}
        zero = {"stage": 3, "offload_optimizer": offload}
        if super_offload:
            offload.update(super_offload=True, ratio=0.9, cpuadam_cores_perc=0.9)
            zero.update(overlap_comm=False, sub_group_size=400_000_000, reduce_bucket_size=400_000_000)
        self.max_norm = ctx.clips[0]
        ds_config = {
            "train_micro_batch_size_per_gpu": ctx.spec["batch"],
            "gradient_accumulation_steps": 1,
            "gradient_clipping": self.max_norm,
            "bf16": {"enabled": ctx.dtype == torch.bfloat16},
            "optimizer": {"type": "AdamW", "params": {**HPARAMS, "betas": list(HPARAMS["betas"])}},
            "zero_optimization": zero,
            "steps_per_print": 1 << 30,
        }
        deepspeed.init_distributed(dist_backend="nccl" if ctx.cuda else "gloo")
        self.engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        self.model = self.engine.module
        self.config = {"deepspeed": deepspeed.__version__, "zero_optimization": zero,
                       "zero_optimizer": type(self.engine.optimizer).__name__}

    def parameter_count(self):
        # ZeRO-3 partitions the parameters: their full sizes are ds_numel.
        return sum(p.ds_numel for p in self.model.parameters())

    def set_clip(self, max_norm):
        # DeepSpeed reads gradient_clipping once, into its ZeRO-3 optimizer's clip_grad, which
        # step() (and SuperOffload's choice to step during backward) reads each step.
        self.max_norm = max_norm
        self.engine.optimizer.clip_grad = max_norm

    def train_step(self):
        loss = self.engine(input_ids=self.ctx.batch, labels=self.ctx.batch).loss
        self.engine.backward(loss)
        self.engine.step()
        return loss.detach()

    def close(self):
        self.engine.destroy()


class Fsdp2CpuOffload(Trainer):
    def __init__(self, ctx):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        super().__init__(ctx)
        self.model = ctx.fully_shard(ctx.build_model(dtype=torch.float32),
                                     mp_policy=MixedPrecisionPolicy(param_dtype=ctx.dtype, reduce_dtype=torch.float32),
                                     offload_policy=CPUOffloadPolicy(pin_memory=ctx.cuda))
        self.opt = torch.optim.AdamW(self.model.parameters(), fused=True, **HPARAMS)
        self.config = {"masters": "f32 on the CPU", "compute": str(ctx.dtype),
                       "optimizer": "torch.optim.AdamW(fused=True) on the CPU"}

    def train_step(self):
        loss = self.ctx.e2e.forward_backward(self.model, self.ctx.batch)
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

OFFLOAD_ALL = {"gpu_budget_bytes": 0}
# name: (label, constructor(ctx)), in the order of the tables.
SYSTEMS = {
    "torch-gpu-adamw": ("torch AdamW(fused) on the GPU, bf16 state", TorchGpuAdamW),
    "ours": ("ours, defaults", lambda ctx: Ours(ctx, {})),
    "ours-offload-all": ("ours, everything offloaded", lambda ctx: Ours(ctx, OFFLOAD_ALL)),
    "ours-spec-off": ('ours, speculation "off", everything offloaded',
                      lambda ctx: Ours(ctx, {"speculation": "off", **OFFLOAD_ALL})),
    "ours-defaults-spec-off": ('ours, defaults, speculation "off"', lambda ctx: Ours(ctx, {"speculation": "off"})),
    "ours-bf16-moments": ('ours, moment_dtype "bf16", everything offloaded',
                          lambda ctx: Ours(ctx, {"moment_dtype": "bf16", **OFFLOAD_ALL})),
    "ours-budget-auto": ('ours, gpu_budget "auto"', lambda ctx: Ours(ctx, {"gpu_budget": "auto"})),
    "torchao-offload": ("torchao CPUOffloadOptimizer (AdamW)", TorchaoOffload),
    "torchao-offload-grads": ("torchao CPUOffloadOptimizer (AdamW), offload_gradients",
                              lambda ctx: TorchaoOffload(ctx, offload_gradients=True)),
    "ds-zero3-offload": ("DeepSpeed ZeRO-3, offload_optimizer cpu", lambda ctx: DeepSpeedZero3(ctx, False)),
    "torch-fsdp2-offload": ("torch FSDP2 CPUOffloadPolicy", Fsdp2CpuOffload),
    "ds-superoffload": ("DeepSpeed ZeRO-3 + SuperOffload", lambda ctx: DeepSpeedZero3(ctx, True)),
    "torch-fsdp2-gpu-adamw": ("torch FSDP2, AdamW(fused) on the GPU", lambda ctx: TorchGpuAdamW(ctx, sharded=True)),
    "ours-fsdp2": ("ours under FSDP2, defaults", lambda ctx: Ours(ctx, {}, sharded=True)),
}
# The systems that run on more than one rank.
FSDP2_SYSTEMS = ["torch-fsdp2-gpu-adamw", "ours-fsdp2", "torch-fsdp2-offload"]


def baseline_of(ranks):
    """The system every ratio of a table with this many ranks is to."""
    return "torch-gpu-adamw" if ranks == 1 else "torch-fsdp2-gpu-adamw"


# The order of the runs: the rows that the targets need first, so that what --budget-s leaves out
# matters least ("ours" repeats one of the two before it, whichever the package's default is).
RUN_ORDER = ["torch-gpu-adamw", "torch-fsdp2-gpu-adamw", "ours-offload-all", "ours-fsdp2", "ours-budget-auto",
             "torchao-offload", "torchao-offload-grads", "ours-spec-off", "ours", "ours-defaults-spec-off", "ours-bf16-moments",
             "ds-zero3-offload", "torch-fsdp2-offload", "ds-superoffload"]


def error_text(exc):
    return f"{type(exc).__name__}: {exc}".strip()[:2000]


def package_versions():
    versions = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("transformers", "superoffload", "torchao", "deepspeed"):
        module = sys.modules.get(name)
        if module is not None:
            versions[name] = getattr(module, "__version__", "?")
    return versions


def worker_main(args):
    sys.path.insert(0, E2E_DIR)
    ctx = Context(args)
    if ctx.cuda and ctx.cap_bytes:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, ctx.cap_bytes / total), ctx.device)
    timer = ctx.e2e.Timer(ctx.cuda)
    spec = ctx.spec
    rows = [{"clip": clip, "status": "not run"} for clip in ctx.clips]

    # Rank 0's rows are the result; another rank's tell the runner why it failed.
    result = args.result if ctx.rank == 0 else f"{args.result}.rank{ctx.rank}"

    def save():
        tmp = result + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f)
        os.replace(tmp, result)

    def fail(first_index, exc):
        status = "oom" if is_oom(exc) else "error"
        for row in rows[first_index:]:
            row.update(status=status, error=error_text(exc))
        log(traceback.format_exc())
        save()

    t0 = time.perf_counter()
    try:
        trainer = SYSTEMS[args.worker][1](ctx)
    except Exception as exc:
        fail(0, exc)
        return 1
    setup_s = time.perf_counter() - t0
    n_params = trainer.parameter_count()
    log(f"[{args.worker}] set up in {setup_s:.1f} s: {n_params / 1e9:.3f} B parameters, {trainer.config}")
    steps = argparse.Namespace(steps=args.steps, warmup=args.warmup)
    failed = False
    first = True
    for i, clip in enumerate(ctx.clips):
        try:
            trainer.set_clip(clip)
        except Unsupported as exc:
            rows[i].update(status="unsupported", error=str(exc))
            continue
        try:
            trainer.before_phase(first=first)
            first = False
            if ctx.cuda:
                torch.cuda.synchronize(ctx.device)
                torch.cuda.reset_peak_memory_stats(ctx.device)
            times, _, losses = ctx.e2e.run_steps(args.worker, trainer.step, steps, timer)
            session_bytes = ctx.largest_of_ranks(trainer.device_bytes())
            torch_peak = ctx.largest_of_ranks(torch.cuda.max_memory_allocated(ctx.device) if ctx.cuda else 0)
        except Exception as exc:
            fail(i, exc)
            failed = True
            break
        median = statistics.median(times)
        tokens = spec["batch"] * spec["seq"] * ctx.world
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        rows[i].update(
            status="ok", s_per_step=median, s_per_step_all=times, loss=losses[-1],
            tflops=model_flops_per_token(spec, n_params) * tokens / median / 1e12,
            torch_peak_gib=torch_peak / GIB, session_device_gib=session_bytes / GIB,
            gpu_gib=(torch_peak + session_bytes) / GIB, host_rss_peak_gib=rss / GIB,
            host_bytes_per_param=rss / n_params, steps_taken=trainer.steps_taken, setup_s=setup_s,
            config=dict(trainer.config))
        log(f"[{args.worker}] clip {clip:g}: {rows[i]['s_per_step']:.4f} s/step (steps "
            f"{', '.join(f'{t:.3f}' for t in times)}), loss {losses[-1]:.4f}, GPU {rows[i]['gpu_gib']:.2f} GiB, "
            f"{rows[i]['tflops']:.0f} TFLOPS, host RSS peak {rows[i]['host_rss_peak_gib']:.1f} GiB")
        save()
    for row in rows:
        row.update(params=n_params, tokens_per_step=spec["batch"] * spec["seq"] * ctx.world, ranks=ctx.world,
                   batch=spec["batch"],
                   versions=package_versions(),
                   device_name=torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu")
    save()
    if failed and ctx.world > 1:
        # At once and non-zero: the runner then stops the other ranks, which may wait in a
        # collective (as would this rank's own clean-up).
        return 1
    trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Runner: the workers in turn, results as JSON and Markdown
# ---------------------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_worker(job, args, workdir, log_file, seconds):
    """Runs one worker (a process per rank); returns its rows (one per clip), failures included."""
    system, model, cap, clips = job
    ranks = args.ranks
    result = os.path.join(workdir, "result.json")
    results = [result] + [f"{result}.rank{r}" for r in range(1, ranks)]
    outputs = [os.path.join(workdir, f"worker.rank{r}.log") for r in range(ranks)]
    for path in results + outputs:
        if os.path.exists(path):
            os.remove(path)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system, "--model", model,
           "--cap-gib", str(cap or 0), "--clips", ",".join(repr(c) for c in clips), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--device", args.device, "--result", result,
           *(["--batch", str(args.batch)] if args.batch else []), *(["--no-settle"] if args.no_settle else [])]
    # The ranks of one process group on this host (a group of one for DeepSpeed and FSDP2).
    env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
    t0 = time.perf_counter()
    procs = []
    for r in range(ranks):
        with open(outputs[r], "w") as out:
            # Its own process group, so that stopping it also ends what it started (DeepSpeed's
            # CPU-optimizer process).
            procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                          env=dict(env, RANK=str(r), LOCAL_RANK=str(r))))
    # A rank that fails leaves the others waiting in a collective: stop them all. The first to
    # fail has the reason.
    timed_out = False
    failed_rank = None
    while any(p.poll() is None for p in procs):
        failed_rank = next((r for r, p in enumerate(procs) if p.poll()), None)
        if failed_rank is not None:
            break
        if time.perf_counter() - t0 > seconds:
            timed_out = True
            break
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            stop_group(p)
    wall = time.perf_counter() - t0
    texts = []
    for path in outputs:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    codes = [p.returncode for p in procs]
    for r, text in enumerate(texts):
        log_file.write(f"\n===== {system} {model} cap {cap or 'none'} clips {clips}"
                       + (f" rank {r} of {ranks}" if ranks > 1 else "")
                       + f": exit {codes[r]}, {wall:.1f} s{' (timed out)' if timed_out else ''}\n{text}")
    log_file.flush()
    def rows_of(rank):
        if not os.path.exists(results[rank]):
            return {}
        with open(results[rank]) as f:
            return {row["clip"]: row for row in json.load(f)}
    # Rank 0's rows, with the errors of the first rank that failed.
    failed_rank = failed_rank if failed_rank is not None else next((r for r, c in enumerate(codes) if c), 0)
    by_clip = rows_of(0)
    by_clip.update({clip: row for clip, row in rows_of(failed_rank).items() if row["status"] not in ("ok", "not run")})
    tail = "\n".join(texts[failed_rank].strip().splitlines()[-15:])[-1500:]
    out_rows = []
    for clip in clips:
        row = by_clip.get(clip, {"clip": clip, "status": "not run"})
        if row["status"] == "not run":
            rank = f"rank {failed_rank}'s " if ranks > 1 else "its "
            if timed_out:
                why = "at the end of --budget-s" if seconds < args.timeout_s else f"after {seconds:.0f} s"
                row.update(status="timeout", error=f"worker stopped {why}; {rank}output ended:\n{tail}")
            elif codes[failed_rank] == -signal.SIGKILL:
                row.update(status="killed",
                           error=f"{rank}process was killed (SIGKILL: the kernel's out-of-memory killer, if the host "
                                 f"ran out of memory); its output ended:\n{tail}")
            else:
                row.update(status="crash",
                           error=f"worker exited with {codes[failed_rank]}; {rank}output ended:\n{tail}")
        row.update(system=system, model=model, cap_gib=cap, ranks=ranks, worker_s=round(wall, 1))
        out_rows.append(row)
    return out_rows


def stop_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def plan(systems, models, caps, clips, have_baseline, ranks):
    """(system, model, cap, clips) per worker, in RUN_ORDER, each worker running the clip settings
    in turn; the uncapped baseline of every model first, unless given."""
    jobs = [] if have_baseline else [(baseline_of(ranks), model, None, clips) for model in models]
    for system in sorted(systems, key=RUN_ORDER.index):
        for model in models:
            for cap in caps:
                if (system, model, cap, clips) not in jobs:
                    jobs.append((system, model, cap, clips))
    return jobs


def load_baseline(path, models, clips, ranks):
    """The uncapped baseline rows of an earlier run's peers.json, one per model and clip."""
    baseline = baseline_of(ranks)
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r["system"] == baseline and r["cap_gib"] is None
                and r.get("ranks", 1) == ranks and r["status"] == "ok" and r["model"] in models and r["clip"] in clips]
    missing = sorted({(m, c) for m in models for c in clips} - {(r["model"], r["clip"]) for r in rows})
    if missing:
        sys.exit(f"peers.py: {path} has no {baseline} row with {ranks} rank(s) for {missing} (model, clip) uncapped")
    for r in rows:
        r["note"] = f"from {path}"
    return rows


def baseline_rows(rows):
    return {(r["model"], r["clip"], r.get("ranks", 1)): r for r in rows
            if r["system"] == baseline_of(r.get("ranks", 1)) and r["cap_gib"] is None and r["status"] == "ok"}


def write_outputs(args, header, rows):
    base = baseline_rows(rows)
    for row in rows:
        ref = base.get((row["model"], row["clip"], row.get("ranks", 1)))
        row["ratio_to_gpu_adamw"] = row["s_per_step"] / ref["s_per_step"] if ref and row["status"] == "ok" else None
    with open(os.path.join(args.out, "peers.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    text = markdown(header, rows)
    with open(os.path.join(args.out, "peers.md"), "w") as f:
        f.write(text)
    return text


def fmt(x, digits):
    return "—" if x is None else f"{x:.{digits}f}"


def markdown(header, rows):
    machine = [header["device_name"], f"{header['cpus']} CPUs", f"/dev/shm {header['dev_shm_gib']} GiB",
               ", ".join(f"{k} {v}" for k, v in header["versions"].items()),
               f"{header['warmup']} warm-up + {header['steps']} timed steps, median"
               + ("" if header.get("settle", True) else ", no settling"),
               f"clip every step: max_grad_norm {header['clip_max_norm']:g}"]
    out = [f"# Peers: {header['started']}", "", "; ".join(m for m in machine if m) + ".", ""]
    order = list(SYSTEMS)
    groups = []
    for row in rows:
        key = (row["model"], row["cap_gib"], row.get("ranks", 1))
        if key not in groups:
            groups.append(key)
    for model, cap, ranks in sorted(groups, key=lambda k: (list(MODELS).index(k[0]), k[2], k[1] or 0)):
        group = sorted((r for r in rows if (r["model"], r["cap_gib"], r.get("ranks", 1)) == (model, cap, ranks)),
                       key=lambda r: (order.index(r["system"]), r["clip"]))
        spec = MODELS[model]
        params = next((r["params"] for r in group if r.get("params")), None)
        tokens = next((r["tokens_per_step"] for r in group if r.get("tokens_per_step")), None)
        size = (f"{params / 1e9:.2f} B parameters, " if params >= 1e9 else f"{params / 1e6:.2f} M parameters, "
                ) if params else ""
        on_ranks = f"{ranks} ranks of FSDP2, " if ranks > 1 else ""
        out += [f"## {model}: {spec['layers']} x {spec['hidden']}, {size}{on_ranks}"
                + (f"{tokens} tokens a step; " if tokens else "")
                + (f"memory cap {cap:g} GiB" if cap else "no memory cap"), "",
                "| system | clip | s/step | × GPU AdamW | TFLOPS | GPU GiB (torch peak + session) "
                "| host RSS GiB (B/param) | loss (steps) | status, note |",
                "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in group:
            out.append(row_markdown(r, cap))
        out.append("")
    out += capacity_markdown(rows)
    return "\n".join(out)


def row_markdown(r, cap):
    ok = r["status"] == "ok"
    note = r["status"] if not ok else ""
    if r.get("error"):
        note += ": " + " ".join(r["error"].split())[:300].replace("|", "\\|")
    if r.get("note"):
        note = r["note"]
    if ok and cap and r["gpu_gib"] > cap:
        note = "above the cap"
    gpu = (f"{r['gpu_gib']:.2f}" + (f" ({r['torch_peak_gib']:.2f} + {r['session_device_gib']:.2f})"
                                      if r["session_device_gib"] else "")) if ok else "—"
    host = f"{r['host_rss_peak_gib']:.1f} ({r['host_bytes_per_param']:.1f})" if ok and "host_rss_peak_gib" in r else "—"
    loss = f"{r['loss']:.4f} ({r['steps_taken']})" if ok else "—"
    return (f"| {SYSTEMS[r['system']][0]} | {'every step' if r['clip'] else 'none'} | "
            f"{fmt(r.get('s_per_step'), 3)} | {fmt(r.get('ratio_to_gpu_adamw'), 3)} | {fmt(r.get('tflops'), 0)} | "
            f"{gpu} | {host} | {loss} | {note} |")


def capacity_markdown(rows):
    """Per system, cap and clip setting: the largest model that ran (within the cap), with its
    figures; nothing with fewer than two models."""
    models = sorted({r["model"] for r in rows}, key=list(MODELS).index)
    if len(models) < 2:
        return []
    out = ["## Capacity: the largest model each system trained", "",
           "| system | cap | clip | largest model | s/step | TFLOPS | GPU GiB | host RSS GiB (B/param) | larger: why not |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    keys = sorted({(r["system"], r["cap_gib"] or 0, r["clip"]) for r in rows},
                  key=lambda k: (list(SYSTEMS).index(k[0]), k[1], k[2]))
    for system, cap, clip in keys:
        mine = {r["model"]: r for r in rows if (r["system"], r["cap_gib"] or 0, r["clip"]) == (system, cap, clip)}
        fits = [m for m in models if m in mine and mine[m]["status"] == "ok"
                and not (cap and mine[m]["gpu_gib"] > cap)]
        best = mine[fits[-1]] if fits else None
        larger = [m for m in models if m in mine and (not fits or models.index(m) > models.index(fits[-1]))]
        why = "; ".join(f"{m}: {mine[m]['status']}" for m in larger) or "—"
        figures = (f"{fmt(best['s_per_step'], 3)} | {fmt(best['tflops'], 0)} | {best['gpu_gib']:.2f} | "
                   f"{best['host_rss_peak_gib']:.1f} ({best['host_bytes_per_param']:.1f})") if best else "— | — | — | —"
        out.append(f"| {SYSTEMS[system][0]} | {f'{cap:g} GiB' if cap else 'none'} | "
                   f"{'every step' if clip else 'none'} | {fits[-1] if fits else 'none'} | {figures} | {why} |")
    out.append("")
    return out


def host_header(args):
    def gib(path):
        try:
            return round(shutil.disk_usage(path).total / GIB, 1)
        except OSError:
            return None
    return {"started": datetime.datetime.now().isoformat(timespec="seconds"), "cpus": os.cpu_count(),
            "dev_shm_gib": gib("/dev/shm"), "models": args.models, "systems": args.systems,
            "caps_gib": args.mem_cap_gib, "ranks": args.ranks, "clip": args.clip, "clip_max_norm": args.clip_max_norm,
            "steps": args.steps, "warmup": args.warmup, "settle": not args.no_settle, "device": args.device, "timeout_s": args.timeout_s,
            "device_name": "?", "versions": {}}


def note_machine(header, row):
    if row.get("device_name"):
        header["device_name"] = row["device_name"]
        header["versions"].update(row["versions"])


def runner_main(args):
    # Above one rank, "all" is the FSDP2 systems.
    known = SYSTEMS if args.ranks == 1 else {n: v for n, v in SYSTEMS.items() if n in FSDP2_SYSTEMS}
    systems = parse_list(args.systems, known, "system" if args.ranks == 1 else f"system with --ranks {args.ranks}")
    models = parse_list(args.models, MODELS, "model")
    caps = [None if c in ("none", "0") else float(c) for c in args.mem_cap_gib.split(",")]
    clips = {"none": [0.0], "every": [args.clip_max_norm], "both": [0.0, args.clip_max_norm]}[args.clip]
    os.makedirs(args.out, exist_ok=True)
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"peers.py: --ranks {args.ranks} needs as many GPUs; this machine has {torch.cuda.device_count()}")
    rows = load_baseline(args.baseline, models, clips, args.ranks) if args.baseline else []
    jobs = plan(systems, models, caps, clips, bool(rows), args.ranks)
    header = host_header(args)
    for r in rows:
        note_machine(header, r)
    failed = {}
    start = time.perf_counter()
    log(f"peers: {len(jobs)} workers, timeout {args.timeout_s} s each"
        + (f", {args.budget_s} s in all" if args.budget_s else "") + f"; output in {args.out}")
    with tempfile.TemporaryDirectory(prefix="peers-") as workdir, \
            open(os.path.join(args.out, "peers.log"), "w") as log_file:
        for n, job in enumerate(jobs, 1):
            system, model, cap, job_clips = job
            where = f"{model}, cap {cap:g} GiB" if cap else f"{model}, no cap"
            left = args.budget_s - (time.perf_counter() - start) if args.budget_s else args.timeout_s
            reason = None
            if system in failed and not args.retry_failed:
                reason = f"it failed at {failed[system]}"
            elif args.budget_s and left < args.min_worker_s:
                reason = f"--budget-s {args.budget_s:g} spent"
            if reason:
                new = [dict(system=system, model=model, cap_gib=cap, clip=c, status="skipped", error=reason)
                       for c in job_clips]
            else:
                log(f"[{n}/{len(jobs)}] {system} ({where}) ...")
                new = run_worker(job, args, workdir, log_file, min(args.timeout_s, left))
                if any(r["status"] in ("error", "timeout", "crash", "killed") for r in new):
                    failed.setdefault(system, where)
            for r in new:
                note_machine(header, r)
                log(f"    {system} {where} clip {r['clip']:g}: {r['status']}"
                    + (f" {r['s_per_step']:.4f} s/step, GPU {r['gpu_gib']:.2f} GiB, loss {r['loss']:.4f}"
                       if r["status"] == "ok" else f" ({' '.join(r.get('error', '').split())[:200]})"))
            rows += new
            header["elapsed_s"] = round(time.perf_counter() - start, 1)
            text = write_outputs(args, header, rows)
    log("\n" + text)
    return 0


def parse_list(value, known, what):
    """The names of a comma list (or all), in the order of `known`."""
    names = set(known) if value == "all" else {v.strip() for v in value.split(",") if v.strip()}
    unknown = sorted(names - set(known))
    if unknown:
        sys.exit(f"peers.py: unknown {what} {', '.join(unknown)} (known: {', '.join(known)})")
    return [n for n in known if n in names]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--systems", default="all", help="comma list of the systems above, or all (default)")
    ap.add_argument("--models", default="1.1b,2.8b",
                    help="comma list of 1.1b, 2.8b, 7b, 8b, 10b, 13b, tiny (default 1.1b,2.8b)")
    ap.add_argument("--batch", type=int, default=0, help="sequences a step, for every model (default: the model's)")
    ap.add_argument("--clip", choices=("none", "every", "both"), default="both",
                    help="runs without clipping, clipping every step, or both (default)")
    ap.add_argument("--clip-max-norm", type=float, default=1e-3,
                    help="max_grad_norm of the clipped runs: tiny, so that every step clips (default 1e-3)")
    ap.add_argument("--mem-cap-gib", default="none",
                    help="comma list of GPU memory caps in GiB, none for uncapped (default none), e.g. none,24,48")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per run (default 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    ap.add_argument("--no-settle", action="store_true",
                    help="time the steps right after --warmup: no settling of ours' automatic split or speculation "
                         "first (how fast the defaults settle: compare --warmup 3 with --warmup 10)")
    ap.add_argument("--timeout-s", type=float, default=240, help="one worker's limit (default 240)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="stop starting workers when this many seconds have passed (default 480, so that "
                         "the run and bench/peers_setup.sh fit in one 10-minute command; 0: no limit); the "
                         "ones left become 'not run' rows")
    ap.add_argument("--min-worker-s", type=float, default=45,
                    help="with --budget-s: start no worker with less than this left (default 45)")
    ap.add_argument("--baseline", metavar="PEERS_JSON",
                    help="take the uncapped torch-gpu-adamw rows from an earlier run's peers.json instead of "
                         "running them")
    ap.add_argument("--retry-failed", action="store_true",
                    help="run a system again for the later models and caps after it failed")
    ap.add_argument("--ranks", type=int, default=1,
                    help="processes (GPUs) per worker, FSDP2 systems only above 1 (default 1)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: a dry run of the harness (with --models tiny), no numbers")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT") or "bench-out", "peers"),
                    help="output directory (default $OUT/peers, else bench-out/peers)")
    worker = ap.add_argument_group("worker mode (the runner starts these)")
    worker.add_argument("--worker", choices=list(SYSTEMS), help="run this system")
    worker.add_argument("--model", choices=list(MODELS))
    worker.add_argument("--cap-gib", type=float, default=0)
    worker.add_argument("--clips", type=lambda s: [float(c) for c in s.split(",")])
    worker.add_argument("--result", help="where the worker writes its rows (JSON)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.ranks < 1:
        ap.error("--steps and --ranks must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: use --device cpu --models tiny for a dry run")
    if args.worker:
        if not (args.model and args.clips and args.result):
            ap.error("--worker needs --model, --clips and --result")
        return worker_main(args)
    return runner_main(args)


if __name__ == "__main__":
    sys.exit(main())
