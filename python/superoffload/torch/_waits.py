"""When the training thread waits for a step's weights (CUDA: its current stream waits on the
GPU; host mode: the thread waits): with `wait="module"` each module's forward waits for its own
sub-groups only, so the next forward overlaps the optimizer's tail; with `wait="step"` step()
waits for every sub-group."""
import torch

from . import _fsdp


class Waits:
    """The waits for the final weights of the session's sub-groups `sgs`, and what the next
    forward has yet to wait for."""

    def __init__(self, session, device, sgs, times, nvtx):
        self.session = session
        self.device = device
        self.cuda = device.type == "cuda"
        self.all_sgs = sgs
        self.mode = "step"
        self.pending = set()  # sub-groups of the latest step no forward has waited for yet
        self.unowned = []  # sub-groups no module's forward reads: waited for at step()
        self._times, self._nvtx = times, nvtx
        self._hooks = []
        self._forward_waits = None

    def install(self, wait, model, infos_by_param, fsdp, fsdp_modules):
        """Picks the mode (`wait`, "auto": "module" with a model and no FSDP2, or with FSDP2
        modules whose state this torch exposes) and, for "module", hooks each module's forward."""
        if wait == "auto":
            wait = "module" if model is not None and (not fsdp or fsdp_modules) else "step"
        if wait == "module":
            if model is None:
                raise ValueError('wait="module" needs model=')
            if fsdp and not fsdp_modules:
                raise ValueError('wait="module" under FSDP2 needs a torch whose FSDP2 modules expose their state; '
                                 'use wait="step"')
            if fsdp_modules:
                self._forward_waits = _fsdp.ForwardWaits(fsdp_modules, infos_by_param, self.module_wait)
                covered = self._forward_waits.covered
            else:
                covered = self._hook_modules(model, infos_by_param)
            self.unowned = [s for s in self.all_sgs if s not in covered]
        self.mode = wait

    def _hook_modules(self, model, infos_by_param):
        """A pre-hook per module that holds parameters; returns the sub-groups they cover."""
        by_module = {}
        for m in model.modules():
            infos = [infos_by_param.get(id(p)) for p in m._parameters.values() if p is not None]
            sgs = sorted({i.sg for i in infos if i is not None and i.sg is not None})
            if sgs:
                by_module[m] = sgs
        for m, sgs in by_module.items():
            self._hooks.append(m.register_forward_pre_hook(self.module_wait(sgs)))
        return {s for sgs in by_module.values() for s in sgs}

    def module_wait(self, sgs):
        """A forward pre-hook waiting for those of `sgs` still pending."""
        def pre_forward(module, args):
            self.wait_pending_of(sgs)
        return pre_forward

    def wait_pending_of(self, sgs):
        """Waits for those of `sgs` the latest step left pending (the next forward's reads)."""
        if not self.pending:
            return
        todo = [s for s in sgs if s in self.pending]
        if todo:
            self.pending.difference_update(todo)
            self.wait(todo)

    def _stream(self):
        return torch.cuda.current_stream(self.device).cuda_stream

    def wait(self, sgs):
        if self.cuda:
            self.session.enqueue_wait_final(sgs, self._stream())
        else:
            with self._times.timed("wait_s"), self._nvtx.range("superoffload:wait"):
                self.session.wait_final(sgs)

    def wait_pending(self):
        """Waits for the sub-groups no forward waited for (their modules did not run)."""
        if self.pending:
            todo = sorted(self.pending)
            self.pending.clear()
            self.wait(todo)

    def after_step(self, ticket):
        """At the end of step(): "module" leaves the sub-groups to the forwards that read them."""
        if self.mode == "module":
            self.pending = set(self.all_sgs)
            if self.unowned:
                self.pending.difference_update(self.unowned)
                self.wait(self.unowned)
        elif self.cuda:
            self.enqueue_all()
        else:
            self.session.wait(ticket)

    def enqueue_all(self):
        """CUDA: the current stream waits for the publication of every sub-group."""
        self.session.enqueue_wait_final(self.all_sgs, self._stream())

    def close(self):
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._forward_waits is not None:
            self._forward_waits.close()
