"""The parameters SuperOffloadAdamW steps and their layout: each trainable parameter is a named
slice of a sub-group, and sub-groups pack consecutive parameters of one param group in forward
order."""
import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # older torch
    try:
        from torch.distributed._tensor import DTensor
    except ImportError:
        DTensor = None

DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
TORCH_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}


def is_dtensor(t):
    return DTensor is not None and isinstance(t, DTensor)


def local(t):
    """The rank-local tensor of a parameter (its DTensor shard, or itself), without autograd."""
    if is_dtensor(t):
        return t._local_tensor
    return t.data


def round_up(x, m):
    return (x + m - 1) // m * m


class ParamInfo:
    """One trainable parameter: its slice of a sub-group and its place in the state dict."""

    __slots__ = ("param", "name", "group", "numel", "dtensor", "sg", "slice", "offset", "count", "index",
                 "grad_buffer")

    def __init__(self, param, name, group, index):
        self.param, self.name, self.group, self.index = param, name, group, index
        self.dtensor = is_dtensor(param)
        self.numel = local(param).numel()
        self.sg = self.slice = None  # the session's sub-group and slice ids (None: an empty FSDP shard)
        self.offset = 0  # in the sub-group's buffers
        self.count = 0  # backward passes seen in this step (gradient accumulation)
        self.grad_buffer = None  # its view of a gradient buffer the session borrows (FSDP2 on the host)


class SubGroup:
    """Consecutive parameters of one param group and the buffers the session steps them in."""

    __slots__ = ("id", "group", "params", "numel", "device_placed", "master", "device_param", "exp_avg",
                 "exp_avg_sq", "grad", "copy")

    def __init__(self, group, device_placed):
        self.group, self.device_placed = group, device_placed
        self.params, self.numel = [], 0
        self.id = self.master = self.device_param = self.exp_avg = self.exp_avg_sq = self.grad = self.copy = None

    def span(self, info):
        return slice(info.offset, info.offset + info.numel)


def split_names(params):
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


def collect(param_groups, names, model):
    """The trainable parameters of `param_groups`, each once, in forward order (the model's
    registration order when given: each must be one of its parameters), each with a unique name
    (its own, else `param<k>`)."""
    order = {}
    if model is not None:
        for i, (n, p) in enumerate(model.named_parameters()):
            names.setdefault(id(p), n)
            order[id(p)] = i
    infos, seen, index = [], set(), 0
    for gi, group in enumerate(param_groups):
        for k, p in enumerate(group["params"]):
            pos = index
            index += 1
            if id(p) in seen or not p.requires_grad:
                continue
            if model is not None and id(p) not in order:
                # Its forward order, and which module's forward waits for it, would be unknown.
                what = repr(names[id(p)]) if id(p) in names else f"{k} of param group {gi}"
                raise ValueError(f"SuperOffloadAdamW: parameter {what} (shape {tuple(p.shape)}) is not a parameter "
                                 "of `model`: pass the model that holds every parameter, or no model")
            seen.add(id(p))
            infos.append(ParamInfo(p, names.get(id(p)), gi, pos))
    if not infos:
        raise ValueError("SuperOffloadAdamW got no trainable parameters")
    if model is not None:
        infos.sort(key=lambda i: order[id(i.param)])
    used = set()
    for k, info in enumerate(infos):
        name = info.name or f"param{k}"
        while name in used:
            name += "_"
        used.add(name)
        info.name = name
    return infos


def common_placement(infos):
    """(device, dtype, fsdp) that every parameter shares; ValueError if they do not."""
    devices = {local(i.param).device for i in infos}
    if len(devices) != 1:
        raise ValueError("SuperOffloadAdamW: all trainable parameters must be on one device; got "
                         f"{sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"SuperOffloadAdamW: parameters on {device} (only cuda and cpu are supported)")
    dtypes = {local(i.param).dtype for i in infos}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPE_NAMES:
        raise ValueError("SuperOffloadAdamW: trainable parameters must share one of float32, bfloat16, float16; "
                         f"got {sorted(map(str, dtypes))} (cast the model first)")
    dtype = dtypes.pop()
    fsdp = any(i.dtensor for i in infos)
    if device.type == "cpu" and dtype != torch.float32 and not fsdp:
        raise ValueError("SuperOffloadAdamW: host mode (CPU parameters) needs float32 parameters: the parameters "
                         f"are the master weights there; got {dtype}")
    if fsdp and not all(i.dtensor for i in infos):
        raise ValueError("SuperOffloadAdamW: some parameters are DTensors (FSDP2) and some are not; apply "
                         "fully_shard to the root module too so every parameter is sharded")
    return device, dtype, fsdp


def gpu_prefix(infos, fraction):
    """The first parameters in forward order, up to `fraction` of the elements (SuperOffload's
    ratio = 1 - fraction): their gradients arrive last in backward and their weights are needed
    first, so they are the ones worth keeping on the GPU."""
    budget, acc, out = fraction * sum(i.numel for i in infos), 0, []
    for info in infos:
        if acc + info.numel > budget:
            break
        acc += info.numel
        out.append(info)
    if len(out) == len(infos):
        raise ValueError(f"SuperOffloadAdamW: gpu_fraction={fraction} leaves no parameter to offload")
    return out


def partition(infos, limit, device_placed):
    """Sub-groups of up to `limit` elements (0: one per parameter): each packs the next parameters
    of one param group in forward order, and sub-groups are ordered by their first parameter, so
    the finalization order stays the forward order even when param groups interleave (e.g.
    weights with decay, biases and norms without). Parameters in `device_placed` (ids) get
    sub-groups of their own kind."""
    out, open_ = [], {}
    for info in infos:
        if info.numel == 0:  # an empty FSDP shard on this rank: nothing to step
            continue
        on_device = id(info) in device_placed
        key = (info.group, on_device)
        cur = open_.get(key)
        if cur is None or limit <= 0 or cur.numel + info.numel > limit:
            cur = SubGroup(info.group, on_device)
            out.append(cur)
            open_[key] = cur
        cur.params.append(info)
        cur.numel += info.numel
    return out
