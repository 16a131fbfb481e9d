"""The sub-groups' buffers and their registration with the session: f32 master weights in one
page-aligned host arena, moment buffers (torch tensors the session steps in place, so the state
dict can view them), and in CUDA mode one flat device buffer per sub-group that the model's
parameters are re-pointed into, which is where the library publishes. In host mode the
parameters are re-pointed into the master weights themselves.

The host state is checked against host_memory_limit and what the host can give
(`so_host_memory`) before any of it is allocated, so a model too large for the host is an
error, not a process the kernel kills;
the device buffers are allocated one sub-group at a time, each parameter's old storage freed as
it moves, so the GPU never holds two copies of the weights."""
import mmap
import os
import sys

import torch

from .. import _abi, _core
from ._params import DTYPE_NAMES, TORCH_DTYPES, local, round_up

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TOUCH_CHUNK = 1 << 22


def host_empty(numel, dtype):
    """An untouched host tensor whose whole 2 MiB pages Linux is asked to back with transparent
    huge pages, where the system leaves them to madvise (its first touch chooses the pages): the
    library's passes stream through gigabytes of state and then miss the TLB once per 2 MiB of
    each buffer instead of once per 4 KiB. Where mmap has no such advice, torch.empty."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(numel, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype)  # the tensor keeps the mapping alive


class PinnedHostBuffer:
    """A host buffer page-locked at its exact size with cudaHostRegister, so the GPU copies
    into it by DMA: torch's pinned allocator rounds each block up to a power of two (up to 2x
    the bytes, for a gradient buffer per sub-group). Owns the mapping, so its memory is
    unregistered before it is unmapped; a view that outlives it only loses the page lock."""

    def __init__(self, numel, dtype):
        self.tensor = host_empty(numel, dtype)
        self.tensor.zero_()  # first touch: the pages the registration locks are the final ones
        self._ptr = self.tensor.data_ptr()
        nbytes = self.tensor.numel() * self.tensor.element_size()
        err = torch.cuda.cudart().cudaHostRegister(self._ptr, nbytes, 0) if nbytes else 0
        if int(err) != 0:
            raise RuntimeError(f"SuperOffloadAdamW: cudaHostRegister of {nbytes} bytes failed ({err})")
        self._registered = nbytes > 0

    def __del__(self):
        # At interpreter exit the CUDA runtime may already be gone; the process's end unpins.
        if getattr(self, "_registered", False) and not sys.is_finalizing():
            torch.cuda.cudart().cudaHostUnregister(self._ptr)


@torch.no_grad()
def first_touch(bufs, pool):
    """First touch of freshly allocated host buffers by the pool's threads: one so_adam_update
    pass with lr 0 over them (param = bufs[0], moments = bufs[1:] or scratch), chunk by chunk;
    the values are overwritten afterwards. Linux places a page on the NUMA node of the thread
    that first writes it, so the state lands where the pool updates it."""
    if bufs[0].numel() == 0:
        return
    n = bufs[0].numel()
    ch = min(n, TOUCH_CHUNK)
    grad = torch.zeros(ch, dtype=torch.bfloat16)
    mdt = bufs[-1].dtype if len(bufs) > 1 else torch.float32
    scratch = [torch.empty(ch, dtype=mdt) for _ in range(3 - len(bufs))]
    for start in range(0, n, ch):
        k = min(ch, n - start)
        p, m, v = [b[start:start + k] for b in bufs] + [t[:k] for t in scratch]
        _core.adam_update(p.data_ptr(), grad.data_ptr(), m.data_ptr(), v.data_ptr(), k, lr=0.0, beta1=0.5,
                          beta2=0.5, weight_decay=0.0, pool=pool, param_dtype=DTYPE_NAMES[p.dtype],
                          grad_dtype="bf16", moment_dtype=DTYPE_NAMES[m.dtype])


GIB = 1 << 30
# Host memory left free when the state is allocated (the library's reserve starts there too).
HOST_RESERVE_BYTES = 2 * GIB


def element_size(dtype_name):
    return torch.tensor([], dtype=TORCH_DTYPES[dtype_name]).element_size()


def layout(subgroups, *, cuda, param_dtype, align_bytes):
    """Places each parameter's slice in its sub-group's buffers (aligned to `align_bytes` in the
    device buffer in CUDA mode, to 64 bytes on the host) and sets the sub-groups' sizes."""
    align = max(1, align_bytes // torch.tensor([], dtype=param_dtype).element_size()) if cuda else 64 // 4
    for sg in subgroups:
        off = 0
        for info in sg.params:
            off = round_up(off, align)
            info.offset = off
            off += info.numel
        sg.numel = off


def arena_numel(subgroups):
    """f32 elements of the master arena: each sub-group on pages of its own, and a page more to
    align the first."""
    page_el = PAGE_BYTES // 4
    return sum(round_up(sg.numel, page_el) for sg in subgroups) + page_el


def session_host_bytes(subgroups, *, cuda, accum_dtype, copy_dtype, host_copy, gradient_home, grads_lent=False,
                       copies_lent=False):
    """Host bytes the session must allocate for the offloaded sub-groups, and the options that
    lower them: a host session's gradient buffers (unless this layer lends them: `grads_lent`)
    and copies (unless they are the caller's low-precision shards: `copies_lent`); in CUDA mode
    the host gradients and copies asked for explicitly (the automatic choices fit in what the
    limit leaves)."""
    numel = sum(sg.numel for sg in subgroups if not sg.device_placed)
    per_param, lower = 0, []
    if (not cuda and not grads_lent) or gradient_home == "host":
        per_param += element_size(accum_dtype)
        if cuda:
            lower.append('gradient_home="device"')
    if copy_dtype != "none" and (host_copy == "full" or not cuda) and not copies_lent:
        per_param += element_size(copy_dtype)
        lower.append('host_copy="bounded"' if cuda else 'copy_dtype="none"')
    return numel * per_param, lower


def check_host_memory(subgroups, *, masters, moment_dtype, session_bytes, session_lower, limit, grad_dtype=None,
                      staging_bytes=0):
    """The host bytes this layer lends the session: the master arena (`masters`: this layer
    allocates it), both moments and the gradient buffers (`grad_dtype`, or None), with the
    pinned buffers later micro-steps' gradients are staged in (`staging_bytes`). Raises
    SuperOffloadError (OUT_OF_RESOURCES) before anything is allocated when they and the
    session's `session_bytes` exceed host_memory_limit (`limit`; 0: none) or what the host can
    give, with what it needs, what there is and what lowers it (`session_lower`: the session's
    options that do)."""
    numel = sum(sg.numel for sg in subgroups)
    lent = 2 * numel * element_size(moment_dtype) + (4 * arena_numel(subgroups) if masters else 0)
    lent += (numel * element_size(grad_dtype) if grad_dtype else 0) + staging_bytes
    need = lent + session_bytes
    lower = (['moment_dtype="bf16" (4 bytes per parameter less)'] if moment_dtype == "f32" else []) + session_lower
    lower.append("fewer parameters offloaded (freeze some, or a smaller model)")
    what = (f"the optimizer state of {numel:,} parameters ({'f32 master weights, ' if masters else ''}"
            f"{moment_dtype} moments{f', {grad_dtype} gradients' if grad_dtype else ''}"
            f"{' and their staging' if staging_bytes else ''}: {lent:,} bytes; the "
            f"session's buffers: {session_bytes:,} bytes)")
    if limit and need > limit:
        raise _core.SuperOffloadError(
            _abi.Status.OUT_OF_RESOURCES,
            f"SuperOffloadAdamW's host_memory_limit of {limit:,} bytes would be exceeded: {need - limit:,} more "
            f"bytes needed for {what}; lower it with {', '.join(lower)}, or raise host_memory_limit")
    measured = _core.host_memory()
    if measured is not None and need + HOST_RESERVE_BYTES > measured[0]:
        available = measured[0]
        raise _core.SuperOffloadError(
            _abi.Status.OUT_OF_RESOURCES,
            f"SuperOffloadAdamW needs {need / GIB:.2f} GiB of host memory for {what} and the library keeps "
            f"{HOST_RESERVE_BYTES / GIB:.0f} GiB free; {available / GIB:.2f} GiB is available: lower it with "
            f"{', '.join(lower)}, or run on a host with more memory")
    return lent


@torch.no_grad()
def register(session, subgroups, *, device, param_dtype, moment_dtype, fsdp, masters, pool, touch, grad_dtype=None,
             pinned_grads=False, shard_copies=False):
    """Allocates and fills every laid out sub-group's buffers, registers it with the session and
    re-points the parameters; returns the master arena (None without `masters`: host FSDP f32
    shards are their own masters). `touch`: first-touch the host buffers with `pool` (NUMA
    placement). `grad_dtype`: lend the session a gradient buffer of that dtype per sub-group
    (pinned with `pinned_grads`), which each slice's `grad_buffer` views. `shard_copies`: host
    FSDP with low-precision shards, which the session keeps as its weights' copy."""
    cuda = device.type == "cuda"
    page_el = PAGE_BYTES // 4
    arena = None
    if masters:
        arena = host_empty(arena_numel(subgroups), torch.float32)
        if touch:
            first_touch([arena], pool)
        base = (-(arena.data_ptr() // 4)) % page_el  # first page boundary
    host_pos = base if arena is not None else 0
    mdt = TORCH_DTYPES[moment_dtype]
    for sg in subgroups:
        if not masters:
            sg.master = _contiguous_shard(sg.params[0])
        else:
            sg.master = arena[host_pos:host_pos + sg.numel]
            host_pos += round_up(sg.numel, page_el)
            sg.master.zero_()
            for info in sg.params:
                sg.master[sg.span(info)].copy_(local(info.param).reshape(-1))
        sg.exp_avg = host_empty(sg.numel, mdt)
        sg.exp_avg_sq = host_empty(sg.numel, mdt)
        if touch:
            first_touch([sg.exp_avg, sg.exp_avg_sq], pool)
        sg.exp_avg.zero_()
        sg.exp_avg_sq.zero_()
        keep = [sg.master, sg.exp_avg, sg.exp_avg_sq]
        if grad_dtype:
            if pinned_grads:
                pinned = PinnedHostBuffer(sg.numel, TORCH_DTYPES[grad_dtype])
                sg.grad = pinned.tensor
                keep.append(pinned)
            else:
                sg.grad = torch.zeros(sg.numel, dtype=TORCH_DTYPES[grad_dtype])
            keep.append(sg.grad)
            for info in sg.params:
                info.grad_buffer = sg.grad[sg.span(info)]
        if cuda:
            if fsdp:
                sg.device_param = _contiguous_shard(sg.params[0])
            else:
                # The parameters' old storage goes as they move in: the caching allocator hands
                # it to the next sub-group's buffer.
                sg.device_param = torch.zeros(sg.numel, dtype=param_dtype, device=device)
                for info in sg.params:
                    view = sg.device_param[sg.span(info)]
                    view.copy_(info.param.data.reshape(-1))
                    info.param.data = view.view(info.param.shape)
            keep.append(sg.device_param)
        elif shard_copies:
            sg.copy = _contiguous_shard(sg.params[0])
            keep.append(sg.copy)
        elif masters:
            for info in sg.params:  # host mode: the parameter is its master slice
                info.param.data = sg.master[sg.span(info)].view(info.param.shape)
        slices = [(info.name, info.offset, info.numel) for info in sg.params]
        sg.id, slice_ids = session.add_subgroup(
            sg.group, sg.master.data_ptr(), sg.numel, slices, master_dtype="f32",
            grad=sg.grad.data_ptr() if sg.grad is not None else 0,
            device_param=sg.device_param.data_ptr() if sg.device_param is not None else 0,
            device_param_dtype=DTYPE_NAMES[param_dtype], keep=keep, exp_avg=sg.exp_avg.data_ptr(),
            exp_avg_sq=sg.exp_avg_sq.data_ptr(), **({"copy": sg.copy.data_ptr()} if sg.copy is not None else {}),
            placement=int(_abi.Placement.DEVICE if sg.device_placed else _abi.Placement.HOST))
        for info, sid in zip(sg.params, slice_ids):
            info.sg, info.slice = sg.id, sid
    if cuda:
        torch.cuda.current_stream(device).synchronize()
        torch.cuda.empty_cache()  # what the moved parameters left cached goes back to the device
    return arena


def _contiguous_shard(info):
    shard = local(info.param)
    if not shard.is_contiguous():
        raise ValueError(f"SuperOffloadAdamW: the local shard of {info.name} is not contiguous")
    return shard.view(-1)


def memory(session, subgroups, *, numel, gpu_numel, master_arena, staging_bytes, device_bytes):
    """The optimizer's `memory()` (see there): `numel` trainable elements, `gpu_numel` of them
    GPU-resident; `master_arena` as `register` returned it; `staging_bytes` of a GradientTaker."""
    if master_arena is not None:
        master = lent_master = master_arena.numel() * 4
    else:  # host FSDP with f32 shards: the shards are the masters, not this optimizer's allocation
        master, lent_master = sum(sg.master.numel() * 4 for sg in subgroups), 0
    moments = sum(sg.exp_avg.numel() * sg.exp_avg.element_size() * 2 for sg in subgroups)
    grads = sum(sg.grad.numel() * sg.grad.element_size() for sg in subgroups if sg.grad is not None)
    grads += staging_bytes  # the pinned buffers later micro-steps' gradients are staged in
    offloaded = numel - gpu_numel
    host = session.host_bytes()
    return {"params": offloaded, "session_host_bytes": host, "master_bytes": master, "moment_bytes": moments,
            "grad_bytes": grads, "host_bytes": host + lent_master + moments + grads,
            "host_bytes_per_param": (host + master + moments + grads) / max(offloaded, 1),
            "pinned_bytes": session.pinned_bytes(), "gpu_resident_params": gpu_numel,
            "gpu_resident_bytes": device_bytes}
