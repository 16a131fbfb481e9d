"""ctypes mirrors of `include/superoffload.h`: every enum, struct and function of the C ABI.

This is the only place the ABI is written down on the Python side. `superoffload._header`
parses the header and compares it with `ENUMS`, `STRUCTS` and `FUNCTIONS` here (names, order,
types); the package's tests run that check, so a header change without the matching change
here fails CI. Enum classes drop the C prefix (`SO_STATUS_OK` -> `Status.OK`).
"""
import ctypes as C
import enum

ABI_VERSION = 6

# `#define`d constants the package uses (`superoffload._header` checks their values).
CONSTANTS = {
    # so_session_options.gpu_budget_bytes for a budget the session measures itself.
    "SO_GPU_BUDGET_AUTO": (1 << 64) - 1,
    # so_session_limit_device_memory's value for no limit.
    "SO_DEVICE_MEMORY_UNLIMITED": (1 << 64) - 1,
}
GPU_BUDGET_AUTO = CONSTANTS["SO_GPU_BUDGET_AUTO"]
DEVICE_MEMORY_UNLIMITED = CONSTANTS["SO_DEVICE_MEMORY_UNLIMITED"]

c_size_t, c_u32, c_u64, c_i32, c_i64 = C.c_size_t, C.c_uint32, C.c_uint64, C.c_int32, C.c_int64
c_f64, c_f32, c_bool, c_void_p, c_char_p = C.c_double, C.c_float, C.c_bool, C.c_void_p, C.c_char_p
P = C.POINTER

# typedefs
so_status = c_u32
so_ticket = c_u64
so_device_ptr = c_u64
so_cuda_stream_t = c_void_p


# ---- enums ------------------------------------------------------------------------------------

class Status(enum.IntEnum):
    OK = 0
    NULL_ARGUMENT = 1
    INVALID_ARGUMENT = 2
    STRUCT_SIZE = 3
    UNSUPPORTED = 4
    ALIASING = 5
    INVALID_STATE = 6
    NOT_FOUND = 7
    NON_FINITE = 20
    OUT_OF_RESOURCES = 30
    TIMEOUT = 40
    PENDING = 41
    IO = 50
    BAD_CHECKPOINT = 51
    CUDA_UNAVAILABLE = 60
    CUDA_ERROR = 61
    STREAM_CAPTURING = 62
    PANIC = 99


class DType(enum.IntEnum):
    NONE = 0
    F32 = 1
    BF16 = 2
    F16 = 3


class AdamMode(enum.IntEnum):
    ADAMW = 1
    L2 = 2


class Isa(enum.IntEnum):
    AUTO = 0
    PORTABLE = 1
    AVX2 = 2
    AVX512 = 3


class NormSource(enum.IntEnum):
    LOCAL = 1
    GIVEN = 2


class SkipReason(enum.IntEnum):
    NONE = 0
    OVERFLOW = 1
    NON_FINITE_GRADIENT = 2
    NON_FINITE_NORM = 3
    UNUSABLE_FACTOR = 4


class Speculation(enum.IntEnum):
    OFF = 0
    ON = 1
    AUTO = 2


class Placement(enum.IntEnum):
    HOST = 0
    DEVICE = 1


class HostCopy(enum.IntEnum):
    AUTO = 0
    FULL = 1
    BOUNDED = 2


class GradientHome(enum.IntEnum):
    AUTO = 0
    HOST = 1
    DEVICE = 2


ENUMS = {
    "so_status": Status,
    "so_dtype": DType,
    "so_adam_mode": AdamMode,
    "so_isa": Isa,
    "so_norm_source": NormSource,
    "so_skip_reason": SkipReason,
    "so_speculation": Speculation,
    "so_placement": Placement,
    "so_host_copy": HostCopy,
    "so_gradient_home": GradientHome,
}


# ---- structs ----------------------------------------------------------------------------------

class _Struct(C.Structure):
    @classmethod
    def field_names(cls):
        return [n for n, _ in cls._fields_]

    def as_dict(self):
        return {n: getattr(self, n) for n, _ in self._fields_ if n != "struct_size"}


class AdamHparams(_Struct):
    _fields_ = [("struct_size", c_size_t), ("mode", c_u32), ("lr", c_f64), ("beta1", c_f64), ("beta2", c_f64),
                ("eps", c_f64), ("weight_decay", c_f64), ("bias_correction", c_bool), ("step", c_u64)]


class AdamBuffers(_Struct):
    _fields_ = [("struct_size", c_size_t), ("numel", c_size_t), ("param", c_void_p), ("grad", c_void_p),
                ("exp_avg", c_void_p), ("exp_avg_sq", c_void_p), ("param_copy", c_void_p), ("param_dtype", c_u32),
                ("grad_dtype", c_u32), ("moment_dtype", c_u32), ("param_copy_dtype", c_u32)]


class UpdateOptions(_Struct):
    _fields_ = [("struct_size", c_size_t), ("grad_scale", c_f32), ("check_finite", c_bool)]


class PoolOptions(_Struct):
    _fields_ = [("struct_size", c_size_t), ("num_threads", c_size_t), ("cores", P(c_u32)), ("num_cores", c_size_t),
                ("isa", c_u32)]


class PoolInfo(_Struct):
    _fields_ = [("struct_size", c_size_t), ("isa", c_u32), ("num_threads", c_size_t), ("pinned", c_bool)]


class LossScalerOptions(_Struct):
    _fields_ = [("struct_size", c_size_t), ("init_scale", c_f32), ("growth_factor", c_f32),
                ("backoff_factor", c_f32), ("growth_interval", c_u32), ("hysteresis", c_u32), ("min_scale", c_f32)]


class SessionOptions(_Struct):
    _fields_ = [("struct_size", c_size_t), ("pool", c_void_p), ("cores", P(c_u32)), ("num_cores", c_size_t),
                ("mode", c_u32), ("bias_correction", c_bool), ("moment_dtype", c_u32), ("grad_dtype", c_u32),
                ("accum_dtype", c_u32), ("speculation", c_u32), ("host_memory_limit", c_u64), ("amsgrad", c_bool),
                ("loss_scaler", P(LossScalerOptions)), ("copy_dtype", c_u32), ("gpu_budget_bytes", c_u64),
                ("host_copy", c_u32), ("gradient_home", c_u32)]


class GroupHparams(_Struct):
    _fields_ = [("struct_size", c_size_t), ("lr", c_f64), ("beta1", c_f64), ("beta2", c_f64), ("eps", c_f64),
                ("weight_decay", c_f64)]


class SliceDesc(_Struct):
    _fields_ = [("name", c_char_p), ("offset", c_size_t), ("numel", c_size_t)]


class SubgroupDesc(_Struct):
    _fields_ = [("struct_size", c_size_t), ("group", c_u32), ("master", c_void_p), ("master_dtype", c_u32),
                ("numel", c_size_t), ("grad", c_void_p), ("slices", P(SliceDesc)), ("num_slices", c_size_t),
                ("device_param", so_device_ptr), ("device_param_dtype", c_u32), ("exp_avg", c_void_p),
                ("exp_avg_sq", c_void_p), ("placement", c_u32), ("copy", c_void_p)]


class StepArgs(_Struct):
    _fields_ = [("struct_size", c_size_t), ("max_norm", c_f64), ("norm_source", c_u32), ("global_norm", c_f64),
                ("overflow", c_bool)]


class CudaOptions(_Struct):
    _fields_ = [("struct_size", c_size_t), ("device", c_i32), ("piece_bytes", c_size_t)]


class StepResult(_Struct):
    _fields_ = [("struct_size", c_size_t), ("serial", c_u64), ("skipped", c_bool), ("global_norm", c_f64),
                ("clip_coef", c_f64), ("grad_factor", c_f32), ("loss_scale", c_f32), ("next_loss_scale", c_f32),
                ("speculative", c_u32), ("late_gradients", c_u32), ("kept", c_u32), ("rescaled", c_u32),
                ("rolled_back", c_u32), ("redone", c_u32), ("stepped", c_u32), ("skip_reason", c_u32),
                ("cancelled", c_u32), ("device_stepped", c_u32), ("device_subgroups", c_u32),
                ("final_pass_elements", c_u64), ("forward_wait_s", c_f64)]


class SubgroupState(_Struct):
    _fields_ = [("struct_size", c_size_t), ("placement", c_u32), ("numel", c_size_t), ("master", c_void_p),
                ("exp_avg", c_void_p), ("exp_avg_sq", c_void_p), ("master_dtype", c_u32), ("moment_dtype", c_u32),
                ("step_count", c_u64)]


STRUCTS = {
    "so_adam_hparams": AdamHparams,
    "so_adam_buffers": AdamBuffers,
    "so_update_options": UpdateOptions,
    "so_pool_options": PoolOptions,
    "so_pool_info": PoolInfo,
    "so_loss_scaler_options": LossScalerOptions,
    "so_session_options": SessionOptions,
    "so_group_hparams": GroupHparams,
    "so_slice_desc": SliceDesc,
    "so_subgroup_desc": SubgroupDesc,
    "so_step_args": StepArgs,
    "so_cuda_options": CudaOptions,
    "so_step_result": StepResult,
    "so_subgroup_state": SubgroupState,
}


# ---- functions: name -> (restype, argtypes) ---------------------------------------------------

_pool = c_void_p      # const struct so_pool *
_session = c_void_p   # struct so_session *

FUNCTIONS = {
    "so_adam_hparams_default": (AdamHparams, []),
    "so_adam_buffers_default": (AdamBuffers, []),
    "so_update_options_default": (UpdateOptions, []),
    "so_adam_update": (so_status, [_pool, P(AdamHparams), P(AdamBuffers), P(UpdateOptions), P(c_f64)]),
    "so_adam_rollback": (so_status, [_pool, P(AdamHparams), P(AdamBuffers), c_f32]),
    "so_adam_rescale": (so_status, [_pool, P(AdamHparams), P(AdamBuffers), c_f32, c_f32]),
    "so_grad_sumsq": (so_status, [_pool, c_void_p, c_u32, c_size_t, c_f32, P(c_f64)]),
    "so_pool_options_default": (PoolOptions, []),
    "so_pool_create": (so_status, [P(PoolOptions), P(c_void_p)]),
    "so_pool_destroy": (None, [_pool]),
    "so_pool_get_info": (so_status, [_pool, P(PoolInfo)]),
    "so_isa_name": (c_char_p, [c_u32]),
    "so_loss_scaler_options_default": (LossScalerOptions, []),
    "so_session_options_default": (SessionOptions, []),
    "so_group_hparams_default": (GroupHparams, []),
    "so_subgroup_desc_default": (SubgroupDesc, []),
    "so_step_args_default": (StepArgs, []),
    "so_session_create": (so_status, [P(SessionOptions), P(c_void_p)]),
    "so_session_create_cuda": (so_status, [P(SessionOptions), P(CudaOptions), P(c_void_p)]),
    "so_session_destroy": (None, [_session]),
    "so_session_add_group": (so_status, [_session, P(GroupHparams), P(c_u32)]),
    "so_session_set_group": (so_status, [_session, c_u32, P(GroupHparams)]),
    "so_session_get_group": (so_status, [_session, c_u32, P(GroupHparams)]),
    "so_session_add_subgroup": (so_status, [_session, P(SubgroupDesc), P(c_u32)]),
    "so_session_remove_subgroup": (so_status, [_session, c_u32]),
    "so_session_slice_id": (so_status, [_session, c_char_p, P(c_u32)]),
    "so_session_begin_step": (so_status, [_session, c_f32, c_u32]),
    "so_session_next_micro_step": (so_status, [_session]),
    "so_session_grad_copy": (so_status, [_session, c_u32, c_void_p, c_size_t, P(so_ticket)]),
    "so_session_grad_written": (so_status, [_session, c_u32, P(so_ticket)]),
    "so_session_local_grad_sumsq": (so_status, [_session, c_i64, P(c_f64)]),
    "so_session_step": (so_status, [_session, P(StepArgs), P(so_ticket)]),
    "so_session_step_result": (so_status, [_session, so_ticket, c_i64, P(StepResult)]),
    "so_session_final_ticket": (so_status, [_session, c_u32, P(so_ticket)]),
    "so_session_wait_settled": (so_status, [_session, c_u32, c_i64]),
    "so_session_step_count": (so_status, [_session, c_u32, P(c_u64)]),
    "so_session_loss_scale": (so_status, [_session, P(c_f32)]),
    "so_host_memory": (so_status, [P(c_size_t), P(c_size_t)]),
    "so_session_host_bytes": (so_status, [_session, P(c_size_t)]),
    "so_session_id": (so_status, [_session, P(c_u64)]),
    "so_ticket_query": (so_status, [_session, so_ticket]),
    "so_ticket_wait": (so_status, [_session, so_ticket, c_i64]),
    "so_ticket_wait_all": (so_status, [_session, so_ticket, c_i64]),
    "so_session_save": (so_status, [_session, c_char_p]),
    "so_session_load": (so_status, [_session, c_char_p]),
    "so_session_get_speculation_history": (so_status, [_session, P(c_u32), P(c_u32)]),
    "so_session_set_speculation_history": (so_status, [_session, c_u32, c_u32]),
    "so_cuda_options_default": (CudaOptions, []),
    "so_cuda_available": (so_status, []),
    "so_session_grad_device": (so_status, [_session, c_u32, so_device_ptr, c_size_t, c_u32, so_cuda_stream_t,
                                           P(so_ticket)]),
    "so_session_set_compute_stream": (so_status, [_session, so_cuda_stream_t]),
    "so_ticket_enqueue_wait": (so_status, [_session, so_ticket, so_cuda_stream_t]),
    "so_session_copy_stream": (so_status, [_session, P(so_cuda_stream_t)]),
    "so_session_pinned_bytes": (so_status, [_session, P(c_size_t)]),
    "so_session_trace": (so_status, [_session, c_bool]),
    "so_session_trace_save": (so_status, [_session, c_char_p]),
    "so_session_get_subgroup_state": (so_status, [_session, c_u32, P(SubgroupState)]),
    "so_session_set_step_count": (so_status, [_session, c_u32, c_u64]),
    "so_session_set_placement": (so_status, [_session, c_u32, c_u32]),
    "so_session_device_bytes": (so_status, [_session, P(c_size_t)]),
    "so_session_gpu_budget": (so_status, [_session, P(c_u64)]),
    "so_session_limit_device_memory": (so_status, [_session, c_u64]),
    "so_xla_begin_step": (c_void_p, [c_void_p]),
    "so_xla_hand_over": (c_void_p, [c_void_p]),
    "so_xla_step": (c_void_p, [c_void_p]),
    "so_xla_read_weights": (c_void_p, [c_void_p]),
    "so_xla_write_weights": (c_void_p, [c_void_p]),
    "so_abi_version": (c_u32, []),
    "so_version_string": (c_char_p, []),
    "so_status_str": (c_char_p, [c_u32]),
    "so_last_error_message": (c_size_t, [c_char_p, c_size_t]),
}


def bind(lib):
    """Sets restype/argtypes of every mirrored function on a ctypes.CDLL; returns the names the
    library lacks (none for a library of this ABI)."""
    missing = []
    for name, (res, args) in FUNCTIONS.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.restype = res
        fn.argtypes = args
    return missing


def new(cls, **fields):
    """A struct from its library default (`so_<name>_default()` where the library has one is
    used by the caller); here: zeroed with struct_size set, then `fields` applied."""
    s = cls()
    if "struct_size" in cls.field_names():
        s.struct_size = C.sizeof(cls)
    for k, v in fields.items():
        setattr(s, k, v)
    return s
