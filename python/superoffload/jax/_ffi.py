"""The library's XLA FFI handlers (`so_xla_*`, exported by libsuperoffload itself), registered with
JAX for the CPU platform at import and for the CUDA platform when an optimizer is initialised with
parameters on a GPU, and the `jax.ffi.ffi_call`s a jitted step makes with them. The same handlers
serve both platforms: each call finds out from its session (a host or a CUDA session) and from XLA
(whether the call has a GPU stream) where it runs, and refuses a mismatch.

Nothing is compiled: the handlers' addresses come from the loaded library through ctypes and are
handed to XLA as PyCapsules (`jax.ffi.register_ffi_target`). Each call names the session by its
id (`so_session_id`, an unsigned 64-bit attribute), which no other session ever gets, so a
compiled step that outlives its optimizer fails with an error instead of reaching freed memory
or another session.
"""
import numpy as np

import jax
import jax.numpy as jnp

from .. import _core

# (XLA target name, the library's export): the targets the ffi_calls below name.
TARGETS = {
    "begin_step": ("superoffload_begin_step", "so_xla_begin_step"),
    "hand_over": ("superoffload_hand_over", "so_xla_hand_over"),
    "step": ("superoffload_step", "so_xla_step"),
    "read_weights": ("superoffload_read_weights", "so_xla_read_weights"),
    "write_weights": ("superoffload_write_weights", "so_xla_write_weights"),
}
# JAX's platform names: "cpu", and "CUDA" for NVIDIA GPUs (jax.Device.platform says "gpu").
CPU, CUDA = "cpu", "CUDA"

_registered = set()


def register(platform=CPU):
    """Registers the handlers with XLA for `platform` (once per process and platform)."""
    if platform in _registered:
        return
    lib = _core.lib()
    for target, export in TARGETS.values():
        try:
            handler = getattr(lib, export)
        except AttributeError:
            raise ImportError(f"superoffload.jax: {_core.library_path()} does not export {export}: it is older than "
                              "this package; install the package and the library together") from None
        try:
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform=platform)
        except Exception as e:  # XLA's own message says why (e.g. an FFI API version it does not accept)
            raise ImportError(f"superoffload.jax: XLA refused the FFI handler {export} ({target}) for the "
                              f"{platform} platform: {e}") from e
    _registered.add(platform)


def _attrs(session, **more):
    return dict(session=np.uint64(session), **more)


def begin_step(session, group, lr, loss_scale, *previous):
    """The step's learning rate and loss scale go to the session; returns the loss scale (f32 scalar)
    the backward must use. `previous` (the previous step's ticket and the weights it read back)
    orders the call after every call of the previous step."""
    call = jax.ffi.ffi_call(TARGETS["begin_step"][0], jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)
    return call(lr, loss_scale, *previous, **_attrs(session, group=np.uint32(group)))


def hand_over(grad, loss_scale, session, slice_id, *after):
    """Hands a slice's gradient to the session, after `loss_scale` (the step's begin) and the arrays
    in `after`; returns the gradient (the same buffer)."""
    call = jax.ffi.ffi_call(TARGETS["hand_over"][0], jax.ShapeDtypeStruct(grad.shape, grad.dtype),
                            has_side_effect=True, input_output_aliases={0: 0})
    return call(grad, loss_scale, *after, **_attrs(session, slice=np.uint32(slice_id)))


def step(handed, session, max_norm, after=()):
    """Ends the step, after the hand-overs (`handed`, their results) and the arrays in `after`;
    returns its ticket (uint32[2]: low and high words)."""
    call = jax.ffi.ffi_call(TARGETS["step"][0], jax.ShapeDtypeStruct((2,), jnp.uint32), has_side_effect=True)
    return call(*handed, *after, **_attrs(session, max_norm=np.float64(max_norm)))


def read_weights(ticket, shape, dtype, session, slice_id, subgroup, offset, after=()):
    """A slice's weights after the step of `ticket` (waits for its own sub-group alone), read after
    the arrays in `after`. `subgroup` and `offset` (the slice's place in it) name where a CUDA
    session publishes them."""
    call = jax.ffi.ffi_call(TARGETS["read_weights"][0], jax.ShapeDtypeStruct(shape, dtype), has_side_effect=True)
    return call(ticket, *after, **_attrs(session, slice=np.uint32(slice_id), subgroup=np.uint32(subgroup),
                                         offset=np.uint64(offset)))


def write_weights(weights, session, subgroup, offset):
    """Writes `weights` (on the GPU) into the device parameter a CUDA session's sub-group publishes
    into, `offset` elements in (between steps); returns a uint32 scalar to wait for."""
    call = jax.ffi.ffi_call(TARGETS["write_weights"][0], jax.ShapeDtypeStruct((), jnp.uint32), has_side_effect=True)
    return call(weights, **_attrs(session, subgroup=np.uint32(subgroup), offset=np.uint64(offset)))


def wait_for_dispatched_steps():
    """Waits until every computation with effects this thread dispatched has run (jax.effects_barrier:
    every compiled step that calls the handlers is one), so that the session is not in the middle
    of one. A computation that failed has run too: its error is the caller's to see where they use
    its results, not here."""
    try:
        jax.effects_barrier()
    except Exception:  # noqa: BLE001 - the failure belongs to the failed computation's results
        pass

