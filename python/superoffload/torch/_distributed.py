"""The process group a distributed optimizer all-reduces its shards' sum of squares over: each
rank's session knows only its local shards, so the global norm (and the overflow verdict, a
sum that is not finite) comes from every rank's `local_grad_sumsq`."""
import math

import torch


class NormGroup:
    """The group the gradients' sums of squares are all-reduced over (`distributed`: "auto", on
    with DTensor parameters and an initialised process group; `process_group`: default the
    parameters' shard group), and where the all-reduce's tensor lives for its backend."""

    def __init__(self, infos, fsdp, distributed, process_group):
        import torch.distributed as dist
        initialised = dist.is_available() and dist.is_initialized()
        self.enabled = fsdp and initialised if distributed == "auto" else bool(distributed)
        self.pg = None
        self.comm_device = None
        self.ranks = 1  # one needs no all-reduce
        if not self.enabled:
            return
        if not initialised:
            raise RuntimeError("SuperOffloadAdamW(distributed=True) needs an initialised torch.distributed "
                               "process group")
        if process_group is None and fsdp:
            process_group = _shard_group(infos)
        self.pg = process_group
        self.ranks = dist.get_world_size(process_group)
        nccl = dist.get_backend(process_group) == "nccl"
        self.comm_device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def global_norm(self, local_sumsq):
        """The gradient norm over every rank's shards (NaN when a sum is not finite)."""
        import torch.distributed as dist
        t = torch.tensor([local_sumsq], dtype=torch.float64, device=self.comm_device)
        dist.all_reduce(t, group=self.pg)
        total = t.item()
        return math.sqrt(total) if math.isfinite(total) and total >= 0 else float("nan")


def _shard_group(infos):
    """The process group of the DTensor parameters' one sharded mesh dimension."""
    p = infos[0].param
    mesh, placements = p.device_mesh, p.placements
    shard_dims = [d for d, pl in enumerate(placements) if pl.is_shard()]
    for info in infos:
        if info.param.device_mesh != mesh or tuple(info.param.placements) != tuple(placements):
            raise ValueError("SuperOffloadAdamW: DTensor parameters on different meshes or placements")
    if len(shard_dims) != 1:
        raise ValueError(f"SuperOffloadAdamW: expected one sharded mesh dimension, got placements {placements}")
    return mesh.get_group(shard_dims[0]) if mesh.ndim > 1 else mesh.get_group()
