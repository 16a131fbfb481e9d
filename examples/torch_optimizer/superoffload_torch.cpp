// PyTorch C++ extension over superoffload: a pybind11 `Session` (host or CUDA) that takes
// torch tensors, plus the CPU Adam kernel for measurements. Every optimizer operation is the
// library's; this file only converts tensors, streams and errors. Built by
// superoffload_torch/_build.py (torch.utils.cpp_extension.load, or g++ directly without
// ninja) against an installed superoffload prefix.
//
// SO_TORCH_CUDA=1: compiled against the CUDA headers torch needs (<ATen/cuda/CUDAContext.h>):
// the current stream comes from at::cuda::getCurrentCUDAStream() and the copy stream is
// wrapped with c10::cuda::getStreamFromExternal for Tensor::record_stream.
// SO_TORCH_CUDA=0: no CUDA headers at all; a CUDA session then needs the caller's stream as a
// raw pointer and the copy stream as a torch.Stream (torch.cuda.ExternalStream), both passed
// from Python (superoffload_torch does this automatically).

#include <torch/extension.h>

#include <pybind11/stl.h>

#include <superoffload.hpp>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#ifndef SO_TORCH_CUDA
#define SO_TORCH_CUDA 0
#endif

#if SO_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace py = pybind11;
namespace so = superoffload;

namespace {

// ---- errors -------------------------------------------------------------------------------

PyObject* g_error_type = nullptr; // superoffload_torch.SuperOffloadError (a RuntimeError)

const char* status_constant(so_status st) {
    switch (st) {
    case SO_STATUS_OK: return "SO_STATUS_OK";
    case SO_STATUS_NULL_ARGUMENT: return "SO_STATUS_NULL_ARGUMENT";
    case SO_STATUS_INVALID_ARGUMENT: return "SO_STATUS_INVALID_ARGUMENT";
    case SO_STATUS_STRUCT_SIZE: return "SO_STATUS_STRUCT_SIZE";
    case SO_STATUS_UNSUPPORTED: return "SO_STATUS_UNSUPPORTED";
    case SO_STATUS_ALIASING: return "SO_STATUS_ALIASING";
    case SO_STATUS_INVALID_STATE: return "SO_STATUS_INVALID_STATE";
    case SO_STATUS_NOT_FOUND: return "SO_STATUS_NOT_FOUND";
    case SO_STATUS_NON_FINITE: return "SO_STATUS_NON_FINITE";
    case SO_STATUS_OUT_OF_RESOURCES: return "SO_STATUS_OUT_OF_RESOURCES";
    case SO_STATUS_TIMEOUT: return "SO_STATUS_TIMEOUT";
    case SO_STATUS_PENDING: return "SO_STATUS_PENDING";
    case SO_STATUS_IO: return "SO_STATUS_IO";
    case SO_STATUS_BAD_CHECKPOINT: return "SO_STATUS_BAD_CHECKPOINT";
    case SO_STATUS_CUDA_UNAVAILABLE: return "SO_STATUS_CUDA_UNAVAILABLE";
    case SO_STATUS_CUDA_ERROR: return "SO_STATUS_CUDA_ERROR";
    case SO_STATUS_STREAM_CAPTURING: return "SO_STATUS_STREAM_CAPTURING";
    case SO_STATUS_PANIC: return "SO_STATUS_PANIC";
    }
    return "SO_STATUS_UNKNOWN";
}

// Errors found by this file (not by the library) use the library's statuses too, so Python
// sees one exception type with a status for everything a session refuses.
[[noreturn]] void fail(so_status st, const std::string& message) {
    throw so::Error(st, "superoffload_torch: " + message);
}

void require(bool ok, const std::string& message) {
    if (!ok) fail(SO_STATUS_INVALID_ARGUMENT, message);
}

// ---- dtypes -------------------------------------------------------------------------------

so::DType parse_dtype(const std::string& s, bool allow_none = false) {
    if (s == "f32" || s == "float32" || s == "float") return so::DType::F32;
    if (s == "bf16" || s == "bfloat16") return so::DType::Bf16;
    if (s == "f16" || s == "float16" || s == "half") return so::DType::F16;
    if (allow_none && (s.empty() || s == "none")) return so::DType::None;
    fail(SO_STATUS_INVALID_ARGUMENT,
         "unknown dtype \"" + s + "\" (use f32, bf16, f16" + std::string(allow_none ? " or none)" : ")"));
}

const char* dtype_str(so::DType d) {
    switch (d) {
    case so::DType::None: return "none";
    case so::DType::F32: return "f32";
    case so::DType::Bf16: return "bf16";
    case so::DType::F16: return "f16";
    }
    return "?";
}

so::DType tensor_dtype(const at::Tensor& t, const char* what) {
    switch (t.scalar_type()) {
    case at::kFloat: return so::DType::F32;
    case at::kBFloat16: return so::DType::Bf16;
    case at::kHalf: return so::DType::F16;
    default: break;
    }
    fail(SO_STATUS_INVALID_ARGUMENT, std::string(what) + " is " + std::string(c10::toString(t.scalar_type())) +
                                         "; superoffload takes float32, bfloat16 or float16 tensors");
}

at::ScalarType scalar_type(so::DType d) {
    switch (d) {
    case so::DType::F32: return at::kFloat;
    case so::DType::Bf16: return at::kBFloat16;
    case so::DType::F16: return at::kHalf;
    default: break;
    }
    fail(SO_STATUS_INVALID_ARGUMENT, "no tensor dtype for none");
}

std::string describe(const at::Tensor& t) {
    std::string s =
        std::string(c10::toString(t.scalar_type())) + "[" + std::to_string(t.numel()) + "] on " + t.device().str();
    if (!t.is_contiguous()) s += " (non-contiguous)";
    return s;
}

int64_t to_ns(double seconds) {
    if (!(seconds >= 0.0) || !std::isfinite(seconds)) return -1; // negative, NaN, inf: forever
    return static_cast<int64_t>(seconds * 1e9);
}

py::dict step_result_dict(const so_step_result& r) {
    py::dict d;
    d["serial"] = r.serial;
    d["skipped"] = r.skipped;
    d["global_norm"] = r.global_norm;
    d["clip_coef"] = r.clip_coef;
    d["grad_factor"] = r.grad_factor;
    d["loss_scale"] = r.loss_scale;
    d["next_loss_scale"] = r.next_loss_scale;
    d["speculative"] = r.speculative;
    d["late_gradients"] = r.late_gradients;
    d["kept"] = r.kept;
    d["rescaled"] = r.rescaled;
    d["rolled_back"] = r.rolled_back;
    d["redone"] = r.redone;
    d["stepped"] = r.stepped;
    return d;
}

so::GroupHparams group_hparams(double lr, double beta1, double beta2, double eps, double weight_decay) {
    so::GroupHparams g;
    g.lr = lr;
    g.beta1 = beta1;
    g.beta2 = beta2;
    g.eps = eps;
    g.weight_decay = weight_decay;
    return g;
}

// ---- thread pool (for the kernel) ---------------------------------------------------------

class TorchPool {
public:
    TorchPool(size_t threads, std::optional<std::vector<uint32_t>> cores) {
        so::PoolOptions o;
        o.threads = threads;
        if (cores) o.cores = *cores;
        pool_ = so::Pool::create(o);
    }
    py::dict info() const {
        so::PoolInfo i = pool_.info();
        py::dict d;
        d["isa"] = i.isa_name;
        d["threads"] = i.threads;
        d["pinned"] = i.pinned;
        return d;
    }
    const so_pool* raw() const { return pool_.raw(); }

private:
    so::Pool pool_;
};

// One so_adam_update over CPU tensors (the kernel every session pass is built on): used to
// measure CPU Adam time alone. f32 param and moments; f32/bf16/f16 gradient.
double adam_update(at::Tensor param, const at::Tensor& grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, double lr,
                   double beta1, double beta2, double eps, double weight_decay, uint64_t step, double grad_scale,
                   const std::string& mode, bool bias_correction, const TorchPool* pool,
                   std::optional<at::Tensor> param_copy_opt) {
    const at::Tensor param_copy = param_copy_opt.value_or(at::Tensor());
    for (const at::Tensor* t : {static_cast<const at::Tensor*>(&param), &grad, static_cast<const at::Tensor*>(&exp_avg),
                                static_cast<const at::Tensor*>(&exp_avg_sq)}) {
        require(t->device().is_cpu() && t->is_contiguous(),
                "adam_update takes contiguous CPU tensors; got " + describe(*t));
        require(t->numel() == param.numel(), "adam_update: every tensor must have param.numel() elements");
    }
    so_adam_hparams hp = so_adam_hparams_default();
    hp.mode = mode == "l2" ? SO_ADAM_MODE_L2 : SO_ADAM_MODE_ADAMW;
    hp.lr = lr;
    hp.beta1 = beta1;
    hp.beta2 = beta2;
    hp.eps = eps;
    hp.weight_decay = weight_decay;
    hp.bias_correction = bias_correction;
    hp.step = step;
    so_adam_buffers b = so_adam_buffers_default();
    b.numel = static_cast<size_t>(param.numel());
    b.param = param.data_ptr();
    b.grad = grad.data_ptr();
    b.exp_avg = exp_avg.data_ptr();
    b.exp_avg_sq = exp_avg_sq.data_ptr();
    b.param_dtype = static_cast<uint32_t>(tensor_dtype(param, "param"));
    b.grad_dtype = static_cast<uint32_t>(tensor_dtype(grad, "grad"));
    b.moment_dtype = static_cast<uint32_t>(tensor_dtype(exp_avg, "exp_avg"));
    if (param_copy.defined()) {
        require(param_copy.device().is_cpu() && param_copy.is_contiguous() && param_copy.numel() == param.numel(),
                "adam_update: param_copy must be a contiguous CPU tensor like param");
        b.param_copy = param_copy.data_ptr();
        b.param_copy_dtype = static_cast<uint32_t>(tensor_dtype(param_copy, "param_copy"));
    }
    so_update_options o = so_update_options_default();
    o.grad_scale = static_cast<float>(grad_scale);
    double sumsq = 0.0;
    so_status st;
    {
        py::gil_scoped_release nogil;
        st = so_adam_update(pool ? pool->raw() : nullptr, &hp, &b, &o, &sumsq);
    }
    so::check(st);
    return sumsq;
}

// ---- session ------------------------------------------------------------------------------

struct SliceInfo {
    int64_t numel;
    uint32_t subgroup;
};

class TorchSession {
public:
    TorchSession(bool cuda, int device, bool speculation, const std::string& mode, bool bias_correction,
                 const std::string& grad_dtype, const std::string& accum_dtype, const std::string& moment_dtype,
                 const std::string& copy_dtype, std::optional<std::vector<uint32_t>> cores, uint64_t host_memory_limit,
                 size_t piece_bytes, std::optional<py::dict> loss_scaler)
        : cuda_(cuda), device_(device) {
        require(so::abi_compatible(), "libsuperoffload's ABI version " + std::to_string(so::abi_version()) +
                                          " differs from this header's " + std::to_string(so::header_abi_version) +
                                          ": rebuild the extension against the installed prefix");
        so::SessionOptions o;
        if (mode == "adamw") {
            o.mode = so::Mode::AdamW;
        } else if (mode == "l2" || mode == "adam") {
            o.mode = so::Mode::L2;
        } else {
            fail(SO_STATUS_INVALID_ARGUMENT, "mode must be \"adamw\" or \"l2\", not \"" + mode + "\"");
        }
        o.bias_correction = bias_correction;
        o.grad_dtype = parse_dtype(grad_dtype);
        o.accum_dtype = accum_dtype.empty() ? o.grad_dtype : parse_dtype(accum_dtype);
        o.moment_dtype = parse_dtype(moment_dtype);
        o.copy_dtype = parse_dtype(copy_dtype, true);
        o.speculation = speculation;
        o.host_memory_limit = host_memory_limit;
        if (cores) o.cores = *cores;
        if (loss_scaler) {
            so::LossScalerOptions ls;
            const py::dict& d = *loss_scaler;
            if (d.contains("init_scale")) ls.init_scale = d["init_scale"].cast<float>();
            if (d.contains("growth_factor")) ls.growth_factor = d["growth_factor"].cast<float>();
            if (d.contains("backoff_factor")) ls.backoff_factor = d["backoff_factor"].cast<float>();
            if (d.contains("growth_interval")) ls.growth_interval = d["growth_interval"].cast<uint32_t>();
            if (d.contains("hysteresis")) ls.hysteresis = d["hysteresis"].cast<uint32_t>();
            if (d.contains("min_scale")) ls.min_scale = d["min_scale"].cast<float>();
            o.loss_scaler = ls;
        }
        grad_dtype_ = o.grad_dtype;
        accum_dtype_ = o.accum_dtype;
        if (cuda_) {
            so::CudaOptions co;
            co.device = device;
            co.piece_bytes = piece_bytes;
            s_ = so::Session::create_cuda(o, co);
            copy_stream_ptr_ = reinterpret_cast<uint64_t>(s_.copy_stream());
#if SO_TORCH_CUDA
            copy_stream_ = c10::cuda::getStreamFromExternal(reinterpret_cast<cudaStream_t>(copy_stream_ptr_),
                                                            static_cast<c10::DeviceIndex>(device_))
                               .unwrap();
#endif
        } else {
            s_ = so::Session::create(o);
        }
    }

    // ---- groups --------------------------------------------------------------------

    uint32_t add_group(double lr, double beta1, double beta2, double eps, double weight_decay) {
        return live().add_group(group_hparams(lr, beta1, beta2, eps, weight_decay));
    }

    void set_group(uint32_t group, double lr, double beta1, double beta2, double eps, double weight_decay) {
        live().set_group(group, group_hparams(lr, beta1, beta2, eps, weight_decay));
    }

    py::dict get_group(uint32_t group) {
        so::GroupHparams g = live().group(group);
        py::dict d;
        d["lr"] = g.lr;
        d["beta1"] = g.beta1;
        d["beta2"] = g.beta2;
        d["eps"] = g.eps;
        d["weight_decay"] = g.weight_decay;
        return d;
    }

    // ---- sub-groups ----------------------------------------------------------------

    // Registers `master` (a contiguous CPU tensor, kept alive by this object) with its named
    // slices (name, offset, numel); in a CUDA session also `device_param`, the model's
    // parameter storage on the GPU where updated weights are published (kept alive too).
    // Returns (sub-group id, [slice id per slice]).
    std::pair<uint32_t, std::vector<uint32_t>> add_subgroup(
        uint32_t group, const at::Tensor& master, const std::vector<std::tuple<std::string, int64_t, int64_t>>& slices,
        std::optional<at::Tensor> device_param) {
        live();
        require(master.defined() && master.device().is_cpu(),
                "the master weights must be a CPU tensor; got " + (master.defined() ? describe(master) : "None"));
        require(master.is_contiguous(), "the master weights must be contiguous; got " + describe(master));
        require(master.numel() > 0, "the master weights are empty");
        require(!master.requires_grad(), "the master weights must not require grad (pass a detached tensor)");
        const so::DType mdt = tensor_dtype(master, "the master weights");
        std::vector<so::Slice> sl;
        for (const auto& [name, offset, numel] : slices) {
            require(offset >= 0 && numel > 0 && offset + numel <= master.numel(),
                    "slice \"" + name + "\" (offset " + std::to_string(offset) + ", numel " + std::to_string(numel) +
                        ") lies outside the master's " + std::to_string(master.numel()) + " elements");
            sl.push_back(so::Slice{name, static_cast<size_t>(offset), static_cast<size_t>(numel)});
        }
        uint32_t id = 0;
        if (cuda_) {
            require(device_param.has_value() && device_param->defined(),
                    "a CUDA session needs each sub-group's device_param (the model parameter on the GPU)");
            const at::Tensor& dp = *device_param;
            require(dp.is_cuda() && dp.device().index() == device_,
                    "device_param must be on cuda:" + std::to_string(device_) + "; got " + describe(dp));
            require(dp.is_contiguous(), "device_param must be contiguous; got " + describe(dp));
            require(dp.numel() == master.numel(), "device_param has " + std::to_string(dp.numel()) +
                                                      " elements, the master weights " +
                                                      std::to_string(master.numel()));
            const so::DType ddt = tensor_dtype(dp, "device_param");
            void* mptr = master.data_ptr();
            const auto dptr = static_cast<so_device_ptr>(reinterpret_cast<uintptr_t>(dp.data_ptr()));
            py::gil_scoped_release nogil; // page-locking a large master takes a while
            switch (mdt) {
            case so::DType::F32:
                id = s_.add_subgroup_cuda(group, static_cast<float*>(mptr), master.numel(), sl, dptr, ddt);
                break;
            case so::DType::Bf16:
                id = s_.add_subgroup_cuda(group, static_cast<so::bf16*>(mptr), master.numel(), sl, dptr, ddt);
                break;
            default:
                id = s_.add_subgroup_cuda(group, static_cast<so::f16*>(mptr), master.numel(), sl, dptr, ddt);
                break;
            }
        } else {
            require(!device_param.has_value() || !device_param->defined(),
                    "a host session has no device parameters (device_param must be None)");
            void* mptr = master.data_ptr();
            py::gil_scoped_release nogil;
            switch (mdt) {
            case so::DType::F32: id = s_.add_subgroup(group, static_cast<float*>(mptr), master.numel(), sl); break;
            case so::DType::Bf16: id = s_.add_subgroup(group, static_cast<so::bf16*>(mptr), master.numel(), sl); break;
            default: id = s_.add_subgroup(group, static_cast<so::f16*>(mptr), master.numel(), sl); break;
            }
        }
        keep_[id] = {master, device_param.value_or(at::Tensor())};
        std::vector<uint32_t> ids;
        for (const auto& [name, offset, numel] : slices) {
            const uint32_t sid = s_.slice_id(name);
            slices_[sid] = SliceInfo{numel, id};
            ids.push_back(sid);
        }
        return {id, ids};
    }

    void remove_subgroup(uint32_t sg) {
        {
            py::gil_scoped_release nogil;
            live().remove_subgroup(sg);
        }
        keep_.erase(sg);
        for (auto it = slices_.begin(); it != slices_.end();) {
            it = it->second.subgroup == sg ? slices_.erase(it) : std::next(it);
        }
    }

    uint32_t slice_id(const std::string& name) { return live().slice_id(name); }

    // ---- one step ------------------------------------------------------------------

    void begin_step(float loss_scale, uint32_t micro_steps) {
        so::Session& s = live();
        py::gil_scoped_release nogil; // with the built-in loss scaler this waits for the last verdict
        s.begin_step(loss_scale, micro_steps);
    }

    void next_micro_step() { live().next_micro_step(); }

    // Hands over the gradient of `slice`. CUDA session: a CUDA tensor, copied to the host on
    // the session's copy streams after the work queued so far on the current stream (or on
    // `stream`, a raw cudaStream_t); the tensor is record_stream'ed on the copy stream, so
    // the caller may drop it at once. Host session: a CPU tensor, copied before this returns.
    // Returns the ticket of the speculative step this queued (0 if none).
    uint64_t grad(uint32_t slice, const at::Tensor& g, std::optional<uint64_t> stream,
                  std::optional<c10::Stream> record_on) {
        live();
        auto it = slices_.find(slice);
        if (it == slices_.end()) fail(SO_STATUS_NOT_FOUND, "no slice has id " + std::to_string(slice));
        require(g.defined(), "the gradient is None");
        require(g.numel() == it->second.numel, "the gradient of slice " + std::to_string(slice) + " has " +
                                                   std::to_string(g.numel()) + " elements; the slice has " +
                                                   std::to_string(it->second.numel));
        if (!cuda_) {
            require(g.device().is_cpu(), "a host session takes CPU gradients; got " + describe(g));
            at::Tensor t = g;
            if (t.scalar_type() != scalar_type(grad_dtype_)) t = t.to(scalar_type(grad_dtype_));
            t = t.contiguous();
            py::gil_scoped_release nogil;
            return s_.grad_copy(slice, t.data_ptr(), grad_dtype_, static_cast<size_t>(t.numel()));
        }
        require(g.is_cuda() && g.device().index() == device_,
                "this CUDA session takes gradients on cuda:" + std::to_string(device_) + "; got " + describe(g));
        // Casting or compacting runs on the current stream, which is where the copy is ordered.
        at::Tensor t = g;
        if (t.scalar_type() != scalar_type(accum_dtype_)) t = t.to(scalar_type(accum_dtype_));
        t = t.contiguous();
        uint64_t stream_ptr = 0;
        if (stream) {
            stream_ptr = *stream;
        } else {
#if SO_TORCH_CUDA
            stream_ptr = reinterpret_cast<uint64_t>(
                at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream());
#else
            fail(SO_STATUS_INVALID_ARGUMENT, "this build has no CUDA headers: pass the producing stream's cuda_stream");
#endif
        }
        // The lifetime rule of so_session_grad_device: the caching allocator must not reuse
        // this memory before the copy stream has passed the copy. Recorded before the
        // hand-off, so a failure halfway through cannot leave a copy reading freed memory.
        if (record_on) {
            t.record_stream(*record_on);
        } else {
#if SO_TORCH_CUDA
            t.record_stream(*copy_stream_);
#else
            fail(SO_STATUS_INVALID_ARGUMENT,
                 "this build has no CUDA headers: pass record_on=torch.cuda.ExternalStream(copy_stream)");
#endif
        }
        py::gil_scoped_release nogil;
        return s_.grad_device(slice, static_cast<so_device_ptr>(reinterpret_cast<uintptr_t>(t.data_ptr())),
                              static_cast<size_t>(t.numel()), accum_dtype_,
                              reinterpret_cast<so_cuda_stream_t>(stream_ptr));
    }

    double local_grad_sumsq(double timeout_s) {
        so_session* raw = live().raw();
        double sumsq = 0.0;
        so_status st;
        {
            py::gil_scoped_release nogil;
            st = so_session_local_grad_sumsq(raw, to_ns(timeout_s), &sumsq);
        }
        so::check(st);
        return sumsq;
    }

    uint64_t step(double max_norm, std::optional<double> global_norm, bool overflow) {
        so::StepArgs a;
        a.max_norm = max_norm;
        a.global_norm = global_norm;
        a.overflow = overflow;
        return live().step(a);
    }

    py::dict step_result(uint64_t ticket, double timeout_s) {
        so_session* raw = live().raw();
        so_step_result r{};
        r.struct_size = sizeof r;
        so_status st;
        {
            py::gil_scoped_release nogil;
            st = so_session_step_result(raw, ticket, to_ns(timeout_s), &r);
        }
        so::check(st);
        return step_result_dict(r);
    }

    uint64_t final_ticket(uint32_t sg) { return live().final_ticket(sg); }

    std::vector<uint64_t> final_tickets(const std::vector<uint32_t>& sgs) {
        std::vector<uint64_t> out;
        for (uint32_t sg : sgs) out.push_back(live().final_ticket(sg));
        return out;
    }

    uint64_t step_count(uint32_t sg) { return live().step_count(sg); }

    // ---- tickets -------------------------------------------------------------------

    // Waits on the host; raises the work's error if it failed. Returns False on timeout.
    bool wait(uint64_t ticket, double timeout_s) {
        if (ticket == 0) return true;
        so_session* raw = live().raw();
        so_status st;
        {
            py::gil_scoped_release nogil;
            st = so_ticket_wait(raw, ticket, to_ns(timeout_s));
        }
        if (st == SO_STATUS_TIMEOUT) return false;
        so::check(st);
        return true;
    }

    bool wait_all(uint64_t ticket, double timeout_s) {
        if (ticket == 0) return true;
        so_session* raw = live().raw();
        so_status st;
        {
            py::gil_scoped_release nogil;
            st = so_ticket_wait_all(raw, ticket, to_ns(timeout_s));
        }
        if (st == SO_STATUS_TIMEOUT) return false;
        so::check(st);
        return true;
    }

    // Host waits for the final tickets of these sub-groups (in order).
    void wait_final(const std::vector<uint32_t>& sgs) {
        for (uint32_t sg : sgs) wait(live().final_ticket(sg), -1.0);
    }

    std::string query(uint64_t ticket) {
        const so::TicketStatus ts = live().query(ticket);
        if (ts.done()) return "done";
        if (ts.pending()) return "pending";
        throw *ts.error;
    }

    // Makes the CUDA stream (default: the current one of the session's device) wait on the
    // GPU until `ticket` is complete, without blocking this thread.
    void enqueue_wait(uint64_t ticket, std::optional<uint64_t> stream) {
        if (ticket == 0) return;
        live().enqueue_wait(ticket, stream_arg(stream, "enqueue_wait"));
    }

    // enqueue_wait of each sub-group's final ticket, in order.
    void enqueue_wait_final(const std::vector<uint32_t>& sgs, std::optional<uint64_t> stream) {
        so_cuda_stream_t s = stream_arg(stream, "enqueue_wait_final");
        for (uint32_t sg : sgs) {
            const uint64_t t = live().final_ticket(sg);
            if (t != 0) live().enqueue_wait(t, s);
        }
    }

    // Registers the compute stream (default: the current one) if it is not the one registered.
    // Returns whether it called so_session_set_compute_stream.
    bool set_compute_stream(std::optional<uint64_t> stream, bool force) {
        so_cuda_stream_t s = stream_arg(stream, "set_compute_stream");
        const uint64_t v = reinterpret_cast<uint64_t>(s);
        if (!force && compute_set_ && v == compute_stream_) return false;
        live().set_compute_stream(s);
        compute_stream_ = v;
        compute_set_ = true;
        return true;
    }

    // ---- queries, checkpoints, timeline ------------------------------------------------

    float loss_scale() {
        so::Session& s = live();
        py::gil_scoped_release nogil; // waits for the latest step's verdict
        return s.loss_scale();
    }
    size_t host_bytes() { return live().host_bytes(); }
    size_t pinned_bytes() { return cuda_ ? live().pinned_bytes() : 0; }
    uint64_t copy_stream() const { return copy_stream_ptr_; }

    void save(const std::string& path) {
        so::Session& s = live();
        py::gil_scoped_release nogil;
        s.save(path);
    }

    void load(const std::string& path) {
        so::Session& s = live();
        py::gil_scoped_release nogil;
        s.load(path);
    }

    void trace(bool enable) { live().trace(enable); }
    void save_trace(const std::string& path) { live().save_trace(path); }

    // Destroys the session now (waiting for its queued work) and drops the tensors it borrowed.
    void close() {
        {
            py::gil_scoped_release nogil;
            s_.reset();
        }
        keep_.clear();
        slices_.clear();
    }

    ~TorchSession() { s_.reset(); } // before the borrowed tensors in keep_ are released

    bool closed() const { return !s_; }
    bool is_cuda() const { return cuda_; }
    int device() const { return device_; }
    std::string grad_dtype() const { return dtype_str(grad_dtype_); }
    std::string accum_dtype() const { return dtype_str(accum_dtype_); }

private:
    so::Session& live() {
        if (!s_) fail(SO_STATUS_INVALID_STATE, "the session was closed");
        return s_;
    }

    so_cuda_stream_t stream_arg(std::optional<uint64_t> stream, const char* where) {
        if (!cuda_) fail(SO_STATUS_INVALID_STATE, std::string(where) + ": this is a host session (no CUDA streams)");
        if (stream) return reinterpret_cast<so_cuda_stream_t>(*stream);
#if SO_TORCH_CUDA
        return reinterpret_cast<so_cuda_stream_t>(
            at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device_)).stream());
#else
        fail(SO_STATUS_INVALID_ARGUMENT,
             std::string(where) + ": this build has no CUDA headers: pass the stream's cuda_stream");
#endif
    }

    so::Session s_;
    bool cuda_;
    int device_;
    so::DType grad_dtype_ = so::DType::F32;
    so::DType accum_dtype_ = so::DType::F32;
    std::unordered_map<uint32_t, std::pair<at::Tensor, at::Tensor>> keep_; // sub-group -> (master, device_param)
    std::unordered_map<uint32_t, SliceInfo> slices_;
    uint64_t copy_stream_ptr_ = 0;
    uint64_t compute_stream_ = 0;
    bool compute_set_ = false;
#if SO_TORCH_CUDA
    std::optional<c10::Stream> copy_stream_;
#endif
};

} // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "superoffload for PyTorch: offload sessions over torch tensors (see superoffload_torch)";

    g_error_type = PyErr_NewExceptionWithDoc(
        "superoffload_torch.SuperOffloadError",
        "An error reported by libsuperoffload (or by the extension's own checks): the message is the library's "
        "(so_last_error_message); .status is the so_status number and .status_name its SO_STATUS_* name.",
        PyExc_RuntimeError, nullptr);
    m.attr("SuperOffloadError") = py::handle(g_error_type);
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const so::Error& e) {
            const std::string msg =
                std::string(e.what()) + " [" + status_constant(e.status()) + ": " + e.status_description() + "]";
            py::object exc = py::reinterpret_borrow<py::object>(g_error_type)(msg);
            exc.attr("status") = static_cast<int>(e.status());
            exc.attr("status_name") = status_constant(e.status());
            PyErr_SetObject(g_error_type, exc.ptr());
        }
    });

    m.def(
        "version", [] { return std::string(so::version_string()); }, "libsuperoffload's version string");
    m.def("abi_version", [] { return so::abi_version(); });
    m.attr("header_abi_version") = so::header_abi_version;
    m.attr("compiled_with_cuda_headers") = static_cast<bool>(SO_TORCH_CUDA);
    m.def(
        "cuda_available",
        [] {
            const so_status st = so_cuda_available();
            return py::make_tuple(st == SO_STATUS_OK, st == SO_STATUS_OK ? std::string() : so::last_error_message());
        },
        "(available, why not): whether libsuperoffload can use CUDA here");

    py::class_<TorchPool>(m, "Pool")
        .def(py::init<size_t, std::optional<std::vector<uint32_t>>>(), py::arg("threads") = 0,
             py::arg("cores") = py::none())
        .def("info", &TorchPool::info);

    m.def("adam_update", &adam_update, py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("lr") = 1e-3, py::arg("beta1") = 0.9, py::arg("beta2") = 0.999, py::arg("eps") = 1e-8,
          py::arg("weight_decay") = 0.01, py::arg("step") = 1, py::arg("grad_scale") = 1.0, py::arg("mode") = "adamw",
          py::arg("bias_correction") = true, py::arg("pool") = nullptr, py::arg("param_copy") = py::none(),
          "One so_adam_update over contiguous CPU tensors; returns the gradient's sum of squares.");

    py::class_<TorchSession>(m, "Session")
        .def(py::init<bool, int, bool, const std::string&, bool, const std::string&, const std::string&,
                      const std::string&, const std::string&, std::optional<std::vector<uint32_t>>, uint64_t, size_t,
                      std::optional<py::dict>>(),
             py::arg("cuda") = false, py::arg("device") = 0, py::arg("speculation") = true, py::arg("mode") = "adamw",
             py::arg("bias_correction") = true, py::arg("grad_dtype") = "f32", py::arg("accum_dtype") = "",
             py::arg("moment_dtype") = "f32", py::arg("copy_dtype") = "none", py::arg("cores") = py::none(),
             py::arg("host_memory_limit") = 0, py::arg("piece_bytes") = size_t{16} << 20,
             py::arg("loss_scaler") = py::none())
        .def("add_group", &TorchSession::add_group, py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
             py::arg("weight_decay"))
        .def("set_group", &TorchSession::set_group, py::arg("group"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
             py::arg("eps"), py::arg("weight_decay"))
        .def("get_group", &TorchSession::get_group, py::arg("group"))
        .def("add_subgroup", &TorchSession::add_subgroup, py::arg("group"), py::arg("master"), py::arg("slices"),
             py::arg("device_param") = py::none())
        .def("remove_subgroup", &TorchSession::remove_subgroup, py::arg("subgroup"))
        .def("slice_id", &TorchSession::slice_id, py::arg("name"))
        .def("begin_step", &TorchSession::begin_step, py::arg("loss_scale") = 1.0f, py::arg("micro_steps") = 1)
        .def("next_micro_step", &TorchSession::next_micro_step)
        .def("grad", &TorchSession::grad, py::arg("slice"), py::arg("grad"), py::arg("stream") = py::none(),
             py::arg("record_on") = py::none())
        .def("local_grad_sumsq", &TorchSession::local_grad_sumsq, py::arg("timeout_s") = -1.0)
        .def("step", &TorchSession::step, py::arg("max_norm") = 0.0, py::arg("global_norm") = py::none(),
             py::arg("overflow") = false)
        .def("step_result", &TorchSession::step_result, py::arg("ticket"), py::arg("timeout_s") = -1.0)
        .def("final_ticket", &TorchSession::final_ticket, py::arg("subgroup"))
        .def("final_tickets", &TorchSession::final_tickets, py::arg("subgroups"))
        .def("step_count", &TorchSession::step_count, py::arg("subgroup"))
        .def("wait", &TorchSession::wait, py::arg("ticket"), py::arg("timeout_s") = -1.0)
        .def("wait_all", &TorchSession::wait_all, py::arg("ticket"), py::arg("timeout_s") = -1.0)
        .def("wait_final", &TorchSession::wait_final, py::arg("subgroups"))
        .def("query", &TorchSession::query, py::arg("ticket"))
        .def("enqueue_wait", &TorchSession::enqueue_wait, py::arg("ticket"), py::arg("stream") = py::none())
        .def("enqueue_wait_final", &TorchSession::enqueue_wait_final, py::arg("subgroups"),
             py::arg("stream") = py::none())
        .def("set_compute_stream", &TorchSession::set_compute_stream, py::arg("stream") = py::none(),
             py::arg("force") = false)
        .def("loss_scale", &TorchSession::loss_scale)
        .def("host_bytes", &TorchSession::host_bytes)
        .def("pinned_bytes", &TorchSession::pinned_bytes)
        .def("copy_stream", &TorchSession::copy_stream)
        .def("save", &TorchSession::save, py::arg("path"))
        .def("load", &TorchSession::load, py::arg("path"))
        .def("trace", &TorchSession::trace, py::arg("enable"))
        .def("save_trace", &TorchSession::save_trace, py::arg("path"))
        .def("close", &TorchSession::close)
        .def_property_readonly("closed", &TorchSession::closed)
        .def_property_readonly("is_cuda", &TorchSession::is_cuda)
        .def_property_readonly("device", &TorchSession::device)
        .def_property_readonly("grad_dtype", &TorchSession::grad_dtype)
        .def_property_readonly("accum_dtype", &TorchSession::accum_dtype);
}
