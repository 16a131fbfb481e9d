"""bench/peers.py's models and systems: the model shapes, the hyperparameters, what every system
shares (Context: the model, the batch, the device, the cap, the ranks) and one Trainer per system,
with the systems' labels, the ones that run on more than one rank, and the order of the runs."""
import argparse
import os

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


def chunk_the_loss(model, tokens):
    """transformers' causal-LM loss (the f32 cross-entropy's mean over the shifted labels) with
    the vocabulary projection and the cross-entropy taken `tokens` rows at a time, each piece
    recomputed in backward: no step holds the whole batch's logits (at 8 B, 8,192 tokens of
    128,256 f32 logits are 3.9 GiB). Called before the model is sharded: the projection stays
    a module of the root (its forward waits and FSDP2 group as before), called per piece."""
    from torch.nn import functional as F
    from torch.utils.checkpoint import checkpoint
    head = model.lm_head
    model.lm_head = torch.nn.Identity()  # the forward's "logits" are the last hidden states
    model.vocab_head = head

    def piece_loss(hidden, targets):
        return F.cross_entropy(model.vocab_head(hidden).float(), targets, ignore_index=-100, reduction="sum")

    def loss_function(logits, labels, **_):
        hidden = logits.flatten(0, -2)
        targets = F.pad(labels, (0, 1), value=-100)[..., 1:].flatten()
        total = sum(checkpoint(piece_loss, hidden[i:i + tokens], targets[i:i + tokens], use_reentrant=False)
                    for i in range(0, hidden.shape[0], tokens))
        return total / (targets != -100).sum()

    model.loss_function = loss_function


class Unsupported(Exception):
    """A setting the system cannot run (its row says why; the worker goes on)."""


class Context:
    """What every system shares: the model's shape, the device, the batch, the cap, the ranks."""

    def __init__(self, model, *, batch=0, device="cuda", cap_gib=0, clips=(0.0,), settle=True, micro_batches=1,
                 loss_chunk_tokens=0):
        """`model` one of MODELS; `batch` 0 for the model's; as bench/peers.py's flags otherwise."""
        import bench_e2e
        self.e2e = bench_e2e
        self.spec = dict(MODELS[model], **({"batch": batch} if batch else {}))
        self.cuda = device == "cuda"
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        if self.cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.cap_bytes = int(cap_gib * GIB) if cap_gib else 0
        self.clips = list(clips)
        self.micro_batches = micro_batches
        if self.spec["batch"] % self.micro_batches:
            raise SystemExit(f"--micro-batches {self.micro_batches} does not divide the batch {self.spec['batch']}")
        self.settle = settle
        self.loss_chunk_tokens = loss_chunk_tokens
        # Data parallel: each rank its own tokens.
        generator = torch.Generator().manual_seed(self.rank)
        shape = (self.spec["batch"], self.spec["seq"])
        self.batch = torch.randint(0, self.spec["vocab"], shape, generator=generator).to(self.device)

    def forward_backward(self, model):
        """Forward and backward of the step's batch in `micro_batches` equal parts (gradients
        accumulate); returns the batch's mean loss."""
        if self.micro_batches == 1:
            return self.e2e.forward_backward(model, self.batch)
        total = 0.0
        for part in self.batch.chunk(self.micro_batches):
            loss = model(input_ids=part, labels=part).loss / self.micro_batches
            loss.backward()
            total = total + loss.detach()
        return total

    def build_model(self, dtype=None, device=None, init_device=None):
        shape = argparse.Namespace(**self.spec, dtype=dtype or self.dtype, activation_checkpointing=True)
        model = self.e2e.build_model(shape, device or self.device, init_device)
        if self.loss_chunk_tokens:
            chunk_the_loss(model, self.loss_chunk_tokens)
        return model

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

    def offloaded_model(self, dtype, reduce_dtype):
        """FSDP2 with CPUOffloadPolicy: shards of `dtype` in (pinned) host memory, compute in this
        context's dtype. Under a cap built on the host (its weights drawn on the GPU in pieces), so
        its weights never have to fit the GPU: fully_shard moves one layer at a time through the
        device on its way to the host shards."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
        if self.cap_bytes:
            model = self.build_model(dtype=dtype, device=torch.device("cpu"),
                                     init_device=self.device if self.cuda else None)
        else:
            model = self.build_model(dtype=dtype)
        self.fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=reduce_dtype),
                         offload_policy=CPUOffloadPolicy(pin_memory=self.cuda))
        if self.cuda:
            torch.cuda.empty_cache()
        return model

    def largest_of_ranks(self, value):
        if self.world == 1:
            return value
        import torch.distributed as dist
        t = torch.tensor([float(value)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def budget_within_cap(self, model):
        """The cap less the peak of one forward and backward without an optimizer, less a headroom.
        Each gradient is dropped as it is accumulated, as the session's hand-off takes it: the
        model's gradients need not fit beside its weights (7 B under a 24 GiB cap)."""
        hooks = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
                 for p in model.parameters() if p.requires_grad]
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            self.forward_backward(model)
        finally:
            for h in hooks:
                h.remove()
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

    def start_trace(self):
        """Records the optimizer's timeline and each step's metrics from here on, where it has
        them; returns whether it does."""
        return False

    def save_trace(self, path):
        """Writes the timeline to `path` and returns the metrics of the steps since start_trace."""
        raise NotImplementedError

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
        loss = self.ctx.forward_backward(self.model)
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss


class Ours(Trainer):
    def __init__(self, ctx, options, sharded=False, offload=None):
        from superoffload.torch import SuperOffloadAdamW
        super().__init__(ctx)
        if offload is not None:
            # FSDP2's CPU offload: shards of dtype `offload` on the host (f32: the session's master
            # weights; bf16: the weights' copy the session writes beside its own f32 masters),
            # compute in the context's dtype, the gradients in it too (taken before FSDP2 would
            # reduce them).
            self.model = ctx.offloaded_model(offload, reduce_dtype=None)
        else:
            self.model = ctx.build_model()
            if sharded:
                ctx.fully_shard(self.model)
        options = dict(options)
        if ctx.cap_bytes and options.get("gpu_budget") == "auto":
            del options["gpu_budget"]
            options["gpu_budget_bytes"] = ctx.budget_within_cap(self.model)
        self.max_norm = ctx.clips[0]
        self.opt = SuperOffloadAdamW(self.model.parameters(), model=self.model, max_grad_norm=self.max_norm,
                                     accumulation_steps=ctx.micro_batches, **HPARAMS, **options)
        # An explicit zero budget offloads everything; any other may place sub-groups on the GPU
        # after a few measured steps.
        self.splits = options.get("gpu_budget_bytes") != 0
        self.speculation_auto = options.get("speculation", "auto") == "auto"
        self.config = {**options, "subgroups": len(self.opt.subgroups()), "cores": self.opt.cores,
                       **({"fsdp2": f"CPUOffloadPolicy, {str(offload).removeprefix('torch.')} shards on the host"}
                          if offload else {})}
        self.step_metrics = None

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

    def start_trace(self):
        self.opt.trace(True)
        self.step_metrics = []
        return True

    def save_trace(self, path):
        # The last step's result first: its decision and final passes then stand in the timeline.
        self.step_metrics.append(self.opt.metrics())
        self.opt.trace(False)
        self.opt.save_trace(path)
        recorded, self.step_metrics = self.step_metrics[1:], None
        return recorded

    def train_step(self):
        loss = self.ctx.forward_backward(self.model)
        if self.step_metrics is not None:
            # The previous step's, read once this backward is over: every job of that step
            # runs before this step's, so the wait adds little.
            self.step_metrics.append(self.opt.metrics())
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
        if ctx.micro_batches > 1:
            raise Unsupported("its gradient hooks copy every backward's gradients to the host: no accumulation")
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
        loss = self.ctx.forward_backward(self.model)
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
        if ctx.micro_batches > 1:
            raise Unsupported("gradient accumulation runs through DeepSpeed's own engine steps, not measured here")
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
        super().__init__(ctx)
        self.model = ctx.offloaded_model(torch.float32, reduce_dtype=torch.float32)
        self.opt = torch.optim.AdamW(self.model.parameters(), fused=True, **HPARAMS)
        self.config = {"masters": "f32 on the CPU", "compute": str(ctx.dtype),
                       "optimizer": "torch.optim.AdamW(fused=True) on the CPU"}

    def train_step(self):
        loss = self.ctx.forward_backward(self.model)
        if self.max_norm:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_norm, foreach=True)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

OFFLOAD_ALL = {"gpu_budget_bytes": 0}
# The host holds the Adam state alone.
LEAN = {"gradient_home": "device", "host_copy": "bounded"}
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
    "ours-lean": ('ours, gradient_home "device", host_copy "bounded"', lambda ctx: Ours(ctx, LEAN)),
    "ours-bf16-moments-lean": ('ours, moment_dtype "bf16", everything offloaded, gradient_home "device", '
                               'host_copy "bounded"',
                               lambda ctx: Ours(ctx, {"moment_dtype": "bf16", **OFFLOAD_ALL, **LEAN})),
    "ours-offload-all-bounded-copy": ('ours, everything offloaded, host_copy "bounded"',
                                      lambda ctx: Ours(ctx, {**OFFLOAD_ALL, "host_copy": "bounded"})),
    "ours-bf16-moments-bounded-copy": ('ours, moment_dtype "bf16", everything offloaded, host_copy "bounded"',
                                       lambda ctx: Ours(ctx, {"moment_dtype": "bf16", **OFFLOAD_ALL,
                                                              "host_copy": "bounded"})),
    "ours-budget-auto": ('ours, gpu_budget "auto"', lambda ctx: Ours(ctx, {"gpu_budget": "auto"})),
    "torchao-offload": ("torchao CPUOffloadOptimizer (AdamW)", TorchaoOffload),
    "torchao-offload-grads": ("torchao CPUOffloadOptimizer (AdamW), offload_gradients",
                              lambda ctx: TorchaoOffload(ctx, offload_gradients=True)),
    "ds-zero3-offload": ("DeepSpeed ZeRO-3, offload_optimizer cpu", lambda ctx: DeepSpeedZero3(ctx, False)),
    "torch-fsdp2-offload": ("torch FSDP2 CPUOffloadPolicy", Fsdp2CpuOffload),
    "ds-superoffload": ("DeepSpeed ZeRO-3 + SuperOffload", lambda ctx: DeepSpeedZero3(ctx, True)),
    "torch-fsdp2-gpu-adamw": ("torch FSDP2, AdamW(fused) on the GPU", lambda ctx: TorchGpuAdamW(ctx, sharded=True)),
    "ours-fsdp2": ("ours under FSDP2, defaults", lambda ctx: Ours(ctx, {}, sharded=True)),
    "ours-fsdp2-offload": ("ours under FSDP2 CPUOffloadPolicy (f32 shards are the master weights)",
                           lambda ctx: Ours(ctx, {}, offload=torch.float32)),
    "ours-fsdp2-offload-bf16-moments": ('ours under FSDP2 CPUOffloadPolicy, moment_dtype "bf16"',
                                        lambda ctx: Ours(ctx, {"moment_dtype": "bf16"}, offload=torch.float32)),
    "ours-fsdp2-bf16-offload": ("ours under FSDP2 CPUOffloadPolicy on bf16 shards (the weights' copy)",
                                lambda ctx: Ours(ctx, {}, offload=ctx.dtype)),
    "ours-fsdp2-bf16-offload-bf16-moments": ('ours under FSDP2 CPUOffloadPolicy on bf16 shards, moment_dtype "bf16"',
                                             lambda ctx: Ours(ctx, {"moment_dtype": "bf16"}, offload=ctx.dtype)),
}
# The systems that run on more than one rank.
FSDP2_SYSTEMS = ["torch-fsdp2-gpu-adamw", "ours-fsdp2", "torch-fsdp2-offload", "ours-fsdp2-offload",
                 "ours-fsdp2-offload-bf16-moments", "ours-fsdp2-bf16-offload", "ours-fsdp2-bf16-offload-bf16-moments"]


def baseline_of(ranks):
    """The system every ratio of a table with this many ranks is to."""
    return "torch-gpu-adamw" if ranks == 1 else "torch-fsdp2-gpu-adamw"


# The order of the runs: the rows that the targets need first, so that what --budget-s leaves out
# matters least ("ours" repeats one of the two before it, whichever the package's default is).
RUN_ORDER = ["torch-gpu-adamw", "torch-fsdp2-gpu-adamw", "ours-offload-all", "ours-fsdp2", "ours-budget-auto",
             "torchao-offload", "torchao-offload-grads", "ours-spec-off", "ours", "ours-defaults-spec-off",
             "ours-bf16-moments", "ours-offload-all-bounded-copy", "ours-bf16-moments-bounded-copy", "ours-lean",
             "ours-bf16-moments-lean",
             "ds-zero3-offload", "torch-fsdp2-offload", "ours-fsdp2-offload", "ours-fsdp2-offload-bf16-moments",
             "ours-fsdp2-bf16-offload", "ours-fsdp2-bf16-offload-bf16-moments", "ds-superoffload"]
