"""What SuperOffloadAdamW reports about its steps: the training thread's time in the optimizer,
NVTX ranges for profilers, and the flat dict of `metrics()`."""
import contextlib
import time

import torch

TIME_KEYS = ("handoff_s", "step_call_s", "wait_s")


class StepTimes:
    """Seconds the training thread spent in gradient hand-offs, in step() and waiting for
    weights on the host, since the step before (`last`: those of the latest step)."""

    def __init__(self):
        self.current = dict.fromkeys(TIME_KEYS, 0.0)
        self.last = dict(self.current)

    @contextlib.contextmanager
    def timed(self, key):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.current[key] += time.perf_counter() - t0

    def end_step(self):
        self.last = self.current
        self.current = dict.fromkeys(TIME_KEYS, 0.0)


class Nvtx:
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


def metrics(result, times, *, cuda, pinned_bytes, host_bytes, device_bytes, gpu_budget_bytes):
    """The latest step's result (every so_step_result field under its own name, and `step`), the
    training thread's times (`times`: StepTimes.last) with their sum `exposed_s`, memory, and the
    automatic split's budget where there is one (`gpu_budget_bytes` None: left out).

    exposed_s adds the library's forward_wait_s in CUDA mode, where the compute stream's waits are
    timed on the GPU; in host mode the waits are the training thread's own (wait_s)."""
    out = dict(result)
    out.update(times)
    out["exposed_s"] = sum(times.values()) + (result["forward_wait_s"] if cuda else 0.0)
    out["pinned_bytes"] = pinned_bytes
    out["host_bytes"] = host_bytes
    out["device_bytes"] = device_bytes
    if gpu_budget_bytes is not None:
        out["gpu_budget_bytes"] = gpu_budget_bytes
    return out
