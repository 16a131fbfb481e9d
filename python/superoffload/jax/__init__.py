"""superoffload for JAX: AdamW with its f32 master weights and moments in host memory, stepped by
libsuperoffload's CPU-Adam thread while backward runs, from inside a jitted train step.

    import superoffload.jax as sojax
    opt = sojax.adamw(learning_rate=schedule, weight_decay=0.01, max_grad_norm=1.0)
    state = opt.init(params)

    @jax.jit
    def train_step(params, state, batch):
        loss, params, state = opt.step(loss_fn, params, state, batch)
        return loss, params, state

    params = opt.params(params, state)  # the latest weights, for evaluation or export

The library's XLA FFI handlers (exported by libsuperoffload itself) are registered with JAX for the
CPU platform when this module is imported, and for the CUDA platform when an optimizer is initialised
with parameters on a GPU: nothing is compiled on the user's machine.
"""
try:
    import jax as _jax  # noqa: F401
except ImportError as _e:
    raise ImportError("superoffload.jax needs jax (the CPU build from the package index is enough for the CPU): "
                      "pip install 'superoffload[jax]'") from _e

from .._core import SuperOffloadError
from ._optimizer import SuperOffloadAdamW, SuperOffloadState
from ._ffi import register as _register

_register()


def adamw(learning_rate=1e-3, b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4, *, max_grad_norm=None, loss_scale=1.0,
          speculation="auto", sub_group_numel=1 << 25, cores=None, moment_dtype="f32", gpu_budget_bytes=0,
          wait="forward"):
    """SuperOffloadAdamW with optax.adamw's arguments and defaults (plus clipping, loss scaling and
    the session's settings): the equivalent of `optax.chain(optax.clip_by_global_norm(max_grad_norm),
    optax.adamw(learning_rate, b1, b2, eps, weight_decay=weight_decay))`. See SuperOffloadAdamW."""
    return SuperOffloadAdamW(learning_rate, b1, b2, eps, weight_decay, max_grad_norm=max_grad_norm,
                             loss_scale=loss_scale, speculation=speculation, sub_group_numel=sub_group_numel,
                             cores=cores, moment_dtype=moment_dtype, gpu_budget_bytes=gpu_budget_bytes,
                             wait=wait)


__all__ = ["adamw", "SuperOffloadAdamW", "SuperOffloadState", "SuperOffloadError"]
