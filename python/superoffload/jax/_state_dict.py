"""The optimizer's state as a pytree of numpy arrays and back, bit for bit: what the session holds
(f32 master weights, both moments (f32 or bf16, the optimizer's `moment_dtype`) and the step count
of every parameter, the clip history automatic speculation decides from) and the state's step
count. `SuperOffloadAdamW.state_dict` and `load_state_dict` call these."""
import ctypes as C

import numpy as np

import jax
import jax.numpy as jnp

from .. import _core
from .._abi import DType, Placement, Status
from . import _ffi

STATE_DICT_FORMAT = "superoffload.jax/1"
_KEYS = ("master", "exp_avg", "exp_avg_sq", "step")
# The session's host dtypes as numpy's: (the C element type, the numpy dtype it is viewed as).
_HOST_DTYPES = {DType.F32: (C.c_float, np.dtype(np.float32)), DType.BF16: (C.c_uint16, np.dtype(jnp.bfloat16))}


def _moment_dtype(opt):
    return _HOST_DTYPES[_core.dtype(opt.moment_dtype)][1]


def _host_view(address, numel, dtype):
    """The session's buffer of `dtype` (a DType) at `address` as a numpy array (no copy)."""
    element, np_dtype = _HOST_DTYPES[dtype]
    if numel == 0:
        return np.zeros(0, np_dtype)
    return np.ctypeslib.as_array((element * numel).from_address(address)).view(np_dtype)


def _buffers(session, sg):
    """(master, exp_avg, exp_avg_sq, step count) of a sub-group, after its outstanding work."""
    st = session.get_subgroup_state(sg.id)
    master_dtype, moment_dtype = DType(st["master_dtype"]), DType(st["moment_dtype"])
    if master_dtype != DType.F32 or moment_dtype not in _HOST_DTYPES:
        raise RuntimeError(f"sub-group {sg.id} holds {master_dtype.name} master weights and {moment_dtype.name} "
                           "moments; this optimizer reads f32 master weights and f32 or bf16 moments")
    return (_host_view(st["master"], sg.numel, master_dtype), _host_view(st["exp_avg"], sg.numel, moment_dtype),
            _host_view(st["exp_avg_sq"], sg.numel, moment_dtype), int(st["step_count"]))


def _require_between_steps(session, what):
    """Raises unless the session is between steps: setting the clip history to its current value
    changes nothing, and the library refuses it during a step."""
    try:
        session.set_speculation_history(*session.speculation_history())
    except _core.SuperOffloadError as e:
        if e.status == Status.INVALID_STATE:
            raise RuntimeError(f"{what}: a step is in progress; call it between steps (after the step's results "
                               "are ready, e.g. jax.block_until_ready(params))") from None
        raise


def state_dict(opt, state, ticket):
    """{"format", "count", "speculation_history", "master", "exp_avg", "exp_avg_sq", "step"}: the last
    four are pytrees shaped like the parameters (f32 master weights, moments of the optimizer's
    `moment_dtype`, and int step counts)."""
    session = opt._live_session()
    _ffi.wait_for_dispatched_steps()
    if ticket:
        try:
            session.step_result(ticket)  # the step of `state` is final
        except _core.SuperOffloadError as e:
            if e.status == Status.NOT_FOUND:
                raise ValueError("state_dict(state): `state` is not from the latest step (the session has "
                                 "stepped since); pass the state the latest step returned") from None
            raise
    _require_between_steps(session, "state_dict()")
    per_leaf = {key: [] for key in _KEYS}
    buffers = {sg.id: _buffers(session, sg) for sg in opt._subgroups}
    for leaf in opt._leaves:
        if leaf.slice_id is None:
            master, step = np.zeros(leaf.shape, np.float32), 0
            m = v = np.zeros(leaf.shape, _moment_dtype(opt))
        else:
            master, m, v, step = buffers[opt._subgroups[leaf.subgroup].id]
            span = slice(leaf.offset, leaf.offset + leaf.numel)
            master, m, v = (a[span].reshape(leaf.shape).copy() for a in (master, m, v))
        for key, value in zip(_KEYS, (master, m, v, step)):
            per_leaf[key].append(value)
    out = {"format": STATE_DICT_FORMAT, "count": int(np.asarray(state.count)),
           "speculation_history": list(session.speculation_history())}
    for key in _KEYS:
        out[key] = jax.tree_util.tree_unflatten(opt._treedef, per_leaf[key])
    return out


def _checked_plan(opt, sd):
    """Every array of `sd`, checked against the parameters, before anything changes:
    [(leaf, master, exp_avg, exp_avg_sq)], {sub-group index: step count}."""
    if not isinstance(sd, dict) or sd.get("format") != STATE_DICT_FORMAT:
        fmt = sd.get("format") if isinstance(sd, dict) else type(sd).__name__
        raise ValueError(f"not a superoffload.jax state dict (format {fmt!r}; this version reads "
                         f"{STATE_DICT_FORMAT!r})")
    missing = [k for k in _KEYS + ("count", "speculation_history") if k not in sd]
    if missing:
        raise ValueError(f"the state dict lacks {', '.join(missing)}")
    per_key = {}
    for key in _KEYS:
        try:
            per_key[key] = opt._treedef.flatten_up_to(sd[key])
        except (ValueError, TypeError) as e:
            raise ValueError(f"state dict entry {key!r} does not have the parameters' tree structure: {e}") from None
    plan, steps = [], {}
    expected = dict(zip(_KEYS[:3], (np.dtype(np.float32), _moment_dtype(opt), _moment_dtype(opt))))
    for i, leaf in enumerate(opt._leaves):
        arrays = []
        for key in _KEYS[:3]:
            a = np.asarray(per_key[key][i])
            if a.shape != leaf.shape or a.dtype != expected[key]:
                raise ValueError(f"state dict {key!r} of {leaf.name}: {a.dtype}{list(a.shape)}, expected "
                                 f"{expected[key]}{list(leaf.shape)} (this optimizer's moment_dtype is "
                                 f"{opt.moment_dtype!r})")
            arrays.append(a.reshape(-1))
        step = int(per_key["step"][i])
        if step < 0:
            raise ValueError(f"state dict 'step' of {leaf.name} is {step}")
        if leaf.slice_id is not None:
            if steps.setdefault(leaf.subgroup, step) != step:
                raise ValueError(f"the parameters of sub-group {leaf.subgroup} have different step counts in the "
                                 f"state dict ({steps[leaf.subgroup]} and {step} for {leaf.name}); create the "
                                 "optimizer with the sub_group_numel of the one that saved it")
        plan.append((leaf, *arrays))
    history = sd["speculation_history"]
    if len(history) != 2:
        raise ValueError(f"state dict 'speculation_history' must be [bits, steps], not {history!r}")
    count = int(sd["count"])
    if not 0 <= count < 2 ** 31:
        raise ValueError(f"state dict 'count' {count} is out of range")
    return plan, steps, (int(history[0]), int(history[1])), count


def load_state_dict(opt, sd):
    """Writes `sd` (from `state_dict`) into the session; returns (params, state)."""
    session = opt._live_session()
    plan, steps, history, count = _checked_plan(opt, sd)
    _ffi.wait_for_dispatched_steps()
    _require_between_steps(session, "load_state_dict()")
    buffers = {sg_index: _buffers(session, sg) for sg_index, sg in enumerate(opt._subgroups)}
    current_history = session.speculation_history()
    session.set_speculation_history(*history)  # checked by the library before anything else changes
    # The state of a sub-group the session keeps on the GPU (gpu_budget_bytes) is its host
    # buffers' only while it is placed on the host: it goes there for the writes, and back.
    on_device = [sg.id for sg in opt._subgroups if opt._device is not None and
                 session.get_subgroup_state(sg.id)["placement"] == Placement.DEVICE]
    try:
        for sg in on_device:
            session.set_placement(sg, "host")
        for leaf, master, m, v in plan:
            if leaf.slice_id is None:
                continue
            span = slice(leaf.offset, leaf.offset + leaf.numel)
            for dst, src in zip(buffers[leaf.subgroup][:3], (master, m, v)):
                dst[span] = src
        for sg_index, step in steps.items():
            session.set_step_count(opt._subgroups[sg_index].id, step)
    except BaseException:
        session.set_speculation_history(*current_history)
        raise
    finally:
        for sg in on_device:
            session.set_placement(sg, "device")
    params = [np.zeros(leaf.shape, leaf.dtype) if leaf.slice_id is None else
              master.reshape(leaf.shape).astype(leaf.dtype) for leaf, master, _, _ in plan]
    params = [jax.device_put(p, opt.device) for p in params]
    if opt._device is not None:
        _republish(opt, params)
    return jax.tree_util.tree_unflatten(opt._treedef, params), opt._initial_state(count)


def _republish(opt, params):
    """A CUDA session's reads copy each step's weights from the GPU buffers the session publishes
    into, and a skipped step publishes nothing: those buffers get the loaded weights too."""
    session_id = opt._session_id
    written = [(leaf, opt._subgroups[leaf.subgroup].id) for leaf in opt._leaves if leaf.slice_id is not None]

    @jax.jit
    def write(weights):
        return [_ffi.write_weights(w, session_id, sg, leaf.offset) for (leaf, sg), w in zip(written, weights)]

    jax.block_until_ready(write([p for p, leaf in zip(params, opt._leaves) if leaf.slice_id is not None]))
