"""How a parameter pytree maps onto a session: one named slice per leaf (its key path), leaves packed
in tree order into sub-groups of up to `sub_group_numel` elements, each sub-group's f32 master
weights in one page-aligned host buffer that the session borrows."""
import mmap
import os
from dataclasses import dataclass

import numpy as np

import jax

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
DTYPES = {np.dtype(np.float32): "f32", np.dtype(jax.numpy.bfloat16): "bf16", np.dtype(np.float16): "f16"}


@dataclass
class Leaf:
    """One leaf of the parameter tree: a slice of sub-group `subgroup` at `offset`, or, for a leaf
    with no elements, no slice (`slice_id` None: it is returned unchanged)."""
    name: str
    shape: tuple
    dtype: np.dtype
    numel: int
    value: object = None  # the array it was described from (dropped once copied into the session)
    subgroup: int = -1
    offset: int = 0
    slice_id: int = None


@dataclass
class SubGroup:
    leaves: list
    numel: int
    master: np.ndarray = None  # f32, borrowed by the session
    id: int = -1
    published: object = None  # CUDA sessions: the GPU array the session publishes the weights into


def host_f32(numel):
    """An f32 array of `numel` elements in pages of its own (huge pages where the system leaves it
    to madvise): the session streams through it at every step."""
    nbytes = numel * 4
    if nbytes == 0:
        return np.zeros(0, np.float32)
    region = mmap.mmap(-1, -(-nbytes // PAGE_BYTES) * PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(region, np.float32, count=numel)  # the array keeps the mapping alive


def leaf_name(path):
    name = jax.tree_util.keystr(path)
    return name if name else "<root>"


def _device_of(name, x):
    """The one device a leaf is on (None for a host array such as numpy's: the CPU)."""
    if not isinstance(x, jax.Array):
        return None
    devices = x.devices()
    if len(devices) != 1:
        raise ValueError(f"parameter {name} is spread over {len(devices)} devices; superoffload.jax steps parameters "
                         "that are each on one device (no sharding)")
    device = next(iter(devices))
    if device.platform not in ("cpu", "gpu", "cuda"):
        raise ValueError(f"parameter {name} is on {device.platform}; superoffload.jax runs on JAX's CPU platform "
                         "and on NVIDIA GPUs (CUDA)")
    return None if device.platform == "cpu" else device


def describe(params):
    """(leaves, treedef, device) of a parameter tree, each leaf checked: a concrete float array
    (f32, bf16 or f16), all of one dtype, all on the CPU (device None) or all on one GPU (that
    jax.Device)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if not flat:
        raise ValueError("the parameter tree has no leaves")
    leaves, devices = [], {}
    for path, x in flat:
        name = leaf_name(path)
        if isinstance(x, jax.core.Tracer):
            raise TypeError(f"parameter {name} is a tracer: call init() (and load_state_dict()) outside jax.jit, "
                            "on concrete parameters")
        devices.setdefault(_device_of(name, x), name)
        dtype = np.dtype(x.dtype) if hasattr(x, "dtype") else np.asarray(x).dtype
        if dtype not in DTYPES:
            raise TypeError(f"parameter {name} is {dtype}; superoffload.jax steps float32, bfloat16 or float16 "
                            "parameters (with float32 master weights)")
        shape = tuple(int(d) for d in np.shape(x))
        leaves.append(Leaf(name=name, shape=shape, dtype=dtype, numel=int(np.prod(shape, dtype=np.int64)), value=x))
    if not any(leaf.numel for leaf in leaves):
        raise ValueError("the parameters have no elements")
    dtypes = {leaf.dtype for leaf in leaves}
    if len(dtypes) > 1:
        raise TypeError(f"the parameters mix dtypes {sorted(str(d) for d in dtypes)}: the session takes gradients "
                        "of one dtype; cast the parameters to one (the master weights are float32 either way)")
    if len(devices) > 1:
        where = ", ".join(f"{name} on {device or 'the CPU'}" for device, name in devices.items())
        raise ValueError(f"the parameters are on several devices ({where}): put them all on the CPU or all on one "
                         "GPU (jax.device_put(params, device)); the step runs where they are")
    return leaves, treedef, next(iter(devices))


def partition(leaves, sub_group_numel):
    """Sub-groups of consecutive leaves (tree order) of up to `sub_group_numel` elements (0: one per
    leaf; a larger leaf has one of its own). Leaves with no elements belong to none."""
    groups, current, size = [], [], 0
    for leaf in leaves:
        if leaf.numel == 0:
            continue
        if current and (sub_group_numel <= 0 or size + leaf.numel > sub_group_numel):
            groups.append(SubGroup(current, size))
            current, size = [], 0
        leaf.subgroup, leaf.offset = len(groups), size
        current.append(leaf)
        size += leaf.numel
    if current:
        groups.append(SubGroup(current, size))
    return groups
