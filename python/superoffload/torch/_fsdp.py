"""FSDP2 (`fully_shard`) with the local shards on the host (`CPUOffloadPolicy`, or CPU training):
the f32 shards are the master weights the session steps in place, and two things keep the
optimizer off the training thread's path.

**Per-group waits.** Each FSDP2 module's forward waits, before FSDP2's own pre-forward hook
gathers its shards, for the final pass of its own sub-groups only (and of the modules it
prefetches): step() returns at once and the next forward overlaps the optimizer's tail. The
sub-groups are ordered as FSDP2 gathers them in forward (the root's group first), which is the
order the session finalizes them in.

**Gradients taken before the reduction (a shard group of one rank).** Each parameter's gradient
is taken from FSDP2's unsharded parameter as backward accumulates it: copied on a side stream
into a pinned host buffer of the gradient's dtype (bf16 with bf16 compute: 2 bytes a parameter
cross the link, where FSDP2's offload moves the reduced f32 gradient) which the session borrows
as the sub-group's gradient buffer, and handed over by this layer's thread once the copy is
done, so backward never waits for a copy. FSDP2 then finds no gradient to reduce and moves
nothing. With more ranks FSDP2 must reduce-scatter: each rank's hook on its sharded parameter
hands the reduced gradient over instead (FSDP2 then lands it on the host synchronously).

The hooks use FSDP2's per-module state (`_get_fsdp_state`): the parameter groups, their
unsharded parameters and the modules a module prefetches. Where a torch release lacks them,
`supported()` says so and the optimizer takes the reduced gradients with plain waits at step().
"""
import queue
import threading

import torch

from ._buffers import PinnedHostBuffer

# Pinned buffers a later micro-step's gradient lands in before the thread adds it: enough for
# the copy of one gradient to overlap the addition of the one before.
STAGING_BUFFERS = 3


def _staging_numel(infos):
    """The elements of one staging buffer: the largest parameter's gradient."""
    return max((info.numel for info in infos), default=0)


def staging_bytes(infos, dtype):
    """The pinned host bytes a GradientTaker stages later micro-steps' gradients in (`dtype`, a
    torch dtype): STAGING_BUFFERS of the largest parameter's gradient."""
    return STAGING_BUFFERS * _staging_numel(infos) * torch.empty(0, dtype=dtype).element_size()


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def _groups(state):
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return groups


class FsdpModule:
    """One FSDP2 module: the sharded parameters its groups gather, and its FSDPParams."""

    def __init__(self, module):
        self.module = module
        self.state = module._get_fsdp_state()
        self.fsdp_params = [fp for g in _groups(self.state) for fp in g.fsdp_params]
        self.params = [fp.sharded_param for fp in self.fsdp_params]

    def prefetched(self):
        """The FSDP2 states this module's pre-forward gathers ahead (set_modules_to_forward_prefetch)."""
        return list(getattr(self.state, "_states_to_forward_prefetch", []) or [])


def fsdp_modules(model):
    """The FSDP2 modules of `model` in the order forward gathers them (pre-order: the root's group
    first), or None when the torch release does not expose what the hooks need."""
    cls = _fsdp_module_class()
    if cls is None or model is None:
        return None
    try:
        out = [FsdpModule(m) for m in model.modules() if isinstance(m, cls)]
    except (AttributeError, AssertionError):
        return None
    if not out or not all(hasattr(fp, "sharded_param") and hasattr(fp, "init_unsharded_param")
                          for fm in out for fp in fm.fsdp_params):
        return None
    return out


def forward_order(infos, modules):
    """Sorts `infos` (ParamInfo) by the module that gathers them, in `modules`' order (then by
    their own order); a parameter no module gathers goes last."""
    rank = {}
    for k, fm in enumerate(modules):
        for p in fm.params:
            rank.setdefault(id(p), k)
    infos.sort(key=lambda i: rank.get(id(i.param), len(modules)))


def shard_group_size(modules):
    sizes = {fp.mesh_info.shard_mesh_size for fm in modules for fp in fm.fsdp_params}
    return max(sizes) if sizes else 1


def compute_device(modules):
    """The device FSDP2 computes on (where the unsharded parameters and their gradients live)."""
    device = modules[0].state._device
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def gradient_dtype(modules):
    """The dtype the gradients are taken in: FSDP2's reduce dtype where the policy sets one, else
    its compute dtype (the unsharded parameters'), else the shards'; None where modules differ."""
    dtypes = set()
    for fm in modules:
        policy = getattr(fm.state, "_mp_policy", None)
        chosen = getattr(policy, "reduce_dtype", None) or getattr(policy, "param_dtype", None)
        dtypes.update(chosen or p.dtype for p in fm.params)
    return dtypes.pop() if len(dtypes) == 1 else None


class GradientTaker:
    """Takes each unsharded gradient of a one-rank shard group into its sub-group's pinned host
    buffer and hands it to the session once it is there (see the module docstring).

    `begin(info)` is called before each parameter's first copy of a step (it begins the step
    once and waits until the parameter's buffer is free), `written(info)` hands a complete
    gradient over; both come from `_handoff.Handoff`. The hooks run on autograd's thread; the
    hand-overs on this object's thread, in the order of the copies."""

    def __init__(self, modules, infos_by_param, accumulation_steps, begin, written, device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.accumulation_steps = accumulation_steps
        self._begin, self._written = begin, written
        self._by_sharded = infos_by_param
        self._hooked = set()
        self._hooks = []
        self._stream = torch.cuda.Stream(device) if self.cuda else None
        self._staging = None  # a queue of free PinnedHostBuffers, made at the first micro-step 2
        self.staging_bytes = 0
        self._queue = queue.Queue()
        self._error = None
        self._thread = None
        self.taken = set()  # ids of the ParamInfos handed over this step
        for fm in modules:
            self._hooks.append(fm.module.register_forward_hook(self._install(fm)))

    def _install(self, fm):
        """Hooks the unsharded parameters, which FSDP2 makes at the first gather and keeps."""
        def post_forward(module, args, output):
            for fp in fm.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                if up is None or id(up) in self._hooked:
                    continue
                info = self._by_sharded.get(id(fp.sharded_param))
                if info is None or info.sg is None:
                    continue
                self._hooked.add(id(up))
                self._hooks.append(up.register_post_accumulate_grad_hook(self._take(info)))
        return post_forward

    def _take(self, info):
        def post_accumulate_grad(param):
            grad = param.grad
            if grad is None:
                return
            param.grad = None  # FSDP2 reduces nothing: the gradient is the session's now
            if hasattr(grad, "_local_tensor"):
                grad = grad._local_tensor
            self._check_thread()
            info.count += 1
            last = info.count >= self.accumulation_steps
            if info.count == 1:
                self._begin(info)
            self._copy(info, grad.reshape(-1), first=info.count == 1, last=last)
        return post_accumulate_grad

    def _copy(self, info, grad, first, last):
        """Micro-step 1 lands in the borrowed buffer; later ones in a pinned temporary that the
        thread adds (torch accumulates .grad in its dtype the same way)."""
        buf = info.grad_buffer
        if grad.numel() != buf.numel():
            raise RuntimeError(f"SuperOffloadAdamW: the gradient of {info.name} has {grad.numel()} elements; its "
                               f"buffer {buf.numel()}")
        if not self.cuda:
            if first:
                buf.copy_(grad)
            else:
                buf.add_(grad.to(buf.dtype))
            if last:
                self.taken.add(id(info))
                self._written(info)
            return
        staging = None if first else self._take_staging(buf.dtype)
        dst = buf if first else staging.tensor[:buf.numel()]
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            dst.copy_(grad, non_blocking=True)
            grad.record_stream(self._stream)
            done = torch.cuda.Event()
            done.record(self._stream)
        if last:
            self.taken.add(id(info))
        self._queue.put((info, done, None if first else (staging, dst), last))

    def _take_staging(self, dtype):
        """A free staging buffer, waiting for the thread to release one: the pinned memory of
        the later micro-steps stays bounded however far the backward runs ahead."""
        if self._staging is None:
            numel = _staging_numel(self._by_sharded.values())
            self._staging = queue.Queue()
            for _ in range(STAGING_BUFFERS):
                self._staging.put(PinnedHostBuffer(numel, dtype))
            self.staging_bytes = staging_bytes(self._by_sharded.values(), dtype)
        return self._staging.get()

    def _check_thread(self):
        if self.cuda and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="superoffload-fsdp-grads", daemon=True)
            self._thread.start()

    def _run(self):
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                info, done, staged, last = item
                done.synchronize()
                if self._error is None:
                    if staged is not None:
                        info.grad_buffer.add_(staged[1])
                    if last:
                        self._written(info)
                if staged is not None:
                    self._staging.put(staged[0])
            except BaseException as e:  # raised on the training thread by flush()
                self._error = e
            finally:
                self._queue.task_done()

    def flush(self):
        """Waits until every gradient taken so far was handed over; raises a hand-over's error."""
        if self._thread is not None:
            self._queue.join()
        if self._error is not None:
            e, self._error = self._error, None
            raise e

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class ShardPrefetcher:
    """One rank, shards on the host, compute on a GPU: FSDP2 copies a group's host shards to the
    GPU when the group is needed (its one-rank `wait_for_unshard`), on the compute stream, so no
    copy overlaps compute (at 2.8 B a fifth of the forward and backward). This copies the next
    group's shards ahead, on a stream of its own, while the current group computes (in forward
    once a module's forward is queued, the next group; in backward, as a group's is about to
    be, the one before) and FSDP2's copy then reads them on the GPU. `wait(sgs)` is called
    before the shards of those sub-groups are read: they must be final. Copies made ahead are
    dropped at `reset()` (every optimizer step), so none outlives the weights it copied."""

    def __init__(self, modules, infos_by_param, device, wait):
        self.device = device
        self._wait = wait
        self._stream = torch.cuda.Stream(device)
        self._groups = []  # (FSDPParamGroup, its sub-groups), in forward order
        self._hooks = []
        self._enclosing = set()  # groups of a module enclosing others (the root): its forward ends last
        inner = {id(fm.module) for fm in modules}
        for fm in modules:
            indices = []
            encloses = any(id(m) in inner for m in fm.module.modules() if m is not fm.module)
            for group in _groups(fm.state):
                infos = [infos_by_param.get(id(fp.sharded_param)) for fp in group.fsdp_params]
                indices.append(len(self._groups))
                if encloses:
                    self._enclosing.add(len(self._groups))
                self._groups.append((group, sorted({i.sg for i in infos if i is not None and i.sg is not None})))
            if not encloses:
                self._hooks.append(fm.module.register_forward_hook(self._after_forward(indices)))
        self._ahead = {}  # group index -> (the shards' copies on the GPU, the event they are ready at)
        self.groups_read_ahead = 0  # gathers that found their shards on the GPU (a count, for tests)
        self._gathered = set()  # groups whose forward copied their shards, not yet followed
        for k, (group, _) in enumerate(self._groups):
            group.wait_for_unshard = self._wrap(k, group.wait_for_unshard)

    @staticmethod
    def supported(modules):
        """Whether FSDP2's groups have the one-rank copy this reads ahead of: host shards, plain
        tensors (no `fsdp_pre_all_gather` extension), one rank."""
        return shard_group_size(modules) == 1 and all(
            hasattr(group, "wait_for_unshard") and hasattr(group, "_all_gather_result")
            and hasattr(group, "_training_state")
            and all(getattr(fp, "offload_to_cpu", False) and hasattr(fp, "_sharded_param_data")
                    and not hasattr(getattr(fp, "_sharded_local_tensor", None), "fsdp_pre_all_gather")
                    for fp in group.fsdp_params)
            for fm in modules for group in _groups(fm.state))

    def _wrap(self, k, original):
        group = self._groups[k][0]

        def wait_for_unshard():
            ahead = self._ahead.pop(k, None)
            if group._all_gather_result is None:
                return original()  # unsharded already (a recomputation): FSDP2 copies nothing
            if ahead is None:
                original()
            else:
                copies, ready = ahead
                current = torch.cuda.current_stream(self.device)
                current.wait_event(ready)
                saved = [fp._sharded_param_data for fp in group.fsdp_params]
                try:
                    for fp, copy in zip(group.fsdp_params, copies):
                        fp._sharded_param_data = copy
                    original()
                finally:
                    for fp, data in zip(group.fsdp_params, saved):
                        fp._sharded_param_data = data
                for copy in copies:
                    copy.record_stream(current)  # made on the side stream, read on this one
                self.groups_read_ahead += 1
            if group._training_state.name == "PRE_BACKWARD":
                self._read_ahead(k - 1)
            elif k in self._enclosing:
                self._read_ahead(k + 1)
            else:
                self._gathered.add(k)  # the next group follows once this module's forward is queued
        return wait_for_unshard

    def _after_forward(self, indices):
        def post_forward(module, args, output):
            for k in indices:
                if k in self._gathered:
                    self._gathered.discard(k)
                    self._read_ahead(k + 1)
        return post_forward

    def _read_ahead(self, j):
        if not 0 <= j < len(self._groups) or j in self._ahead:
            return
        group, sgs = self._groups[j]
        if getattr(group, "is_unsharded", False):
            return  # kept unsharded (the root after forward): nothing to copy
        self._wait(sgs)
        with torch.cuda.stream(self._stream):
            copies = [fp._sharded_param_data.to(self.device, non_blocking=True) for fp in group.fsdp_params]
            ready = torch.cuda.Event()
            ready.record(self._stream)
        self._ahead[j] = (copies, ready)

    def reset(self):
        self._ahead.clear()
        self._gathered.clear()

    def close(self):
        self.reset()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for group, _ in self._groups:
            group.__dict__.pop("wait_for_unshard", None)
        self._groups = []


class ForwardWaits:
    """Each FSDP2 module's forward waits for its own sub-groups' final pass (and those of the
    modules it prefetches) before FSDP2 gathers the shards: a pre-forward hook ahead of FSDP2's."""

    def __init__(self, modules, infos_by_param, wait):
        self._hooks = []
        by_state = {}
        for fm in modules:
            by_state[id(fm.state)] = sorted({infos_by_param[id(p)].sg for p in fm.params
                                              if id(p) in infos_by_param and infos_by_param[id(p)].sg is not None})
        self.covered = {s for sgs in by_state.values() for s in sgs}
        for fm in modules:
            sgs = set(by_state.get(id(fm.state), []))
            for state in fm.prefetched():
                sgs.update(by_state.get(id(state), []))
            if sgs:
                self._hooks.append(fm.module.register_forward_pre_hook(wait(sorted(sgs)), prepend=True))

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
