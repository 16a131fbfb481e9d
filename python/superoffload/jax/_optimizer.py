"""SuperOffloadAdamW for JAX: optax's `chain(clip_by_global_norm, adamw)` with the f32 master weights and
Adam moments in host memory, stepped by libsuperoffload's CPU-Adam thread while backward runs."""
import math
import threading
from functools import partial
from typing import NamedTuple

import numpy as np

import jax
import jax.numpy as jnp

from .. import _core
from . import _ffi, _first_use, _layout, _state_dict

WAITS = ("forward", "step")


class SuperOffloadState(NamedTuple):
    """The optimizer state a jitted step carries (a pytree): the master weights and moments stay in
    the session, in host memory.

    count: int32, the number of `step` calls so far (the learning-rate schedule's argument, as
        optax's `count`; skipped steps count too).
    ticket: uint32[2], the latest step's ticket in the session (low, high word): orders the next
        step after it and names it to `metrics`.
    """
    count: jax.Array
    ticket: jax.Array


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _hand_over_in_backward(param, loss_scale, session, slice_id):
    """The identity on a parameter, whose backward hands the parameter's gradient to the session as
    soon as backward produces it."""
    del loss_scale, session, slice_id
    return param


def _hand_over_fwd(param, loss_scale, session, slice_id):
    del session, slice_id
    return param, loss_scale


def _hand_over_bwd(session, slice_id, loss_scale, grad):
    return _ffi.hand_over(grad, loss_scale, session, slice_id), jnp.zeros_like(loss_scale)


_hand_over_in_backward.defvjp(_hand_over_fwd, _hand_over_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(4,))
def _read_in_forward(param, loss_scale, ticket, after, where):
    """A parameter's weights after the step of `ticket`, read from the session once the arrays in
    `after` are computed (`where`: session, slice, sub-group, offset); its backward hands the
    parameter's gradient to the session as soon as backward produces it."""
    return _read_in_forward_fwd(param, loss_scale, ticket, after, where)[0]


def _read_in_forward_fwd(param, loss_scale, ticket, after, where):
    weights = _ffi.read_weights(ticket, param.shape, param.dtype, *where, after=after)
    return weights, (loss_scale, weights)


def _read_in_forward_bwd(where, residuals, grad):
    loss_scale, weights = residuals
    session, slice_id = where[:2]
    # After the read: the gradient completes the sub-group, whose speculative steps then change
    # the weights the read copies.
    return _ffi.hand_over(grad, loss_scale, session, slice_id, weights), jnp.zeros_like(loss_scale), None, None


_read_in_forward.defvjp(_read_in_forward_fwd, _read_in_forward_bwd)


def _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_grad_norm, loss_scale):
    if not callable(learning_rate):
        if not (isinstance(learning_rate, (int, float)) and math.isfinite(learning_rate) and learning_rate >= 0):
            raise ValueError(f"learning_rate must be a finite number >= 0 or a schedule (a function of the step "
                             f"count, as optax's), not {learning_rate!r}")
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{name} must be in [0, 1), not {value!r}")
    for name, value in (("eps", eps), ("weight_decay", weight_decay)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and >= 0, not {value!r}")
    if max_grad_norm is not None and not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be None (no clipping) or finite and > 0, not {max_grad_norm!r}")
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"loss_scale must be finite and > 0, not {loss_scale!r}")


def _cuda_ordinal(device):
    """The CUDA device ordinal of a JAX GPU device (0 for none: a host session ignores it)."""
    if device is None:
        return 0
    ordinal = getattr(device, "local_hardware_id", None)
    return int(device.id if ordinal is None else ordinal)


class SuperOffloadAdamW:
    """AdamW whose f32 master weights and moments live in host memory, in a libsuperoffload session.

    `opt.step(loss_fn, params, state, *args)`, inside your jitted train step, does what
    `jax.value_and_grad(loss_fn)` then `optax.chain(optax.clip_by_global_norm(max_grad_norm),
    optax.adamw(...))` and `optax.apply_updates` do, with each parameter's gradient handed to the
    session as backward produces it (the session steps complete sub-groups on its CPU thread while
    the rest of backward runs), the exact step decided at the end (global-norm clipping, a step with
    an inf or NaN gradient skipped, loss scaling) and each updated parameter read back as soon as its
    own sub-group is final.

    Args:
        learning_rate: a number, or a schedule: a function of the step count (an int32 array)
            returning the learning rate, as optax's schedules (evaluated in the jitted step).
        b1, b2, eps, weight_decay: as optax.adamw (decoupled weight decay, scaled by the learning
            rate; bias correction; `eps` added outside the square root; `eps_root` 0).
        max_grad_norm: clip the global gradient norm to this (None: no clipping). The coefficient
            is torch's `min(1, max_grad_norm / (norm + 1e-6))`.
        loss_scale: a static loss scale: the loss is multiplied by it before backward, the
            gradients divided by it in the session (an inf or NaN gradient skips the step).
        speculation: "auto" (the session decides each step from the steps before), "on"/True or
            "off"/False: whether sub-groups are stepped during backward, before the clip factor is
            known (then rescaled or rolled back exactly if it differs).
        sub_group_numel: pack consecutive leaves (tree order) into sub-groups of up to this many
            elements (0: one per leaf). Put the parameters in forward order (e.g. a list of layers)
            so that backward completes sub-groups early and the next forward reads them first.
        cores: CPU cores for the session's own pinned thread pool (None: the library's default pool).
        moment_dtype: "f32" (12 bytes of host state per parameter with the f32 master weights) or
            "bf16" (8: both moments stored rounded to bf16, the step computed in f32).
        gpu_budget_bytes: on the GPU, device bytes the session's automatic split may fill with the
            state of the first sub-groups (tree order), stepped there by the library's GPU kernel
            with the same bits, as the exposed optimizer time asks; "auto" for a budget it measures
            from the GPU's free memory after 3 steps (XLA's memory pool must leave that memory
            free: XLA_PYTHON_CLIENT_MEM_FRACTION); 0 (the default) keeps all of it in host memory.
            On the CPU platform only 0 (and "auto", which means 0 there).
        wait: "forward" (the default): each step reads every parameter's weights from the
            session inside its forward, right before the parameter's first use, so the previous
            step's last updates overlap the forward's first layers; the parameters a step returns
            are then the weights its forward used, one step behind: call `opt.params(params,
            state)` for the latest (evaluation, export). "step": the step reads the updated
            weights at its end (each once its own sub-group is final) and returns them; the next
            forward starts only when every sub-group is final.
    """

    def __init__(self, learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, *, max_grad_norm=None,
                 loss_scale=1.0, speculation="auto", sub_group_numel=1 << 25, cores=None, moment_dtype="f32",
                 gpu_budget_bytes=0, wait="forward"):
        _check_hyperparameters(learning_rate, b1, b2, eps, weight_decay, max_grad_norm, loss_scale)
        if wait not in WAITS:
            raise ValueError(f"wait must be one of {', '.join(map(repr, WAITS))}, not {wait!r}")
        _core.check_moment_dtype(moment_dtype)
        _core.gpu_budget_bytes(gpu_budget_bytes, automatic=True)  # its checks, before anything is made
        _ffi.register()
        self.learning_rate = learning_rate
        self.b1, self.b2, self.eps, self.weight_decay = float(b1), float(b2), float(eps), float(weight_decay)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.loss_scale = float(loss_scale)
        self.speculation = speculation
        self.sub_group_numel = int(sub_group_numel)
        self.cores = None if cores is None else list(cores)
        self.moment_dtype = moment_dtype
        self.gpu_budget_bytes = gpu_budget_bytes
        self.wait = wait
        self._session = self._device = self._read_latest = None
        self._lock = threading.Lock()

    # ---- set-up ---------------------------------------------------------------------------------

    def init(self, params):
        """Creates the session and registers `params` (concrete arrays, outside jit): their f32 master
        weights are copied into host memory. Returns the initial SuperOffloadState. One parameter tree
        per optimizer: create another SuperOffloadAdamW for another tree."""
        with self._lock:
            if self._session is not None:
                raise RuntimeError("init() was already called on this optimizer: it holds one parameter tree "
                                   "(create another SuperOffloadAdamW for another)")
            leaves, treedef, device = _layout.describe(params)
            subgroups = _layout.partition(leaves, self.sub_group_numel)
            dtype = _layout.DTYPES[leaves[0].dtype]
            if device is not None:
                _ffi.register(_ffi.CUDA)
            budget = _core.gpu_budget_bytes(self.gpu_budget_bytes, automatic=device is not None)
            session = _core.Session(cuda=device is not None, device=_cuda_ordinal(device), speculation=self.speculation,
                                    grad_dtype=dtype, accum_dtype=dtype, moment_dtype=self.moment_dtype,
                                    cores=self.cores, gpu_budget_bytes=budget)
            try:
                group = session.add_group(self._lr_at(0), self.b1, self.b2, self.eps, self.weight_decay)
                for sg in subgroups:
                    sg.master = _layout.host_f32(sg.numel)
                    for leaf in sg.leaves:
                        sg.master[leaf.offset:leaf.offset + leaf.numel] = np.asarray(leaf.value).reshape(-1)
                    slices = [(leaf.name, leaf.offset, leaf.numel) for leaf in sg.leaves]
                    published = {}
                    if device is not None:
                        # A GPU buffer of the sub-group's own, holding the current weights: the session
                        # publishes each step's weights into it, and the step's reads copy them out.
                        sg.published = jax.block_until_ready(jax.device_put(sg.master.astype(leaves[0].dtype), device))
                        published = dict(device_param=sg.published.unsafe_buffer_pointer(), device_param_dtype=dtype)
                    sg.id, ids = session.add_subgroup(group, sg.master.ctypes.data, sg.numel, slices, keep=sg.master,
                                                      **published)
                    for leaf, slice_id in zip(sg.leaves, ids):
                        leaf.slice_id = slice_id
            except BaseException:
                session.close()
                raise
            finally:
                for leaf in leaves:
                    leaf.value = None
            self._session, self._session_id, self._group, self._device = session, session.id(), group, device
            self._leaves, self._treedef, self._subgroups = leaves, treedef, subgroups
        return self._initial_state(0)

    def _initial_state(self, count):
        state = SuperOffloadState(count=np.asarray(count, np.int32), ticket=np.zeros((2,), np.uint32))
        return jax.device_put(state, self.device)

    @property
    def device(self):
        """The jax.Device the parameters and the step are on: the CPU, or the GPU of a CUDA session."""
        return self._device if self._device is not None else jax.devices("cpu")[0]

    def _lr_at(self, count):
        lr = self.learning_rate(count) if callable(self.learning_rate) else self.learning_rate
        return float(lr)

    def _live_session(self):
        if self._session is None:
            raise RuntimeError("the optimizer has no session: call init(params) first (and not after close())")
        return self._session

    @property
    def session(self):
        """The `superoffload.Session` (trace, checkpoint file, host bytes...)."""
        return self._live_session()

    def close(self):
        """Destroys the session, after the compiled steps this thread dispatched have run and the
        session's queued work is done. A compiled step run afterwards fails with an error naming
        the closed session. (Steps dispatched from other threads must have run: wait for their
        results first.)"""
        with self._lock:
            if self._session is not None:
                _ffi.wait_for_dispatched_steps()
                self._session.close()
                self._session = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the step (inside jit) ------------------------------------------------------------------

    def step(self, loss_fn, params, state, *args, has_aux=False):
        """One training step, for use inside `jax.jit`: returns `(loss, new_params, new_state)` (with
        `has_aux`, `((loss, aux), new_params, new_state)`), where `loss = loss_fn(params, *args)` (a
        real scalar; with `has_aux`, `loss_fn` returns `(loss, aux)` as for `jax.value_and_grad`).

        The learning rate (the schedule at `state.count`) and the loss scale go to the session first;
        with `wait="forward"` the forward reads each parameter's weights (the previous step's result)
        from the session before its first use, and `params` only gives the shapes; the backward hands
        each leaf's gradient to the session as it is produced; the session then decides the step
        (clipping, skipping). The parameters returned are the weights the forward used
        (`wait="forward"`; `opt.params(params, state)` gives the latest) or the updated weights, each
        read once its own sub-group is final (`wait="step"`)."""
        self._live_session()
        session = self._session_id
        leaves = self._treedef.flatten_up_to(params)
        for leaf, x in zip(self._leaves, leaves):
            dtype = np.dtype(jnp.result_type(x))
            if tuple(np.shape(x)) != leaf.shape or dtype != leaf.dtype:
                raise ValueError(f"parameter {leaf.name} is {dtype}{list(np.shape(x))}; the optimizer was "
                                 f"initialised with {leaf.dtype}{list(leaf.shape)}")
        lr = self.learning_rate(state.count) if callable(self.learning_rate) else self.learning_rate
        lr = jnp.asarray(lr)
        if lr.dtype not in (jnp.float32, jnp.float64):
            lr = lr.astype(jnp.float32)
        # After the previous step's ticket and every weight read back (the parameters passed in, or
        # whatever they were computed from): no read of the previous step comes after this step's
        # gradients, even in a program that takes several steps.
        scale = _ffi.begin_step(session, self._group, lr, jnp.float32(self.loss_scale), state.ticket, *leaves)

        def scaled_loss(p):
            p = self._treedef.flatten_up_to(p)
            if self.wait == "forward":
                out, read = _first_use.call(loss_fn, p, self._treedef, args, self._reader(p, scale, state.ticket))
            else:
                tapped = [x if leaf.slice_id is None else _hand_over_in_backward(x, scale, session, leaf.slice_id)
                          for leaf, x in zip(self._leaves, p)]
                out, read = loss_fn(jax.tree_util.tree_unflatten(self._treedef, tapped), *args), None
            loss, aux = out if has_aux else (out, None)
            return loss * scale.astype(loss.dtype), (loss, aux, read)

        grads, (loss, aux, read) = jax.grad(scaled_loss, has_aux=True)(params)
        handed = [g for leaf, g in zip(self._leaves, self._treedef.flatten_up_to(grads)) if leaf.slice_id is not None]
        max_norm = 0.0 if self.max_grad_norm is None else self.max_grad_norm
        # After every read of the previous step's weights: this step publishes over them.
        ticket = _ffi.step(handed, session, max_norm, after=read or ())
        new = read if self.wait == "forward" else self._read_all(leaves, ticket)
        new_params = jax.tree_util.tree_unflatten(self._treedef, new)
        new_state = SuperOffloadState(count=state.count + 1, ticket=ticket)
        return ((loss, aux) if has_aux else loss), new_params, new_state

    def _where(self, leaf):
        """Where the session keeps a leaf: (session, slice, sub-group, offset)."""
        return self._session_id, leaf.slice_id, self._subgroups[leaf.subgroup].id, leaf.offset

    def _read_all(self, leaves, ticket):
        """Every leaf's weights after the step of `ticket`, each read once its own sub-group is final."""
        return [x if leaf.slice_id is None else _ffi.read_weights(ticket, leaf.shape, leaf.dtype, *self._where(leaf))
                for leaf, x in zip(self._leaves, leaves)]

    def _reader(self, leaves, scale, ticket):
        """`fetch` for `_first_use.call`: reads leaf `i` after the step of `ticket`, after the arrays it is
        computed with and after the leaf read before it (reads in forward order)."""
        latest = []

        def fetch(i, after):
            leaf = self._leaves[i]
            if leaf.slice_id is None:
                return leaves[i]
            weights = _read_in_forward(leaves[i], scale, ticket, tuple(after) + tuple(latest), self._where(leaf))
            latest[:] = [weights]
            return weights
        return fetch

    # ---- outside jit ----------------------------------------------------------------------------

    def params(self, params, state):
        """The weights after the step of `state`, for use outside the train step (evaluation,
        export). With `wait="forward"` the parameters a step returns are the weights its forward
        used, one step behind the session; this reads the latest ones (it waits for the step)."""
        self._live_session()
        if self._read_latest is None:
            self._read_latest = jax.jit(lambda leaves, ticket: self._read_all(leaves, ticket))
        leaves = self._read_latest(self._treedef.flatten_up_to(params), state.ticket)
        return jax.tree_util.tree_unflatten(self._treedef, leaves)

    @staticmethod
    def _ticket(state):
        t = np.asarray(state.ticket)  # waits for the step call that wrote it
        return int(t[0]) | (int(t[1]) << 32)

    def metrics(self, state):
        """The outcome of the step that produced `state` (waits for it): a dict of the session's
        step result (`global_norm`, `clip_coef`, `skipped`, `skip_reason`, `loss_scale`,
        speculative/kept/rescaled/rolled_back/redone/stepped counts, `final_pass_elements`,
        `forward_wait_s`, ...), plus `learning_rate` (the schedule's value the step used). None
        before the first step. Only the latest step's result is kept."""
        ticket = self._ticket(state)
        if ticket == 0:
            return None
        result = self._live_session().step_result(ticket)
        result["learning_rate"] = self._lr_at(int(state.count) - 1)
        return result

    def state_dict(self, state):
        """The optimizer's state as a pytree of numpy arrays, for any checkpointer (pickle, orbax,
        numpy.savez): {"format", "count", "speculation_history", "master", "exp_avg", "exp_avg_sq",
        "step"}, the last four shaped like the parameter tree (f32 master weights and moments, int
        step counts). Waits for the step of `state`; call it between steps. `load_state_dict`
        restores it bit for bit: training resumed from it continues exactly as without the break."""
        return _state_dict.state_dict(self, state, self._ticket(state))

    def load_state_dict(self, state_dict):
        """Restores a `state_dict()` into this optimizer (initialised with a parameter tree of the
        same structure, shapes and dtypes; between steps). Returns `(params, state)`: the parameters
        (from the restored f32 master weights, in the parameters' dtype) and the optimizer state to
        continue with. Everything is checked before anything changes."""
        return _state_dict.load_state_dict(self, state_dict)
