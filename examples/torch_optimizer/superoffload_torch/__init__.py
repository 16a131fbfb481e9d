"""superoffload for PyTorch: SuperOffloadAdamW (CPU-offloaded AdamW with speculative steps
during backward) over the libsuperoffload C ABI, through a C++ extension built on first use.

    from superoffload_torch import SuperOffloadAdamW
    opt = SuperOffloadAdamW(model.parameters(), lr=1e-4, max_grad_norm=1.0, model=model)

The install prefix of superoffload comes from $SUPEROFFLOAD_PREFIX (or prefix=...).
"""
from ._build import BuildError, find_prefix, load as load_extension
from .optimizer import SuperOffloadAdamW


def extension(prefix=None):
    """The compiled extension module (Session, Pool, adam_update, SuperOffloadError, ...)."""
    return load_extension(prefix)


def __getattr__(name):
    if name == "SuperOffloadError":
        return load_extension().SuperOffloadError
    raise AttributeError(name)


__all__ = ["SuperOffloadAdamW", "BuildError", "extension", "find_prefix", "load_extension"]
