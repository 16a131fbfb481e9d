"""SuperOffloadAdamW's arguments: their checks and their so_session_options values."""
import math
import numbers

from .. import _core


def check_arguments(lr, betas, max_grad_norm, accumulation_steps, gpu_fraction, moment_dtype, wait):
    if not 0.0 <= lr:
        raise ValueError(f"invalid learning rate {lr}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas {betas}")
    if max_grad_norm < 0 or not math.isfinite(max_grad_norm):
        raise ValueError(f"max_grad_norm must be finite and >= 0, not {max_grad_norm}")
    if accumulation_steps < 1:
        raise ValueError("accumulation_steps must be >= 1")
    if not 0.0 <= gpu_fraction < 1.0:
        raise ValueError(f"gpu_fraction must be in [0, 1), not {gpu_fraction}")
    _core.check_moment_dtype(moment_dtype)
    if wait not in ("auto", "module", "step"):
        raise ValueError(f'wait must be "auto", "module" or "step", not {wait!r}')


def choice(name, value, enum):
    """The so_session_options value of a string option ("auto", ...) of `enum`."""
    names = [m.name.lower() for m in enum]
    if value not in names:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, names))}, not {value!r}")
    return int(enum[value.upper()])


def host_memory_limit(value):
    """The host_memory_limit argument as a whole number of bytes (0: no limit)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"host_memory_limit must be a number of bytes (0: no limit), not {value!r}")
    if not (math.isfinite(value) and value == int(value) and 0 <= value < 1 << 64):
        raise ValueError(f"host_memory_limit must be a whole number of bytes >= 0 (0: no limit), not {value!r}")
    return int(value)


def group_hparams(g):
    b1, b2 = g["betas"]
    return (float(g["lr"]), float(b1), float(b2), float(g["eps"]), float(g["weight_decay"]))
