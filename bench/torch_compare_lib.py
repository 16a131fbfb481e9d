"""bench/torch_compare.py's view of libsuperoffload: the library through ctypes, with the C ABI's
declarations of the superoffload package (superoffload._abi), checked against the library's ABI
version and struct sizes."""
import ctypes
import os

from support import import_abi

_abi = import_abi()
Status, DType, AdamMode, Isa = _abi.Status, _abi.DType, _abi.AdamMode, _abi.Isa
ISA_CODES = {isa.name.lower(): isa for isa in Isa}


class SoError(RuntimeError):
    """A failed library call: `status` plus the library's message."""

    def __init__(self, status, message):
        super().__init__(f"{message} (status {status})")
        self.status = status
        self.message = message


class Lib:
    """libsuperoffload through ctypes. Pointers are plain ints (data_ptr() or addressof)."""

    def __init__(self, path):
        if not os.path.exists(path):
            raise SystemExit(f"error: library not found: {path} (build it with `cargo build --release`)")
        self.path = os.path.abspath(path)
        self.so = ctypes.CDLL(self.path)
        so = self.so
        missing = _abi.bind(so)
        if "so_abi_version" in missing:
            raise SystemExit(f"error: {self.path} has no so_abi_version: it is not libsuperoffload")
        abi = so.so_abi_version()
        if abi != _abi.ABI_VERSION:
            raise SystemExit(f"error: {self.path} has ABI version {abi}; the superoffload package ({_abi.__file__}) "
                             f"declares ABI {_abi.ABI_VERSION}: use a library and a package of the same version")
        if missing:
            raise SystemExit(f"error: {self.path} lacks {', '.join(missing)}, though it has ABI version {abi}")
        self.version = so.so_version_string().decode()
        # The defaults carry the library's sizeof: they must equal the package's, or its
        # declarations do not match the library's header.
        for name, (cls, _) in _abi.FUNCTIONS.items():
            if name.endswith("_default") and "struct_size" in cls.field_names():
                got = getattr(so, name)().struct_size
                if got != ctypes.sizeof(cls):
                    raise SystemExit(
                        f"error: {name}: the library's struct_size is {got}, superoffload._abi.{cls.__name__} has "
                        f"{ctypes.sizeof(cls)}; the package's declarations do not match the library's header")

    # -- errors -------------------------------------------------------------------------------
    def last_error(self):
        n = self.so.so_last_error_message(None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self.so.so_last_error_message(buf, n + 1)
        return buf.value.decode(errors="replace")

    def check(self, status):
        if status != Status.OK:
            msg = self.last_error() or self.so.so_status_str(status).decode()
            raise SoError(status, msg)

    # -- structs ------------------------------------------------------------------------------
    def hparams(self, step, lr=1e-3, weight_decay=0.01, mode=AdamMode.ADAMW, betas=None, eps=None):
        hp = self.so.so_adam_hparams_default()
        hp.mode, hp.lr, hp.weight_decay, hp.step = mode, lr, weight_decay, step
        if betas is not None:
            hp.beta1, hp.beta2 = betas
        if eps is not None:
            hp.eps = eps
        return hp

    def buffers(self, n, p, g, m, v, grad_dtype=DType.F32, copy=None, copy_dtype=DType.NONE,
                param_dtype=DType.F32, moment_dtype=DType.F32):
        b = self.so.so_adam_buffers_default()
        b.numel, b.param, b.grad, b.exp_avg, b.exp_avg_sq = n, p, g, m, v
        b.param_dtype, b.grad_dtype, b.moment_dtype = param_dtype, grad_dtype, moment_dtype
        b.param_copy, b.param_copy_dtype = copy, copy_dtype
        return b

    def options(self, grad_scale=1.0, check_finite=False):
        o = self.so.so_update_options_default()
        o.grad_scale, o.check_finite = grad_scale, check_finite
        return o

    # -- pools --------------------------------------------------------------------------------
    def pool_create(self, threads, cores=None, isa="auto"):
        opts = self.so.so_pool_options_default()
        opts.num_threads = threads
        opts.isa = ISA_CODES[isa]
        keep = None
        if cores:
            keep = (ctypes.c_uint32 * len(cores))(*cores)
            opts.cores, opts.num_cores = keep, len(cores)
        out = ctypes.c_void_p()
        self.check(self.so.so_pool_create(ctypes.byref(opts), ctypes.byref(out)))
        del keep  # the library copied the list
        return out.value

    def pool_destroy(self, pool):
        self.so.so_pool_destroy(pool)

    def pool_info(self, pool):
        info = _abi.new(_abi.PoolInfo)
        self.check(self.so.so_pool_get_info(pool, ctypes.byref(info)))
        return {
            "isa": self.so.so_isa_name(info.isa).decode(),
            "threads": info.num_threads,
            "pinned": bool(info.pinned),
        }

    # -- kernels (arguments prepared once, so the timed call is only the C call) -------------
    def update(self, pool, hp, bufs, opts=None, want_sumsq=False):
        out = ctypes.c_double(0.0)
        self.check(self.so.so_adam_update(pool, ctypes.byref(hp), ctypes.byref(bufs),
                                          ctypes.byref(opts) if opts is not None else None,
                                          ctypes.byref(out) if want_sumsq else None))
        return out.value if want_sumsq else None

    def rollback(self, pool, hp, bufs, grad_scale=1.0):
        self.check(self.so.so_adam_rollback(pool, ctypes.byref(hp), ctypes.byref(bufs), grad_scale))

    def rescale(self, pool, hp, bufs, old_scale, new_scale):
        self.check(self.so.so_adam_rescale(pool, ctypes.byref(hp), ctypes.byref(bufs), old_scale, new_scale))

    def grad_sumsq(self, pool, grad, dtype, n, scale=1.0):
        out = ctypes.c_double(0.0)
        self.check(self.so.so_grad_sumsq(pool, grad, dtype, n, scale, ctypes.byref(out)))
        return out.value
