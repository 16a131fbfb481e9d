"""The library and a thin Python layer over its C ABI (ctypes): errors, pools, sessions.

Everything here takes plain integers for addresses (a torch tensor's `data_ptr()`, a numpy
array's `ctypes.data`, a CUDA stream's `cuda_stream`), so it needs neither torch nor numpy.
ctypes releases the GIL for every call into the library.
"""
import ctypes as C
import logging
import os
import threading

from . import _abi
from ._abi import DType, Status

logger = logging.getLogger("superoffload")

_LIB = None
_LIB_LOCK = threading.Lock()
_LIB_PATH = None


class SuperOffloadError(RuntimeError):
    """A call into libsuperoffload failed: the message is the library's (`so_last_error_message`),
    `.status` the `so_status` value (an `superoffload.Status`) and `.status_name` its C name."""

    def __init__(self, status, message):
        try:
            status = Status(status)
            name = f"SO_STATUS_{status.name}"
        except ValueError:
            name = "SO_STATUS_UNKNOWN"
        super().__init__(f"{message} [{name}]")
        self.status = status
        self.status_name = name
        self.message = message


def library_path():
    """Where the library is loaded from: $SUPEROFFLOAD_LIBRARY, else the one in the package."""
    env = os.environ.get("SUPEROFFLOAD_LIBRARY")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    names = sorted(n for n in os.listdir(here) if n.startswith("libsuperoffload.so"))
    if not names:
        raise ImportError(
            f"superoffload: no libsuperoffload.so in {here} (a source checkout on sys.path without a build?) "
            "and SUPEROFFLOAD_LIBRARY is not set: `pip install .` builds and installs the package, or set "
            "SUPEROFFLOAD_LIBRARY=<path to libsuperoffload.so>")
    return os.path.join(here, names[-1])


def lib():
    """The loaded library (ctypes.CDLL with every mirrored prototype set), loaded on first use."""
    global _LIB, _LIB_PATH
    if _LIB is None:
        with _LIB_LOCK:
            if _LIB is None:
                path = library_path()
                handle = C.CDLL(path)
                missing = _abi.bind(handle)
                if missing:
                    raise ImportError(f"superoffload: {path} lacks {', '.join(missing)}: it is not the library "
                                      "this package was built for")
                got = handle.so_abi_version()
                if got != _abi.ABI_VERSION:
                    raise ImportError(f"superoffload: {path} has ABI version {got}, this package mirrors ABI "
                                      f"{_abi.ABI_VERSION}: install the package and the library together")
                _LIB_PATH = path
                _LIB = handle
                logger.debug("loaded %s (version %s, ABI %d)", path, handle.so_version_string().decode(), got)
    return _LIB


def last_error_message():
    buf = C.create_string_buffer(4096)
    n = lib().so_last_error_message(buf, len(buf))
    if n >= len(buf):
        buf = C.create_string_buffer(n + 1)
        lib().so_last_error_message(buf, len(buf))
    return buf.value.decode("utf-8", "replace")


def check(status, what=None):
    """Raises SuperOffloadError for a status other than OK."""
    if status != 0:
        msg = last_error_message() or lib().so_status_str(status).decode()
        if what and not msg.startswith(what):
            msg = f"{what}: {msg}"
        raise SuperOffloadError(status, msg)


def version():
    """The library's version string (so_version_string)."""
    return lib().so_version_string().decode()


def abi_version():
    return int(lib().so_abi_version())


def status_str(status):
    return lib().so_status_str(int(status)).decode()


def cuda_available():
    """(available, why not): whether the library can use CUDA here (so_cuda_available)."""
    st = lib().so_cuda_available()
    return st == 0, ("" if st == 0 else last_error_message())


def check_moment_dtype(moment_dtype):
    """The moment dtypes an optimizer takes: "f32" or "bf16" (the sessions' host state)."""
    if moment_dtype not in ("f32", "bf16"):
        raise ValueError(f'moment_dtype must be "f32" or "bf16", not {moment_dtype!r}')


def gpu_budget_bytes(value, automatic):
    """so_session_options.gpu_budget_bytes of an optimizer's argument: "auto" is the library's
    automatic budget where it applies (`automatic`), else 0; a number of bytes is passed on."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f'gpu_budget_bytes must be "auto" or a number of bytes, not {value!r}')
        return _abi.GPU_BUDGET_AUTO if automatic else 0
    try:
        ok = not isinstance(value, bool) and int(value) == value and 0 <= value < _abi.GPU_BUDGET_AUTO
    except (TypeError, ValueError, OverflowError):
        ok = False
    if not ok:
        raise ValueError(f'gpu_budget_bytes must be "auto" or a number of bytes >= 0, not {value!r}')
    return int(value)


def dtype(x, allow_none=False):
    """DType from a DType, its name ("f32", "bf16", "f16", "none") or a torch dtype."""
    if isinstance(x, DType):
        d = x
    elif isinstance(x, int):
        d = DType(x)
    else:
        s = str(x).replace("torch.", "")
        table = {"f32": DType.F32, "float32": DType.F32, "float": DType.F32, "bf16": DType.BF16,
                 "bfloat16": DType.BF16, "f16": DType.F16, "float16": DType.F16, "half": DType.F16,
                 "none": DType.NONE, "": DType.NONE}
        if s not in table:
            raise ValueError(f"unknown dtype {x!r} (f32, bf16, f16{' or none' if allow_none else ''})")
        d = table[s]
    if d == DType.NONE and not allow_none:
        raise ValueError("a dtype is required here (f32, bf16 or f16)")
    return d


def _ns(timeout_s):
    if timeout_s is None or timeout_s < 0 or timeout_s != timeout_s or timeout_s == float("inf"):
        return -1
    return int(timeout_s * 1e9)


def _u32_array(values):
    values = [int(v) for v in values]
    return (C.c_uint32 * len(values))(*values) if values else None


# ---- pools --------------------------------------------------------------------------------------

class Pool:
    """A thread pool of the library (so_pool_create): `threads` (0: one per core given, else one
    per CPU this process may run on), optionally one thread pinned to each of `cores`."""

    def __init__(self, threads=0, cores=None, isa="auto"):
        o = lib().so_pool_options_default()
        o.num_threads = int(threads)
        arr = _u32_array(cores or [])
        if arr is not None:
            o.cores = C.cast(arr, C.POINTER(C.c_uint32))
            o.num_cores = len(arr)
        o.isa = int(_abi.Isa[str(isa).upper()]) if isinstance(isa, str) else int(isa)
        h = C.c_void_p()
        check(lib().so_pool_create(C.byref(o), C.byref(h)), "so_pool_create")
        self._h = h

    @property
    def handle(self):
        return self._h.value

    def info(self):
        i = _abi.new(_abi.PoolInfo)
        check(lib().so_pool_get_info(self._h, C.byref(i)), "so_pool_get_info")
        return {"isa": lib().so_isa_name(i.isa).decode(), "threads": int(i.num_threads), "pinned": bool(i.pinned)}

    def close(self):
        if self._h:
            lib().so_pool_destroy(self._h)
            self._h = C.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def adam_update(param, grad, exp_avg, exp_avg_sq, numel, *, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.01, step=1, grad_scale=1.0, mode="adamw", bias_correction=True, pool=None,
                param_dtype="f32", grad_dtype="f32", moment_dtype="f32", param_copy=0, param_copy_dtype="none"):
    """One so_adam_update over raw host addresses; returns the scaled gradient's sum of squares."""
    hp = lib().so_adam_hparams_default()
    hp.mode = int(_abi.AdamMode.L2 if mode in ("l2", "adam") else _abi.AdamMode.ADAMW)
    hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay = lr, beta1, beta2, eps, weight_decay
    hp.bias_correction, hp.step = bool(bias_correction), int(step)
    b = lib().so_adam_buffers_default()
    b.numel, b.param, b.grad, b.exp_avg, b.exp_avg_sq = int(numel), param, grad, exp_avg, exp_avg_sq
    b.param_dtype, b.grad_dtype, b.moment_dtype = dtype(param_dtype), dtype(grad_dtype), dtype(moment_dtype)
    if param_copy:
        b.param_copy, b.param_copy_dtype = param_copy, dtype(param_copy_dtype)
    o = lib().so_update_options_default()
    o.grad_scale = float(grad_scale)
    out = C.c_double()
    check(lib().so_adam_update(pool.handle if pool else None, C.byref(hp), C.byref(b), C.byref(o), C.byref(out)),
          "so_adam_update")
    return out.value


def host_memory():
    """(available, total) host bytes, as a session measures them before it allocates
    (`so_host_memory`: MemAvailable within the process's cgroup limit); None where the system
    does not say."""
    available, total = C.c_size_t(), C.c_size_t()
    status = lib().so_host_memory(C.byref(available), C.byref(total))
    if status == Status.UNSUPPORTED:
        return None
    check(status, "so_host_memory")
    return available.value, total.value


# ---- sessions -----------------------------------------------------------------------------------

def _step_result_dict(r):
    d = r.as_dict()
    for k, v in list(d.items()):
        if isinstance(v, bool) or k in ("global_norm", "clip_coef", "forward_wait_s"):
            continue
        if isinstance(v, float):
            d[k] = float(v)
    if "skip_reason" in d:
        try:
            d["skip_reason"] = _abi.SkipReason(d["skip_reason"]).name.lower()
        except ValueError:
            pass
    return d


class Session:
    """An offload session (so_session_create / so_session_create_cuda). See the header for each
    call's contract; addresses are integers, `cores` a list of CPU ids, `loss_scaler` None or a
    dict of so_loss_scaler_options fields. Borrowed buffers: pass the objects owning them as
    `keep=` to `add_subgroup`; they are held until the sub-group is removed or the session closed.
    """

    def __init__(self, *, cuda=False, device=0, speculation="auto", mode="adamw", bias_correction=True,
                 grad_dtype="f32", accum_dtype=None, moment_dtype="f32", copy_dtype="none", cores=None, pool=None,
                 host_memory_limit=0, piece_bytes=16 << 20, loss_scaler=None, **extra):
        L = lib()
        o = L.so_session_options_default()
        o.mode = int(_abi.AdamMode.L2 if mode in ("l2", "adam") else _abi.AdamMode.ADAMW)
        if mode not in ("adamw", "l2", "adam"):
            raise ValueError(f'mode must be "adamw" or "l2", not {mode!r}')
        o.bias_correction = bool(bias_correction)
        o.grad_dtype = dtype(grad_dtype)
        o.accum_dtype = dtype(accum_dtype) if accum_dtype else o.grad_dtype
        o.moment_dtype = dtype(moment_dtype)
        o.copy_dtype = dtype(copy_dtype, allow_none=True)
        o.speculation = _speculation(speculation)
        o.host_memory_limit = int(host_memory_limit)
        self._keep_opts = []
        if cores is not None:
            arr = _u32_array(cores)
            self._keep_opts.append(arr)
            o.cores = C.cast(arr, C.POINTER(C.c_uint32)) if arr is not None else None
            o.num_cores = len(cores)
        if pool is not None:
            o.pool = pool.handle
            self._keep_opts.append(pool)
        if loss_scaler is not None:
            ls = L.so_loss_scaler_options_default()
            for k, v in dict(loss_scaler).items():
                if k not in ls.field_names() or k == "struct_size":
                    raise ValueError(f"unknown loss_scaler setting {k!r}")
                setattr(ls, k, v)
            self._keep_opts.append(ls)
            o.loss_scaler = C.pointer(ls)
        for k, v in extra.items():  # any other so_session_options field by name (e.g. gpu_budget_bytes)
            if k not in o.field_names():
                raise TypeError(f"Session(): this library's so_session_options has no field {k!r}")
            setattr(o, k, v)
        h = C.c_void_p()
        if cuda:
            co = L.so_cuda_options_default()
            co.device = int(device)
            co.piece_bytes = int(piece_bytes)
            check(L.so_session_create_cuda(C.byref(o), C.byref(co), C.byref(h)), "so_session_create_cuda")
        else:
            check(L.so_session_create(C.byref(o), C.byref(h)), "so_session_create")
        self._h = h
        self.cuda = bool(cuda)
        self.device = int(device)
        self.grad_dtype = DType(o.grad_dtype)
        self.accum_dtype = DType(o.accum_dtype)
        self.moment_dtype = DType(o.moment_dtype)
        self._keep = {}
        self._lock = threading.Lock()
        logger.debug("session created (%s, speculation %s, moments %s, cores %s)", "CUDA" if cuda else "host",
                     speculation, self.moment_dtype.name.lower(), cores)

    # -- lifetime
    @property
    def handle(self):
        h = self._h.value
        if not h:
            raise SuperOffloadError(Status.INVALID_STATE, "the session was closed")
        return h

    @property
    def closed(self):
        return not self._h.value

    def close(self):
        """Destroys the session (waiting for its queued work), then drops the borrowed buffers."""
        if self._h.value:
            lib().so_session_destroy(self._h)
            self._h = C.c_void_p()
        self._keep.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- groups
    def _hp(self, lr, beta1, beta2, eps, weight_decay):
        g = lib().so_group_hparams_default()
        g.lr, g.beta1, g.beta2, g.eps, g.weight_decay = lr, beta1, beta2, eps, weight_decay
        return g

    def add_group(self, lr, beta1, beta2, eps, weight_decay):
        out = C.c_uint32()
        check(lib().so_session_add_group(self.handle, C.byref(self._hp(lr, beta1, beta2, eps, weight_decay)),
                                         C.byref(out)), "so_session_add_group")
        return out.value

    def set_group(self, group, lr, beta1, beta2, eps, weight_decay):
        check(lib().so_session_set_group(self.handle, group, C.byref(self._hp(lr, beta1, beta2, eps, weight_decay))),
              "so_session_set_group")

    def get_group(self, group):
        g = _abi.new(_abi.GroupHparams)
        check(lib().so_session_get_group(self.handle, group, C.byref(g)), "so_session_get_group")
        return g.as_dict()

    # -- sub-groups
    def add_subgroup(self, group, master, numel, slices, *, master_dtype="f32", grad=0, device_param=0,
                     device_param_dtype="f32", keep=None, **extra):
        """Registers a sub-group; `slices` = [(name, offset, numel)]. Returns (id, [slice ids]).
        `extra`: other so_subgroup_desc fields by name (exp_avg, exp_avg_sq, placement)."""
        L = lib()
        d = L.so_subgroup_desc_default()
        d.group, d.master, d.master_dtype, d.numel = int(group), int(master), dtype(master_dtype), int(numel)
        d.grad = int(grad) or None
        descs = (_abi.SliceDesc * len(slices))()
        names = []
        for i, (name, off, n) in enumerate(slices):
            b = name.encode()
            names.append(b)
            descs[i].name, descs[i].offset, descs[i].numel = b, int(off), int(n)
        d.slices, d.num_slices = descs, len(slices)
        if self.cuda:
            d.device_param, d.device_param_dtype = int(device_param), dtype(device_param_dtype)
        for k, v in extra.items():
            if k not in d.field_names():
                raise TypeError(f"add_subgroup(): this library's so_subgroup_desc has no field {k!r}")
            setattr(d, k, v)
        out = C.c_uint32()
        check(L.so_session_add_subgroup(self.handle, C.byref(d), C.byref(out)), "so_session_add_subgroup")
        sg = out.value
        self._keep[sg] = keep
        ids = [self.slice_id(name) for name, _, _ in slices]
        return sg, ids

    def remove_subgroup(self, sg):
        check(lib().so_session_remove_subgroup(self.handle, sg), "so_session_remove_subgroup")
        self._keep.pop(sg, None)

    def slice_id(self, name):
        out = C.c_uint32()
        check(lib().so_session_slice_id(self.handle, name.encode(), C.byref(out)), "so_session_slice_id")
        return out.value

    # -- steps
    def begin_step(self, loss_scale=1.0, micro_steps=1):
        check(lib().so_session_begin_step(self.handle, float(loss_scale), int(micro_steps)), "so_session_begin_step")

    def next_micro_step(self):
        check(lib().so_session_next_micro_step(self.handle), "so_session_next_micro_step")

    def grad_copy(self, slice_id, ptr, numel):
        t = _abi.so_ticket()
        check(lib().so_session_grad_copy(self.handle, slice_id, ptr, numel, C.byref(t)), "so_session_grad_copy")
        return t.value

    def grad_written(self, slice_id):
        t = _abi.so_ticket()
        check(lib().so_session_grad_written(self.handle, slice_id, C.byref(t)), "so_session_grad_written")
        return t.value

    def grad_device(self, slice_id, ptr, numel, dt, stream):
        t = _abi.so_ticket()
        check(lib().so_session_grad_device(self.handle, slice_id, ptr, numel, dtype(dt), stream or None, C.byref(t)),
              "so_session_grad_device")
        return t.value

    def local_grad_sumsq(self, timeout_s=-1.0):
        out = C.c_double()
        check(lib().so_session_local_grad_sumsq(self.handle, _ns(timeout_s), C.byref(out)),
              "so_session_local_grad_sumsq")
        return out.value

    def step(self, max_norm=0.0, global_norm=None, overflow=False):
        a = lib().so_step_args_default()
        a.max_norm = float(max_norm)
        if global_norm is not None:
            a.norm_source = int(_abi.NormSource.GIVEN)
            a.global_norm = float(global_norm)
        a.overflow = bool(overflow)
        t = _abi.so_ticket()
        check(lib().so_session_step(self.handle, C.byref(a), C.byref(t)), "so_session_step")
        return t.value

    def step_result(self, ticket, timeout_s=-1.0):
        """The step's outcome as a dict (so_step_result's fields; skip_reason by name), or None
        on a timeout."""
        r = _abi.new(_abi.StepResult)
        st = lib().so_session_step_result(self.handle, ticket, _ns(timeout_s), C.byref(r))
        if st == Status.TIMEOUT:
            return None
        check(st, "so_session_step_result")
        return _step_result_dict(r)

    def final_ticket(self, sg):
        t = _abi.so_ticket()
        check(lib().so_session_final_ticket(self.handle, sg, C.byref(t)), "so_session_final_ticket")
        return t.value

    def step_count(self, sg):
        out = C.c_uint64()
        check(lib().so_session_step_count(self.handle, sg, C.byref(out)), "so_session_step_count")
        return out.value

    def loss_scale(self):
        out = C.c_float()
        check(lib().so_session_loss_scale(self.handle, C.byref(out)), "so_session_loss_scale")
        return out.value

    def id(self):
        """A number naming this session for the rest of the process, never reused by another
        (so_session_id): the `session` attribute of the library's XLA FFI handlers."""
        out = C.c_uint64()
        check(lib().so_session_id(self.handle, C.byref(out)), "so_session_id")
        return out.value

    def host_bytes(self):
        out = C.c_size_t()
        check(lib().so_session_host_bytes(self.handle, C.byref(out)), "so_session_host_bytes")
        return out.value

    def pinned_bytes(self):
        if not self.cuda:
            return 0
        out = C.c_size_t()
        check(lib().so_session_pinned_bytes(self.handle, C.byref(out)), "so_session_pinned_bytes")
        return out.value

    # -- tickets
    def query(self, ticket):
        """"done", "pending", or raises the work's error."""
        st = lib().so_ticket_query(self.handle, ticket)
        if st == 0:
            return "done"
        if st == Status.PENDING:
            return "pending"
        check(st, "so_ticket_query")

    def wait(self, ticket, timeout_s=-1.0):
        """Waits on the host for one ticket; False on a timeout; raises the work's error."""
        if not ticket:
            return True
        st = lib().so_ticket_wait(self.handle, ticket, _ns(timeout_s))
        if st == Status.TIMEOUT:
            return False
        check(st, "so_ticket_wait")
        return True

    def wait_settled(self, sg, timeout_s=-1.0):
        """Waits until the sub-group's latest step wrote its master weights and moments (its
        gradient buffer is free again); False on a timeout."""
        st = lib().so_session_wait_settled(self.handle, sg, _ns(timeout_s))
        if st == Status.TIMEOUT:
            return False
        check(st, "so_session_wait_settled")
        return True

    def wait_all(self, ticket, timeout_s=-1.0):
        if not ticket:
            return True
        st = lib().so_ticket_wait_all(self.handle, ticket, _ns(timeout_s))
        if st == Status.TIMEOUT:
            return False
        check(st, "so_ticket_wait_all")
        return True

    def wait_final(self, sgs):
        for sg in sgs:
            self.wait(self.final_ticket(sg))

    def enqueue_wait(self, ticket, stream):
        if ticket:
            check(lib().so_ticket_enqueue_wait(self.handle, ticket, stream or None), "so_ticket_enqueue_wait")

    def enqueue_wait_final(self, sgs, stream):
        for sg in sgs:
            self.enqueue_wait(self.final_ticket(sg), stream)

    def set_compute_stream(self, stream):
        check(lib().so_session_set_compute_stream(self.handle, stream or None), "so_session_set_compute_stream")

    def copy_stream(self):
        out = C.c_void_p()
        check(lib().so_session_copy_stream(self.handle, C.byref(out)), "so_session_copy_stream")
        return out.value or 0

    # -- checkpoints, timeline
    def save(self, path):
        check(lib().so_session_save(self.handle, os.fsencode(path)), "so_session_save")

    def load(self, path):
        check(lib().so_session_load(self.handle, os.fsencode(path)), "so_session_load")

    def speculation_history(self):
        """(bits, steps): the clip history automatic speculation decides from (a checkpoint file
        keeps it; a state dict kept elsewhere must, for a resumed run to continue bit for bit)."""
        bits, steps = C.c_uint32(), C.c_uint32()
        check(lib().so_session_get_speculation_history(self.handle, C.byref(bits), C.byref(steps)),
              "so_session_get_speculation_history")
        return int(bits.value), int(steps.value)

    def set_speculation_history(self, bits, steps):
        check(lib().so_session_set_speculation_history(self.handle, int(bits), int(steps)),
              "so_session_set_speculation_history")

    def trace(self, enable=True):
        check(lib().so_session_trace(self.handle, bool(enable)), "so_session_trace")

    def save_trace(self, path):
        check(lib().so_session_trace_save(self.handle, os.fsencode(path)), "so_session_trace_save")

    # -- state in place, placement
    def get_subgroup_state(self, sg):
        """so_session_get_subgroup_state as a dict (addresses as integers)."""
        L = lib()
        s = _abi.new(_abi.SubgroupState)
        check(L.so_session_get_subgroup_state(self.handle, sg, C.byref(s)), "so_session_get_subgroup_state")
        return s.as_dict()

    def set_step_count(self, sg, count):
        check(lib().so_session_set_step_count(self.handle, sg, int(count)), "so_session_set_step_count")

    def set_placement(self, sg, placement):
        """Moves a sub-group between host and GPU memory ("host" / "device"), between steps."""
        p = _abi.Placement[placement.upper()] if isinstance(placement, str) else _abi.Placement(placement)
        check(lib().so_session_set_placement(self.handle, sg, int(p)), "so_session_set_placement")

    def device_bytes(self):
        out = C.c_size_t()
        check(lib().so_session_device_bytes(self.handle, C.byref(out)), "so_session_device_bytes")
        return out.value

    def gpu_budget(self):
        """The automatic split's budget in bytes: gpu_budget_bytes as given, or the one the session
        chose with the automatic budget (None until the warm-up steps have run)."""
        out = C.c_uint64()
        check(lib().so_session_gpu_budget(self.handle, C.byref(out)), "so_session_gpu_budget")
        return None if out.value == _abi.GPU_BUDGET_AUTO else out.value

    def limit_device_memory(self, limit_bytes):
        """Limits the free device memory the automatic budget counts on (None: no limit)."""
        value = _abi.DEVICE_MEMORY_UNLIMITED if limit_bytes is None else int(limit_bytes)
        check(lib().so_session_limit_device_memory(self.handle, value), "so_session_limit_device_memory")


def _speculation(value):
    """so_speculation from True (on), False (off) or "on" / "off" / "auto"."""
    if isinstance(value, str):
        try:
            return _abi.Speculation[value.upper()]
        except KeyError:
            raise ValueError(f"speculation must be True, False, 'on', 'off' or 'auto', not {value!r}") from None
    return _abi.Speculation.ON if value else _abi.Speculation.OFF
