// XLA FFI handlers that let a JAX program offload its Adam optimizer to a superoffload
// session (host session on the CPU platform, CUDA session on the CUDA platform).
//
// Protocol (see train_mlp.py):
//   * Python creates a "trainer" with sojax_create (a session, one param group with a
//     warm-up + cosine LR schedule and the clipping threshold) and registers sub-groups with
//     sojax_add_subgroup (the trainer owns the f32 master weights, initialised from Python;
//     on CUDA each sub-group also has a persistent f32 device buffer, allocated by JAX and
//     passed by address, where the session publishes the updated weights). The trainer's
//     address travels to the handlers as the attribute `trainer`.
//   * In the jitted train step, one `so_grad` call per parameter hands its gradient to the
//     session (attribute `slice`): its operand is aliased to its result
//     (input_output_aliases={0: 0}), so the gradient buffer stays alive, unchanged, until the
//     `so_step` call that consumes all those results. The first `so_grad` of a step sets the
//     step's learning rate and begins the step. A sub-group whose gradients are complete is
//     stepped speculatively on the session's CPU-Adam thread while XLA goes on.
//   * `so_step` ends the step (so_session_step: exact clipping, rescale/rollback/redo as
//     needed) and writes every parameter's new value into its results: on the CPU after
//     waiting for the step; on CUDA without blocking the host, by making the XLA stream wait
//     for each sub-group's final ticket (so_ticket_enqueue_wait) and then copying the
//     published weights into the results on that stream. The same waits also keep every
//     gradient buffer alive until the session's copies of it are done.
// No handler is marked command-buffer (CUDA graph) compatible: they enqueue stream waits and
// host-driven work that a graph replay would not repeat.
//
// The CUDA code needs no CUDA header: streams are `struct CUstream_st*`, and the two driver
// calls used here (a device-to-device copy and the stream's context) are looked up in
// libcuda at run time.

#include "xla/ffi/api/ffi.h"

#include "superoffload.h"

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace ffi = xla::ffi;

namespace {

thread_local std::string g_error;

std::string so_message(so_status st, const char* what) {
    char buf[1024];
    so_last_error_message(buf, sizeof buf);
    return std::string(what) + ": " + so_status_str(st) + ": " + buf;
}

// ---- the CUDA driver calls we need, looked up at run time --------------------------------

using CUresult = int;
using CUdeviceptr = unsigned long long;
struct CUctx_st;
using CUcontext = CUctx_st*;

struct Driver {
    CUresult (*memcpy_dtod_async)(CUdeviceptr, CUdeviceptr, size_t, so_cuda_stream_t) = nullptr;
    CUresult (*stream_get_ctx)(so_cuda_stream_t, CUcontext*) = nullptr;
    CUresult (*ctx_push)(CUcontext) = nullptr;
    CUresult (*ctx_pop)(CUcontext*) = nullptr;
    CUresult (*error_name)(CUresult, const char**) = nullptr;
    std::string load_error;

    Driver() {
        void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (h == nullptr) {
            const char* e = dlerror();
            load_error = std::string("cannot load libcuda.so.1: ") + (e ? e : "?");
            return;
        }
        auto sym = [&](const char* name) {
            void* p = dlsym(h, name);
            if (p == nullptr && load_error.empty()) load_error = std::string("libcuda has no ") + name;
            return p;
        };
        memcpy_dtod_async = reinterpret_cast<decltype(memcpy_dtod_async)>(sym("cuMemcpyDtoDAsync_v2"));
        stream_get_ctx = reinterpret_cast<decltype(stream_get_ctx)>(sym("cuStreamGetCtx"));
        ctx_push = reinterpret_cast<decltype(ctx_push)>(sym("cuCtxPushCurrent_v2"));
        ctx_pop = reinterpret_cast<decltype(ctx_pop)>(sym("cuCtxPopCurrent_v2"));
        error_name = reinterpret_cast<decltype(error_name)>(sym("cuGetErrorName"));
    }
    std::string err(CUresult r, const char* what) const {
        const char* n = nullptr;
        if (error_name) error_name(r, &n);
        return std::string(what) + " failed: " + (n ? n : std::to_string(r));
    }
};

const Driver& driver() {
    static const Driver d;
    return d;
}

/** Makes the context of `stream` (XLA's: the device's primary context) current for the
 *  driver calls of a scope. */
struct StreamContext {
    std::string error;
    bool pushed = false;
    explicit StreamContext(so_cuda_stream_t stream) {
        const Driver& d = driver();
        if (!d.load_error.empty()) {
            error = d.load_error;
            return;
        }
        CUcontext ctx = nullptr;
        CUresult r = d.stream_get_ctx(stream, &ctx);
        if (r != 0) {
            error = d.err(r, "cuStreamGetCtx");
            return;
        }
        r = d.ctx_push(ctx);
        if (r != 0) {
            error = d.err(r, "cuCtxPushCurrent");
            return;
        }
        pushed = true;
    }
    ~StreamContext() {
        if (pushed) {
            CUcontext popped = nullptr;
            driver().ctx_pop(&popped);
        }
    }
    StreamContext(const StreamContext&) = delete;
    StreamContext& operator=(const StreamContext&) = delete;
};

// ---- trainers ------------------------------------------------------------------------------

struct SliceLoc {
    uint32_t sg;
    size_t offset, numel;
};

struct SubGroup {
    float* master = nullptr; // page-aligned, owned
    size_t numel = 0;
    uint64_t device_param = 0;
};

} // namespace

extern "C" {

/** Options of sojax_create (mirrored by a ctypes Structure in train_mlp.py). */
typedef struct sojax_options {
    int32_t cuda;        // 1: CUDA session (device 0), 0: host session
    int32_t speculation; // step complete sub-groups during backward
    double lr, beta1, beta2, eps, weight_decay;
    int64_t warmup, total_steps; // LR: linear warm-up over `warmup` steps, cosine to
    double min_lr_ratio;         // min_lr_ratio * lr at step total_steps - 1
    double max_norm;             // clip the global gradient norm to this (0: never)
} sojax_options;

/** What sojax_last_result reports about the latest step. */
typedef struct sojax_result {
    uint64_t serial;
    int32_t skipped;
    double global_norm, clip_coef;
    uint32_t speculative, kept, rescaled, rolled_back, redone, stepped;
} sojax_result;

} // extern "C"

namespace {

struct Trainer {
    std::mutex mu;
    so_session* session = nullptr;
    sojax_options opt{};
    std::vector<SubGroup> sgs;
    std::vector<SliceLoc> slices; // by slice id
    bool in_step = false;
    uint64_t steps_begun = 0;
    so_ticket last_step = 0;

    double lr_at(int64_t step) const {
        const sojax_options& o = opt;
        if (step < o.warmup) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup);
        const double span = static_cast<double>(std::max<int64_t>(1, o.total_steps - 1 - o.warmup));
        const double t = std::min(1.0, static_cast<double>(step - o.warmup) / span);
        const double lo = o.lr * o.min_lr_ratio;
        return lo + 0.5 * (o.lr - lo) * (1.0 + std::cos(3.14159265358979323846 * t));
    }

    /** The first gradient of a step: this step's LR, then begin the step. Lock held. */
    std::string begin_if_needed() {
        if (in_step) return {};
        so_group_hparams hp = so_group_hparams_default();
        hp.lr = lr_at(static_cast<int64_t>(steps_begun));
        hp.beta1 = opt.beta1;
        hp.beta2 = opt.beta2;
        hp.eps = opt.eps;
        hp.weight_decay = opt.weight_decay;
        so_status st = so_session_set_group(session, 0, &hp);
        if (st != SO_STATUS_OK) return so_message(st, "so_session_set_group");
        st = so_session_begin_step(session, 1.0f, 1);
        if (st != SO_STATUS_OK) return so_message(st, "so_session_begin_step");
        in_step = true;
        steps_begun++;
        return {};
    }

    /** Ends the step; the ticket of the whole step. Lock held. */
    std::string end_step(so_ticket* out) {
        std::string e = begin_if_needed(); // a step without any gradient: all zero
        if (!e.empty()) return e;
        so_step_args a = so_step_args_default();
        a.max_norm = opt.max_norm;
        a.norm_source = SO_NORM_SOURCE_LOCAL;
        so_status st = so_session_step(session, &a, out);
        if (st != SO_STATUS_OK) return so_message(st, "so_session_step");
        in_step = false;
        last_step = *out;
        return {};
    }

    ~Trainer() {
        so_session_destroy(session); // waits for queued work before the masters go
        for (auto& sg : sgs) std::free(sg.master);
    }
};

std::mutex g_trainers_mu;
std::set<Trainer*> g_trainers;

Trainer* lookup(int64_t handle) {
    auto* t = reinterpret_cast<Trainer*>(static_cast<intptr_t>(handle));
    std::lock_guard<std::mutex> g(g_trainers_mu);
    return g_trainers.count(t) ? t : nullptr;
}

ffi::Error no_trainer(int64_t handle) {
    return ffi::Error::InvalidArgument("superoffload FFI: attribute trainer = " + std::to_string(handle) +
                                       " is not a live trainer (created by sojax_create, not yet destroyed)");
}

ffi::Error check_slice(const Trainer& t, int64_t slice, const ffi::AnyBuffer& buf, const char* what) {
    if (slice < 0 || static_cast<size_t>(slice) >= t.slices.size()) {
        return ffi::Error::InvalidArgument(std::string(what) + ": no slice " + std::to_string(slice));
    }
    if (buf.element_type() != ffi::DataType::F32) {
        return ffi::Error::InvalidArgument(std::string(what) + ": slice " + std::to_string(slice) + " must be float32");
    }
    if (buf.element_count() != t.slices[static_cast<size_t>(slice)].numel) {
        return ffi::Error::InvalidArgument(std::string(what) + ": slice " + std::to_string(slice) + " has " +
                                           std::to_string(t.slices[static_cast<size_t>(slice)].numel) +
                                           " elements, the buffer " + std::to_string(buf.element_count()));
    }
    return ffi::Error::Success();
}

/** SOJAX_DEBUG=1 reports (once) that XLA gave so_grad a result buffer other than its operand. */
void note_not_aliased() {
    static const bool debug = std::getenv("SOJAX_DEBUG") != nullptr;
    static std::once_flag once;
    if (debug)
        std::call_once(once, [] { std::fprintf(stderr, "sojax: so_grad's result is not aliased to its operand\n"); });
}

/** so_step's results, one per slice in slice-id order, checked before the step is taken. */
ffi::Error collect_results(const Trainer& t, const ffi::RemainingRets& params, std::vector<void*>* out) {
    if (params.size() != t.slices.size()) {
        return ffi::Error::InvalidArgument("so_step: " + std::to_string(params.size()) + " results for " +
                                           std::to_string(t.slices.size()) + " slices");
    }
    out->clear();
    for (size_t i = 0; i < t.slices.size(); i++) {
        auto ret = params.get<ffi::AnyBuffer>(i);
        if (ret.has_error()) return ret.error();
        ffi::AnyBuffer buf = **ret;
        if (auto e = check_slice(t, static_cast<int64_t>(i), buf, "so_step"); e.failure()) return e;
        out->push_back(buf.untyped_data());
    }
    return ffi::Error::Success();
}

// ---- handlers ------------------------------------------------------------------------------

ffi::Error GradCpuImpl(ffi::AnyBuffer grad, ffi::Result<ffi::AnyBuffer> out, int64_t trainer, int64_t slice) {
    Trainer* t = lookup(trainer);
    if (t == nullptr) return no_trainer(trainer);
    std::lock_guard<std::mutex> g(t->mu);
    if (t->opt.cuda) return ffi::Error::InvalidArgument("so_grad on the CPU platform with a CUDA trainer");
    if (auto e = check_slice(*t, slice, grad, "so_grad"); e.failure()) return e;
    if (out->untyped_data() != grad.untyped_data()) { // not aliased: pass the gradient through
        note_not_aliased();
        std::memcpy(out->untyped_data(), grad.untyped_data(), grad.size_bytes());
    }
    if (std::string e = t->begin_if_needed(); !e.empty()) return ffi::Error::Internal(e);
    so_status st = so_session_grad_copy(t->session, static_cast<uint32_t>(slice), grad.untyped_data(),
                                        grad.element_count(), nullptr);
    if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_session_grad_copy"));
    return ffi::Error::Success();
}

ffi::Error StepCpuImpl(ffi::RemainingArgs grads, ffi::RemainingRets params, int64_t trainer) {
    Trainer* t = lookup(trainer);
    if (t == nullptr) return no_trainer(trainer);
    std::lock_guard<std::mutex> g(t->mu);
    if (t->opt.cuda) return ffi::Error::InvalidArgument("so_step on the CPU platform with a CUDA trainer");
    (void)grads; // only there to order this call after every so_grad
    std::vector<void*> outs;
    if (auto e = collect_results(*t, params, &outs); e.failure()) return e;
    so_ticket ticket = 0;
    if (std::string e = t->end_step(&ticket); !e.empty()) return ffi::Error::Internal(e);
    so_step_result r{};
    r.struct_size = sizeof r;
    so_status st = so_session_step_result(t->session, ticket, -1, &r);
    if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_session_step_result"));
    for (size_t i = 0; i < t->slices.size(); i++) {
        const SliceLoc& s = t->slices[i];
        std::memcpy(outs[i], t->sgs[s.sg].master + s.offset, s.numel * sizeof(float));
    }
    return ffi::Error::Success();
}

ffi::Error GradCudaImpl(so_cuda_stream_t stream, ffi::AnyBuffer grad, ffi::Result<ffi::AnyBuffer> out, int64_t trainer,
                        int64_t slice) {
    Trainer* t = lookup(trainer);
    if (t == nullptr) return no_trainer(trainer);
    std::lock_guard<std::mutex> g(t->mu);
    if (!t->opt.cuda) return ffi::Error::InvalidArgument("so_grad on the CUDA platform with a host trainer");
    if (auto e = check_slice(*t, slice, grad, "so_grad"); e.failure()) return e;
    // The buffer handed over must live until so_step (whose stream waits cover the copies):
    // that is the result, which so_step consumes. XLA aliases it to the operand.
    void* keep = out->untyped_data();
    if (keep != grad.untyped_data()) {
        note_not_aliased();
        const Driver& d = driver();
        StreamContext scope(stream);
        if (!scope.error.empty()) return ffi::Error::Internal(scope.error);
        CUresult r = d.memcpy_dtod_async(reinterpret_cast<CUdeviceptr>(keep),
                                         reinterpret_cast<CUdeviceptr>(grad.untyped_data()), grad.size_bytes(), stream);
        if (r != 0) return ffi::Error::Internal(d.err(r, "cuMemcpyDtoDAsync (gradient pass-through)"));
    }
    if (std::string e = t->begin_if_needed(); !e.empty()) return ffi::Error::Internal(e);
    so_status st =
        so_session_grad_device(t->session, static_cast<uint32_t>(slice), reinterpret_cast<so_device_ptr>(keep),
                               grad.element_count(), SO_DTYPE_F32, stream, nullptr);
    if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_session_grad_device"));
    return ffi::Error::Success();
}

ffi::Error StepCudaImpl(so_cuda_stream_t stream, ffi::RemainingArgs grads, ffi::RemainingRets params, int64_t trainer) {
    Trainer* t = lookup(trainer);
    if (t == nullptr) return no_trainer(trainer);
    std::lock_guard<std::mutex> g(t->mu);
    if (!t->opt.cuda) return ffi::Error::InvalidArgument("so_step on the CUDA platform with a host trainer");
    (void)grads; // only there to order this call after every so_grad (and keep them alive)
    std::vector<void*> outs;
    if (auto e = collect_results(*t, params, &outs); e.failure()) return e;
    const Driver& d = driver();
    if (!d.load_error.empty()) return ffi::Error::Internal(d.load_error);
    // Publication waits for everything XLA queued on this stream so far (the backward).
    so_status st = so_session_set_compute_stream(t->session, stream);
    if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_session_set_compute_stream"));
    so_ticket ticket = 0;
    if (std::string e = t->end_step(&ticket); !e.empty()) return ffi::Error::Internal(e);
    // The stream waits, on the GPU, for each sub-group's final ticket, then copies its
    // published weights into the results.
    for (uint32_t k = 0; k < t->sgs.size(); k++) {
        so_ticket fin = 0;
        st = so_session_final_ticket(t->session, k, &fin);
        if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_session_final_ticket"));
        st = so_ticket_enqueue_wait(t->session, fin, stream);
        if (st != SO_STATUS_OK) return ffi::Error::Internal(so_message(st, "so_ticket_enqueue_wait"));
    }
    StreamContext scope(stream);
    if (!scope.error.empty()) return ffi::Error::Internal(scope.error);
    for (size_t i = 0; i < t->slices.size(); i++) {
        const SliceLoc& s = t->slices[i];
        const CUdeviceptr src = t->sgs[s.sg].device_param + s.offset * sizeof(float);
        CUresult r = d.memcpy_dtod_async(reinterpret_cast<CUdeviceptr>(outs[i]), src, s.numel * sizeof(float), stream);
        if (r != 0) return ffi::Error::Internal(d.err(r, "cuMemcpyDtoDAsync (published weights)"));
    }
    return ffi::Error::Success();
}

} // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SoJaxGradCpu, GradCpuImpl,
    ffi::Ffi::Bind().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<int64_t>("trainer").Attr<int64_t>("slice"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoJaxStepCpu, StepCpuImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets().Attr<int64_t>("trainer"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(SoJaxGradCuda, GradCudaImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<so_cuda_stream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("trainer")
                                  .Attr<int64_t>("slice"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    SoJaxStepCuda, StepCudaImpl,
    ffi::Ffi::Bind().Ctx<ffi::PlatformStream<so_cuda_stream_t>>().RemainingArgs().RemainingRets().Attr<int64_t>(
        "trainer"));

// ---- the C entries Python calls through ctypes -------------------------------------------

extern "C" {

/** The message of the latest failed sojax_* call on this thread. */
__attribute__((visibility("default"))) const char* sojax_last_error(void) { return g_error.c_str(); }

__attribute__((visibility("default"))) size_t sojax_options_size(void) { return sizeof(sojax_options); }
__attribute__((visibility("default"))) size_t sojax_result_size(void) { return sizeof(sojax_result); }

/** Creates a trainer: a host (cuda = 0) or CUDA session (device 0) with one param group. */
__attribute__((visibility("default"))) int sojax_create(const sojax_options* o, int64_t* out) {
    if (o == nullptr || out == nullptr) {
        g_error = "sojax_create: NULL argument";
        return 1;
    }
    if (o->warmup < 1 || o->total_steps < 1) {
        g_error = "sojax_create: warmup and total_steps must be >= 1";
        return 1;
    }
    so_session_options so = so_session_options_default();
    so.speculation = o->speculation != 0;
    so.grad_dtype = so.accum_dtype = SO_DTYPE_F32;
    so_session* s = nullptr;
    so_status st = o->cuda ? so_session_create_cuda(&so, nullptr, &s) : so_session_create(&so, &s);
    if (st != SO_STATUS_OK) {
        g_error = so_message(st, o->cuda ? "so_session_create_cuda" : "so_session_create");
        return 1;
    }
    auto* t = new Trainer();
    t->session = s;
    t->opt = *o;
    so_group_hparams hp = so_group_hparams_default();
    hp.lr = t->lr_at(0);
    hp.beta1 = o->beta1;
    hp.beta2 = o->beta2;
    hp.eps = o->eps;
    hp.weight_decay = o->weight_decay;
    uint32_t group = 0;
    st = so_session_add_group(s, &hp, &group);
    if (st != SO_STATUS_OK) {
        g_error = so_message(st, "so_session_add_group");
        delete t;
        return 1;
    }
    if (o->cuda && !driver().load_error.empty()) {
        g_error = "sojax_create: " + driver().load_error;
        delete t;
        return 1;
    }
    {
        std::lock_guard<std::mutex> g(g_trainers_mu);
        g_trainers.insert(t);
    }
    *out = static_cast<int64_t>(reinterpret_cast<intptr_t>(t));
    return 0;
}

/** Registers a sub-group of `num_slices` named slices (`numels[i]` f32 elements each, laid
 *  out in this order), initialised from `init` (their concatenation). CUDA trainers also
 *  take `device_param`: the address of a device buffer of the sub-group's size, owned by
 *  the caller and alive until sojax_destroy, where the updated weights are published.
 *  `out_slices` receives the slice ids (the `slice` attributes of so_grad; so_step's
 *  results are in slice-id order). Between steps only. */
__attribute__((visibility("default"))) int sojax_add_subgroup(int64_t handle, size_t num_slices,
                                                              const char* const* names, const size_t* numels,
                                                              const float* init, uint64_t device_param,
                                                              uint32_t* out_slices) {
    Trainer* t = lookup(handle);
    if (t == nullptr) {
        g_error = "sojax_add_subgroup: not a live trainer";
        return 1;
    }
    std::lock_guard<std::mutex> g(t->mu);
    if (t->in_step) {
        g_error = "sojax_add_subgroup: a step is in progress";
        return 1;
    }
    if (t->opt.cuda && device_param == 0) {
        g_error = "sojax_add_subgroup: a CUDA trainer needs the device buffer of each sub-group";
        return 1;
    }
    size_t numel = 0;
    std::vector<so_slice_desc> slices(num_slices);
    for (size_t i = 0; i < num_slices; i++) {
        slices[i].name = names[i];
        slices[i].offset = numel;
        slices[i].numel = numels[i];
        numel += numels[i];
    }
    // Whole pages of its own: a CUDA session page-locks the master weights in place.
    const size_t page = 4096, bytes = (numel * sizeof(float) + page - 1) / page * page;
    SubGroup sg;
    sg.master = static_cast<float*>(std::aligned_alloc(page, bytes == 0 ? page : bytes));
    if (sg.master == nullptr) {
        g_error = "sojax_add_subgroup: out of memory";
        return 1;
    }
    std::memcpy(sg.master, init, numel * sizeof(float));
    sg.numel = numel;
    sg.device_param = device_param;
    so_subgroup_desc d = so_subgroup_desc_default();
    d.group = 0;
    d.master = sg.master;
    d.master_dtype = SO_DTYPE_F32;
    d.numel = numel;
    d.slices = slices.data();
    d.num_slices = num_slices;
    if (t->opt.cuda) {
        d.device_param = device_param;
        d.device_param_dtype = SO_DTYPE_F32;
    }
    uint32_t id = 0;
    so_status st = so_session_add_subgroup(t->session, &d, &id);
    if (st != SO_STATUS_OK) {
        g_error = so_message(st, "so_session_add_subgroup");
        std::free(sg.master);
        return 1;
    }
    if (id != t->sgs.size()) {
        g_error = "sojax_add_subgroup: unexpected sub-group id";
        return 1;
    }
    t->sgs.push_back(sg);
    for (size_t i = 0; i < num_slices; i++) {
        uint32_t sl = 0;
        st = so_session_slice_id(t->session, names[i], &sl);
        if (st != SO_STATUS_OK) {
            g_error = so_message(st, "so_session_slice_id");
            return 1;
        }
        if (sl >= t->slices.size()) t->slices.resize(sl + 1);
        t->slices[sl] = SliceLoc{id, slices[i].offset, slices[i].numel};
        out_slices[i] = sl;
    }
    return 0;
}

/** Waits for the latest step and describes it. */
__attribute__((visibility("default"))) int sojax_last_result(int64_t handle, sojax_result* out) {
    Trainer* t = lookup(handle);
    if (t == nullptr) {
        g_error = "sojax_last_result: not a live trainer";
        return 1;
    }
    so_ticket ticket;
    {
        std::lock_guard<std::mutex> g(t->mu);
        ticket = t->last_step;
    }
    if (ticket == 0) {
        g_error = "sojax_last_result: no step yet";
        return 1;
    }
    so_step_result r{};
    r.struct_size = sizeof r;
    so_status st = so_session_step_result(t->session, ticket, -1, &r);
    if (st != SO_STATUS_OK) {
        g_error = so_message(st, "so_session_step_result");
        return 1;
    }
    *out = sojax_result{r.serial, r.skipped ? 1 : 0, r.global_norm, r.clip_coef, r.speculative,
                        r.kept,   r.rescaled,        r.rolled_back, r.redone,    r.stepped};
    return 0;
}

/** Copies sub-group `sg`'s master weights, once its latest step is final. */
__attribute__((visibility("default"))) int sojax_read_master(int64_t handle, uint32_t sg, float* out, size_t numel) {
    Trainer* t = lookup(handle);
    if (t == nullptr) {
        g_error = "sojax_read_master: not a live trainer";
        return 1;
    }
    std::lock_guard<std::mutex> g(t->mu);
    if (sg >= t->sgs.size() || numel != t->sgs[sg].numel) {
        g_error = "sojax_read_master: no such sub-group, or a wrong size";
        return 1;
    }
    // The step's ticket (none before the first step): a CUDA session writes the master
    // weights after it publishes a sub-group (its final ticket).
    if (t->last_step != 0) {
        const so_status st = so_ticket_wait(t->session, t->last_step, -1);
        if (st != SO_STATUS_OK) {
            g_error = so_message(st, "waiting for the step's ticket");
            return 1;
        }
    }
    std::memcpy(out, t->sgs[sg].master, numel * sizeof(float));
    return 0;
}

/** Destroys a trainer (waits for its queued work). Device buffers given to it may be freed
 *  afterwards. */
__attribute__((visibility("default"))) void sojax_destroy(int64_t handle) {
    Trainer* t = lookup(handle);
    if (t == nullptr) return;
    {
        std::lock_guard<std::mutex> g(g_trainers_mu);
        g_trainers.erase(t);
    }
    delete t;
}

} // extern "C"
