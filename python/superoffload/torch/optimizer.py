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
  come from an all-reduce of `local_grad_sumsq` over the shard group. With the shards on the host
  (`CPUOffloadPolicy`), f32 shards are the master weights themselves; bf16 or f16 shards are the
  weights' copy, which the session writes beside f32 master weights of its own (the copy first:
  the next forward's gathers wait for it alone, the master weights and moments follow).

GPU-resident parameters (CUDA mode, `gpu_fraction > 0`; SuperOffload's `ratio < 1`): the first
parameters in forward order, up to that fraction of the elements, keep f32 master weights and
moments on the GPU: their sub-groups are registered with SO_PLACEMENT_DEVICE and the library's
GPU kernel steps them with the same decisions. `gpu_budget_bytes` passes through to the
library's automatic split; its default, "auto", lets the library measure the free GPU memory
after the warm-up steps (less a headroom) and keep on the GPU, within it, the first
sub-groups the measured optimizer waits ask for.

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
import warnings

import torch
from torch.optim import Optimizer

from .. import _abi, _core, _cores
from . import _buffers, _distributed, _fsdp, _handoff, _options, _params, _waits
from ._metrics import Nvtx, StepTimes, metrics
from ._params import DTYPE_NAMES, TORCH_DTYPES, local
from ._state_dict import StateDictMixin

logger = logging.getLogger("superoffload")


class SuperOffloadAdamW(StateDictMixin, Optimizer):
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
            or "bf16" (12 bytes; with a copy to publish, those sub-groups speculate on the copy
            alone, with the bits of stepping after backward). Where the host's memory bandwidth
            bounds the step (offloaded models of billions of parameters clipping every step),
            bf16 moments move 20 bytes per parameter a pass instead of 28.
        gpu_fraction: CUDA mode: keep the first parameters in forward order, up to this fraction
            of the trainable elements, on the GPU (f32 masters and moments there). 0: everything
            offloaded. Their sub-groups are placed on the GPU by the library
            (SO_PLACEMENT_DEVICE) and stepped by its GPU kernel with the step's decisions.
        gpu_budget_bytes: CUDA mode: device bytes for the library's automatic split (it places
            the first sub-groups on the GPU after a few measured steps); 0: everything offloaded.
            "auto" (the default): after 3 steps (torch's caching allocator then holds its peak)
            the library takes the GPU's free memory less a headroom of max(1 GiB, 5 % of the
            GPU) as the budget of its automatic split, which keeps the first sub-groups in
            forward order on the GPU, stepped with the same bits, as the exposed optimizer time
            asks: all that fit when clipping every step, fewer where the CPU's speculative
            steps hide in the backward (a GPU-stepped parameter costs the GPU its step); the
            rest is offloaded. Under `torch.cuda.set_per_process_memory_fraction` it counts
            only on what the cap leaves (the cap less torch's reserved memory and the
            session's). "auto" means 0 with CPU
            parameters and with `gpu_fraction` > 0 (which fixes the split itself). `metrics()`
            reports the budget chosen (`gpu_budget_bytes`) and `device_bytes`; the trace what was
            measured.
        model: the module holding the parameters: gives the forward order and names, and lets
            each module's forward wait only for its own sub-groups' weights (`wait="module"`).
            Every trainable parameter given must be one of its parameters (ValueError naming
            the one that is not).
        wait: "module" (per-module forward pre-hooks; needs `model`), "step" (everything waited
            for at the end of step(): on the GPU without blocking in CUDA mode, on the host in
            host mode) or "auto" ("module" with a model, under FSDP2 where this torch's FSDP2
            modules expose their state, else "step").
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
        align_bytes: alignment of each parameter's slice in the device buffers (CUDA mode).
        host_copy: CUDA mode with a copy_dtype: "auto" (the default: the library keeps a full host
            copy of the weights in copy_dtype where host memory allows, measured at the first
            step), "full" (kept: speculative steps write it during backward, and with bf16 moments
            the copy steps ahead of the rest) or "bounded" (each piece of the weights is written
            into one of a few 16 MiB pinned buffers as it is published: 2 bytes per parameter
            less host memory).
        gradient_home: CUDA mode: where each offloaded sub-group's gradient waits for the
            optimizer. "auto" (the default: on the host for as many sub-groups in forward order
            as its memory holds, less a reserve, on the GPU for the rest), "host" (a pinned host
            buffer, 2 bytes per parameter with bf16) or "device" (a GPU buffer the library reads
            back in pieces for each pass: no host memory for it).
        host_memory_limit: host bytes this optimizer may hold (0, the default: no limit; a whole
            number >= 0): the f32 master weights and both moments it allocates (`memory()`) and
            every buffer of the session (gradient buffers, copies, late gradients): what
            `metrics()["host_bytes"]` reports. The parameters' own storage is not counted: it
            existed before (in host mode the parameters become views of the master weights,
            which are counted; their old storage is freed when nothing else holds it; under
            host FSDP the f32 shards are the masters and are not counted), nor are device
            memory and torch's temporaries. A limit the state cannot fit in is refused at
            construction, before anything is allocated or re-pointed: a SuperOffloadError
            (OUT_OF_RESOURCES) with the bytes needed and the options that lower them. Within
            it, the session's automatic choices (`gradient_home`, `host_copy`) take what the
            master weights and moments leave.
        piece_bytes, bias_correction: passed to the session.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *, max_grad_norm=0.0,
                 speculation="auto", sub_group_numel=1 << 25, cores=None, cores_fraction=1.0, model=None, wait="auto",
                 copy_dtype="auto", moment_dtype="f32", accumulation_steps=1, distributed="auto", process_group=None,
                 loss_scaler=None, piece_bytes=16 << 20, host_memory_limit=0, bias_correction=True, align_bytes=256,
                 gpu_fraction=0.0, gpu_budget_bytes="auto", nvtx=None, first_touch=True, host_copy="auto",
                 gradient_home="auto"):
        _options.check_arguments(lr, betas, max_grad_norm, accumulation_steps, gpu_fraction, moment_dtype, wait)
        host_memory_limit = _options.host_memory_limit(host_memory_limit)
        host_copy_name, gradient_home_name = host_copy, gradient_home
        host_copy, gradient_home = _options.choice("host_copy", host_copy, _abi.HostCopy), _options.choice(
            "gradient_home", gradient_home, _abi.GradientHome)
        params, names = _params.split_names(params)
        self._constructing = True
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._constructing = False
        self.max_grad_norm = float(max_grad_norm)
        self.accumulation_steps = int(accumulation_steps)
        self.moment_dtype = moment_dtype
        self._bias_correction = bool(bias_correction)
        self._loss_scaler = loss_scaler is not None
        self._closed = False
        self._in_step = False
        self._ticket = None
        self._result = None
        self._nsteps = 0
        self._loaded = False
        self._hooks = []
        self._times = StepTimes()
        self._nvtx = Nvtx(torch.cuda.is_available() if nvtx is None else nvtx)
        self.session = None
        self._pool = None

        infos = _params.collect(self.param_groups, names, model)
        self._infos = infos
        self._by_param = {id(i.param): i for i in infos}
        self.device, self.param_dtype, self.fsdp = _params.common_placement(infos)
        self.cuda = self.device.type == "cuda"
        self._norm_group = _distributed.NormGroup(infos, self.fsdp, distributed, process_group)
        # FSDP2: the sub-groups in the order forward gathers them, and each module's forward
        # waiting for its own (_waits.py); with the shards on the host (`_fsdp_modules`) also, on
        # one rank, the gradients taken before FSDP2 reduces them (see _fsdp.py).
        fsdp_modules = _fsdp.fsdp_modules(model) if self.fsdp else None
        self._fsdp_modules = None if self.cuda else fsdp_modules
        self._handoff = self._waits = self._prefetcher = None
        take_dtype = None
        if fsdp_modules:
            _fsdp.forward_order(infos, fsdp_modules)
        if self._fsdp_modules:
            gdt = _fsdp.gradient_dtype(self._fsdp_modules)
            if _fsdp.shard_group_size(self._fsdp_modules) == 1 and gdt in DTYPE_NAMES:
                take_dtype = DTYPE_NAMES[gdt]
        compute = _fsdp.compute_device(self._fsdp_modules) if take_dtype else None
        self._device_infos = []  # the first parameters, placed on the GPU by the library
        if gpu_fraction > 0:
            if not self.cuda or self.fsdp:
                raise ValueError("SuperOffloadAdamW: gpu_fraction needs CUDA parameters without FSDP2")
            self._device_infos = _params.gpu_prefix(infos, float(gpu_fraction))
        gpu_budget_bytes = _core.gpu_budget_bytes(gpu_budget_bytes, self.cuda and not self._device_infos)
        # Until the library measures it (after the warm-up steps), the automatic budget is kept
        # within torch's per-process memory fraction, which the device's free memory does not show.
        self._budget_unmeasured = gpu_budget_bytes == _abi.GPU_BUDGET_AUTO
        if gpu_budget_bytes and not self.cuda:
            raise ValueError("SuperOffloadAdamW: gpu_budget_bytes needs CUDA parameters")

        dt = take_dtype or DTYPE_NAMES[self.param_dtype]
        # Host FSDP2 with bf16 or f16 shards: the session keeps f32 master weights and writes the
        # shards FSDP2 gathers as the weights' copy (half the bytes of f32 shards cross the link,
        # and the copy can step ahead of the rest).
        self._shard_copies = self.fsdp and not self.cuda and self.param_dtype != torch.float32
        if self._shard_copies:
            shard_dtype = DTYPE_NAMES[self.param_dtype]
            if copy_dtype not in ("auto", shard_dtype):
                raise ValueError(f"SuperOffloadAdamW: the {shard_dtype} FSDP2 shards are the weights' copy; "
                                 f"copy_dtype={copy_dtype!r} cannot differ")
            copy_dtype = shard_dtype
        if copy_dtype == "auto":
            copy_dtype = dt if self.cuda and dt != "f32" else "none"
        device_placed = {id(i) for i in self._device_infos}
        self._subgroups = _params.partition(infos, 0 if self.fsdp else int(sub_group_numel), device_placed)
        _buffers.layout(self._subgroups, cuda=self.cuda, param_dtype=self.param_dtype, align_bytes=align_bytes)
        # Host FSDP with f32 shards: the shards themselves are the masters.
        masters = not (self.fsdp and not self.cuda) or self._shard_copies
        session_bytes, session_lower = _buffers.session_host_bytes(
            self._subgroups, cuda=self.cuda, accum_dtype=dt, copy_dtype=copy_dtype, host_copy=host_copy_name,
            gradient_home=gradient_home_name, grads_lent=take_dtype is not None, copies_lent=self._shard_copies)
        # A taker on a GPU stages later micro-steps' gradients in pinned buffers of its own.
        staged = take_dtype is not None and compute.type == "cuda" and self.accumulation_steps > 1
        staging = _fsdp.staging_bytes(infos, TORCH_DTYPES[take_dtype]) if staged else 0
        # Checked before anything is allocated; the session then keeps its own buffers within what
        # the lent master weights and moments leave of the limit (its 0 would mean no limit).
        lent = _buffers.check_host_memory(self._subgroups, masters=masters, moment_dtype=moment_dtype,
                                          session_bytes=session_bytes, session_lower=session_lower,
                                          limit=host_memory_limit, grad_dtype=take_dtype, staging_bytes=staging)
        session_limit = max(1, host_memory_limit - lent) if host_memory_limit else 0

        if cores is None:
            cores = _cores.rank_cores(cores_fraction, self.device.index if self.cuda else None)
        self.cores = list(cores) if cores is not None else None
        # The pool the session runs on; also used to first-touch the host state (NUMA).
        self._pool = _core.Pool(0, self.cores) if self.cores else None
        self.session = _core.Session(
            cuda=self.cuda, device=(self.device.index or 0) if self.cuda else 0, speculation=speculation,
            mode="adamw", bias_correction=bias_correction, grad_dtype=dt, accum_dtype=dt, moment_dtype=moment_dtype,
            copy_dtype=copy_dtype, pool=self._pool, host_memory_limit=session_limit,
            piece_bytes=int(piece_bytes), loss_scaler=loss_scaler, gpu_budget_bytes=gpu_budget_bytes,
            host_copy=host_copy, gradient_home=gradient_home)
        self._group_hp = [None] * len(self.param_groups)
        for gi, g in enumerate(self.param_groups):
            hp = _options.group_hparams(g)
            self.session.add_group(*hp)
            self._group_hp[gi] = hp

        self._master_arena = _buffers.register(
            self.session, self._subgroups, device=self.device, param_dtype=self.param_dtype,
            moment_dtype=moment_dtype, fsdp=self.fsdp, masters=masters, pool=self._pool, touch=bool(first_touch),
            grad_dtype=take_dtype, pinned_grads=compute is not None and compute.type == "cuda",
            shard_copies=self._shard_copies)
        self._handoff = _handoff.Handoff(
            self.session, infos, device=self.device, accum_dtype=TORCH_DTYPES[dt],
            accumulation_steps=self.accumulation_steps, distributed=self.distributed, begin=self._begin,
            times=self._times, nvtx=self._nvtx)
        self._handoff.install(self._fsdp_modules, self._by_param, take_dtype, compute,
                              unsharded_modules=self._unsharded_gradients(fsdp_modules))

        self._waits = _waits.Waits(self.session, self.device, [sg.id for sg in self._subgroups], self._times,
                                   self._nvtx)
        self._waits.install(wait, model, self._by_param, self.fsdp, fsdp_modules)
        if self._fsdp_modules and _fsdp.compute_device(self._fsdp_modules).type == "cuda" and \
                _fsdp.ShardPrefetcher.supported(self._fsdp_modules):
            self._prefetcher = _fsdp.ShardPrefetcher(self._fsdp_modules, self._by_param,
                                                     _fsdp.compute_device(self._fsdp_modules),
                                                     self._waits.wait_pending_of)
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
                    mem["host_bytes_per_param"], moment_dtype, len(self._device_infos), speculation,
                    self.max_grad_norm or "off", _cores._fmt(self.cores) if self.cores else "default")

    def _unsharded_gradients(self, fsdp_modules):
        """FSDP2 with GPU shards on one rank, one backward a step: its modules, whose unsharded
        parameters' gradients are handed over as backward produces them (None: the sharded
        parameters' gradients, as FSDP2 reduces them)."""
        if not (self.fsdp and self.cuda and self.accumulation_steps == 1):
            return None
        return fsdp_modules if fsdp_modules and _fsdp.shard_group_size(fsdp_modules) == 1 else None

    # ---- the model's state_dict hooks -----------------------------------------------------

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

    # ---- a step's beginning ---------------------------------------------------------------

    def _begin(self):
        """Begins the step at its first gradient (once a step)."""
        if self._in_step:
            return
        self._waits.wait_pending()
        self._sync_groups()
        if self._budget_unmeasured:
            self._limit_budget_to_fraction()
        self.session.begin_step(0.0 if self._loss_scaler else 1.0, 1)
        self._in_step = True

    def _limit_budget_to_fraction(self):
        """Under torch.cuda.set_per_process_memory_fraction the automatic budget may count on
        what the cap leaves: the cap less what torch's allocator reserved and the session holds on
        the device (the library measures it at a begin_step after the warm-up steps)."""
        if self.session.gpu_budget() is not None:
            self._budget_unmeasured = False
            return
        get_fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        fraction = get_fraction(self.device) if get_fraction else 1.0
        if fraction >= 1.0:
            return
        cap = int(fraction * torch.cuda.get_device_properties(self.device).total_memory)
        held = torch.cuda.memory_reserved(self.device) + self.session.device_bytes()
        self.session.limit_device_memory(max(0, cap - held))

    def _sync_groups(self):
        for gi, g in enumerate(self.param_groups):
            hp = _options.group_hparams(g)
            if hp != self._group_hp[gi]:
                self.session.set_group(gi, *hp)
                self._group_hp[gi] = hp

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
        self._handoff.flush()
        if not self._in_step:
            return loss  # no gradient this step: like torch, nothing changes
        self._handoff.zero_untaken()
        with self._times.timed("step_call_s"), self._nvtx.range("superoffload:step"):
            self._sync_groups()
            if self.cuda:
                self.session.set_compute_stream(torch.cuda.current_stream(self.device).cuda_stream)
            max_norm = self.max_grad_norm if max_grad_norm is None else float(max_grad_norm)
            if self._norm_group.ranks > 1:
                norm = self._norm_group.global_norm(self.session.local_grad_sumsq())
                self._ticket = self.session.step(max_norm, norm, False)
            else:
                self._ticket = self.session.step(max_norm)
            self._in_step = False
            self._result = None
            self._nsteps += 1
            self._expose_state()
            self._handoff.end_step()
            self._drop_read_ahead()
            self._waits.after_step(self._ticket)
        self._times.end_step()
        return loss

    def _drop_read_ahead(self):
        """Shards copied to the GPU ahead of FSDP2 (one rank) hold the weights before a step or
        a load: none is read after it."""
        if self._prefetcher is not None:
            self._prefetcher.reset()

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
            with self._times.timed("wait_s"):
                self.session.wait(self._ticket)
        self._waits.wait_pending()
        if self._ticket is None or not self.cuda:
            return
        self._waits.enqueue_all()
        if host:
            torch.cuda.current_stream(self.device).synchronize()

    @torch.no_grad()
    def reload_from_params(self):
        """Copies the model's current parameter values into the master weights (CUDA mode: after
        the parameters were changed behind the optimizer's back, e.g. by model.load_state_dict(),
        which calls this by itself when the optimizer was given `model`). Between steps only.
        Low-precision parameters change only the master weights they no longer round to: an f32
        master weight that still rounds to its parameter keeps its bits (so loading a model's
        state beside the optimizer's, in either order, keeps the optimizer's master weights)."""
        self._check_idle("reload_from_params")
        if self._ticket is not None:
            self.session.wait(self._ticket)  # the step ticket: every sub-group is final
        self._drop_read_ahead()
        for sg in self._subgroups:
            with self._host_authoritative(sg):
                for info in sg.params:
                    src = local(info.param).reshape(-1)
                    dst = sg.master[sg.span(info)]
                    if src.device.type == "cpu" and src.data_ptr() == dst.data_ptr():
                        continue  # host mode: the parameter is its master
                    if src.dtype == dst.dtype:
                        dst.copy_(src)
                        continue
                    src = src.to(dst.device)
                    changed = src != dst.to(src.dtype)
                    dst[changed] = src[changed].to(dst.dtype)

    @contextlib.contextmanager
    def _host_authoritative(self, sg):
        """Makes the host buffers the sub-group's state while the block writes them: one the library
        keeps on the GPU (`gpu_fraction`, the automatic split) comes to the host and goes back."""
        on_device = self.cuda and self.session.get_subgroup_state(sg.id)["placement"] == _abi.Placement.DEVICE
        if on_device:
            self.session.set_placement(sg.id, "host")
        yield
        if on_device:
            self.session.set_placement(sg.id, "device")

    def last_step_result(self, wait=True):
        """The latest step's outcome as a dict: the library's so_step_result fields by name
        (global_norm, clip_coef, skipped, skip_reason, kept, rescaled, rolled_back, redone,
        stepped, speculative, cancelled, device_stepped, ...) and `step` (steps taken by this
        optimizer), or None before the first step. Waits for the step unless wait=False (then
        None if not done)."""
        if self._ticket is None:
            return None
        if self._result is None:
            r = self.session.step_result(self._ticket, -1.0 if wait else 0.0)
            if r is None:
                return None
            r["step"] = self._nsteps
            self._result = r
        return dict(self._result)

    def metrics(self, wait=True):
        """One flat dict for loggers (Trainer, W&B, TensorBoard) about the latest step: every
        field of `last_step_result()` under the library's name (global_norm, clip_coef, skipped,
        kept / rescaled / rolled_back / redone / stepped / speculative / cancelled /
        device_stepped counts, forward_wait_s, ...) and `step`; seconds the training thread spent
        in hand-offs, in step() and waiting for weights (host mode) since the step before
        (handoff_s, step_call_s, wait_s; their sum with forward_wait_s in CUDA mode: exposed_s);
        pinned bytes, host bytes (host_bytes: what `host_memory_limit` bounds, as in
        `memory()`), device bytes of GPU-resident state (device_bytes) and, in CUDA mode, the
        automatic split's budget (gpu_budget_bytes; with "auto", from when it was chosen on).
        {} before the first step."""
        r = self.last_step_result(wait=wait)
        if r is None:
            return {}
        budget = self.session.gpu_budget() if self.cuda and not self.session.closed else None
        return metrics(r, self._times.last, cuda=self.cuda, pinned_bytes=self.session.pinned_bytes(),
                       host_bytes=self.memory()["host_bytes"],
                       device_bytes=self._device_state_bytes(), gpu_budget_bytes=budget)

    def loss_scale(self):
        """The built-in loss scaler's scale for the next backward (1 without one)."""
        return self.session.loss_scale()

    def add_param_group(self, param_group):
        if getattr(self, "_constructing", True):
            return super().add_param_group(param_group)
        raise NotImplementedError("SuperOffloadAdamW: param groups are fixed at construction")

    # ---- measurements and lifetime ---------------------------------------------------------

    def trace(self, enable=True):
        """Starts (clearing an earlier one) or stops recording the session's timeline."""
        self.session.trace(bool(enable))

    def save_trace(self, path):
        """Writes the recorded timeline as Chrome trace JSON (bench/trace_plot.py renders it)."""
        self.session.save_trace(str(path))

    def _device_state_bytes(self):
        return self.session.device_bytes() if self.cuda and not self.session.closed else 0

    def memory(self):
        """Host bytes: the session's allocations (gradient buffers, copies, late gradients), the
        master weights and moments this optimizer allocated, their sum (`host_bytes`, what
        `host_memory_limit` bounds: under host FSDP without the shards, which are the masters),
        page-locked bytes, and bytes per offloaded parameter;
        GPU-resident parameters and the session's device bytes (their f32 master and moment
        bytes, and staging buffers)."""
        return _buffers.memory(self.session, self._subgroups, numel=sum(i.numel for i in self._infos),
                               gpu_numel=sum(i.numel for i in self._device_infos), master_arena=self._master_arena,
                               staging_bytes=self._handoff.staging_bytes,
                               device_bytes=self._device_state_bytes())

    def subgroups(self):
        """[(sub-group id, param group, numel, [slice names])] in forward order."""
        return [(sg.id, sg.group, sg.numel, [i.name for i in sg.params]) for sg in self._subgroups]

    def gpu_resident(self):
        """Names of the GPU-resident parameters (see gpu_fraction)."""
        return [i.name for i in self._device_infos]

    @property
    def distributed(self):
        """Whether the global norm is all-reduced over a process group (see `distributed`)."""
        return self._norm_group.enabled

    @property
    def wait_mode(self):
        """What waits for a step's weights: "module" or "step" (see `wait`)."""
        return self._waits.mode

    @property
    def closed(self):
        """Whether close() was called: the optimizer takes no more gradients or calls."""
        return self._closed

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
        for hooks in (self._handoff, self._waits, self._prefetcher):
            if hooks is not None:
                hooks.close()
        if self.cuda and not self.session.closed:
            if self._ticket is not None:
                self._waits.enqueue_all()
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
