"""The gradients' way into the session. A post-accumulate-grad hook per parameter hands `p.grad`
over at the last micro-step and drops it: in CUDA mode the library copies it to pinned host
memory on its copy stream (`so_session_grad_device`), in host mode it copies it in
(`so_session_grad_copy`). Under host FSDP2 on one rank, `_fsdp.GradientTaker` takes the
unsharded gradients into buffers lent to the session instead; under FSDP2 with GPU shards on
one rank the hook is on FSDP2's unsharded parameters, whose gradients backward produces layer
by layer (FSDP2 sets a sharded gradient at its group's post-backward, the root's, with the
output layer, only after the whole backward)."""
import torch

from .. import _abi, _core
from . import _fsdp
from ._params import is_dtensor


class Handoff:
    """Hands the gradients of `infos` (ParamInfo) to `session`, in `accum_dtype` (a torch
    dtype). `begin()` begins the step (once a step) before the first gradient of a sub-group,
    or of any parameter when `distributed` (a rank whose shards are all empty still joins the
    all-reduce)."""

    def __init__(self, session, infos, *, device, accum_dtype, accumulation_steps, distributed, begin, times, nvtx):
        self.session = session
        self.device = device
        self.cuda = device.type == "cuda"
        self.accum_dtype = accum_dtype
        self.accumulation_steps = accumulation_steps
        self.taker = None  # FSDP2 on one host rank: _fsdp.GradientTaker
        self.closed = False
        self._infos = infos
        self._distributed = distributed
        self._begin = begin
        self._times, self._nvtx = times, nvtx
        self._hooks = []
        self.unsharded_handed = 0  # gradients handed over from FSDP2's unsharded parameters (a count, for tests)
        # so_session_grad_device's lifetime rule: each gradient is record_stream'ed on this stream.
        self._copy_stream = torch.cuda.ExternalStream(session.copy_stream(), device=device) if self.cuda else None

    def install(self, fsdp_modules, infos_by_param, take_dtype, compute, unsharded_modules=None):
        """Hooks each parameter, or with a `take_dtype` FSDP2's unsharded parameters on `compute`;
        with `unsharded_modules` (FSDP2 modules of one rank, GPU shards, no accumulation) also
        their unsharded parameters, once a first forward made them: the one of a pair that gets a
        gradient hands it over (FSDP2 then reduces nothing)."""
        if take_dtype:
            self.taker = _fsdp.GradientTaker(fsdp_modules, infos_by_param, self.accumulation_steps,
                                             self._begin_gradient, self.written, compute)
            return
        for info in self._infos:
            self._hooks.append(info.param.register_post_accumulate_grad_hook(self._hook(info)))
        for fm in unsharded_modules or ():
            self._hooks.append(fm.module.register_forward_hook(self._hook_unsharded(fm, infos_by_param)))

    def _hook_unsharded(self, fm, infos_by_param):
        hooked = set()

        def post_forward(module, args, output):
            for fp in fm.fsdp_params:
                up = getattr(fp, "_unsharded_param", None)
                info = infos_by_param.get(id(fp.sharded_param))
                if up is None or info is None or id(up) in hooked:
                    continue
                hooked.add(id(up))
                self._hooks.append(up.register_post_accumulate_grad_hook(self._hook(info, unsharded=True)))
        return post_forward

    @property
    def staging_bytes(self):
        return self.taker.staging_bytes if self.taker is not None else 0

    def _hook(self, info, unsharded=False):
        def post_accumulate_grad(p):
            if self.closed or p.grad is None:
                return
            info.count += 1
            if info.count < self.accumulation_steps:
                return  # keep accumulating in p.grad
            self.hand_over(info, p)
            self.unsharded_handed += unsharded
        return post_accumulate_grad

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def hand_over(self, info, p):
        with self._times.timed("handoff_s"), self._nvtx.range(f"superoffload:hand_over {info.name}"):
            g = p.grad
            if is_dtensor(g):
                g = g._local_tensor
            if info.sg is not None or self._distributed:
                self._begin()
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
                t = g if g.dtype == self.accum_dtype else g.to(self.accum_dtype)
                t = t.contiguous()
                # The lifetime rule of so_session_grad_device: the caching allocator must not reuse
                # this memory before the copy stream has passed the copy. Recorded before the
                # hand-off, so a failure cannot leave a copy reading freed memory.
                t.record_stream(self._copy_stream)
                self.session.grad_device(info.slice, t.data_ptr(), t.numel(), self.session.accum_dtype, self._stream())
            else:
                t = g if g.dtype == self.accum_dtype else g.to(self.accum_dtype)
                t = t.contiguous()
                if t.device.type != "cpu":
                    raise _core.SuperOffloadError(_abi.Status.INVALID_ARGUMENT,
                                                  f"the gradient of {info.name} is on {t.device}; a host session takes "
                                                  "CPU gradients")
                self.session.grad_copy(info.slice, t.data_ptr(), t.numel())
                if self.taker is not None:
                    self.taker.taken.add(id(info))
            p.grad = None  # the session has it (CUDA: record_stream'ed on the copy stream)

    def written(self, info):
        """A gradient is in the slice's borrowed buffer (FSDP2 on the host, _fsdp.GradientTaker)."""
        with self._times.timed("handoff_s"), self._nvtx.range(f"superoffload:hand_over {info.name}"):
            self.session.grad_written(info.slice)

    def _begin_gradient(self, info):
        """Before a lent gradient buffer is written: the step begun, and the buffer free, i.e.
        the previous step's state pass of this sub-group (which reads it) ended. Per sub-group,
        so the backward's first gradients wait only for the state passes of the last layers,
        which the session runs first."""
        self._begin()
        with self._times.timed("wait_s"):
            self.session.wait_settled(info.sg)

    def flush(self):
        """At step(): every gradient taken handed over, and those still in p.grad (a short
        accumulation, no hook, set by hand)."""
        if self.taker is not None:
            self.taker.flush()
        for info in self._infos:
            if info.param.grad is not None:
                self.hand_over(info, info.param)

    def zero_untaken(self):
        """A parameter whose unsharded gradient backward did not produce is stepped with a zero
        gradient, as in every other mode (its buffer still holds an earlier step's)."""
        if self.taker is None:
            return
        for info in self._infos:
            if info.sg is not None and id(info) not in self.taker.taken:
                info.grad_buffer.zero_()
                self.written(info)

    def end_step(self):
        """The step taken: the next accumulation starts."""
        for info in self._infos:
            info.count = 0
        if self.taker is not None:
            self.taker.taken.clear()

    def close(self):
        self.closed = True
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.taker is not None:
            self.taker.close()
