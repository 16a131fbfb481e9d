"""SuperOffloadAdamW: a torch.optim.Optimizer whose AdamW runs in libsuperoffload on the CPU.

Each trainable parameter is a named slice of a sub-group (consecutive parameters of one param
group packed up to `sub_group_numel` elements, in forward order); the sub-groups' f32 master
weights and Adam moments live in host memory. A post-accumulate-grad hook per parameter hands
`p.grad` to the session as soon as backward produces it (and drops it, freeing GPU memory); the
session steps each complete sub-group speculatively on its CPU-Adam thread during the rest of
backward. `step()` sets the group hyperparameters from `param_groups` (so LR schedulers work),
makes every speculative step exact (clipping, skipped steps) and, in CUDA mode, publishes the
updated weights into the model's parameters; the next forward waits on the GPU only for the
sub-groups it reads.

Python only orchestrates: every optimizer operation (gradient transfer, Adam, clipping, norm,
rollback, rescale, publication, checkpoints) is the library's, through the C++ extension.

Modes (picked from where the parameters are):
- CUDA: parameters (bf16, f16 or f32) on one GPU; gradients arrive as device tensors and are
  copied to pinned host buffers by the library; the model's parameters are re-pointed into one
  flat device buffer per sub-group, which is where the library publishes.
- host: f32 parameters on the CPU; they are re-pointed into the f32 master buffers themselves,
  which the library updates in place.
- FSDP2 (`fully_shard`): parameters are DTensors; each rank's session steps its local shards
  (one sub-group per parameter, FSDP owns the storage); the global norm and the overflow verdict
  come from an all-reduce of `local_grad_sumsq` over the shard group.

GPU-resident parameters (CUDA mode, `gpu_fraction > 0`; SuperOffload's `ratio < 1`): the first
parameters in forward order, up to that fraction of the elements, keep f32 master weights and
moments on the GPU and are stepped there by torch's fused AdamW after the checks. Their
gradients arrive last in backward and their weights are needed first in the next forward, so
taking them off the CPU shortens the critical path most where clipping makes every sub-group
wait for the global norm. The global norm covers both parts (the session's sums of squares plus
the GPU gradients'); the clip coefficient and the skip verdict are the same for both.

Differences from torch.optim.AdamW: a trainable parameter that gets no gradient in a step is
stepped with a zero gradient (torch skips it); `amsgrad`, `maximize`, `capturable` and
`differentiable` are not supported; gradient clipping is built in (`max_grad_norm`, the same
coefficient as torch.nn.utils.clip_grad_norm_).
"""
import math
import os
import tempfile
import warnings

import torch
from torch.optim import Optimizer

from . import _build

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def _local(t):
    """The rank-local tensor of a parameter (its DTensor shard, or itself), without autograd."""
    if _is_dtensor(t):
        return t._local_tensor
    return t.data


def _round_up(x, m):
    return (x + m - 1) // m * m


class _ParamInfo:
    __slots__ = ("param", "name", "group", "numel", "dtensor", "sg", "slice", "offset", "count", "gpu_master")

    def __init__(self, param, name, group):
        self.param, self.name, self.group = param, name, group
        self.dtensor = _is_dtensor(param)
        self.numel = _local(param).numel()
        self.sg = self.slice = None
        self.offset = 0
        self.count = 0
        self.gpu_master = None  # f32 master on the GPU: a GPU-resident parameter


class _SubGroup:
    __slots__ = ("id", "group", "params", "numel", "master", "device_param")

    def __init__(self, group):
        self.group, self.params, self.numel = group, [], 0
        self.id = self.master = self.device_param = None


class SuperOffloadAdamW(Optimizer):
    """AdamW with its state in host memory, stepped by libsuperoffload (see the module docstring).

    Args:
        params: parameters, named parameters ((name, tensor) pairs) or param-group dicts, as for
            torch.optim.AdamW. Names (from `model.named_parameters()` when `model` is given) name
            the checkpoint slices.
        lr, betas, eps, weight_decay: as torch.optim.AdamW (per param group).
        max_grad_norm: clip the global gradient norm to this at every step (0: no clipping).
        speculation: step sub-groups during backward (False: all at step()).
        sub_group_numel: pack consecutive parameters of a group into sub-groups of up to this
            many elements (0: one sub-group per parameter; FSDP2 always uses one per parameter).
        cores: CPU cores for the session's own pinned thread pool (None: the library's default pool).
        gpu_fraction: CUDA mode: keep the first parameters in forward order, up to this fraction
            of the trainable elements, on the GPU (f32 masters and moments there, stepped by
            torch's fused AdamW with the session's clip coefficient; see the module docstring).
            0 (default): everything offloaded. Needs bias correction and no loss scaler.
        model: the module holding the parameters: gives the forward order and names, and lets
            each module's forward wait only for its own sub-groups' weights (`wait="module"`).
        wait: "module" (per-module forward pre-hooks; needs `model`), "step" (everything waited
            for at the end of step(): on the GPU without blocking in CUDA mode, on the host in
            host mode) or "auto" ("module" with a model and no FSDP, else "step").
        copy_dtype: "auto" (bf16/f16 parameters get a bf16/f16 copy of the master weights made on
            the CPU in the same pass, which halves the weights sent to the GPU), "none", "bf16", "f16".
        accumulation_steps: backward passes per step; gradients accumulate in p.grad (on the GPU)
            and are handed over at the last one.
        distributed: "auto" (on with DTensor parameters and an initialised process group), True,
            False. process_group: the group to all-reduce the sum of squares over (default: the
            parameters' shard group).
        loss_scaler: None, or a dict of the library's dynamic loss scaler settings (fp16):
            multiply the loss by `loss_scale()` before backward.
        prefix: the superoffload install prefix (default $SUPEROFFLOAD_PREFIX).
        piece_bytes, host_memory_limit, bias_correction: passed to the session.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, max_grad_norm=0.0,
                 speculation=True, sub_group_numel=1 << 25, cores=None, model=None, wait="auto", copy_dtype="auto",
                 accumulation_steps=1, distributed="auto", process_group=None, loss_scaler=None, prefix=None,
                 piece_bytes=16 << 20, host_memory_limit=0, bias_correction=True, align_bytes=256, gpu_fraction=0.0):
        if not 0.0 <= lr:
            raise ValueError(f"invalid learning rate {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"invalid betas {betas}")
        if max_grad_norm < 0 or not math.isfinite(max_grad_norm):
            raise ValueError(f"max_grad_norm must be finite and >= 0, not {max_grad_norm}")
        if accumulation_steps < 1:
            raise ValueError("accumulation_steps must be >= 1")
        if not 0.0 <= gpu_fraction < 1.0:
            raise ValueError(f"gpu_fraction must be in [0, 1), not {gpu_fraction}")
        params, names = _split_names(params)
        self._constructing = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._constructing = False
        self.max_grad_norm = float(max_grad_norm)
        self.accumulation_steps = int(accumulation_steps)
        self._ext = _build.load(prefix)
        self._closed = False
        self._in_step = False
        self._ticket = None
        self._result = None
        self._nsteps = 0
        self._hooks = []
        self._pending = set()

        if model is not None:
            for n, p in model.named_parameters():
                names.setdefault(id(p), n)
        infos, seen = [], set()
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                infos.append(_ParamInfo(p, names.get(id(p)), gi))
        if not infos:
            raise ValueError("SuperOffloadAdamW got no trainable parameters")
        if model is not None:  # forward (registration) order of the model
            order = {id(p): i for i, p in enumerate(model.parameters())}
            infos.sort(key=lambda i: order.get(id(i.param), len(order)))
        used = set()
        for k, info in enumerate(infos):
            name = info.name or f"param{k}"
            while name in used:
                name += "_"
            used.add(name)
            info.name = name
        self._infos = infos
        self._by_param = {id(i.param): i for i in infos}

        # Mode: where the rank-local parameters live.
        devices = {_local(i.param).device for i in infos}
        if len(devices) != 1:
            raise ValueError(f"SuperOffloadAdamW: all trainable parameters must be on one device; got {sorted(map(str, devices))}")
        self.device = devices.pop()
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"SuperOffloadAdamW: parameters on {self.device} (only cuda and cpu are supported)")
        self.cuda = self.device.type == "cuda"
        dtypes = {_local(i.param).dtype for i in infos}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise ValueError(f"SuperOffloadAdamW: trainable parameters must share one of float32, bfloat16, float16; "
                             f"got {sorted(map(str, dtypes))} (cast the model first)")
        self.param_dtype = dtypes.pop()
        if not self.cuda and self.param_dtype != torch.float32:
            raise ValueError("SuperOffloadAdamW: host mode (CPU parameters) needs float32 parameters: the parameters "
                             f"are the master weights there; got {self.param_dtype}")
        self.fsdp = any(i.dtensor for i in infos)
        if self.fsdp and not all(i.dtensor for i in infos):
            raise ValueError("SuperOffloadAdamW: some parameters are DTensors (FSDP2) and some are not; apply "
                             "fully_shard to the root module too so every parameter is sharded")
        self._setup_distributed(distributed, process_group)
        infos = self._split_gpu_resident(infos, float(gpu_fraction), loss_scaler, bias_correction)

        dt = _DTYPES[self.param_dtype]
        if copy_dtype == "auto":
            copy_dtype = dt if self.cuda and dt != "f32" else "none"
        self._loss_scaler = loss_scaler is not None
        self.session = self._ext.Session(
            cuda=self.cuda, device=(self.device.index or 0) if self.cuda else 0, speculation=bool(speculation),
            mode="adamw", bias_correction=bias_correction, grad_dtype=dt, accum_dtype=dt, moment_dtype="f32",
            copy_dtype=copy_dtype, cores=list(cores) if cores is not None else None,
            host_memory_limit=int(host_memory_limit), piece_bytes=int(piece_bytes), loss_scaler=loss_scaler)
        self._group_hp = [None] * len(self.param_groups)
        for gi, g in enumerate(self.param_groups):
            hp = self._hparams(g)
            self.session.add_group(*hp)
            self._group_hp[gi] = hp
        self._lite = self.cuda and not self._ext.compiled_with_cuda_headers
        if self._lite:  # no CUDA headers in the extension: streams come from here
            self._copy_stream = torch.cuda.ExternalStream(self.session.copy_stream(), device=self.device)

        self._subgroups = self._partition(infos, 0 if self.fsdp else int(sub_group_numel))
        self._register(align_bytes)
        for info in self._infos:
            self._hooks.append(info.param.register_post_accumulate_grad_hook(self._make_hook(info)))

        if wait == "auto":
            wait = "module" if model is not None and not self.fsdp else "step"
        if wait == "module":
            if model is None:
                raise ValueError('wait="module" needs model=')
            if self.fsdp:
                raise ValueError('wait="module" does not work under FSDP2 (its all-gathers read the shards before '
                                 'module hooks run); use wait="step"')
            self._install_module_waits(model)
        elif wait != "step":
            raise ValueError(f'wait must be "auto", "module" or "step", not {wait!r}')
        self.wait_mode = wait
        if model is not None:
            # model.state_dict() reads the weights, model.load_state_dict() writes them: both
            # after the latest step is final; a load also refreshes the master weights.
            self._hooks.append(model.register_state_dict_pre_hook(self._model_hook_sync))
            self._hooks.append(model.register_load_state_dict_pre_hook(self._model_hook_sync_load))
            self._hooks.append(model.register_load_state_dict_post_hook(self._model_hook_reload))

    # ---- construction ---------------------------------------------------------------------

    @staticmethod
    def _hparams(g):
        b1, b2 = g["betas"]
        return (float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]))

    def _setup_distributed(self, distributed, process_group):
        import torch.distributed as dist
        on = self.fsdp and dist.is_available() and dist.is_initialized() if distributed == "auto" else bool(distributed)
        self.distributed = on
        self._pg = None
        self._comm_device = None
        if not on:
            return
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("SuperOffloadAdamW(distributed=True) needs an initialised torch.distributed process group")
        if process_group is None and self.fsdp:
            p = self._infos[0].param
            mesh, placements = p.device_mesh, p.placements
            shard_dims = [d for d, pl in enumerate(placements) if pl.is_shard()]
            for info in self._infos:
                if info.param.device_mesh != mesh or tuple(info.param.placements) != tuple(placements):
                    raise ValueError("SuperOffloadAdamW: DTensor parameters on different meshes or placements")
            if len(shard_dims) != 1:
                raise ValueError(f"SuperOffloadAdamW: expected one sharded mesh dimension, got placements {placements}")
            process_group = mesh.get_group(shard_dims[0]) if mesh.ndim > 1 else mesh.get_group()
        self._pg = process_group
        backend = dist.get_backend(process_group)
        self._comm_device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def _split_gpu_resident(self, infos, fraction, loss_scaler, bias_correction):
        """Picks the GPU-resident parameters (a prefix in forward order) and sets up their f32
        masters and torch optimizer; returns the offloaded ones."""
        self._gpu_infos, self._gpu_opt, self._gpu_groups = [], None, []
        if fraction == 0.0:
            return infos
        if not self.cuda or self.fsdp:
            raise ValueError("SuperOffloadAdamW: gpu_fraction needs CUDA parameters without FSDP2")
        if loss_scaler is not None or not bias_correction:
            raise ValueError("SuperOffloadAdamW: gpu_fraction does not support loss_scaler or bias_correction=False "
                             "(torch's AdamW steps the GPU-resident part)")
        budget, acc = fraction * sum(i.numel for i in infos), 0
        for info in infos:
            if acc + info.numel > budget:
                break
            acc += info.numel
            self._gpu_infos.append(info)
        if len(self._gpu_infos) == len(infos):
            raise ValueError(f"SuperOffloadAdamW: gpu_fraction={fraction} leaves no parameter to offload")
        by_group = {}
        with torch.no_grad():
            for info in self._gpu_infos:
                info.gpu_master = info.param.detach().float().clone()
                by_group.setdefault(info.group, []).append(info.gpu_master)
        self._gpu_groups = sorted(by_group)
        if by_group:
            self._gpu_opt = torch.optim.AdamW(
                [dict(params=by_group[gi], **self._torch_hparams(self.param_groups[gi])) for gi in self._gpu_groups],
                fused=True)
        return infos[len(self._gpu_infos):]

    @staticmethod
    def _torch_hparams(g):
        return dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"])

    def _partition(self, infos, limit):
        """Sub-groups of up to `limit` elements: each packs the next parameters of one param
        group in forward order, and sub-groups are ordered by their first parameter, so the
        finalization order stays the forward order even when param groups interleave (e.g.
        weights with decay, biases and norms without)."""
        out, open_ = [], {}
        for info in infos:
            if info.numel == 0:  # an empty FSDP shard on this rank: nothing to step
                continue
            cur = open_.get(info.group)
            if cur is None or limit <= 0 or cur.numel + info.numel > limit:
                cur = _SubGroup(info.group)
                out.append(cur)
                open_[info.group] = cur
            cur.params.append(info)
            cur.numel += info.numel
        return out

    def _register(self, align_bytes):
        """Master buffers (one page-aligned f32 arena), device buffers, and the session's sub-groups."""
        el = torch.tensor([], dtype=self.param_dtype).element_size()
        dev_align = max(1, align_bytes // el)
        host_align = max(1, 64 // 4)
        borrow = self.fsdp and not self.cuda  # host FSDP: the f32 shards themselves are the masters
        # Layout: slice offsets inside each sub-group (aligned), sub-group sizes.
        for sg in self._subgroups:
            off = 0
            align = dev_align if self.cuda else host_align
            for info in sg.params:
                off = _round_up(off, align)
                info.offset = off
                off += info.numel
            sg.numel = off
        page_el = _PAGE // 4
        arena = None
        if not borrow:
            total = sum(_round_up(sg.numel, page_el) for sg in self._subgroups) + page_el
            arena = torch.zeros(total, dtype=torch.float32)
            base = (-(arena.data_ptr() // 4)) % page_el  # first page boundary
            self._master_arena = arena
        dev_arena = None
        if self.cuda and not self.fsdp:
            dev_total = sum(_round_up(sg.numel, dev_align) for sg in self._subgroups)
            dev_arena = torch.zeros(dev_total, dtype=self.param_dtype, device=self.device)
            self._device_arena = dev_arena
        host_pos, dev_pos = (base if arena is not None else 0), 0
        with torch.no_grad():
            for sg in self._subgroups:
                if borrow:
                    local = _local(sg.params[0].param)
                    if not local.is_contiguous():
                        raise ValueError(f"SuperOffloadAdamW: the local shard of {sg.params[0].name} is not contiguous")
                    sg.master = local.view(-1)
                else:
                    sg.master = arena[host_pos:host_pos + sg.numel]
                    host_pos += _round_up(sg.numel, page_el)
                    for info in sg.params:
                        sg.master[info.offset:info.offset + info.numel].copy_(_local(info.param).reshape(-1))
                if self.cuda:
                    if self.fsdp:
                        local = _local(sg.params[0].param)
                        if not local.is_contiguous():
                            raise ValueError(f"SuperOffloadAdamW: the local shard of {sg.params[0].name} is not contiguous")
                        sg.device_param = local.view(-1)
                    else:
                        sg.device_param = dev_arena[dev_pos:dev_pos + sg.numel]
                        dev_pos += _round_up(sg.numel, dev_align)
                        for info in sg.params:
                            view = sg.device_param[info.offset:info.offset + info.numel]
                            view.copy_(info.param.data.reshape(-1))
                            info.param.data = view.view(info.param.shape)
                elif not borrow:
                    for info in sg.params:  # host mode: the parameter is its master slice
                        info.param.data = sg.master[info.offset:info.offset + info.numel].view(info.param.shape)
                slices = [(info.name, info.offset, info.numel) for info in sg.params]
                sg.id, slice_ids = self.session.add_subgroup(sg.group, sg.master, slices, sg.device_param)
                for info, sid in zip(sg.params, slice_ids):
                    info.sg, info.slice = sg.id, sid
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self._all_sgs = [sg.id for sg in self._subgroups]

    def _model_hook_sync(self, module, *args, **kwargs):
        if not self._closed:
            self.synchronize()

    def _model_hook_sync_load(self, *args, **kwargs):
        if not self._closed:
            self._check_idle("model.load_state_dict")
            self.synchronize()
            if self.cuda:
                torch.cuda.current_stream(self.device).synchronize()

    def _model_hook_reload(self, module, incompatible_keys):
        if not self._closed:
            self.reload_from_params()

    def _install_module_waits(self, model):
        by_module = {}
        for m in model.modules():
            sgs = sorted({self._by_param[id(p)].sg for p in m._parameters.values()
                          if p is not None and id(p) in self._by_param and self._by_param[id(p)].sg is not None})
            if sgs:
                by_module[m] = sgs
        covered = {s for sgs in by_module.values() for s in sgs}
        self._unowned = [s for s in self._all_sgs if s not in covered]  # waited for at step()
        for m, sgs in by_module.items():
            self._hooks.append(m.register_forward_pre_hook(self._make_module_wait(sgs)))

    def _make_module_wait(self, sgs):
        def pre_forward(module, args):
            if not self._pending:
                return None
            todo = [s for s in sgs if s in self._pending]
            if todo:
                self._pending.difference_update(todo)
                self._wait_subgroups(todo)
            return None
        return pre_forward

    # ---- gradients ------------------------------------------------------------------------

    def _stream_args(self):
        if not self._lite:
            return {}
        return {"stream": torch.cuda.current_stream(self.device).cuda_stream}

    def _make_hook(self, info):
        def post_accumulate_grad(p):
            if self._closed or p.grad is None:
                return
            info.count += 1
            if info.count < self.accumulation_steps:
                return  # keep accumulating in p.grad
            if info.gpu_master is not None:  # GPU-resident: its gradient stays in p.grad until step()
                if not self._in_step:
                    self._begin()
                return
            self._hand_over(info, p)
        return post_accumulate_grad

    def _hand_over(self, info, p):
        g = p.grad
        if _is_dtensor(g):
            g = g._local_tensor
        if not self._in_step and (info.sg is not None or self.distributed):
            self._begin()  # distributed: even a rank whose shards are all empty joins the all-reduce
        if info.sg is None:  # empty local shard
            p.grad = None
            return
        if self._lite:
            self.session.grad(info.slice, g, stream=torch.cuda.current_stream(self.device).cuda_stream,
                              record_on=self._copy_stream)
        else:
            self.session.grad(info.slice, g)
        p.grad = None  # the session has it (CUDA: record_stream'ed on the copy stream)

    def _begin(self):
        if self._pending:  # sub-groups no forward waited for (their modules did not run)
            todo = sorted(self._pending)
            self._pending.clear()
            self._wait_subgroups(todo)
        self._sync_groups()
        self.session.begin_step(0.0 if self._loss_scaler else 1.0, 1)
        self._in_step = True

    def _sync_groups(self):
        for gi, g in enumerate(self.param_groups):
            hp = self._hparams(g)
            if hp != self._group_hp[gi]:
                self.session.set_group(gi, *hp)
                self._group_hp[gi] = hp

    def _wait_subgroups(self, sgs):
        if self.cuda:
            self.session.enqueue_wait_final(sgs, **self._stream_args())
        else:
            self.session.wait_final(sgs)

    # ---- the optimizer API ----------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None, *, max_grad_norm=None):
        """Ends the step: clips to `max_grad_norm` (default: the constructor's), makes every
        sub-group exact and (CUDA) publishes the weights; returns at once. The next forward
        waits for the weights it reads (see `wait`)."""
        self._check_open()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for info in self._infos:  # gradients still held in p.grad (short accumulation, no hook)
            if info.param.grad is not None and info.gpu_master is None:
                self._hand_over(info, info.param)
        if not self._in_step:
            return loss  # no gradient this step: like torch, nothing changes
        self._sync_groups()
        if self.cuda:
            self.session.set_compute_stream(**self._stream_args())
        max_norm = self.max_grad_norm if max_grad_norm is None else float(max_grad_norm)
        if self._gpu_infos:
            self._step_with_gpu_resident(max_norm)
        elif self.distributed:
            import torch.distributed as dist
            sumsq = self.session.local_grad_sumsq()
            t = torch.tensor([sumsq], dtype=torch.float64, device=self._comm_device)
            dist.all_reduce(t, group=self._pg)
            total = t.item()
            norm = math.sqrt(total) if math.isfinite(total) and total >= 0 else float("nan")
            self._ticket = self.session.step(max_norm, norm, False)
        else:
            self._ticket = self.session.step(max_norm)
        self._in_step = False
        self._result = None
        self._nsteps += 1
        for info in self._infos:
            info.count = 0
        if self.wait_mode == "module":
            self._pending = set(self._all_sgs)
            if self._unowned:
                self._pending.difference_update(self._unowned)
                self._wait_subgroups(self._unowned)
        elif self.cuda:
            self.session.enqueue_wait_final(self._all_sgs, **self._stream_args())
        else:
            self.session.wait(self._ticket)
        return loss

    def _step_with_gpu_resident(self, max_norm):
        """One global norm over the session's sums of squares and the GPU-resident gradients;
        the session and the GPU part then apply the same clip coefficient, or both skip."""
        grads = []
        for info in self._gpu_infos:
            g = info.param.grad
            # A parameter without a gradient steps with zeros, as the offloaded ones do.
            info.gpu_master.grad = g.float() if g is not None else torch.zeros_like(info.gpu_master)
            info.param.grad = None
            grads.append(info.gpu_master.grad)
        gpu_sumsq = torch.stack(torch._foreach_norm(grads)).double().square().sum()
        total = self.session.local_grad_sumsq() + gpu_sumsq.item()
        norm = math.sqrt(total) if math.isfinite(total) else float("nan")
        self._ticket = self.session.step(max_norm, norm, False)
        if math.isfinite(norm):  # else the session skips the step: so does the GPU part
            coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0  # the session's formula
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
            for pg, gi in zip(self._gpu_opt.param_groups, self._gpu_groups):
                pg.update(self._torch_hparams(self.param_groups[gi]))
            self._gpu_opt.step()
            for info in self._gpu_infos:
                info.param.data.copy_(info.gpu_master.view_as(info.param))
        for info in self._gpu_infos:
            info.gpu_master.grad = None

    def zero_grad(self, set_to_none=True):
        super().zero_grad(set_to_none=set_to_none)
        for info in self._infos:
            info.count = 0

    def synchronize(self):
        """Makes the weights of the latest step visible: CUDA, the current stream waits for
        them (on the GPU); host, this waits. Call it before reading parameters outside a forward."""
        self._check_open()
        if self._pending:
            todo = sorted(self._pending)
            self._pending.clear()
            self._wait_subgroups(todo)
        if self._ticket is not None and not self.cuda:
            self.session.wait(self._ticket)
        elif self._ticket is not None:
            self.session.enqueue_wait_final(self._all_sgs, **self._stream_args())

    @torch.no_grad()
    def reload_from_params(self):
        """Copies the model's current parameter values into the master weights (CUDA mode: after
        the parameters were changed behind the optimizer's back, e.g. by model.load_state_dict(),
        which calls this by itself when the optimizer was given `model`). Between steps only."""
        self._check_idle("reload_from_params")
        if self._ticket is not None:
            self.session.wait(self._ticket)  # the step ticket: every sub-group is final
        for info in self._gpu_infos:
            info.gpu_master.copy_(info.param.detach().reshape(info.gpu_master.shape))
        for sg in self._subgroups:
            for info in sg.params:
                src = _local(info.param).reshape(-1)
                dst = sg.master[info.offset:info.offset + info.numel]
                if src.device.type == "cpu" and src.data_ptr() == dst.data_ptr():
                    continue  # host mode: the parameter is its master
                dst.copy_(src)

    def last_step_result(self, wait=True):
        """The latest step's outcome as a dict (global_norm, clip_coef, skipped, kept,
        rescaled, rolled_back, redone, stepped, speculative, late_gradients, ...), or None
        before the first step. Waits for the step unless wait=False (then None if not done)."""
        if self._ticket is None:
            return None
        if self._result is None:
            r = self.session.step_result(self._ticket, -1.0 if wait else 0.0)
            r["step"] = self._nsteps
            r["gpu_resident_stepped"] = 0 if r["skipped"] else len(self._gpu_infos)
            self._result = r
        return dict(self._result)

    def loss_scale(self):
        """The built-in loss scaler's scale for the next backward (1 without one)."""
        return self.session.loss_scale()

    def add_param_group(self, param_group):
        if getattr(self, "_constructing", True):
            return super().add_param_group(param_group)
        raise NotImplementedError("SuperOffloadAdamW: param groups are fixed at construction")

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self):
        """{"state": {}, "param_groups": [...], "superoffload": {"checkpoint": bytes, ...}}: the
        library's checkpoint file (master weights, moments, step counts; rank-local under FSDP2)
        as bytes, plus the param groups' hyperparameters (lr schedules etc.)."""
        self._check_idle("state_dict")
        self.synchronize()
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "optimizer.safetensors")
            self.session.save(path)
            with open(path, "rb") as f:
                blob = f.read()
        index, groups = 0, []
        for g in self.param_groups:
            entry = {k: v for k, v in g.items() if k != "params"}
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        so = {"format": 1, "checkpoint": blob, "steps": self._nsteps, "slices": [i.name for i in self._infos]}
        if self._gpu_infos:
            so["gpu_resident"] = {"names": [i.name for i in self._gpu_infos],
                                  "masters": [i.gpu_master.detach().cpu() for i in self._gpu_infos],
                                  "optimizer": self._gpu_opt.state_dict()}
        return {"state": {}, "param_groups": groups, "superoffload": so}

    def load_state_dict(self, state_dict):
        """Restores master weights (and, through them, the model's parameters), moments, step
        counts and the param groups' hyperparameters from `state_dict()`'s output."""
        self._check_idle("load_state_dict")
        so = state_dict.get("superoffload")
        if not isinstance(so, dict) or so.get("format") != 1:
            raise ValueError("not a SuperOffloadAdamW state dict (no 'superoffload' entry of format 1)")
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                        for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state dict's param groups do not match this optimizer's")
        gpu = so.get("gpu_resident")
        names = [i.name for i in self._gpu_infos]
        if (gpu["names"] if gpu else []) != names:
            raise ValueError(f"the state dict keeps {len(gpu['names']) if gpu else 0} parameters on the GPU and this "
                             f"optimizer {len(names)} (gpu_fraction must match the saving optimizer's)")
        if self.cuda:
            # Nothing queued may still read the parameters the load publishes into, and the load
            # publishes on the session's stream without a ticket: synchronise on both sides.
            torch.cuda.synchronize(self.device)
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "optimizer.safetensors")
            with open(path, "wb") as f:
                f.write(so["checkpoint"])
            self.session.load(path)
        if gpu:
            with torch.no_grad():
                for info, master in zip(self._gpu_infos, gpu["masters"]):
                    info.gpu_master.copy_(master)
                    info.param.data.copy_(info.gpu_master.view_as(info.param))
            self._gpu_opt.load_state_dict(gpu["optimizer"])
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._group_hp = [None] * len(self.param_groups)  # the checkpoint set the session's groups
        self._sync_groups()
        self._nsteps = int(so.get("steps", 0))
        self._pending.clear()

    # ---- measurements and lifetime ---------------------------------------------------------

    def trace(self, enable=True):
        """Starts (clearing an earlier one) or stops recording the session's timeline."""
        self.session.trace(bool(enable))

    def save_trace(self, path):
        """Writes the recorded timeline as Chrome trace JSON (bench/trace_plot.py renders it)."""
        self.session.save_trace(str(path))

    def memory(self):
        """Host bytes: the session's allocations (moments, gradient buffers, copies), the master
        weights, page-locked bytes, and bytes per offloaded parameter; GPU-resident parameters
        and their f32 master and moment bytes on the GPU."""
        gpu = sum(i.numel for i in self._gpu_infos)
        numel = sum(i.numel for i in self._infos) - gpu
        arena = getattr(self, "_master_arena", None)
        master = arena.numel() * 4 if arena is not None else sum(sg.master.numel() * 4 for sg in self._subgroups)
        session = self.session.host_bytes()
        return {"params": numel, "session_host_bytes": session, "master_bytes": master,
                "host_bytes_per_param": (session + master) / max(numel, 1), "pinned_bytes": self.session.pinned_bytes(),
                "gpu_resident_params": gpu, "gpu_resident_bytes": gpu * 12}

    def subgroups(self):
        """[(sub-group id, param group, numel, [slice names])] in forward order (offloaded ones)."""
        return [(sg.id, sg.group, sg.numel, [i.name for i in sg.params]) for sg in self._subgroups]

    def gpu_resident(self):
        """Names of the GPU-resident parameters (see gpu_fraction)."""
        return [i.name for i in self._gpu_infos]

    def close(self):
        """Removes the hooks and destroys the session (waiting for its work). The parameters keep
        their last published values and stay views of this optimizer's buffers."""
        if self._closed:
            return
        if self._in_step:
            warnings.warn("SuperOffloadAdamW.close() during a step: the gradients handed over are dropped")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.cuda:
            if self._ticket is not None:
                self.session.enqueue_wait_final(self._all_sgs, **self._stream_args())
            # Destroying the session frees the device word that enqueued waits read: every
            # stream must have passed its waits first.
            torch.cuda.synchronize(self.device)
        self.session.close()
        self._closed = True

    def _check_open(self):
        if self._closed:
            raise RuntimeError("SuperOffloadAdamW was closed")

    def _check_idle(self, what):
        self._check_open()
        if self._in_step:
            raise RuntimeError(f"SuperOffloadAdamW.{what}() between backward and step(): call step() first")

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _split_names(params):
    """Accepts parameters, (name, parameter) pairs, or groups of either; returns plain params
    (groups kept) and {id(param): name}."""
    names = {}

    def plain(seq):
        out = []
        for x in seq:
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
                names.setdefault(id(x[1]), x[0])
                out.append(x[1])
            else:
                out.append(x)
        return out

    params = list(params)
    if params and isinstance(params[0], dict):
        groups = []
        for g in params:
            g = dict(g)
            ps = g["params"]
            g["params"] = plain([ps] if isinstance(ps, torch.Tensor) else list(ps))
            groups.append(g)
        return groups, names
    return plain(params), names
