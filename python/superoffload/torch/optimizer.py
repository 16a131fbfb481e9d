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

Python only orchestrates, through the library's C ABI (ctypes, `superoffload._core`): every
optimizer operation (gradient transfer, Adam, clipping, norm, rollback, rescale, publication) is
the library's. No C++ extension, so one wheel serves every torch version.

Modes (picked from where the parameters are):
- CUDA: parameters (bf16, f16 or f32) on one GPU; gradients arrive as device tensors and are
  copied to pinned host buffers by the library (`so_session_grad_device` on the current stream,
  the tensor `record_stream`ed on the session's copy stream); the model's parameters are
  re-pointed into one flat device buffer per sub-group, which is where the library publishes.
- host: f32 parameters on the CPU; they are re-pointed into the f32 master buffers themselves,
  which the library updates in place (`so_session_grad_copy`).
- FSDP2 (`fully_shard`): parameters are DTensors; each rank's session steps its local shards
  (one sub-group per parameter, FSDP owns the storage); the global norm and the overflow verdict
  come from an all-reduce of `local_grad_sumsq` over the shard group.

GPU-resident parameters (CUDA mode, `gpu_fraction > 0`; SuperOffload's `ratio < 1`): the first
parameters in forward order, up to that fraction of the elements, keep f32 master weights and
moments on the GPU: their sub-groups are registered with SO_PLACEMENT_DEVICE and the library's
GPU kernel steps them with the same decisions (`gpu_resident="torch"` keeps the earlier path:
torch's fused AdamW on GPU masters, with the session's clip coefficient and skip verdict).
`gpu_budget_bytes` passes through to the library's automatic split.

When are the weights final? The next forward of a module waits for its own sub-groups
(`wait="module"`); `model.state_dict()` / `load_state_dict()`, `state_dict()`, `synchronize()`
wait for everything. A direct read of a parameter outside a forward (an EMA, a custom save,
`p.detach().cpu()`) must come after `opt.synchronize()` (CUDA: the current stream waits on the
GPU; `synchronize(host=True)` also waits on the host), or it may see the previous step's weights.

Differences from torch.optim.AdamW: a trainable parameter that gets no gradient in a step is
stepped with a zero gradient (torch skips it); `amsgrad`, `maximize`, `capturable` and
`differentiable` are not supported; gradient clipping is built in (`max_grad_norm`, the same
coefficient as torch.nn.utils.clip_grad_norm_).
"""
import contextlib
import logging
import math
import os
import tempfile
import time
import warnings

import torch
from torch.optim import Optimizer

from .. import _abi, _core
from .. import _cores
from . import _checkpoint

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None

logger = logging.getLogger("superoffload")

_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TOUCH_CHUNK = 1 << 22
_TORCH_ADAMW_KEYS = dict(amsgrad=False, maximize=False, foreach=None, capturable=False, differentiable=False,
                         fused=None)


def _is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def _local(t):
    """The rank-local tensor of a parameter (its DTensor shard, or itself), without autograd."""
    if _is_dtensor(t):
        return t._local_tensor
    return t.data


def _round_up(x, m):
    return (x + m - 1) // m * m


class _Nvtx:
    """NVTX ranges through torch.cuda.nvtx (no-ops when off or unavailable)."""

    def __init__(self, on):
        self.on = False
        if on:
            try:
                self._push, self._pop = torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
                self._push("superoffload:init")
                self._pop()
                self.on = True
            except Exception:
                self.on = False

    @contextlib.contextmanager
    def range(self, name):
        if not self.on:
            yield
            return
        self._push(name)
        try:
            yield
        finally:
            self._pop()


class _ParamInfo:
    __slots__ = ("param", "name", "group", "numel", "dtensor", "sg", "slice", "offset", "count", "gpu_master",
                 "index")

    def __init__(self, param, name, group):
        self.param, self.name, self.group = param, name, group
        self.dtensor = _is_dtensor(param)
        self.numel = _local(param).numel()
        self.sg = self.slice = None
        self.offset = 0
        self.count = 0
        self.gpu_master = None  # f32 master on the GPU: a GPU-resident parameter
        self.index = None  # position in the torch-style state dict


class _SubGroup:
    __slots__ = ("id", "group", "params", "numel", "master", "device_param", "exp_avg", "exp_avg_sq", "device")

    def __init__(self, group):
        self.group, self.params, self.numel = group, [], 0
        self.device = False  # SO_PLACEMENT_DEVICE
        self.id = self.master = self.device_param = self.exp_avg = self.exp_avg_sq = None


class SuperOffloadAdamW(Optimizer):
    """AdamW with its state in host memory, stepped by libsuperoffload (see the module docstring).

    Args:
        params: parameters, named parameters ((name, tensor) pairs) or param-group dicts, as for
            torch.optim.AdamW. Names (from `model.named_parameters()` when `model` is given) name
            the slices (and the library checkpoint's tensors).
        lr, betas, eps, weight_decay: as torch.optim.AdamW (per param group).
        max_grad_norm: clip the global gradient norm to this at every step (0: no clipping).
        speculation: "auto" (default: the session decides each step, from what it measured,
            whether stepping sub-groups during backward pays), True or "on" (always during
            backward), False or "off" (all at step(); bit-for-bit reproducible with clipping).
        sub_group_numel: pack consecutive parameters of a group into sub-groups of up to this
            many elements (0: one sub-group per parameter; FSDP2 always uses one per parameter).
        cores: CPU cores of the optimizer's own pinned thread pool. None: with torch.distributed
            initialised, this rank's share of the node (see `superoffload.torch._cores`); else the
            library's default pool (every CPU this process may run on).
        cores_fraction: the fraction of this rank's share (after one core left to the training
            thread) given to the pool when `cores` is None (DeepSpeed's cpuadam_cores_perc).
        moment_dtype: "f32" (16 bytes of host memory per offloaded parameter with bf16 gradients)
            or "bf16" (12 bytes; those sub-groups are stepped at step(), without speculation).
        gpu_fraction: CUDA mode: keep the first parameters in forward order, up to this fraction
            of the trainable elements, on the GPU (f32 masters and moments there). 0: everything
            offloaded. gpu_resident="library" (default): sub-groups placed on the GPU by the
            library (SO_PLACEMENT_DEVICE, stepped by its GPU kernel after each decision);
            "torch": the earlier path, torch's fused AdamW on GPU masters (needs bias correction
            and no loss scaler).
        gpu_budget_bytes: CUDA mode: device bytes for the library's automatic split (it places
            the first sub-groups on the GPU after a few measured steps); 0: off.
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
        nvtx: NVTX ranges around hand-offs and step() (default: on when CUDA is available).
        first_touch: allocate the host state untouched and let the optimizer pool's threads write
            it first (NUMA placement), before the master weights are filled in.
        piece_bytes, host_memory_limit, bias_correction: passed to the session.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, max_grad_norm=0.0,
                 speculation="auto", sub_group_numel=1 << 25, cores=None, cores_fraction=1.0, model=None, wait="auto",
                 copy_dtype="auto", moment_dtype="f32", accumulation_steps=1, distributed="auto", process_group=None,
                 loss_scaler=None, piece_bytes=16 << 20, host_memory_limit=0, bias_correction=True, align_bytes=256,
                 gpu_fraction=0.0, gpu_budget_bytes=0, gpu_resident="library", nvtx=None, first_touch=True):
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
        if moment_dtype not in ("f32", "bf16"):
            raise ValueError(f'moment_dtype must be "f32" or "bf16", not {moment_dtype!r}')
        params, names = _split_names(params)
        self._constructing = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._constructing = False
        self.max_grad_norm = float(max_grad_norm)
        self.accumulation_steps = int(accumulation_steps)
        self.moment_dtype = moment_dtype
        self._bc = bool(bias_correction)
        self._closed = False
        self._in_step = False
        self._ticket = None
        self._result = None
        self._nsteps = 0
        self._loaded = False
        self._saved_meta = None
        self._hooks = []
        self._pending = set()
        self._unowned = []
        self._times = {"handoff_s": 0.0, "step_call_s": 0.0, "wait_s": 0.0}
        self._last_times = dict(self._times)
        self._nvtx = _Nvtx(torch.cuda.is_available() if nvtx is None else nvtx)
        self.session = None

        if model is not None:
            for n, p in model.named_parameters():
                names.setdefault(id(p), n)
        infos, seen, index = [], set(), 0
        by_index = {}
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                pos = index
                index += 1
                if id(p) in seen or not p.requires_grad:
                    continue
                seen.add(id(p))
                info = _ParamInfo(p, names.get(id(p)), gi)
                info.index = pos
                by_index[pos] = info
                infos.append(info)
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
        self._by_index = by_index

        # Mode: where the rank-local parameters live.
        devices = {_local(i.param).device for i in infos}
        if len(devices) != 1:
            raise ValueError("SuperOffloadAdamW: all trainable parameters must be on one device; got "
                             f"{sorted(map(str, devices))}")
        self.device = devices.pop()
        if self.device.type not in ("cuda", "cpu"):
            raise ValueError(f"SuperOffloadAdamW: parameters on {self.device} (only cuda and cpu are supported)")
        self.cuda = self.device.type == "cuda"
        dtypes = {_local(i.param).dtype for i in infos}
        if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES:
            raise ValueError("SuperOffloadAdamW: trainable parameters must share one of float32, bfloat16, float16; "
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
        if gpu_resident not in ("library", "torch"):
            raise ValueError(f'gpu_resident must be "library" or "torch", not {gpu_resident!r}')
        self._device_infos = []  # first parameters placed on the GPU by the library (ABI 2 placement)
        if gpu_resident == "library" and gpu_fraction > 0:
            self._gpu_infos, self._gpu_opt, self._gpu_groups = [], None, []
            self._device_infos = self._pick_gpu_prefix(infos, float(gpu_fraction))
        else:
            infos = self._split_gpu_resident(infos, float(gpu_fraction), loss_scaler, bias_correction)
        if gpu_budget_bytes and not self.cuda:
            raise ValueError("SuperOffloadAdamW: gpu_budget_bytes needs CUDA parameters")

        if cores is None:
            cores = _cores.rank_cores(cores_fraction, self.device.index if self.cuda else None)
        self.cores = list(cores) if cores is not None else None
        # The pool the session runs on; also used to first-touch the host state (NUMA).
        self._pool = _core.Pool(0, self.cores) if self.cores else None
        dt = _DTYPES[self.param_dtype]
        if copy_dtype == "auto":
            copy_dtype = dt if self.cuda and dt != "f32" else "none"
        self._loss_scaler = loss_scaler is not None
        self.session = _core.Session(
            cuda=self.cuda, device=(self.device.index or 0) if self.cuda else 0, speculation=speculation,
            mode="adamw", bias_correction=bias_correction, grad_dtype=dt, accum_dtype=dt, moment_dtype=moment_dtype,
            copy_dtype=copy_dtype, pool=self._pool, host_memory_limit=int(host_memory_limit),
            piece_bytes=int(piece_bytes), loss_scaler=loss_scaler,
            **({"gpu_budget_bytes": int(gpu_budget_bytes)} if gpu_budget_bytes else {}))
        self._accum_torch = _TORCH[dt]
        self._group_hp = [None] * len(self.param_groups)
        for gi, g in enumerate(self.param_groups):
            hp = self._hparams(g)
            self.session.add_group(*hp)
            self._group_hp[gi] = hp
        # ABI 2: the caller provides the moment buffers (torch tensors here: the state dict views them).
        self._own_moments = "exp_avg" in _abi.SubgroupDesc.field_names()
        if self.cuda:
            self._copy_stream = torch.cuda.ExternalStream(self.session.copy_stream(), device=self.device)

        self._first_touch = bool(first_touch)
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
        mem = self.memory()
        logger.info("SuperOffloadAdamW: %s mode, %d parameters offloaded in %d sub-groups (%.2f B/param on the host, "
                    "moments %s), %d GPU-resident, speculation %s, clip %s, pool %s",
                    "CUDA" if self.cuda else "host", mem["params"], len(self._subgroups),
                    mem["host_bytes_per_param"], moment_dtype, len(self._gpu_infos), speculation,
                    self.max_grad_norm or "off", _cores._fmt(self.cores) if self.cores else "default")

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

    def _pick_gpu_prefix(self, infos, fraction):
        """The first parameters in forward order, up to `fraction` of the elements (SuperOffload's
        ratio = 1 - fraction): their gradients arrive last in backward and their weights are needed
        first, so they are the ones worth keeping on the GPU."""
        if not self.cuda or self.fsdp:
            raise ValueError("SuperOffloadAdamW: gpu_fraction needs CUDA parameters without FSDP2")
        budget, acc, out = fraction * sum(i.numel for i in infos), 0, []
        for info in infos:
            if acc + info.numel > budget:
                break
            acc += info.numel
            out.append(info)
        if len(out) == len(infos):
            raise ValueError(f"SuperOffloadAdamW: gpu_fraction={fraction} leaves no parameter to offload")
        return out

    def _split_gpu_resident(self, infos, fraction, loss_scaler, bias_correction):
        """Picks the GPU-resident parameters (a prefix in forward order) and sets up their f32
        masters and torch optimizer; returns the offloaded ones.

        ABI 1 path: torch's fused AdamW steps them. When the library has GPU-resident sub-groups
        (so_subgroup_desc.placement, ABI 2), they become sub-groups with that placement instead;
        see `_device_placement_supported`."""
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
        device = {id(i) for i in self._device_infos}
        for info in infos:
            if info.numel == 0:  # an empty FSDP shard on this rank: nothing to step
                continue
            key = (info.group, id(info) in device)  # device-placed and host sub-groups never mix
            cur = open_.get(key)
            if cur is None or limit <= 0 or cur.numel + info.numel > limit:
                cur = _SubGroup(info.group)
                cur.device = id(info) in device
                out.append(cur)
                open_[key] = cur
            cur.params.append(info)
            cur.numel += info.numel
        return out

    @torch.no_grad()
    def _touch(self, bufs):
        """First touch of freshly allocated host buffers by the optimizer pool's threads: one
        so_adam_update pass with lr 0 over them (param = bufs[0], moments = bufs[1:] or scratch),
        chunk by chunk; the values are overwritten afterwards. Linux places a page on the NUMA
        node of the thread that first writes it, so the state lands where the pool updates it."""
        if not self._first_touch or bufs[0].numel() == 0:
            return
        n = bufs[0].numel()
        ch = min(n, _TOUCH_CHUNK)
        grad = torch.zeros(ch, dtype=torch.bfloat16)
        mdt = bufs[-1].dtype if len(bufs) > 1 else torch.float32
        scratch = [torch.empty(ch, dtype=mdt) for _ in range(3 - len(bufs))]
        for start in range(0, n, ch):
            k = min(ch, n - start)
            p, m, v = [b[start:start + k] for b in bufs] + [t[:k] for t in scratch]
            _core.adam_update(p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), k, lr=0.0, beta1=0.5,
                              beta2=0.5, weight_decay=0.0, pool=self._pool, param_dtype=_DTYPES[p.dtype],
                              grad_dtype="bf16", moment_dtype=_DTYPES[m.dtype])

    def _register(self, align_bytes):
        """Master buffers (one page-aligned f32 arena), moment buffers (ABI 2), device buffers,
        and the session's sub-groups."""
        el = torch.tensor([], dtype=self.param_dtype).element_size()
        dev_align = max(1, align_bytes // el)
        host_align = max(1, 64 // 4)
        borrow = self.fsdp and not self.cuda  # host FSDP: the f32 shards themselves are the masters
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
            arena = torch.empty(total, dtype=torch.float32)
            self._touch([arena])
            base = (-(arena.data_ptr() // 4)) % page_el  # first page boundary
            self._master_arena = arena
        dev_arena = None
        if self.cuda and not self.fsdp:
            dev_total = sum(_round_up(sg.numel, dev_align) for sg in self._subgroups)
            dev_arena = torch.zeros(dev_total, dtype=self.param_dtype, device=self.device)
            self._device_arena = dev_arena
        host_pos, dev_pos = (base if arena is not None else 0), 0
        mdt = _TORCH[self.moment_dtype]
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
                    sg.master.zero_()
                    for info in sg.params:
                        sg.master[info.offset:info.offset + info.numel].copy_(_local(info.param).reshape(-1))
                extra, keep = {}, [sg.master]
                if self._own_moments:
                    sg.exp_avg = torch.empty(sg.numel, dtype=mdt)
                    sg.exp_avg_sq = torch.empty(sg.numel, dtype=mdt)
                    self._touch([sg.exp_avg, sg.exp_avg_sq])
                    sg.exp_avg.zero_()
                    sg.exp_avg_sq.zero_()
                    extra = dict(exp_avg=sg.exp_avg.data_ptr(), exp_avg_sq=sg.exp_avg_sq.data_ptr())
                if sg.device:
                    extra["placement"] = int(_abi.Placement.DEVICE)
                    keep += [sg.exp_avg, sg.exp_avg_sq]
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
                    keep.append(sg.device_param)
                elif not borrow:
                    for info in sg.params:  # host mode: the parameter is its master slice
                        info.param.data = sg.master[info.offset:info.offset + info.numel].view(info.param.shape)
                slices = [(info.name, info.offset, info.numel) for info in sg.params]
                sg.id, slice_ids = self.session.add_subgroup(
                    sg.group, sg.master.data_ptr(), sg.numel, slices, master_dtype="f32",
                    device_param=sg.device_param.data_ptr() if sg.device_param is not None else 0,
                    device_param_dtype=_DTYPES[self.param_dtype], keep=keep, **extra)
                for info, sid in zip(sg.params, slice_ids):
                    info.sg, info.slice = sg.id, sid
        if self.cuda:
            torch.cuda.current_stream(self.device).synchronize()
        self._all_sgs = [sg.id for sg in self._subgroups]
        self._sg_by_id = {sg.id: sg for sg in self._subgroups}

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

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

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
        t0 = time.perf_counter()
        with self._nvtx.range(f"superoffload:hand_over {info.name}"):
            g = p.grad
            if _is_dtensor(g):
                g = g._local_tensor
            if not self._in_step and (info.sg is not None or self.distributed):
                self._begin()  # distributed: even a rank whose shards are all empty joins the all-reduce
            if info.sg is None:  # empty local shard
                p.grad = None
                return
            if g.numel() != info.numel:
                raise _core.SuperOffloadError(_abi.Status.INVALID_ARGUMENT,
                                              f"the gradient of {info.name} has {g.numel()} elements; the parameter "
                                              f"{info.numel}")
            if self.cuda:
                if not g.is_cuda:
                    raise _core.SuperOffloadError(_abi.Status.INVALID_ARGUMENT,
                                                  f"the gradient of {info.name} is on {g.device}; this CUDA session "
                                                  f"takes gradients on {self.device}")
                # Casting or compacting runs on the current stream, which is where the copy is ordered.
                t = g if g.dtype == self._accum_torch else g.to(self._accum_torch)
                t = t.contiguous()
                # The lifetime rule of so_session_grad_device: the caching allocator must not reuse
                # this memory before the copy stream has passed the copy. Recorded before the
                # hand-off, so a failure cannot leave a copy reading freed memory.
                t.record_stream(self._copy_stream)
                self.session.grad_device(info.slice, t.data_ptr(), t.numel(), self.session.accum_dtype, self._stream())
            else:
                t = g if g.dtype == torch.float32 else g.float()
                t = t.contiguous()
                if t.device.type != "cpu":
                    raise _core.SuperOffloadError(_abi.Status.INVALID_ARGUMENT,
                                                  f"the gradient of {info.name} is on {t.device}; a host session takes "
                                                  "CPU gradients")
                self.session.grad_copy(info.slice, t.data_ptr(), t.numel())
            p.grad = None  # the session has it (CUDA: record_stream'ed on the copy stream)
        self._times["handoff_s"] += time.perf_counter() - t0

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
            self.session.enqueue_wait_final(sgs, self._stream())
        else:
            t0 = time.perf_counter()
            with self._nvtx.range("superoffload:wait"):
                self.session.wait_final(sgs)
            self._times["wait_s"] += time.perf_counter() - t0

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
        t0 = time.perf_counter()
        with self._nvtx.range("superoffload:step"):
            self._sync_groups()
            if self.cuda:
                self.session.set_compute_stream(self._stream())
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
            self._mark_state()
            for info in self._infos:
                info.count = 0
            if self.wait_mode == "module":
                self._pending = set(self._all_sgs)
                if self._unowned:
                    self._pending.difference_update(self._unowned)
                    self._wait_subgroups(self._unowned)
            elif self.cuda:
                self.session.enqueue_wait_final(self._all_sgs, self._stream())
            else:
                self.session.wait(self._ticket)
        self._times["step_call_s"] += time.perf_counter() - t0
        self._last_times = dict(self._times)
        for k in self._times:
            self._times[k] = 0.0
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

    def synchronize(self, host=False):
        """Makes the weights of the latest step final and visible: waits on the host until the
        step is done (every sub-group final), and in CUDA mode makes the current stream wait for
        the publication of the weights (with `host=True`, also until the current stream has
        passed that point). Call it before reading parameters outside a forward.

        The stream waits only for publication already queued: so_ticket_enqueue_wait waits on
        the host for a ticket still pending (a GPU-side wait for work not yet queued was seen to
        deadlock: python/tests/gpu_wait_repro.py)."""
        self._check_open()
        if self._ticket is not None:
            t0 = time.perf_counter()
            self.session.wait(self._ticket)
            self._times["wait_s"] += time.perf_counter() - t0
        if self._pending:
            todo = sorted(self._pending)
            self._pending.clear()
            self._wait_subgroups(todo)
        if self._ticket is None or not self.cuda:
            return
        self.session.enqueue_wait_final(self._all_sgs, self._stream())
        if host:
            torch.cuda.current_stream(self.device).synchronize()

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
        """The latest step's outcome as a dict (global_norm, clip_coef, skipped, skip_reason, kept,
        rescaled, rolled_back, redone, stepped, speculative, late_gradients, ...), or None
        before the first step. Waits for the step unless wait=False (then None if not done)."""
        if self._ticket is None:
            return None
        if self._result is None:
            r = self.session.step_result(self._ticket, -1.0 if wait else 0.0)
            if r is None:
                return None
            r["step"] = self._nsteps
            r["gpu_resident_stepped"] = 0 if r["skipped"] else len(self._gpu_infos) + r.get("device_stepped", 0)
            self._result = r
        return dict(self._result)

    def metrics(self, wait=True):
        """One flat dict for loggers (Trainer, W&B, TensorBoard) about the latest step: global_norm,
        clip_coef, skipped, kept / rescaled / rolled_back / redone / stepped / speculative /
        cancelled counts, seconds the training thread spent in hand-offs, in step() and waiting
        for weights (host mode) since the step before (handoff_s, step_call_s, wait_s; their sum
        exposed_s), forward_wait_s (the library's, where it reports it), pinned and host bytes,
        device bytes of GPU-resident state. {} before the first step."""
        r = self.last_step_result(wait=wait)
        if r is None:
            return {}
        t = self._last_times
        out = {k: r.get(k) for k in ("global_norm", "clip_coef", "skipped", "skip_reason", "kept", "rescaled",
                                      "rolled_back", "redone", "stepped", "speculative", "late_gradients", "loss_scale")}
        out["cancelled"] = r.get("cancelled", 0)
        out["device_stepped"] = r.get("gpu_resident_stepped", 0)
        out.update(t)
        out["forward_wait_s"] = r.get("forward_wait_s", t["wait_s"] if not self.cuda else None)
        out["exposed_s"] = t["handoff_s"] + t["step_call_s"] + t["wait_s"] + (
            r.get("forward_wait_s", 0.0) if self.cuda else 0.0)
        out["pinned_bytes"] = self.session.pinned_bytes()
        out["host_bytes"] = self.session.host_bytes() + self._master_bytes()
        out["device_bytes"] = self._device_state_bytes()
        out["step"] = r["step"]
        return out

    def loss_scale(self):
        """The built-in loss scaler's scale for the next backward (1 without one)."""
        return self.session.loss_scale()

    def add_param_group(self, param_group):
        if getattr(self, "_constructing", True):
            return super().add_param_group(param_group)
        raise NotImplementedError("SuperOffloadAdamW: param groups are fixed at construction")

    # ---- torch-native state ---------------------------------------------------------------

    def _param_shape(self, info):
        return _local(info.param).shape

    def _wrap(self, info, t):
        """A per-parameter state tensor shaped like the parameter (a DTensor like it under FSDP2)."""
        local = t.view(self._param_shape(info))
        if info.dtensor:
            if self._saved_meta is not None:
                # A view of the mapped file cannot be pickled inside a DTensor (torch.save refuses
                # its storage): the rank-local shard is copied.
                local = local.clone()
            p = info.param
            return DTensor.from_local(local, device_mesh=p.device_mesh, placements=p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return local

    def _slice_states(self):
        """{param name: (master, exp_avg, exp_avg_sq, step)} of the offloaded parameters, 1-d
        tensors viewing the host state: the moment buffers themselves (caller-owned moments, ABI 2)
        or a mapped checkpoint file the session wrote (ABI 1); plus the loss scaler's metadata."""
        out, scaler = {}, None
        self._saved_meta = None
        if self._own_moments and not self._loss_scaler:
            for sg in self._subgroups:
                st = self.session.get_subgroup_state(sg.id)
                step = int(st["step_count"]) if st else self.session.step_count(sg.id)
                for info in sg.params:
                    sl = slice(info.offset, info.offset + info.numel)
                    out[info.name] = (sg.master[sl], sg.exp_avg[sl], sg.exp_avg_sq[sl], step)
            return out, scaler
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "state.safetensors")
            self.session.save(path)
            meta, tensors = _checkpoint.read(path)  # views of the mapping, which outlives the file
        for sg in self._subgroups:
            for info in sg.params:
                out[info.name] = (tensors[f"master/{info.name}"], tensors[f"exp_avg/{info.name}"],
                                  tensors[f"exp_avg_sq/{info.name}"], int(meta[f"slice.{info.name}.step"]))
        if meta.get("loss_scaler") == "dynamic":
            scaler = {k: v for k, v in meta.items() if k.startswith("loss_scaler")}
        self._saved_meta = meta
        return out, scaler

    def state_dict(self):
        """torch.optim.AdamW's layout: {"state": {index: {"step", "exp_avg", "exp_avg_sq",
        "master"}}, "param_groups": [...]} with tensors shaped like the parameters (DTensors under
        FSDP2), plus {"superoffload": {...}} (parameter names, step count, loss scaler). The
        tensors view the host state where the library lets them (its moment buffers with ABI 2,
        a mapped file otherwise); "master" is the f32 master weight. torch.optim.AdamW loads it
        (it ignores "master"); `load_state_dict` takes it or a torch AdamW state dict."""
        self._check_idle("state_dict")
        self.synchronize(host=True)
        index, groups = 0, []
        for g in self.param_groups:
            entry = dict(_TORCH_ADAMW_KEYS)
            entry.update({k: v for k, v in g.items() if k != "params"})
            entry["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(entry)
        so = {"format": 2, "library_version": _core.version(), "steps": self._nsteps,
              "moment_dtype": self.moment_dtype,
              "names": {i.index: i.name for i in self._infos},
              "gpu_resident": [i.name for i in self._gpu_infos],
              "device_placed": [i.name for i in self._device_infos]}
        if self._nsteps == 0 and not self._loaded:
            # Like torch: no per-parameter state before the first step (and nothing to copy
            # when a wrapper round-trips the state dict, as accelerate's device placement does).
            return {"state": {}, "param_groups": groups, "superoffload": so}
        slices, scaler = self._slice_states()
        state = {}
        for info in self._infos:
            if info.gpu_master is not None:
                st = self._gpu_opt.state.get(info.gpu_master, {})
                if not st:
                    continue
                state[info.index] = {"step": torch.tensor(float(st["step"])),
                                     "exp_avg": st["exp_avg"].view(info.param.shape),
                                     "exp_avg_sq": st["exp_avg_sq"].view(info.param.shape),
                                     "master": info.gpu_master.view(info.param.shape)}
                continue
            if info.name in slices:
                master, m, v, step = slices[info.name]
            else:  # an empty local shard
                mdt = _TORCH[self.moment_dtype]
                master, m, v = torch.zeros(0), torch.zeros(0, dtype=mdt), torch.zeros(0, dtype=mdt)
                step = self._nsteps_taken()
            state[info.index] = {"step": torch.tensor(float(step)), "exp_avg": self._wrap(info, m),
                                 "exp_avg_sq": self._wrap(info, v), "master": self._wrap(info, master)}
        if scaler:
            so["loss_scaler"] = scaler
        if self._saved_meta:
            so["checkpoint_meta"] = dict(self._saved_meta)  # lets a load skip recomputing the checksum
        return {"state": state, "param_groups": groups, "superoffload": so}

    def _mark_state(self):
        """Optimizer.state gets one entry per parameter once there is state (its tensors live in
        the library; state_dict() has them): tools that test `optimizer.state` for emptiness,
        such as torch.distributed.checkpoint's state-dict helpers, see an initialised optimizer."""
        if not self.state:
            for info in self._infos:
                self.state[info.param] = {"superoffload": "state in state_dict()"}

    def _nsteps_taken(self):
        for sg in self._subgroups:
            return self.session.step_count(sg.id)
        return 0

    @torch.no_grad()
    def load_state_dict(self, state_dict):
        """Restores master weights (and through them the model's parameters), moments, step counts
        and the param groups' hyperparameters from `state_dict()`'s output, or from a
        torch.optim.AdamW state dict of the same param groups (migration: its moments and steps;
        master weights from the model's current parameters)."""
        self._check_idle("load_state_dict")
        so = state_dict.get("superoffload") if isinstance(state_dict, dict) else None
        if isinstance(so, dict) and so.get("format") == 1:
            return self._load_format1(state_dict)
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                        for a, b in zip(groups, self.param_groups)):
            raise ValueError("the state dict's param groups do not match this optimizer's (same groups, same "
                             "number of parameters in each, as torch.optim.AdamW requires)")
        by_name = {i.name: i.index for i in self._infos}
        saved_state = {}
        for k, v in state_dict["state"].items():
            if isinstance(k, str) and not k.isdigit():  # keyed by parameter name (FQN)
                if k not in by_name:
                    raise ValueError(f"the state dict has state for {k!r}, which is not a parameter of this optimizer")
                saved_state[by_name[k]] = v
            else:
                saved_state[int(k)] = v
        if so is not None:
            gpu_saved = so.get("gpu_resident", [])
            if gpu_saved != [i.name for i in self._gpu_infos]:
                raise ValueError(f"the state dict keeps {len(gpu_saved)} parameters on the GPU and this optimizer "
                                 f"{len(self._gpu_infos)} (gpu_fraction must match the saving optimizer's)")
        if not saved_state and self._nsteps == 0 and not self._loaded:
            # Nothing to restore into a fresh optimizer (torch's state dict before a first step,
            # or accelerate's device-placement round trip): the hyperparameters only.
            for g, saved in zip(self.param_groups, groups):
                for k, v in saved.items():
                    if k != "params" and k in g:
                        g[k] = tuple(v) if k == "betas" else v
            self._sync_groups()
            return
        mdt = _TORCH[self.moment_dtype]

        def local(x):
            return x.to_local() if _is_dtensor(x) else x

        # Gather and check everything before changing anything.
        plan = []  # (sg, step, [(info, master, m, v)])
        for sg in self._subgroups:
            entries, steps = [], set()
            for info in sg.params:
                st = saved_state.get(info.index)
                if st:
                    m = local(st["exp_avg"]).detach().reshape(-1)
                    v = local(st["exp_avg_sq"]).detach().reshape(-1)
                    master = local(st["master"]).detach().reshape(-1) if "master" in st else None
                    step = int(float(st["step"]))
                else:
                    m = v = master = None
                    step = 0
                for what, t in (("exp_avg", m), ("exp_avg_sq", v), ("master", master)):
                    if t is not None and t.numel() != info.numel:
                        raise ValueError(f"state of {info.name}: {what} has {t.numel()} elements, the parameter "
                                         f"{info.numel}")
                steps.add(step)
                entries.append((info, master, m, v))
            if len(steps) > 1:
                raise ValueError(f"parameters {[i.name for i in sg.params]} share a sub-group but have different "
                                 f"step counts {sorted(steps)} in the state dict; use sub_group_numel=0 (one "
                                 "sub-group per parameter) to load it")
            plan.append((sg, steps.pop(), entries))

        if self.cuda:
            torch.cuda.synchronize(self.device)
        for g, saved in zip(self.param_groups, groups):
            for k, v in saved.items():
                if k != "params" and k in g:
                    g[k] = tuple(v) if k == "betas" else v
        self._group_hp = [None] * len(self.param_groups)
        self._sync_groups()

        if self._own_moments and not self._loss_scaler:
            for sg, step, entries in plan:
                if sg.device:  # the host buffers become authoritative, then go back to the GPU
                    self.session.set_placement(sg.id, "host")
                for info, master, m, v in entries:
                    sl = slice(info.offset, info.offset + info.numel)
                    if master is not None:
                        sg.master[sl].copy_(master)
                    else:
                        sg.master[sl].copy_(_local(info.param).reshape(-1))
                    sg.exp_avg[sl].copy_(m if m is not None else torch.zeros(()))
                    sg.exp_avg_sq[sl].copy_(v if v is not None else torch.zeros(()))
                self.session.set_step_count(sg.id, step)
                if sg.device:
                    self.session.set_placement(sg.id, "device")
                if self.cuda:  # publish the loaded masters into the model's parameters
                    sg.device_param.copy_(sg.master.to(self.device, non_blocking=False).to(self.param_dtype))
        else:
            tensors, meta = {}, self._checkpoint_meta(so)
            for sg, step, entries in plan:
                for info, master, m, v in entries:
                    if master is None:
                        master = _local(info.param).detach().reshape(-1)
                    tensors[f"master/{info.name}"] = master.to("cpu", torch.float32).contiguous()
                    for key, t in (("exp_avg", m), ("exp_avg_sq", v)):
                        t = torch.zeros(info.numel, dtype=mdt) if t is None else t.to("cpu", mdt).contiguous()
                        tensors[f"{key}/{info.name}"] = t
                    meta[f"slice.{info.name}.group"] = str(sg.group)
                    meta[f"slice.{info.name}.step"] = str(step)
            with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
                path = os.path.join(d, "state.safetensors")
                saved = (so or {}).get("checkpoint_meta")
                if saved and {k: v for k, v in saved.items() if k.startswith("slice.")} == \
                        {k: v for k, v in meta.items() if k.startswith("slice.")}:
                    # Our own state dict, same slices and steps: the file the library wrote had
                    # exactly these tensors and metadata, so its checksum holds unless a tensor
                    # changed (the library checks; then the checksum is computed here).
                    try:
                        _checkpoint.write(path, tensors, saved, known_checksum=saved["checksum"])
                        self.session.load(path)
                        saved = True
                    except _core.SuperOffloadError as e:
                        if e.status != _abi.Status.BAD_CHECKPOINT:
                            raise
                        logger.info("load_state_dict: the state changed since it was saved; recomputing the "
                                    "checkpoint checksum")
                        saved = None
                else:
                    saved = None
                if saved is None:
                    _checkpoint.write(path, tensors, meta)
                    self.session.load(path)  # CUDA: also publishes the loaded weights
                del tensors
            self._group_hp = [None] * len(self.param_groups)
            self._sync_groups()  # the file carried the saved session's values; param_groups win

        if self._gpu_infos:
            gpu_state = {}
            order = [i for gi in self._gpu_groups for i in self._gpu_infos if i.group == gi]
            for k, info in enumerate(order):
                st = saved_state.get(info.index)
                if st:
                    if "master" in st:
                        info.gpu_master.copy_(local(st["master"]).reshape(info.gpu_master.shape))
                    else:
                        info.gpu_master.copy_(info.param.detach().reshape(info.gpu_master.shape))
                    gpu_state[k] = {"step": torch.tensor(float(st["step"])),
                                    "exp_avg": local(st["exp_avg"]).reshape(info.gpu_master.shape),
                                    "exp_avg_sq": local(st["exp_avg_sq"]).reshape(info.gpu_master.shape)}
                info.param.data.copy_(info.gpu_master.view_as(info.param))
            sd = self._gpu_opt.state_dict()
            sd["state"] = gpu_state
            self._gpu_opt.load_state_dict(sd)
        if self.cuda:
            torch.cuda.synchronize(self.device)
        steps = [s for _, s, _ in plan]
        self._nsteps = int(so.get("steps", 0)) if so else (max(steps) if steps else 0)
        self._loaded = True
        self._mark_state()
        self._pending.clear()

    def _checkpoint_meta(self, so):
        """Metadata of a library checkpoint file for this session (everything but the slices)."""
        meta = {"format": _checkpoint.FORMAT, "format_version": _checkpoint.FORMAT_VERSION,
                "library_version": _core.version(), "mode": "adamw",
                "bias_correction": "true" if self._bias_correction() else "false",
                "moment_dtype": self.moment_dtype, "groups": str(len(self.param_groups))}
        for gi in range(len(self.param_groups)):
            hp = self.session.get_group(gi)
            for k in ("lr", "beta1", "beta2", "eps", "weight_decay"):
                meta[f"group.{gi}.{k}"] = repr(float(hp[k]))
        scaler = (so or {}).get("loss_scaler")
        if self._loss_scaler:
            if not scaler:  # keep the scaler's current state
                with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
                    path = os.path.join(d, "s.safetensors")
                    self.session.save(path)
                    cur, _ = _checkpoint.read(path)
                scaler = {k: v for k, v in cur.items() if k.startswith("loss_scaler")}
            meta.update(scaler)
        else:
            meta["loss_scaler"] = "none"
        return meta

    def _bias_correction(self):
        return getattr(self, "_bc", True)

    def _load_format1(self, state_dict):
        """The earlier layout: the library's checkpoint file as bytes."""
        so = state_dict["superoffload"]
        if self._gpu_infos or so.get("gpu_resident"):
            raise ValueError("format-1 state dicts with GPU-resident parameters cannot be loaded; save again")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        with tempfile.TemporaryDirectory(prefix="superoffload-") as d:
            path = os.path.join(d, "optimizer.safetensors")
            with open(path, "wb") as f:
                f.write(so["checkpoint"])
            self.session.load(path)
        for g, saved in zip(self.param_groups, state_dict["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
        self._group_hp = [None] * len(self.param_groups)
        self._sync_groups()
        self._nsteps = int(so.get("steps", 0))
        self._pending.clear()

    def save_checkpoint(self, path):
        """The library's own checkpoint file (safetensors, per-slice, partition-independent)."""
        self._check_idle("save_checkpoint")
        self.synchronize(host=True)
        self.session.save(str(path))

    def load_checkpoint(self, path):
        """Loads a file of `save_checkpoint` (CUDA: republishes the weights)."""
        self._check_idle("load_checkpoint")
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.session.load(str(path))
        self._group_hp = [tuple(self.session.get_group(gi)[k] for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
                          for gi in range(len(self.param_groups))]
        for g, hp in zip(self.param_groups, self._group_hp):
            g["lr"], g["betas"], g["eps"], g["weight_decay"] = hp[0], (hp[1], hp[2]), hp[3], hp[4]
        self._pending.clear()

    # ---- measurements and lifetime ---------------------------------------------------------

    def trace(self, enable=True):
        """Starts (clearing an earlier one) or stops recording the session's timeline."""
        self.session.trace(bool(enable))

    def save_trace(self, path):
        """Writes the recorded timeline as Chrome trace JSON (bench/trace_plot.py renders it)."""
        self.session.save_trace(str(path))

    def _master_bytes(self):
        arena = getattr(self, "_master_arena", None)
        if arena is not None:
            return arena.numel() * 4
        return sum(sg.master.numel() * 4 for sg in self._subgroups)

    def _device_state_bytes(self):
        if self.cuda and self.session is not None and not self.session.closed:
            return self.session.device_bytes() + sum(i.numel for i in self._gpu_infos) * 12
        return sum(i.numel for i in self._gpu_infos) * 12

    def memory(self):
        """Host bytes: the session's allocations (moments, gradient buffers, copies), the master
        weights and moments this optimizer allocated, page-locked bytes, and bytes per offloaded
        parameter; GPU-resident parameters and their f32 master and moment bytes on the GPU."""
        gpu = sum(i.numel for i in self._gpu_infos) + sum(i.numel for i in self._device_infos)
        numel = sum(i.numel for i in self._infos) - gpu
        master = self._master_bytes()
        moments = sum(sg.exp_avg.numel() * sg.exp_avg.element_size() * 2 for sg in self._subgroups
                      if sg.exp_avg is not None)
        session = self.session.host_bytes()
        return {"params": numel, "session_host_bytes": session, "master_bytes": master, "moment_bytes": moments,
                "host_bytes_per_param": (session + master + moments) / max(numel, 1),
                "pinned_bytes": self.session.pinned_bytes(), "gpu_resident_params": gpu,
                "gpu_resident_bytes": self._device_state_bytes()}

    def subgroups(self):
        """[(sub-group id, param group, numel, [slice names])] in forward order (offloaded ones)."""
        return [(sg.id, sg.group, sg.numel, [i.name for i in sg.params]) for sg in self._subgroups]

    def gpu_resident(self):
        """Names of the GPU-resident parameters (see gpu_fraction)."""
        return [i.name for i in self._gpu_infos] + [i.name for i in self._device_infos]

    def close(self):
        """Removes the hooks and destroys the session (waiting for its work). The parameters keep
        their last published values and stay views of this optimizer's buffers."""
        if self._closed or self.session is None:
            self._closed = True
            return
        if self._in_step:
            warnings.warn("SuperOffloadAdamW.close() during a step: the gradients handed over are dropped")
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.cuda and not self.session.closed:
            if self._ticket is not None:
                self.session.enqueue_wait_final(self._all_sgs, self._stream())
            # Destroying the session frees the events that enqueued waits read: every stream
            # must have passed its waits first.
            torch.cuda.synchronize(self.device)
        self.session.close()
        if self._pool is not None:
            self._pool.close()
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
