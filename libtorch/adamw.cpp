// superoffload::torch::AdamW (include/superoffload/torch.hpp): the layout of the parameters in
// sub-groups, the session, the gradient hooks, the waits before a forward and checkpoints.
//
// No CUDA header is needed: the current CUDA stream comes from c10's device-generic stream
// interface, and the session's copy stream is named to c10 by its pointer, which is how c10
// identifies a stream it did not create (checked once, through native_handle()).

#include "superoffload/torch.hpp"

#include <c10/core/Stream.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/cuda.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>
#include <new>
#include <sstream>
#include <stdexcept>
#include <string>
#include <unistd.h>
#include <unordered_map>
#include <utility>

namespace superoffload {
namespace torch {

namespace {

namespace optim = ::torch::optim;
using ::torch::Tensor;

constexpr std::size_t kPageBytes = 4096;
// Each parameter starts at this alignment in the flat buffers, as an allocation of its own would.
constexpr std::size_t kParamAlignBytes = 256;

[[noreturn]] void fail(so_status status, const std::string& what) {
    throw Error(status, "superoffload::torch::AdamW: " + what);
}

/** A zeroed f32 CPU tensor on whole pages of its own: a CUDA session page-locks the master
 *  weights in place, so no two sub-groups may share a page. */
Tensor page_aligned_f32(std::size_t numel) {
    const std::size_t bytes = (numel * sizeof(float) + kPageBytes - 1) / kPageBytes * kPageBytes;
    void* p = std::aligned_alloc(kPageBytes, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return ::torch::from_blob(
        p, {static_cast<int64_t>(numel)}, [](void* q) { std::free(q); }, ::torch::kFloat32);
}

DType dtype_of(c10::ScalarType t) {
    switch (t) {
    case c10::ScalarType::Float: return DType::F32;
    case c10::ScalarType::BFloat16: return DType::Bf16;
    case c10::ScalarType::Half: return DType::F16;
    default: return DType::None;
    }
}

GroupHparams hparams_of(const optim::OptimizerParamGroup& group, std::size_t index) {
    const auto& o = static_cast<const optim::AdamWOptions&>(group.options());
    if (o.amsgrad()) fail(SO_STATUS_UNSUPPORTED, "param group " + std::to_string(index) + ": amsgrad is not supported");
    GroupHparams hp;
    hp.lr = o.lr();
    hp.beta1 = std::get<0>(o.betas());
    hp.beta2 = std::get<1>(o.betas());
    hp.eps = o.eps();
    hp.weight_decay = o.weight_decay();
    return hp;
}

void set_hparams(optim::OptimizerParamGroup& group, const GroupHparams& hp) {
    auto& o = static_cast<optim::AdamWOptions&>(group.options());
    o.lr(hp.lr).betas({hp.beta1, hp.beta2}).eps(hp.eps).weight_decay(hp.weight_decay);
}

so_cuda_stream_t current_stream(c10::Device device) {
    return static_cast<so_cuda_stream_t>(
        c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(device).native_handle());
}

/** A directory of its own under $TMPDIR for one checkpoint file, removed with it. */
class TempCheckpoint {
public:
    TempCheckpoint() {
        const char* tmp = std::getenv("TMPDIR");
        std::string pattern = std::string(tmp != nullptr && *tmp != '\0' ? tmp : "/tmp") + "/superoffload-XXXXXX";
        if (mkdtemp(pattern.data()) == nullptr) fail(SO_STATUS_IO, "cannot create a directory like " + pattern);
        dir_ = pattern;
    }
    ~TempCheckpoint() {
        std::remove(path().c_str());
        rmdir(dir_.c_str());
    }
    TempCheckpoint(const TempCheckpoint&) = delete;
    TempCheckpoint& operator=(const TempCheckpoint&) = delete;
    std::string path() const { return dir_ + "/session.safetensors"; }

private:
    std::string dir_;
};

} // namespace

struct AdamW::State {
    struct Param {
        Tensor tensor;
        std::string name;
        std::size_t group = 0;
        std::size_t subgroup = 0;
        std::size_t offset = 0; // within its sub-group
        std::uint32_t slice = 0;
        unsigned hook = 0;
    };
    struct SubGroup {
        std::size_t group = 0;
        std::vector<std::size_t> params;
        std::size_t numel = 0;
        Tensor master; // f32, CPU, page-aligned: borrowed by the session
        Tensor flat;   // CUDA: the parameters' storage on the device, where the session publishes
    };

    std::vector<optim::OptimizerParamGroup>* groups = nullptr; // the optimizer's param_groups()
    Options options;
    std::vector<Param> params; // forward order
    std::vector<SubGroup> subgroups;
    std::unordered_map<const c10::TensorImpl*, std::size_t> index_of; // a parameter's place in params
    c10::Device device{c10::kCPU};
    DType dtype = DType::F32;
    c10::Stream copy_stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
    std::vector<GroupHparams> session_hparams; // what the session was last given, per group
    Session session;                           // declared after the buffers it borrows

    std::mutex mutex; // the step's bookkeeping: hooks may run on autograd's device threads
    bool in_step = false;
    std::vector<char> handed; // per parameter, this step
    std::size_t handed_count = 0;
    Ticket last_step = no_ticket;

    bool cuda() const { return device.is_cuda(); }

    /** Gives the session each group's hyperparameters where they changed (LR schedules). */
    void push_hparams() {
        if (groups->size() != session_hparams.size()) {
            fail(SO_STATUS_INVALID_STATE, "param groups were added after construction; the layout is fixed");
        }
        for (std::size_t g = 0; g < groups->size(); g++) {
            const GroupHparams hp = hparams_of((*groups)[g], g);
            if (hp != session_hparams[g]) {
                session.set_group(static_cast<std::uint32_t>(g), hp);
                session_hparams[g] = hp;
            }
        }
    }

    /** What a gradient hook does: hands parameter `index`'s gradient to the session. */
    void hand_over(std::size_t index, const Tensor& grad) {
        const Param& p = params[index];
        std::lock_guard<std::mutex> lock(mutex);
        if (!in_step) {
            push_hparams(); // before the first hand-off: speculative steps use this step's values
            session.begin_step();
            in_step = true;
        }
        if (handed[index]) {
            fail(SO_STATUS_INVALID_STATE, "the gradient of " + p.name +
                                              " arrived twice in one step (one backward per step: gradient "
                                              "accumulation across backward passes is not supported)");
        }
        const Tensor g = grad.contiguous();
        if (g.device() != device || dtype_of(g.scalar_type()) != dtype) {
            fail(SO_STATUS_INVALID_ARGUMENT, "the gradient of " + p.name + " is a " + std::string(g.dtype().name()) +
                                                 " tensor on " + g.device().str() + "; the parameters are on " +
                                                 device.str());
        }
        const std::size_t numel = static_cast<std::size_t>(g.numel());
        if (cuda()) {
            session.grad_device(p.slice, reinterpret_cast<so_device_ptr>(g.data_ptr()), numel, dtype,
                                current_stream(device));
            // The session's copy stream reads the gradient later: the caching allocator must not
            // hand its memory out again before then.
            g.record_stream(copy_stream);
        } else {
            session.grad_copy(p.slice, g.data_ptr(), dtype, numel);
        }
        handed[index] = 1;
        handed_count++;
    }

    /** Makes sub-group k's latest step final for what comes next on this thread (and stream). */
    void wait_subgroup(std::size_t k) {
        const Ticket t = session.final_ticket(static_cast<std::uint32_t>(k));
        if (cuda()) {
            session.enqueue_wait(t, current_stream(device));
        } else {
            session.wait(t);
        }
    }

    void wait_last_step() const {
        if (last_step != no_ticket) session.wait_all(last_step);
    }

    void require_between_steps(const char* call) const {
        if (in_step) fail(SO_STATUS_INVALID_STATE, std::string(call) + " between a backward and its step()");
    }

    /** One line per parameter: what a checkpoint must match. */
    std::string layout() const {
        std::ostringstream out;
        for (std::size_t k = 0; k < subgroups.size(); k++) {
            for (std::size_t i : subgroups[k].params) {
                out << "sub-group " << k << " group " << params[i].group << ' ' << params[i].name << " offset "
                    << params[i].offset << " numel " << params[i].tensor.numel() << '\n';
            }
        }
        return out.str();
    }

    /** Gathers the parameters of `param_groups` in forward order, with their names. */
    void collect(const ::torch::nn::Module* model) {
        std::unordered_map<const c10::TensorImpl*, std::pair<std::size_t, Tensor>> chosen; // group, parameter
        std::vector<const c10::TensorImpl*> given_order;
        for (std::size_t g = 0; g < groups->size(); g++) {
            for (const Tensor& p : (*groups)[g].params()) {
                if (!p.requires_grad()) continue;
                if (!chosen.emplace(p.unsafeGetTensorImpl(), std::make_pair(g, p)).second) {
                    fail(SO_STATUS_INVALID_ARGUMENT,
                         "a parameter is in two param groups (the second: group " + std::to_string(g) + ")");
                }
                given_order.push_back(p.unsafeGetTensorImpl());
            }
        }
        auto add = [&](const c10::TensorImpl* impl, std::string name) {
            auto it = chosen.find(impl);
            if (it == chosen.end()) return;
            Param p;
            p.tensor = it->second.second;
            p.name = std::move(name);
            p.group = it->second.first;
            index_of.emplace(impl, params.size());
            params.push_back(std::move(p));
            chosen.erase(it);
        };
        if (model != nullptr) {
            for (const auto& named : model->named_parameters(/*recurse=*/true)) {
                add(named.value().unsafeGetTensorImpl(), named.key());
            }
            if (!chosen.empty()) {
                const auto& stray = chosen.begin()->second;
                fail(SO_STATUS_INVALID_ARGUMENT, "a parameter of param group " + std::to_string(stray.first) +
                                                     " (shape " + c10::str(stray.second.sizes()) +
                                                     ") is not a parameter of the model");
            }
        } else {
            for (const c10::TensorImpl* impl : given_order) add(impl, "param" + std::to_string(params.size()));
        }
        if (params.empty()) fail(SO_STATUS_INVALID_ARGUMENT, "no trainable parameter");

        device = params[0].tensor.device();
        const c10::ScalarType type = params[0].tensor.scalar_type();
        for (const Param& p : params) {
            if (p.tensor.device() != device || p.tensor.scalar_type() != type) {
                fail(SO_STATUS_INVALID_ARGUMENT,
                     "the parameters must share one device and dtype: " + params[0].name + " is " +
                         std::string(params[0].tensor.dtype().name()) + " on " + device.str() + ", " + p.name + " is " +
                         std::string(p.tensor.dtype().name()) + " on " + p.tensor.device().str());
            }
        }
        dtype = dtype_of(type);
        if (device.is_cpu() ? dtype != DType::F32 : !device.is_cuda() || dtype == DType::None) {
            fail(SO_STATUS_INVALID_ARGUMENT, "parameters of " + std::string(params[0].tensor.dtype().name()) + " on " +
                                                 device.str() +
                                                 " (supported: float32 on the CPU; float32, bfloat16 or float16 "
                                                 "on one CUDA device)");
        }
    }

    /** Packs consecutive parameters of one group into sub-groups, in forward order (a
     *  sub-group's place is its first parameter's, so interleaved groups keep that order). */
    void partition() {
        const std::size_t limit = options.sub_group_numel;
        const std::size_t align = kParamAlignBytes / params[0].tensor.element_size();
        std::unordered_map<std::size_t, std::size_t> open; // group -> its sub-group being filled
        for (std::size_t i = 0; i < params.size(); i++) {
            Param& p = params[i];
            const std::size_t numel = static_cast<std::size_t>(p.tensor.numel());
            auto it = open.find(p.group);
            if (it == open.end() || limit == 0 || subgroups[it->second].numel + numel > limit) {
                SubGroup sg;
                sg.group = p.group;
                subgroups.push_back(std::move(sg));
                it = open.insert_or_assign(p.group, subgroups.size() - 1).first;
            }
            SubGroup& sg = subgroups[it->second];
            p.subgroup = it->second;
            p.offset = (sg.numel + align - 1) / align * align;
            sg.numel = p.offset + numel;
            sg.params.push_back(i);
        }
    }

    /** Moves the parameters into their sub-groups' buffers, keeping their values. */
    void place() {
        ::torch::NoGradGuard no_grad;
        for (SubGroup& sg : subgroups) {
            sg.master = page_aligned_f32(sg.numel);
            for (std::size_t i : sg.params) {
                Param& p = params[i];
                p.tensor.mutable_grad().reset();
                span(sg.master, p).copy_(p.tensor.detach().reshape({-1}));
            }
            // Host: the master weights are the parameters; CUDA: a flat device buffer.
            if (cuda()) sg.flat = sg.master.to(device, params[sg.params[0]].tensor.scalar_type());
            const Tensor& storage = cuda() ? sg.flat : sg.master;
            for (std::size_t i : sg.params)
                params[i].tensor.set_data(span(storage, params[i]).view_as(params[i].tensor));
        }
    }

    static Tensor span(const Tensor& flat, const Param& p) {
        return flat.narrow(0, static_cast<int64_t>(p.offset), p.tensor.numel());
    }

    void create_session() {
        SessionOptions so;
        so.speculation = options.speculation;
        so.moment_dtype = options.moment_dtype;
        so.grad_dtype = so.accum_dtype = dtype;
        if (options.loss_scaler) so.set_loss_scaler(*options.loss_scaler);
        if (!options.cores.empty()) so.set_cores(options.cores);
        if (cuda()) {
            // bf16/f16 parameters: the CPU writes their copy in the same pass as the update, and
            // half the bytes cross to the GPU.
            so.copy_dtype = dtype == DType::F32 ? DType::None : dtype;
            so.gpu_budget_bytes = options.gpu_budget_bytes;
            CudaOptions co;
            co.device = device.index() < 0 ? 0 : device.index();
            if (options.piece_bytes != 0) co.piece_bytes = options.piece_bytes;
            session = Session::create_cuda(so, co);
        } else {
            session = Session::create(so);
        }
        for (std::size_t g = 0; g < groups->size(); g++) {
            session_hparams.push_back(hparams_of((*groups)[g], g));
            session.add_group(session_hparams.back());
        }
        for (SubGroup& sg : subgroups) {
            std::vector<Slice> slices;
            for (std::size_t i : sg.params) {
                slices.emplace_back(params[i].name, params[i].offset,
                                    static_cast<std::size_t>(params[i].tensor.numel()));
            }
            float* master = sg.master.data_ptr<float>();
            const auto group = static_cast<std::uint32_t>(sg.group);
            if (cuda()) {
                session.add_subgroup_cuda(group, master, sg.numel, slices,
                                          reinterpret_cast<so_device_ptr>(sg.flat.data_ptr()), dtype);
            } else {
                session.add_subgroup(group, master, sg.numel, slices);
            }
            for (std::size_t i : sg.params) params[i].slice = session.slice_id(params[i].name);
        }
        if (cuda()) {
            // Publication waits for what this stream queued before step() (the backward).
            session.set_compute_stream(current_stream(device));
            so_cuda_stream_t raw = session.copy_stream();
            copy_stream = c10::Stream(c10::Stream::UNSAFE, device,
                                      static_cast<c10::StreamId>(reinterpret_cast<std::intptr_t>(raw)));
            if (copy_stream.native_handle() != static_cast<void*>(raw)) {
                fail(SO_STATUS_UNSUPPORTED, "this libtorch does not name an external CUDA stream by its pointer");
            }
        }
        handed.assign(params.size(), 0);
    }
};

AdamW::AdamW(const ::torch::nn::Module& model, const optim::AdamWOptions& defaults, const Options& options)
    : Optimizer({optim::OptimizerParamGroup(model.parameters())}, std::make_unique<optim::AdamWOptions>(defaults)) {
    init(&model, options);
}

AdamW::AdamW(const ::torch::nn::Module& model, std::vector<optim::OptimizerParamGroup> param_groups,
             const optim::AdamWOptions& defaults, const Options& options)
    : Optimizer(param_groups, std::make_unique<optim::AdamWOptions>(defaults)) {
    init(&model, options);
}

AdamW::AdamW(std::vector<optim::OptimizerParamGroup> param_groups, const optim::AdamWOptions& defaults,
             const Options& options)
    : Optimizer(param_groups, std::make_unique<optim::AdamWOptions>(defaults)) {
    init(nullptr, options);
}

void AdamW::init(const ::torch::nn::Module* model, const Options& options) {
    auto s = std::make_unique<State>();
    s->groups = &param_groups_;
    s->options = options;
    s->collect(model);
    s->partition();
    s->place();
    s->create_session();
    // A hook per parameter, called with its whole gradient once autograd has it (a weight used
    // twice, e.g. a tied embedding, once with the sum).
    for (std::size_t i = 0; i < s->params.size(); i++) {
        State* raw = s.get();
        s->params[i].hook =
            s->params[i].tensor.register_hook([raw, i](const Tensor& grad) { raw->hand_over(i, grad); });
    }
    state_ = std::move(s);
}

AdamW::~AdamW() {
    for (State::Param& p : state_->params) p.tensor.remove_hook(p.hook);
}

void AdamW::wait_for(const ::torch::nn::Module& module) {
    State& s = *state_;
    std::vector<char> needed(s.subgroups.size(), 0);
    for (const Tensor& p : module.parameters(/*recurse=*/true)) {
        auto it = s.index_of.find(p.unsafeGetTensorImpl());
        if (it != s.index_of.end()) needed[s.params[it->second].subgroup] = 1;
    }
    for (std::size_t k = 0; k < needed.size(); k++) {
        if (needed[k]) s.wait_subgroup(k);
    }
}

void AdamW::wait_all() {
    for (std::size_t k = 0; k < state_->subgroups.size(); k++) state_->wait_subgroup(k);
}

Tensor AdamW::step(LossClosure closure) {
    Tensor loss;
    if (closure) {
        ::torch::AutoGradMode grad_mode(true);
        loss = closure();
    }
    State& s = *state_;
    std::lock_guard<std::mutex> lock(s.mutex);
    if (!s.in_step) fail(SO_STATUS_INVALID_STATE, "step() without a backward since the last step");
    if (s.handed_count != s.params.size()) {
        for (std::size_t i = 0; i < s.params.size(); i++) {
            if (!s.handed[i]) {
                fail(SO_STATUS_INVALID_STATE, "the parameter " + s.params[i].name +
                                                  " got no gradient in this backward (every trainable parameter "
                                                  "must get one each step)");
            }
        }
    }
    s.push_hparams();
    StepArgs args;
    args.max_norm = s.options.max_grad_norm;
    s.last_step = s.session.step(args);
    s.in_step = false;
    s.handed.assign(s.params.size(), 0);
    s.handed_count = 0;
    for (State::Param& p : s.params) p.tensor.mutable_grad().reset();
    return loss;
}

StepResult AdamW::last_result() const {
    if (state_->last_step == no_ticket) fail(SO_STATUS_INVALID_STATE, "last_result() before the first step");
    return state_->session.step_result(state_->last_step);
}

float AdamW::loss_scale() const { return state_->session.loss_scale(); }

std::uint64_t AdamW::step_count() const {
    state_->wait_last_step();
    return state_->session.step_count(0);
}

void AdamW::save(::torch::serialize::OutputArchive& archive) const {
    State& s = *state_;
    s.require_between_steps("save()");
    s.wait_last_step();
    TempCheckpoint file;
    s.session.save(file.path());
    std::ifstream in(file.path(), std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) fail(SO_STATUS_IO, "cannot read back " + file.path());
    archive.write("superoffload_session",
                  ::torch::from_blob(bytes.data(), {static_cast<int64_t>(bytes.size())}, ::torch::kUInt8).clone());
    archive.write("superoffload_layout", c10::IValue(s.layout()));
    for (std::size_t g = 0; g < param_groups_.size(); g++) {
        const GroupHparams hp = hparams_of(param_groups_[g], g);
        archive.write("superoffload_group" + std::to_string(g),
                      ::torch::tensor({hp.lr, hp.beta1, hp.beta2, hp.eps, hp.weight_decay}, ::torch::kFloat64));
    }
}

void AdamW::load(::torch::serialize::InputArchive& archive) {
    State& s = *state_;
    s.require_between_steps("load()");
    s.wait_last_step();
    Tensor bytes;
    c10::IValue layout;
    if (!archive.try_read("superoffload_session", bytes) || !archive.try_read("superoffload_layout", layout)) {
        fail(SO_STATUS_BAD_CHECKPOINT, "the archive holds no superoffload::torch::AdamW state");
    }
    if (!layout.isString() || layout.toStringRef() != s.layout()) {
        fail(SO_STATUS_BAD_CHECKPOINT, "the archive was written with another layout:\n" +
                                           (layout.isString() ? layout.toStringRef() : std::string("?")) +
                                           "this optimizer's:\n" + s.layout());
    }
    std::vector<GroupHparams> hparams;
    for (std::size_t g = 0; g < param_groups_.size(); g++) {
        Tensor t;
        if (!archive.try_read("superoffload_group" + std::to_string(g), t) || t.numel() != 5) {
            fail(SO_STATUS_BAD_CHECKPOINT, "the archive has no hyperparameters for param group " + std::to_string(g));
        }
        const Tensor v = t.to(::torch::kFloat64).contiguous();
        const double* x = v.data_ptr<double>();
        GroupHparams hp;
        hp.lr = x[0], hp.beta1 = x[1], hp.beta2 = x[2], hp.eps = x[3], hp.weight_decay = x[4];
        hparams.push_back(hp);
    }
    {
        TempCheckpoint file;
        const Tensor b = bytes.to(::torch::kUInt8).contiguous();
        std::ofstream out(file.path(), std::ios::binary);
        out.write(static_cast<const char*>(b.data_ptr()), static_cast<std::streamsize>(b.numel()));
        out.close();
        if (!out) fail(SO_STATUS_IO, "cannot write " + file.path());
        s.session.load(file.path());
    }
    for (std::size_t g = 0; g < hparams.size(); g++) {
        set_hparams(param_groups_[g], hparams[g]);
        s.session.set_group(static_cast<std::uint32_t>(g), hparams[g]);
        s.session_hparams[g] = hparams[g];
    }
    if (s.cuda()) {
        // The model's weights follow the loaded master weights (the session may still publish
        // the previous ones on its own stream: wait for the device first).
        ::torch::cuda::synchronize(s.device.index());
        ::torch::NoGradGuard no_grad;
        for (std::size_t k = 0; k < s.subgroups.size(); k++) {
            (void)s.session.subgroup_state(static_cast<std::uint32_t>(k)); // a GPU-resident one's to the host
            s.subgroups[k].flat.copy_(s.subgroups[k].master);
        }
        ::torch::cuda::synchronize(s.device.index());
    }
}

Tensor AdamW::master_weights(const Tensor& param) const {
    const State& s = *state_;
    auto it = s.index_of.find(param.unsafeGetTensorImpl());
    if (it == s.index_of.end()) fail(SO_STATUS_NOT_FOUND, "master_weights() of a tensor that is not a parameter");
    const State::Param& p = s.params[it->second];
    s.wait_last_step();
    (void)s.session.subgroup_state(static_cast<std::uint32_t>(p.subgroup)); // a GPU-resident one's to the host
    return State::span(s.subgroups[p.subgroup].master, p).view(p.tensor.sizes());
}

bool AdamW::is_cuda() const noexcept { return state_->cuda(); }

std::size_t AdamW::num_subgroups() const noexcept { return state_->subgroups.size(); }

Session& AdamW::session() noexcept { return state_->session; }

} // namespace torch
} // namespace superoffload
