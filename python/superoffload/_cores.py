"""Which CPU cores a rank's optimizer pool takes when several ranks share a node.

With torch.distributed initialised and no explicit `cores`, each local rank takes its own share of
the CPUs this process may run on (`os.sched_getaffinity(0)`), by local rank and local world size
(LOCAL_RANK / LOCAL_WORLD_SIZE from torchrun, else from the process group): the CPUs are split
into `local_world_size` equal shares, each rank preferring the CPUs of its GPU's NUMA node (read
from sysfs) where the node has more than one; the first core of the share is left to the
training thread and `cores_fraction` of the rest go to the pool (DeepSpeed's
`cpuadam_cores_perc`). If the launcher already bound each rank to its own cores (the mask holds
fewer CPUs than a share would), the whole mask is this rank's share.
"""
import logging
import os

logger = logging.getLogger("superoffload")


def _parse_list(s):
    out = []
    for part in s.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def numa_nodes():
    """{node: [cpus]} from sysfs ({0: all CPUs} when there is none)."""
    base = "/sys/devices/system/node"
    nodes = {}
    try:
        for name in os.listdir(base):
            if name.startswith("node") and name[4:].isdigit():
                with open(os.path.join(base, name, "cpulist")) as f:
                    nodes[int(name[4:])] = _parse_list(f.read())
    except OSError:
        pass
    return nodes or {0: list(range(os.cpu_count() or 1))}


def gpu_numa_node(device_index):
    """The NUMA node of CUDA device `device_index` (None when unknown)."""
    try:
        import torch
        props = torch.cuda.get_device_properties(device_index)
        bus = "%04x:%02x:%02x.0" % (getattr(props, "pci_domain_id", 0), props.pci_bus_id, props.pci_device_id)
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read())
        return node if node >= 0 else None
    except Exception:
        return None


def local_rank_and_size():
    """(local rank, local world size) of this process, or (0, 1) without torch.distributed."""
    env_rank, env_size = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    if env_rank is not None and env_size is not None:
        return int(env_rank), int(env_size)
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
            size = int(env_size) if env_size else max(1, min(world, int(os.environ.get("LOCAL_WORLD_SIZE", world))))
            rank = int(env_rank) if env_rank else dist.get_rank() % size
            return rank, size
    except Exception:
        pass
    return 0, 1


def plan_shares(allowed, local_size, nodes, gpu_nodes):
    """Splits `allowed` CPUs into `local_size` disjoint shares (one per local rank), rank r
    taking CPUs of NUMA node gpu_nodes[r] first (None: no preference). Deterministic, so every
    rank computes the same plan."""
    allowed = sorted(allowed)
    per = max(1, len(allowed) // local_size)
    node_of = {c: n for n, cs in nodes.items() for c in cs}
    free = list(allowed)
    shares = []
    for r in range(local_size):
        want = gpu_nodes[r] if r < len(gpu_nodes) else None
        pref = [c for c in free if want is not None and node_of.get(c) == want]
        rest = [c for c in free if c not in pref]
        share = (pref + rest)[:per]
        share.sort()
        shares.append(share)
        free = [c for c in free if c not in share]
    return shares


def rank_cores(fraction=1.0, device_index=None):
    """This rank's optimizer cores (see the module docstring), or None when torch.distributed is
    not initialised (the library's default pool is used then)."""
    try:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            return None
    except Exception:
        return None
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"cores_fraction must be in (0, 1], not {fraction}")
    allowed = sorted(os.sched_getaffinity(0))
    rank, size = local_rank_and_size()
    ncpu = os.cpu_count() or len(allowed)
    if size > 1 and len(allowed) * size <= ncpu:
        share = allowed  # the launcher bound this rank already
    else:
        nodes = numa_nodes()
        gpu_nodes = []
        if len(nodes) > 1:
            try:
                import torch
                n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            except Exception:
                n = 0
            gpu_nodes = [gpu_numa_node(r) if r < n else None for r in range(size)]
        share = plan_shares(allowed, size, nodes, gpu_nodes)[rank]
    pool = share[1:] if len(share) > 1 else share
    keep = max(1, int(round(len(pool) * fraction)))
    cores = pool[:keep]
    logger.info("local rank %d of %d: optimizer pool on cores %s (core %s left to the training thread)", rank, size,
                _fmt(cores), share[0] if len(share) > 1 else "none")
    return cores


def _fmt(cores):
    if not cores:
        return "[]"
    runs, start, prev = [], cores[0], cores[0]
    for c in cores[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        runs.append(f"{start}-{prev}" if prev != start else str(start))
        if c is not None:
            start = prev = c
    return ",".join(runs)
