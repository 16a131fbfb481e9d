// A GPT-style decoder trained from C++ with libtorch, its Adam state offloaded to the CPU
// through a superoffload session. No Python at run time.
//
// Model: token + position embedding, L pre-norm blocks (causal self-attention through
// torch::scaled_dot_product_attention, GELU MLP), final LayerNorm, LM head tied to the token
// embedding (default) or untied (--untied). Data: synthetic sequences of a fixed random
// Markov chain, generated here from the step number (so every run and every resumed run
// sees the same batches).
//
// Placement. CUDA mode (used when torch::cuda::is_available(), unless --device cpu): the
// model's parameters are bf16 on the GPU; the f32 master weights and both Adam moments live
// in host memory, owned by a CUDA session. CPU mode: the model's parameters are f32 tensors
// on the CPU and a host session keeps separate f32 master weights. --param-dtype bf16|f32
// overrides the model's dtype in either mode (bf16 on the CPU mimics the GPU's numerics).
//
// Sub-groups, registered in forward order: "embed" (token and position embeddings; the tied
// head's weight is the token embedding), one per block ("block<k>", all its parameters),
// "head" (final norm, and the head's weight when untied). Each sub-group's parameters are
// views into one flat buffer, which is the sub-group's `device_param` in CUDA mode; its
// slices are named after the parameters. Two param groups: the blocks (weight decay) and
// embeddings + head (no decay); both follow a linear warm-up + cosine LR schedule set with
// so_session_set_group before each step.
//
// One step: set the LR; forward, where before the embeddings, each block and the head the
// current stream waits (so_ticket_enqueue_wait: the host for a pending ticket, the stream
// for its publication) for that sub-group's final ticket of the previous step, or in CPU
// mode the host waits for it and copies the sub-group's master weights into the model;
// so_session_begin_step; backward, during which a gradient hook on every parameter hands
// its gradient to the session as soon as autograd has produced it (so_session_grad_device
// with at::cuda::getCurrentCUDAStream(), then record_stream on the session's copy stream;
// so_session_grad_copy in CPU mode), so sub-groups are stepped speculatively on the
// session's CPU-Adam thread while the backward of earlier layers goes on; so_session_step
// with max_norm 1.0 (torch's clip_grad_norm_ semantics), which publishes the final weights
// of each sub-group into the model once decided (CUDA) while the next forward already runs
// on the layers that are final.
//
// Checks (--check, default "parity,exact,resume"; exit status 1 if one fails, 2 on errors):
//   parity  the same training with torch::optim::AdamW on f32 master weights kept on the
//           model's device (CUDA: bf16 model copies refreshed after each step), same init,
//           data, schedule and clipping (torch::nn::utils::clip_grad_norm_): per-step losses
//           must agree to a mean relative difference <= --parity-tol (default 1e-3); the
//           session's losses must also show learning. With f32 parameters the two agree to
//           ~1e-7 (rounding order only); with bf16 model copies a 1-ulp difference of an f32
//           master can flip a bf16 weight, so the runs drift apart slowly: at the CUDA
//           defaults ~1.2e-4 mean (measured on the CPU with --param-dtype bf16).
//   exact   clipping that never triggers (max_norm 1e6, so every clip coefficient is 1 and
//           each speculative step is kept, whether its pass ran or was cancelled at step()):
//           the speculative session must end bit for bit
//           equal (losses, master weights, model weights) to a session with speculation off.
//   resume  a run with speculation off (clipping triggers; a speculative run resumes bit for
//           bit as well, see tests/reproducibility.rs) saves a checkpoint (so_session_save + the step counter)
//           half-way; a fresh model (other init seed) and a fresh session load it (so_session_load) and train to the
//           end: losses and final weights must equal the uninterrupted run's bit for bit.
// --save-at/--ckpt and --resume run one training in a process of its own (run.sh uses them
// to check a resume across processes, with --losses-out files compared by --compare).
// The bit-for-bit checks need a deterministic forward and backward: the program sets
// CUBLAS_WORKSPACE_CONFIG=:4096:8, turns on torch's deterministic algorithms (warn-only) and
// by default restricts scaled_dot_product_attention to the math backend (--sdpa auto lifts
// that; fused attention backwards may accumulate in a nondeterministic order).

#include <torch/torch.h>

#if SO_TRAINER_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "superoffload.h"
#include "superoffload.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <sys/stat.h>
#include <vector>

namespace so = superoffload;

namespace {

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

/** Throws with the library's message if a C call failed. */
void so_check(so_status status, const char* what) {
    if (status != SO_STATUS_OK) {
        std::string msg = so::last_error_message();
        throw std::runtime_error(std::string(what) + " failed: " + so_status_str(status) + ": " + msg);
    }
}

struct CheckFailed : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// ------------------------------------------------------------------------------------------
// Configuration
// ------------------------------------------------------------------------------------------

struct Config {
    bool cuda = false;
    bool bf16 = false; // model parameters (and gradients) in bf16; f32 otherwise
    int64_t vocab = 64, seq = 32, dim = 64, layers = 2, heads = 4, batch = 8;
    int64_t steps = 60, warmup = 6;
    bool tied = true;
    double lr = 1e-2, min_lr_ratio = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
    double clip = 1.0;
    uint64_t seed = 1234, data_seed = 99;
    double parity_tol = 1e-3;
    bool math_sdpa = true;
    int log_every = 10;
};

struct Args {
    std::map<std::string, std::string> kv;
    bool has(const std::string& k) const { return kv.count(k) != 0; }
    std::string str(const std::string& k, const std::string& d) const { return has(k) ? kv.at(k) : d; }
    int64_t i64(const std::string& k, int64_t d) const { return has(k) ? std::stoll(kv.at(k)) : d; }
    double f64(const std::string& k, double d) const { return has(k) ? std::stod(kv.at(k)) : d; }
};

const char* kUsage =
    "usage: so_torch_trainer [--check parity,exact,resume] [--device auto|cpu|cuda]\n"
    "   [--steps N] [--vocab V] [--seq T] [--dim D] [--layers L] [--heads H] [--batch B]\n"
    "   [--lr X] [--warmup N] [--clip X] [--untied] [--seed S] [--order 1|2|3] [--parity-tol X]\n"
    "   [--sdpa math|auto] [--param-dtype bf16|f32] [--log-every N]\n"
    "   [--ckpt DIR] [--save-at K|half] [--resume DIR] [--losses-out FILE]   (one training run)\n"
    "   [--compare A B [--from K]]   (compare the steps two --losses-out files share, bit for bit)\n"
    "Defaults are small on the CPU (D 64, L 2, 60 steps) and larger on CUDA (D 384, L 6, 80 steps).\n";

Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; i++) {
        std::string k = argv[i];
        if (k.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument " + k + "\n" + kUsage);
        k = k.substr(2);
        if (k == "untied" || k == "help") {
            a.kv[k] = "1";
        } else if (k == "compare") {
            if (i + 2 >= argc) throw std::invalid_argument("--compare needs two files");
            a.kv["compare_a"] = argv[++i];
            a.kv["compare_b"] = argv[++i];
        } else {
            if (i + 1 >= argc) throw std::invalid_argument("--" + k + " needs a value");
            a.kv[k] = argv[++i];
        }
    }
    return a;
}

// ------------------------------------------------------------------------------------------
// Data: a fixed random second-order Markov chain
// ------------------------------------------------------------------------------------------

uint64_t splitmix64(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/** A fixed random Markov chain: each context has 4 possible next tokens with probabilities
 *  0.55, 0.25, 0.12, 0.08 (entropy 1.13 nats, the loss floor). The context is the previous
 *  token (--order 1, the default: learnt within a few dozen steps), the previous two tokens
 *  (--order 2) or (3a + b) mod V of them (--order 3): harder, they need the attention. */
struct MarkovData {
    int64_t vocab;
    std::vector<int32_t> succ; // vocab * vocab * 4
    int order;
    int64_t context(int64_t a, int64_t c) const {
        return order == 1 ? c : order == 2 ? a * vocab + c : (3 * a + c) % vocab;
    }
    explicit MarkovData(int64_t v, uint64_t seed, int order_)
        : vocab(v), succ(static_cast<size_t>(v * v * 4)), order(order_) {
        uint64_t s = seed;
        for (auto& x : succ) x = static_cast<int32_t>(splitmix64(s) % static_cast<uint64_t>(v));
    }
    static double entropy() {
        const double p[4] = {0.55, 0.25, 0.12, 0.08};
        double h = 0;
        for (double q : p) h -= q * std::log(q);
        return h;
    }
    /** Tokens [batch, seq + 1] for a step, the same for every run. */
    torch::Tensor batch(int64_t step, int64_t b, int64_t t, uint64_t seed) const {
        auto out = torch::empty({b, t + 1}, torch::kInt64);
        auto* p = out.data_ptr<int64_t>();
        uint64_t s = seed ^ (0xD1B54A32D192ED03ull * static_cast<uint64_t>(step + 1));
        for (int64_t i = 0; i < b; i++) {
            int64_t a = static_cast<int64_t>(splitmix64(s) % vocab), c = static_cast<int64_t>(splitmix64(s) % vocab);
            p[i * (t + 1)] = a;
            p[i * (t + 1) + 1] = c;
            for (int64_t j = 2; j <= t; j++) {
                const double u = static_cast<double>(splitmix64(s) >> 11) * 0x1.0p-53;
                const int k = u < 0.55 ? 0 : u < 0.80 ? 1 : u < 0.92 ? 2 : 3;
                const int64_t n = succ[static_cast<size_t>(context(a, c) * 4 + k)];
                p[i * (t + 1) + j] = n;
                a = c;
                c = n;
            }
        }
        return out;
    }
};

// ------------------------------------------------------------------------------------------
// Model
// ------------------------------------------------------------------------------------------

struct BlockImpl : torch::nn::Module {
    BlockImpl(int64_t dim, int64_t heads_) : heads(heads_) {
        ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
        qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
        proj = register_module("proj", torch::nn::Linear(dim, dim));
        ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
        fc = register_module("fc", torch::nn::Linear(dim, 4 * dim));
        fc_proj = register_module("fc_proj", torch::nn::Linear(4 * dim, dim));
    }
    torch::Tensor forward(const torch::Tensor& x) {
        const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
        // [B, T, 3, H, hd] -> [3, B, H, T, hd]
        auto q_k_v = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
        auto y = torch::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], {}, 0.0, /*is_causal=*/true);
        y = y.transpose(1, 2).contiguous().view({B, T, C});
        auto h = x + proj(y);
        return h + fc_proj(torch::gelu(fc(ln2(h)), "tanh"));
    }
    int64_t heads;
    torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
    torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_proj{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
    explicit GPTImpl(const Config& c) : tied(c.tied) {
        tok = register_module("tok", torch::nn::Embedding(c.vocab, c.dim));
        pos = register_module("pos", torch::nn::Embedding(c.seq, c.dim));
        for (int64_t l = 0; l < c.layers; l++) {
            blocks.push_back(register_module("block" + std::to_string(l), Block(c.dim, c.heads)));
        }
        ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({c.dim})));
        if (!tied) {
            head = register_module("head", torch::nn::Linear(torch::nn::LinearOptions(c.dim, c.vocab).bias(false)));
        }
    }
    /** `before(k)` is called before the forward touches sub-group k's parameters. */
    torch::Tensor forward(const torch::Tensor& idx, const std::function<void(size_t)>& before) {
        before(0);
        auto positions = torch::arange(idx.size(1), idx.options());
        auto x = tok(idx) + pos(positions);
        for (size_t l = 0; l < blocks.size(); l++) {
            before(1 + l);
            x = blocks[l](x);
        }
        before(1 + blocks.size());
        x = ln_f(x);
        return tied ? torch::nn::functional::linear(x, tok->weight) : head(x);
    }
    bool tied;
    torch::nn::Embedding tok{nullptr}, pos{nullptr};
    std::vector<Block> blocks;
    torch::nn::LayerNorm ln_f{nullptr};
    torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

/** GPT-2 style init, in f32 on the CPU, from `seed`. */
void init_weights(GPT& model, int64_t layers, uint64_t seed) {
    torch::manual_seed(seed);
    torch::NoGradGuard ng;
    const double resid = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
    for (auto& np : model->named_parameters()) {
        const std::string& n = np.key();
        auto& p = np.value();
        const bool is_bias = n.size() >= 4 && n.compare(n.size() - 4, 4, "bias") == 0;
        if (n.find("ln") != std::string::npos) {
            is_bias ? p.zero_() : p.fill_(1.0);
        } else if (is_bias) {
            p.zero_();
        } else if (n.find(".proj.") != std::string::npos || n.find("fc_proj") != std::string::npos) {
            p.normal_(0.0, resid);
        } else {
            p.normal_(0.0, 0.02);
        }
    }
}

// ------------------------------------------------------------------------------------------
// Sub-group layout: flat buffers, parameter views, master weights
// ------------------------------------------------------------------------------------------

struct ParamRef {
    std::string name;
    torch::Tensor param;
    int64_t offset = 0, numel = 0;
    uint32_t slice = 0;
};

struct SubGroupLayout {
    std::string name;
    uint32_t group = 0; // 0: blocks (decay), 1: embeddings and head (no decay)
    std::vector<ParamRef> params;
    int64_t numel = 0;
    torch::Tensor master; // f32, CPU, contiguous: the session's borrowed master weights
    torch::Tensor flat;   // the model's storage: bf16 on the GPU or f32 on the CPU
};

/** A zeroed f32 CPU tensor on whole pages of its own: a CUDA session page-locks the master
 *  weights in place (cuMemHostRegister), so no two sub-groups should share a page. */
torch::Tensor page_aligned_f32(int64_t numel) {
    const size_t page = 4096, bytes = (static_cast<size_t>(numel) * 4 + page - 1) / page * page;
    void* p = std::aligned_alloc(page, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return torch::from_blob(
        p, {numel}, [](void* q) { std::free(q); }, torch::kFloat32);
}

/** Groups the parameters into sub-groups in forward order, fills each sub-group's f32
 *  master from the current (f32, CPU) values and moves the parameters into one flat buffer
 *  per sub-group on `device` in `dtype` (parameters become views into it). */
std::vector<SubGroupLayout> build_layout(GPT& model, const Config& c, torch::Device device, torch::Dtype dtype) {
    std::vector<SubGroupLayout> sgs;
    auto add = [&](const std::string& name, uint32_t group, const std::string& prefix,
                   const std::vector<std::string>& extra) {
        SubGroupLayout sg;
        sg.name = name;
        sg.group = group;
        for (auto& np : model->named_parameters()) {
            const std::string& n = np.key();
            const bool match =
                (!prefix.empty() && n.rfind(prefix, 0) == 0) || std::find(extra.begin(), extra.end(), n) != extra.end();
            if (match) sg.params.push_back(ParamRef{n, np.value(), 0, np.value().numel(), 0});
        }
        if (sg.params.empty()) throw std::logic_error("no parameters for sub-group " + name);
        sgs.push_back(std::move(sg));
    };
    add("embed", 1, "", {"tok.weight", "pos.weight"});
    for (int64_t l = 0; l < c.layers; l++) add("block" + std::to_string(l), 0, "block" + std::to_string(l) + ".", {});
    add("head", 1, "", {"ln_f.weight", "ln_f.bias", "head.weight"});

    size_t total = 0;
    torch::NoGradGuard ng;
    for (auto& sg : sgs) {
        for (auto& p : sg.params) {
            p.offset = sg.numel;
            sg.numel += p.numel;
        }
        sg.master = page_aligned_f32(sg.numel);
        for (auto& p : sg.params) sg.master.narrow(0, p.offset, p.numel).copy_(p.param.detach().reshape({-1}));
        sg.flat = sg.master.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
        for (auto& p : sg.params) p.param.set_data(sg.flat.narrow(0, p.offset, p.numel).view(p.param.sizes()));
        total += sg.params.size();
    }
    if (total != model->parameters().size()) throw std::logic_error("a parameter is in no sub-group");
    return sgs;
}

/** Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at the last step. */
double lr_at(const Config& c, int64_t step) {
    if (step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
    const double span = std::max<int64_t>(1, c.steps - 1 - c.warmup);
    const double t = std::min(1.0, static_cast<double>(step - c.warmup) / span);
    const double lo = c.lr * c.min_lr_ratio;
    return lo + 0.5 * (c.lr - lo) * (1.0 + std::cos(3.14159265358979323846 * t));
}

// ------------------------------------------------------------------------------------------
// One training run
// ------------------------------------------------------------------------------------------

enum class OptKind { Session, SessionNoSpec, TorchAdamW };

const char* opt_name(OptKind k) {
    switch (k) {
    case OptKind::Session: return "superoffload session (speculative)";
    case OptKind::SessionNoSpec: return "superoffload session (speculation off)";
    case OptKind::TorchAdamW: return "torch::optim::AdamW";
    }
    return "?";
}

struct RunSpec {
    std::string label;
    OptKind kind = OptKind::Session;
    double max_norm = 1.0;
    uint64_t init_seed = 0;
    int64_t save_at = -1;   // save a checkpoint after this many steps
    std::string ckpt_dir;   // where
    std::string resume_dir; // start from this checkpoint
    bool quiet = false;
    size_t gpu_subgroups = 0; // the first sub-groups kept on the GPU (SO_PLACEMENT_DEVICE)
};

struct StepStats {
    int clipped = 0, skipped = 0;
    uint64_t speculative = 0, kept = 0, rescaled = 0, redone = 0, rolled_back = 0, stepped = 0, late = 0;
};

struct RunOut {
    int64_t first_step = 0;
    std::vector<double> loss;           // indexed by step; NaN where not run
    std::vector<double> norm;           // global gradient norm per step
    std::vector<torch::Tensor> masters; // per sub-group, f32 CPU (session: its master; torch: its f32 masters)
    std::vector<torch::Tensor> model;   // per sub-group flat model weights, on the CPU
    StepStats stats;
    bool every_step_kept = true;    // each step: clip coefficient 1, every sub-group kept or stepped once
    bool every_step_stepped = true; // each step: every sub-group stepped at step() (speculation off)
    double seconds = 0;
};

/** The state a gradient hook needs (shared with the hooks, which may run on autograd's
 *  device threads). */
struct HookState {
    so::Session* session = nullptr;
    bool cuda = false;
    so::DType dtype = so::DType::F32;
    torch::Dtype torch_dtype = torch::kFloat32;
    std::atomic<int> handed{0};
#if SO_TRAINER_CUDA
    c10::Stream copy_stream{c10::Stream::DEFAULT, c10::Device(c10::kCPU)};
#endif
};

/** Hands a parameter's gradient to the session: what the gradient hooks do. */
void hand_over(HookState& h, uint32_t slice, const std::string& name, const torch::Tensor& grad) {
    const torch::Tensor g = grad.contiguous();
    if (g.scalar_type() != h.torch_dtype || g.is_cuda() != h.cuda) {
        throw std::runtime_error("the gradient of " + name + " is not a " + (h.cuda ? "CUDA" : "CPU") +
                                 " tensor of the model's dtype");
    }
    try {
        if (h.cuda) {
#if SO_TRAINER_CUDA
            // Autograd runs this hook with the stream of the backward op current.
            const auto stream = at::cuda::getCurrentCUDAStream(g.device().index());
            h.session->grad_device(slice, reinterpret_cast<so_device_ptr>(g.data_ptr()), static_cast<size_t>(g.numel()),
                                   h.dtype, stream.stream());
            // The header's lifetime rule: the caching allocator must not reuse this memory
            // before the session's copy stream has read it.
            g.record_stream(h.copy_stream);
#endif
        } else {
            h.session->grad_copy(slice, g.data_ptr(), h.dtype, static_cast<size_t>(g.numel()));
        }
    } catch (const so::Error& e) {
        throw std::runtime_error("handing the gradient of " + name + " to the session: " + e.what());
    }
    h.handed.fetch_add(1, std::memory_order_relaxed);
}

#if SO_TRAINER_CUDA
so_cuda_stream_t current_stream(const torch::Device& d) { return at::cuda::getCurrentCUDAStream(d.index()).stream(); }
#endif

void write_text(const std::string& path, const std::string& text) {
    std::ofstream f(path);
    f << text;
    if (!f) throw std::runtime_error("cannot write " + path);
}

std::string read_text(const std::string& path) {
    std::ifstream f(path);
    if (!f) throw std::runtime_error("cannot read " + path);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

/** What must match between a checkpoint and the run that loads it. */
std::string config_fingerprint(const Config& c) {
    std::ostringstream o;
    o << "vocab " << c.vocab << " seq " << c.seq << " dim " << c.dim << " layers " << c.layers << " heads " << c.heads
      << " batch " << c.batch << " steps " << c.steps << " warmup " << c.warmup << " tied " << c.tied << " lr " << c.lr
      << " data_seed " << c.data_seed << " cuda " << c.cuda << " bf16 " << c.bf16;
    return o.str();
}

RunOut train(const Config& c, const MarkovData& data, const RunSpec& spec) {
    const auto t0 = std::chrono::steady_clock::now();
    const torch::Device device = c.cuda ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
    const torch::Dtype model_dtype = c.bf16 ? torch::kBFloat16 : torch::kFloat32;
    const bool use_session = spec.kind != OptKind::TorchAdamW;

    GPT model(c);
    init_weights(model, c.layers, spec.init_seed);
    std::vector<SubGroupLayout> sgs = build_layout(model, c, device, model_dtype);

    RunOut out;
    out.loss.assign(static_cast<size_t>(c.steps), std::numeric_limits<double>::quiet_NaN());
    out.norm = out.loss;

    // ---- the optimizer -------------------------------------------------------------------
    so::Session session; // RAII owner of the so_session (host or CUDA)
    auto hooks = std::make_shared<HookState>();
    std::vector<torch::Tensor> torch_masters; // TorchAdamW: one f32 master per parameter, on `device`
    std::vector<std::pair<torch::Tensor, torch::Tensor>> torch_pairs; // (model param, its master)
    std::unique_ptr<torch::optim::AdamW> adamw;

    so::GroupHparams ghp[2];
    for (int g = 0; g < 2; g++) {
        ghp[g].lr = lr_at(c, 0);
        ghp[g].beta1 = c.beta1;
        ghp[g].beta2 = c.beta2;
        ghp[g].eps = c.eps;
        ghp[g].weight_decay = g == 0 ? c.weight_decay : 0.0;
    }

    if (use_session) {
        so::SessionOptions o;
        o.speculation = spec.kind == OptKind::Session ? so::Speculation::On : so::Speculation::Off;
        o.grad_dtype = o.accum_dtype = c.bf16 ? so::DType::Bf16 : so::DType::F32; // the model's
        if (c.cuda) {
            so::CudaOptions co;
            co.device = device.index();
            session = so::Session::create_cuda(o, co);
        } else {
            session = so::Session::create(o);
        }
        for (int g = 0; g < 2; g++) {
            if (session.add_group(ghp[g]) != static_cast<uint32_t>(g)) throw std::logic_error("unexpected group id");
        }
        for (size_t k = 0; k < sgs.size(); k++) {
            auto& sg = sgs[k];
            std::vector<so::Slice> slices;
            for (auto& p : sg.params)
                slices.push_back({p.name, static_cast<size_t>(p.offset), static_cast<size_t>(p.numel)});
            float* master = sg.master.data_ptr<float>();
            const size_t n = static_cast<size_t>(sg.numel);
            const so_device_ptr flat = reinterpret_cast<so_device_ptr>(sg.flat.data_ptr());
            const uint32_t id =
                c.cuda ? session.add_subgroup_cuda(sg.group, master, n, slices, flat, session.accum_dtype(),
                                                   k < spec.gpu_subgroups ? so::Placement::Device : so::Placement::Host)
                       : session.add_subgroup(sg.group, master, n, slices);
            if (id != k) throw std::logic_error("unexpected sub-group id");
            for (auto& p : sg.params) p.slice = session.slice_id(p.name);
        }
        hooks->session = &session;
        hooks->cuda = c.cuda;
        hooks->dtype = session.accum_dtype();
        hooks->torch_dtype = model_dtype;
        if (c.cuda) {
#if SO_TRAINER_CUDA
            // Publication of each step's weights waits for what the compute stream queued
            // before so_session_step (the backward).
            session.set_compute_stream(current_stream(device));
            hooks->copy_stream = at::cuda::getStreamFromExternal(session.copy_stream(), device.index()).unwrap();
#endif
        }
        // A gradient hook per parameter: hand the gradient over as soon as autograd has it.
        for (auto& sg : sgs) {
            for (auto& p : sg.params) {
                auto h = hooks;
                const uint32_t slice = p.slice;
                const std::string name = p.name;
                p.param.register_hook([h, slice, name](torch::Tensor grad) { hand_over(*h, slice, name, grad); });
            }
        }
    } else {
        std::vector<torch::optim::OptimizerParamGroup> groups;
        std::vector<torch::Tensor> gp[2];
        for (auto& sg : sgs) {
            for (auto& p : sg.params) {
                auto m = sg.master.narrow(0, p.offset, p.numel)
                             .view(p.param.sizes())
                             .to(device, torch::kFloat32, false, true);
                m.set_requires_grad(true);
                torch_masters.push_back(m);
                torch_pairs.emplace_back(p.param, m);
                gp[sg.group].push_back(m);
            }
        }
        for (int g = 0; g < 2; g++) {
            auto opts = std::make_unique<torch::optim::AdamWOptions>(ghp[g].lr);
            opts->betas(std::make_tuple(c.beta1, c.beta2)).eps(c.eps).weight_decay(ghp[g].weight_decay).amsgrad(false);
            groups.emplace_back(gp[g], std::move(opts));
        }
        adamw = std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(c.lr));
    }

    // ---- resume ----------------------------------------------------------------------------
    int64_t first = 0;
    if (!spec.resume_dir.empty()) {
        if (!use_session) throw std::logic_error("resume is for session runs");
        const std::string fp = read_text(spec.resume_dir + "/trainer.txt");
        std::istringstream in(fp);
        std::string line;
        std::getline(in, line);
        first = std::stoll(line);
        std::getline(in, line);
        if (line != config_fingerprint(c)) {
            throw std::runtime_error("checkpoint " + spec.resume_dir + " was written with another configuration:\n  " +
                                     line + "\nthis run:\n  " + config_fingerprint(c));
        }
        session.load(spec.resume_dir + "/session.safetensors");
        // The model follows the loaded master weights. (The library may publish them itself
        // on its own stream: wait for the whole device first, then write the same values.)
        if (c.cuda) torch::cuda::synchronize();
        torch::NoGradGuard ng;
        for (auto& sg : sgs) sg.flat.copy_(sg.master);
        if (c.cuda) torch::cuda::synchronize();
        for (size_t k = 0; k < sgs.size(); k++) {
            if (session.step_count(static_cast<uint32_t>(k)) != static_cast<uint64_t>(first)) {
                throw std::runtime_error("sub-group " + sgs[k].name + " has " +
                                         std::to_string(session.step_count(static_cast<uint32_t>(k))) +
                                         " steps after loading, the trainer's step counter says " +
                                         std::to_string(first));
            }
        }
    }
    out.first_step = first;

    // ---- the loop --------------------------------------------------------------------------
    std::vector<torch::Tensor> params = model->parameters();
    so::Ticket pending = so::no_ticket; // the latest step's ticket whose result is not read yet
    int64_t pending_step = -1;
    auto resolve = [&]() {
        if (pending == so::no_ticket) return;
        const so::StepResult r = session.step_result(pending);
        auto& st = out.stats;
        st.clipped += r.clip_coef < 1.0;
        st.skipped += r.skipped;
        st.speculative += r.speculative;
        st.kept += r.kept;
        st.rescaled += r.rescaled;
        st.redone += r.redone;
        st.rolled_back += r.rolled_back;
        st.stepped += r.stepped;
        st.late += r.late_gradients;
        out.norm[static_cast<size_t>(pending_step)] = r.global_norm;
        if (r.skipped)
            throw std::runtime_error("step " + std::to_string(pending_step) + " was skipped (non-finite gradient?)");
        const uint32_t n = static_cast<uint32_t>(sgs.size());
        // Each sub-group's step is exact: a speculative step kept (its pass run, preempted or
        // cancelled at step()), or a GPU-resident sub-group stepped on the GPU; never rescaled,
        // redone or rolled back.
        if (!(r.clip_coef == 1.0 && r.kept + r.stepped + r.device_stepped == n && r.rescaled == 0 && r.redone == 0 &&
              r.rolled_back == 0)) {
            out.every_step_kept = false;
        }
        if (r.stepped != n) out.every_step_stepped = false;
        pending = so::no_ticket;
    };

    for (int64_t step = first; step < c.steps; step++) {
        const double lr = lr_at(c, step);
        if (use_session) {
            for (uint32_t g = 0; g < 2; g++) {
                ghp[g].lr = lr;
                session.set_group(g, ghp[g]);
            }
        } else {
            for (auto& g : adamw->param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
        }
        auto tokens = data.batch(step, c.batch, c.seq, c.data_seed).to(device);
        auto x = tokens.narrow(1, 0, c.seq), y = tokens.narrow(1, 1, c.seq);
        for (auto& p : params) p.mutable_grad().reset();

        // Forward: sub-group k's weights are needed from here on.
        auto before = [&](size_t k) {
            if (!use_session) return;
            const so::Ticket fin = session.final_ticket(static_cast<uint32_t>(k));
            if (c.cuda) {
#if SO_TRAINER_CUDA
                session.enqueue_wait(fin, current_stream(device));
#endif
            } else {
                session.wait(fin);
                torch::NoGradGuard ng;
                sgs[k].flat.copy_(sgs[k].master); // "publication" in CPU mode
            }
        };
        auto logits = model->forward(x, before);
        auto loss =
            torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).view({-1, c.vocab}), y.reshape({-1}));
        resolve(); // the previous step's result (its finalization overlapped this forward)

        if (use_session) {
            session.begin_step(1.0f, 1);
            hooks->handed = 0;
        }
        loss.backward();
        if (use_session) {
            if (hooks->handed.load() != static_cast<int>(params.size())) {
                throw std::runtime_error("only " + std::to_string(hooks->handed.load()) + " of " +
                                         std::to_string(params.size()) + " gradients were handed to the session");
            }
            so::StepArgs a;
            a.max_norm = spec.max_norm;
            pending = session.step(a);
            pending_step = step;
        } else {
            torch::NoGradGuard ng;
            for (auto& pm : torch_pairs) pm.second.mutable_grad() = pm.first.grad().to(torch::kFloat32);
            out.norm[static_cast<size_t>(step)] = torch::nn::utils::clip_grad_norm_(torch_masters, spec.max_norm);
            adamw->step();
            for (auto& pm : torch_pairs) pm.first.copy_(pm.second); // bf16 (CUDA) or f32 model copy
        }
        out.loss[static_cast<size_t>(step)] = loss.item<double>();
        if (!spec.quiet && (step % c.log_every == 0 || step == c.steps - 1)) {
            std::printf("  [%s] step %3" PRId64 "  loss %.5f  lr %.2e\n", spec.label.c_str(), step,
                        out.loss[static_cast<size_t>(step)], lr);
            std::fflush(stdout);
        }
        if (step + 1 == spec.save_at) {
            resolve();
            mkdir(spec.ckpt_dir.c_str(), 0755);
            session.save(spec.ckpt_dir + "/session.safetensors");
            write_text(spec.ckpt_dir + "/trainer.txt", std::to_string(step + 1) + "\n" + config_fingerprint(c) + "\n");
            if (!spec.quiet)
                std::printf("  [%s] saved a checkpoint after step %" PRId64 " to %s\n", spec.label.c_str(), step,
                            spec.ckpt_dir.c_str());
        }
    }
    resolve();

    // ---- results ---------------------------------------------------------------------------
    if (use_session) {
        for (size_t k = 0; k < sgs.size(); k++) session.wait(session.final_ticket(static_cast<uint32_t>(k)));
        if (c.cuda) torch::cuda::synchronize();
        for (size_t k = 0; k < spec.gpu_subgroups; k++) {
            // A GPU-resident sub-group's master lives on the GPU: bring it into its host buffer.
            (void)session.subgroup_state(static_cast<uint32_t>(k));
        }
        for (auto& sg : sgs) out.masters.push_back(sg.master.clone());
        if (!c.cuda) { // the last step's weights into the model, as the next forward would
            torch::NoGradGuard ng;
            for (auto& sg : sgs) sg.flat.copy_(sg.master);
        }
    } else {
        size_t i = 0;
        for (auto& sg : sgs) {
            auto m = torch::empty({sg.numel}, torch::kFloat32);
            for (auto& p : sg.params)
                m.narrow(0, p.offset, p.numel).copy_(torch_masters[i++].detach().reshape({-1}).cpu());
            out.masters.push_back(m);
        }
    }
    if (c.cuda) torch::cuda::synchronize();
    for (auto& sg : sgs) out.model.push_back(sg.flat.cpu());
    session.reset(); // destroy the session before the buffers it borrows
    out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!spec.quiet) {
        const auto& s = out.stats;
        if (use_session) {
            std::printf("  [%s] %.1f s; steps clipped %d of %" PRId64 "; speculative %" PRIu64 ", kept %" PRIu64
                        ", rescaled %" PRIu64 ", redone %" PRIu64 ", stepped at step() %" PRIu64 "\n",
                        spec.label.c_str(), out.seconds, s.clipped, c.steps - first, s.speculative, s.kept, s.rescaled,
                        s.redone, s.stepped);
        } else {
            int clipped = 0;
            for (int64_t i = first; i < c.steps; i++) clipped += out.norm[static_cast<size_t>(i)] > spec.max_norm;
            std::printf("  [%s] %.1f s; steps clipped %d of %" PRId64 "\n", spec.label.c_str(), out.seconds, clipped,
                        c.steps - first);
        }
        std::fflush(stdout);
    }
    return out;
}

// ------------------------------------------------------------------------------------------
// Comparisons
// ------------------------------------------------------------------------------------------

bool bits_equal(const torch::Tensor& a, const torch::Tensor& b) {
    auto x = a.contiguous(), y = b.contiguous();
    return x.scalar_type() == y.scalar_type() && x.numel() == y.numel() &&
           std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.numel()) * x.element_size()) == 0;
}

/** Bitwise comparison of losses from `from` on and of every sub-group's weights. */
bool compare_exact(const char* what, const RunOut& a, const RunOut& b, int64_t from, int64_t steps) {
    bool ok = true;
    int shown = 0;
    for (int64_t s = from; s < steps; s++) {
        const double x = a.loss[static_cast<size_t>(s)], y = b.loss[static_cast<size_t>(s)];
        if (std::memcmp(&x, &y, sizeof x) != 0) {
            ok = false;
            if (shown++ < 5) std::printf("    step %" PRId64 ": loss %.9g vs %.9g (diff %.3g)\n", s, x, y, x - y);
        }
    }
    for (size_t k = 0; k < a.masters.size(); k++) {
        if (!bits_equal(a.masters[k], b.masters[k])) {
            ok = false;
            const double d = (a.masters[k] - b.masters[k]).abs().max().item<double>();
            const int64_t n = (a.masters[k] != b.masters[k]).sum().item<int64_t>();
            std::printf("    sub-group %zu master weights differ: %" PRId64 " elements, max |diff| %.3g\n", k, n, d);
        }
        if (!bits_equal(a.model[k], b.model[k])) {
            ok = false;
            std::printf("    sub-group %zu model weights differ\n", k);
        }
    }
    std::printf("  %s: losses of steps %" PRId64 "..%" PRId64 " and final master + model weights %s\n", what, from,
                steps - 1, ok ? "bit-identical" : "DIFFER");
    return ok;
}

void write_losses(const std::string& path, const RunOut& r, int64_t steps) {
    std::ofstream f(path);
    for (int64_t s = r.first_step; s < steps; s++) {
        char line[128];
        std::snprintf(line, sizeof line, "%" PRId64 " %a %.9g\n", s, r.loss[static_cast<size_t>(s)],
                      r.loss[static_cast<size_t>(s)]);
        f << line;
    }
    if (!f) throw std::runtime_error("cannot write " + path);
}

int compare_loss_files(const std::string& pa, const std::string& pb, int64_t from) {
    auto load = [](const std::string& p) {
        std::map<int64_t, std::string> m;
        std::istringstream in(read_text(p));
        int64_t s;
        std::string hex, dec;
        while (in >> s >> hex >> dec) m[s] = hex + " (" + dec + ")";
        return m;
    };
    auto a = load(pa), b = load(pb);
    int compared = 0, bad = 0;
    for (auto& kv : a) {
        if (kv.first < from) continue;
        auto it = b.find(kv.first);
        if (it == b.end()) continue;
        compared++;
        if (it->second != kv.second) {
            if (bad++ < 5)
                std::printf("  step %" PRId64 ": %s vs %s\n", kv.first, kv.second.c_str(), it->second.c_str());
        }
    }
    std::printf("compare %s %s from step %" PRId64 ": %d steps compared, %d differ\n", pa.c_str(), pb.c_str(), from,
                compared, bad);
    return compared > 0 && bad == 0 ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    // Deterministic cuBLAS (needed for the bit-for-bit checks); before CUDA starts.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    try {
        const Args args = parse_args(argc, argv);
        if (args.has("help")) {
            std::printf("%s", kUsage);
            return 0;
        }
        if (args.has("compare_a")) {
            return compare_loss_files(args.str("compare_a", ""), args.str("compare_b", ""), args.i64("from", 0));
        }
        if (!so::abi_compatible()) {
            std::fprintf(stderr, "libsuperoffload ABI %u, header %u\n", so::abi_version(), SO_ABI_VERSION);
            return 2;
        }
        Config c;
        const std::string dev = args.str("device", "auto");
        const bool have_gpu = torch::cuda::is_available();
        if (dev == "cuda" && !have_gpu) throw std::runtime_error("--device cuda: torch sees no CUDA device");
        c.cuda = dev == "cuda" || (dev == "auto" && have_gpu);
        if (dev != "auto" && dev != "cpu" && dev != "cuda") throw std::invalid_argument("--device auto|cpu|cuda");
#if !SO_TRAINER_CUDA
        if (c.cuda) {
            throw std::runtime_error(
                "torch sees a CUDA device but this trainer was built without CUDA support (the CMake configuration "
                "found no CUDA-enabled torch with CUDA headers: see SO_TRAINER_CUDA in CMakeLists.txt), or pass "
                "--device cpu");
        }
#endif
        if (c.cuda) {
            so_status st = so_cuda_available();
            if (st != SO_STATUS_OK) so_check(st, "so_cuda_available (torch sees a GPU, superoffload does not)");
            c.vocab = 256, c.seq = 128, c.dim = 384, c.layers = 6, c.heads = 6, c.batch = 16, c.steps = 80,
            c.warmup = 8;
            c.lr = 1e-3;
        }
        c.steps = args.i64("steps", c.steps);
        c.warmup = args.i64("warmup", std::max<int64_t>(1, c.steps / 10));
        c.vocab = args.i64("vocab", c.vocab);
        c.seq = args.i64("seq", c.seq);
        c.dim = args.i64("dim", c.dim);
        c.layers = args.i64("layers", c.layers);
        c.heads = args.i64("heads", c.heads);
        c.batch = args.i64("batch", c.batch);
        c.lr = args.f64("lr", c.lr);
        c.clip = args.f64("clip", c.clip);
        c.tied = !args.has("untied");
        c.seed = static_cast<uint64_t>(args.i64("seed", static_cast<int64_t>(c.seed)));
        c.parity_tol = args.f64("parity-tol", c.parity_tol);
        c.math_sdpa = args.str("sdpa", "math") == "math";
        const std::string pd = args.str("param-dtype", c.cuda ? "bf16" : "f32");
        if (pd != "bf16" && pd != "f32") throw std::invalid_argument("--param-dtype bf16|f32");
        c.bf16 = pd == "bf16";
        c.log_every = static_cast<int>(args.i64("log-every", c.log_every));
        if (c.dim % c.heads != 0) throw std::invalid_argument("--dim must be a multiple of --heads");
        if (c.steps < 2) throw std::invalid_argument("--steps must be at least 2");

        // Determinism for the bit-for-bit checks: deterministic kernels (warn where there is
        // none) and, by default, the math attention backend (fused attention backwards may
        // accumulate with atomics).
        at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
        if (c.math_sdpa) {
            at::globalContext().setSDPUseFlash(false);
            at::globalContext().setSDPUseMemEfficient(false);
            at::globalContext().setSDPUseCuDNN(false);
            at::globalContext().setSDPUseMath(true);
        }

        const MarkovData data(c.vocab, c.data_seed, static_cast<int>(args.i64("order", 1)));
        {
            GPT probe(c);
            int64_t n = 0;
            for (auto& p : probe->parameters()) n += p.numel();
            so_pool_info info{};
            info.struct_size = sizeof info;
            so_check(so_pool_get_info(nullptr, &info), "so_pool_get_info");
            std::printf("superoffload %s; torch %s; mode %s, %s model parameters%s\n", so::version_string(),
                        TORCH_VERSION, c.cuda ? "CUDA (parameters on the GPU, CUDA session)" : "CPU (host session)",
                        c.bf16 ? "bf16" : "f32", c.cuda || have_gpu ? "" : " [no GPU]");
            std::printf("model: vocab %" PRId64 ", seq %" PRId64 ", dim %" PRId64 ", layers %" PRId64 ", heads %" PRId64
                        ", %s head, %" PRId64 " parameters in %" PRId64 " sub-groups; batch %" PRId64 ", %" PRId64
                        " steps (warm-up %" PRId64
                        ", peak lr %.1e, cosine), clip %.1f; session pool: %zu threads, %s\n",
                        c.vocab, c.seq, c.dim, c.layers, c.heads, c.tied ? "tied" : "untied", n, c.layers + 2, c.batch,
                        c.steps, c.warmup, c.lr, c.clip, info.num_threads, so_isa_name(info.isa));
            std::printf("data: Markov chain (order %d), entropy floor %.3f nats (uniform: %.3f)\n", data.order,
                        MarkovData::entropy(), std::log(static_cast<double>(c.vocab)));
            std::fflush(stdout);
        }

        // ---- a single run (run.sh's cross-process resume check) ----
        if (args.has("resume") || args.has("save-at") || args.has("losses-out")) {
            RunSpec s;
            s.label = args.has("resume") ? "resumed" : "train";
            // Speculation off: the resume check compares with the non-speculative reference run
            // (a speculative run repeats bit for bit as well, whatever its timing).
            s.kind = OptKind::SessionNoSpec;
            s.max_norm = c.clip;
            s.init_seed = args.has("resume") ? c.seed + 1000 : c.seed;
            s.resume_dir = args.str("resume", "");
            s.save_at = args.str("save-at", "") == "half" ? c.steps / 2 : args.i64("save-at", -1);
            s.ckpt_dir = args.str("ckpt", "ckpt");
            RunOut r = train(c, data, s);
            if (args.has("losses-out")) write_losses(args.str("losses-out", ""), r, c.steps);
            return 0;
        }

        // ---- the checks ----
        const std::string checks = args.str("check", "parity,exact,resume,gpu");
        auto want = [&](const char* k) { return checks.find(k) != std::string::npos; };
        bool ok = true;
        const int64_t half = c.steps / 2;
        const std::string ckpt = args.str("ckpt", "so_trainer_ckpt");

        if (want("parity") || want("resume")) {
            std::printf("\n== run 1: %s, clip %.1f\n", opt_name(OptKind::Session), c.clip);
            RunSpec s1{"session", OptKind::Session, c.clip, c.seed, -1, "", "", false};
            RunOut r1 = train(c, data, s1);

            // Learning: the last losses are well below the first ones.
            const size_t n5 = 5;
            double head = 0, tail = 0;
            for (size_t i = 0; i < n5; i++) head += r1.loss[i] / n5, tail += r1.loss[r1.loss.size() - 1 - i] / n5;
            const bool learned = tail < head - 0.25 * (head - MarkovData::entropy());
            std::printf("  learning: mean loss of the first 5 steps %.4f, of the last 5 %.4f -> %s\n", head, tail,
                        learned ? "ok" : "NOT LEARNING");
            ok &= learned;

            if (want("parity")) {
                std::printf("\n== run 2: %s on f32 masters on the %s%s, clip %.1f\n", opt_name(OptKind::TorchAdamW),
                            c.cuda ? "GPU" : "CPU", c.bf16 ? ", bf16 model copies" : "", c.clip);
                RunSpec s2{"torch", OptKind::TorchAdamW, c.clip, c.seed, -1, "", "", false};
                RunOut r2 = train(c, data, s2);
                double sum = 0, mx = 0, nd = 0, nmx = 0;
                for (int64_t s = 0; s < c.steps; s++) {
                    const double a = r1.loss[static_cast<size_t>(s)], b = r2.loss[static_cast<size_t>(s)];
                    const double rel = std::fabs(a - b) / std::max(std::fabs(b), 1e-12);
                    sum += rel;
                    mx = std::max(mx, rel);
                    const double na = r1.norm[static_cast<size_t>(s)], nb = r2.norm[static_cast<size_t>(s)];
                    const double nrel = std::fabs(na - nb) / std::max(nb, 1e-12);
                    nd += nrel;
                    nmx = std::max(nmx, nrel);
                }
                const double mean = sum / static_cast<double>(c.steps);
                double wmax = 0;
                for (size_t k = 0; k < r1.masters.size(); k++) {
                    wmax = std::max(wmax, (r1.masters[k] - r2.masters[k]).abs().max().item<double>());
                }
                std::printf("  parity over %" PRId64
                            " steps: loss relative difference mean %.3g, max %.3g (tolerance: "
                            "mean <= %.1g); gradient norm relative difference mean %.3g, max %.3g; final master "
                            "weights max |diff| %.3g\n",
                            c.steps, mean, mx, c.parity_tol, nd / static_cast<double>(c.steps), nmx, wmax);
                for (int64_t s : {int64_t(0), int64_t(1), half, c.steps - 1}) {
                    std::printf("    step %3" PRId64 ": session %.6f (norm %.4f)  torch %.6f (norm %.4f)\n", s,
                                r1.loss[static_cast<size_t>(s)], r1.norm[static_cast<size_t>(s)],
                                r2.loss[static_cast<size_t>(s)], r2.norm[static_cast<size_t>(s)]);
                }
                const bool pass = mean <= c.parity_tol && std::isfinite(mean);
                std::printf("  parity: %s\n", pass ? "PASS" : "FAIL");
                ok &= pass;
                if (r1.stats.clipped == 0) std::printf("  note: clipping never triggered in this configuration\n");
            }
            if (want("resume")) {
                // Speculation off, as run 2's reference (a speculative run repeats bit for bit as
                // well, whatever its timing).
                std::printf("\n== run 3: %s, clip %.1f, checkpoint half-way\n", opt_name(OptKind::SessionNoSpec),
                            c.clip);
                RunSpec s3{"uninterrupted", OptKind::SessionNoSpec, c.clip, c.seed, half, ckpt, "", false};
                RunOut r3 = train(c, data, s3);
                std::printf("\n== run 3b: fresh model (init seed %" PRIu64
                            ") and session, resumed from %s at step %" PRId64 "\n",
                            c.seed + 1000, ckpt.c_str(), half);
                RunSpec s3b{"resumed", OptKind::SessionNoSpec, c.clip, c.seed + 1000, -1, "", ckpt, false};
                RunOut r3b = train(c, data, s3b);
                const bool pass = compare_exact("resume vs uninterrupted", r3b, r3, half, c.steps);
                std::printf("  resume: %s\n", pass ? "PASS" : "FAIL");
                ok &= pass;
            }
        }
        if (want("exact")) {
            std::printf(
                "\n== runs 4 and 5: clipping that never triggers (max_norm 1e6), speculative vs speculation off\n");
            RunSpec s4{"spec", OptKind::Session, 1e6, c.seed, -1, "", "", true};
            RunSpec s5{"no-spec", OptKind::SessionNoSpec, 1e6, c.seed, -1, "", "", true};
            RunOut r4 = train(c, data, s4);
            RunOut r5 = train(c, data, s5);
            std::printf("  speculative: %.1f s, speculative steps %" PRIu64
                        " all kept: %s; speculation off: %.1f s, "
                        "stepped at step() %" PRIu64 "; final loss %.6f / %.6f\n",
                        r4.seconds, r4.stats.speculative, r4.every_step_kept ? "yes" : "NO", r5.seconds,
                        r5.stats.stepped, r4.loss.back(), r5.loss.back());
            bool pass = r4.every_step_kept && r4.stats.kept > 0 && r5.every_step_stepped;
            pass &= compare_exact("speculative vs non-speculative", r4, r5, 0, c.steps);
            std::printf("  exact: %s\n", pass ? "PASS" : "FAIL");
            ok &= pass;
            if (want("gpu") && c.cuda) {
                // The library's GPU kernel is the CPU kernels' operation sequence: keeping the
                // first sub-groups on the GPU changes no bit of the run.
                RunSpec s6{"gpu-resident", OptKind::Session, 1e6, c.seed, -1, "", "", true};
                s6.gpu_subgroups = std::max<size_t>(1, static_cast<size_t>(c.layers) / 3);
                std::printf("\n== run 6: the first %zu sub-groups on the GPU (library GPU kernel) vs all offloaded\n",
                            s6.gpu_subgroups);
                RunOut r6 = train(c, data, s6);
                bool gpu_pass = r6.every_step_kept;
                gpu_pass &= compare_exact("GPU-resident vs all offloaded", r6, r4, 0, c.steps);
                std::printf("  GPU-resident: %.1f s vs %.1f s; %s\n", r6.seconds, r4.seconds,
                            gpu_pass ? "PASS" : "FAIL");
                ok &= gpu_pass;
            }
        }
        std::printf("\n%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
        return ok ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
