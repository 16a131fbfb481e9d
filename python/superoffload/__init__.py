"""superoffload: CPU-offloaded AdamW with speculative sub-group steps during backward and exact
gradient clipping, over libsuperoffload's C ABI (bundled in this package, reached through ctypes).

    import superoffload
    superoffload.__version__          # the library's version (so_version_string())
    from superoffload.torch import SuperOffloadAdamW
    from superoffload.hf import SuperOffloadTrainer

Layers: `superoffload.Session` / `superoffload.Pool` (the C ABI, addresses as integers; no torch
needed), `superoffload.torch` (the torch.optim optimizer), `superoffload.hf` (Hugging Face
Trainer). Logging goes to `logging.getLogger("superoffload")`.
"""
import logging as _logging

from ._abi import AdamMode, DType, Isa, NormSource, SkipReason, Status
from ._core import (Pool, Session, SuperOffloadError, abi_version, adam_update, cuda_available, library_path,
                    status_str, version)

_logging.getLogger("superoffload").addHandler(_logging.NullHandler())


def get_include():
    """Directory of superoffload.h and superoffload.hpp (for C/C++ extensions linking the library)."""
    import os
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")


def get_library():
    """Path of the bundled library, named by its SONAME (libsuperoffload.so.0.<minor> while 0.x; link it
    by path, rpath its directory)."""
    return library_path()


def __getattr__(name):
    if name == "__version__":
        return version()
    raise AttributeError(f"module 'superoffload' has no attribute {name!r}")


__all__ = ["Session", "Pool", "SuperOffloadError", "Status", "DType", "AdamMode", "Isa", "NormSource",
           "SkipReason", "version", "abi_version", "cuda_available", "adam_update", "status_str", "get_include",
           "get_library", "__version__"]
