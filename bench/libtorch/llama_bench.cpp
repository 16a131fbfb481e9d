// A Llama-style model trained from C++ with libtorch, one optimizer per process:
//
//   ours   superoffload::torch::AdamW: f32 master weights and moments in host memory (the
//          session's automatic GPU budget keeps what fits of the first sub-groups on the GPU),
//          gradients handed over during backward, each layer's forward waiting for its weights;
//   fused  torch's fused AdamW kernel on the GPU as torch.optim.AdamW(fused=True) runs it for a
//          bf16 model with f32 master weights: the bf16 gradients cast into f32 gradient
//          buffers (_foreach_copy_), clipping as clip_grad_norm_(foreach=True) does
//          (_foreach_norm, the total norm, _foreach_mul_ by min(1, max_norm / (norm + 1e-6))),
//          at::_fused_adamw_ over the f32 master weights with f32 moments and f32 step tensors
//          on the GPU, then the master weights copied into the bf16 parameters (_foreach_copy_).
//
// Model (defaults: TinyLlama's shape, 1.1 B parameters): token embedding, decoder layers of
// RMSNorm, attention with rotary embedding and grouped KV heads (at::scaled_dot_product_attention),
// RMSNorm and a SwiGLU MLP, a final RMSNorm and an untied head; bf16 parameters and compute on
// one GPU (f32 on the CPU with --device cpu, a check of the program on small shapes); random
// tokens. A step: forward, cross-entropy, backward, the optimizer step; its time
// runs from one step's end (the device synchronized) to the next one's, so work an optimizer
// leaves running (ours: the last sub-groups' CPU passes) lands in the next step. Every step's
// time is printed and written to the JSON file (--json).
//
//   so_llama_bench --system ours|fused [--device cuda|cpu] [--clip 1.0|0] [--steps 20] [--warmup 5] [--batch 8]
//                  [--seq 2048] [--layers 22] [--hidden 2048] [--intermediate 5632] [--heads 32]
//                  [--kv-heads 4] [--vocab 32000] [--sub-group-numel N] [--json FILE]

#include <superoffload/torch.hpp>

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace sot = superoffload::torch;

struct Config {
    std::string system = "ours";
    std::string device = "cuda";
    double clip = 1.0; // max_norm; 0: no clipping
    int steps = 20, warmup = 5;
    int64_t batch = 8, seq = 2048, layers = 22, hidden = 2048, intermediate = 5632, heads = 32, kv_heads = 4;
    int64_t vocab = 32000;
    size_t sub_group_numel = size_t{1} << 25;
    std::string json;
};

torch::Tensor weight(int64_t rows, int64_t cols, const torch::TensorOptions& o) {
    return torch::empty({rows, cols}, o).normal_(0.0, 0.02);
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w) {
    const auto xf = x.to(torch::kFloat32);
    return (xf * torch::rsqrt(xf.pow(2).mean(-1, true) + 1e-5)).to(x.scalar_type()) * w;
}

/** Rotates pairs (i, i + d/2) of the last dimension by the position's angles. */
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
    const int64_t half = x.size(-1) / 2;
    const auto x1 = x.narrow(-1, 0, half), x2 = x.narrow(-1, half, half);
    return torch::cat({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1);
}

struct LayerImpl : torch::nn::Module {
    LayerImpl(const Config& c, const torch::TensorOptions& o) : heads(c.heads), kv_heads(c.kv_heads) {
        const int64_t hd = c.hidden / c.heads;
        attn_norm = register_parameter("attn_norm", torch::ones({c.hidden}, o));
        wq = register_parameter("wq", weight(c.hidden, c.hidden, o));
        wk = register_parameter("wk", weight(c.kv_heads * hd, c.hidden, o));
        wv = register_parameter("wv", weight(c.kv_heads * hd, c.hidden, o));
        wo = register_parameter("wo", weight(c.hidden, c.hidden, o));
        mlp_norm = register_parameter("mlp_norm", torch::ones({c.hidden}, o));
        gate = register_parameter("gate", weight(c.intermediate, c.hidden, o));
        up = register_parameter("up", weight(c.intermediate, c.hidden, o));
        down = register_parameter("down", weight(c.hidden, c.intermediate, o));
    }
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
        const int64_t B = x.size(0), T = x.size(1), hd = x.size(2) / heads;
        const auto h = rms_norm(x, attn_norm);
        auto q = torch::linear(h, wq).view({B, T, heads, hd}).transpose(1, 2);
        auto k = torch::linear(h, wk).view({B, T, kv_heads, hd}).transpose(1, 2);
        auto v = torch::linear(h, wv).view({B, T, kv_heads, hd}).transpose(1, 2);
        q = rotary(q, cos, sin);
        k = rotary(k, cos, sin);
        auto a = at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, std::nullopt,
                                                  /*enable_gqa=*/true);
        const auto y = x + torch::linear(a.transpose(1, 2).reshape({B, T, heads * hd}), wo);
        const auto m = rms_norm(y, mlp_norm);
        return y + torch::linear(torch::silu(torch::linear(m, gate)) * torch::linear(m, up), down);
    }
    int64_t heads, kv_heads;
    torch::Tensor attn_norm, wq, wk, wv, wo, mlp_norm, gate, up, down;
};
TORCH_MODULE(Layer);

struct EmbeddingImpl : torch::nn::Module {
    EmbeddingImpl(const Config& c, const torch::TensorOptions& o) {
        table = register_parameter("table", weight(c.vocab, c.hidden, o));
    }
    torch::Tensor table;
};
TORCH_MODULE(Embedding);

struct HeadImpl : torch::nn::Module {
    HeadImpl(const Config& c, const torch::TensorOptions& o) {
        norm = register_parameter("norm", torch::ones({c.hidden}, o));
        out = register_parameter("out", weight(c.vocab, c.hidden, o));
    }
    torch::Tensor norm, out;
};
TORCH_MODULE(Head);

struct LlamaImpl : torch::nn::Module {
    LlamaImpl(const Config& c, const torch::TensorOptions& o) {
        embed = register_module("embed", Embedding(c, o));
        for (int64_t l = 0; l < c.layers; l++)
            layers.push_back(register_module("layer" + std::to_string(l), Layer(c, o)));
        head = register_module("head", Head(c, o));
        // Rotary angles, f32 then the compute dtype: [T, head_dim / 2], one per rotated pair.
        const int64_t hd = c.hidden / c.heads;
        const auto inv = torch::pow(10000.0, -torch::arange(0, hd, 2, torch::kFloat64) / static_cast<double>(hd));
        const auto angles = torch::outer(torch::arange(c.seq, torch::kFloat64), inv).to(torch::kFloat32);
        cos = angles.cos().to(o.device(), o.dtype());
        sin = angles.sin().to(o.device(), o.dtype());
    }
    /** Logits; `opt`, when given, makes each layer wait for its own weights first. */
    torch::Tensor forward(const torch::Tensor& tokens, sot::AdamW* opt) {
        auto wait_for = [opt](const torch::nn::Module& m) {
            if (opt != nullptr) opt->wait_for(m);
        };
        wait_for(*embed);
        auto x = torch::embedding(embed->table, tokens);
        for (auto& layer : layers) {
            wait_for(*layer);
            x = layer(x, cos, sin);
        }
        wait_for(*head);
        return torch::linear(rms_norm(x, head->norm), head->out);
    }
    Embedding embed{nullptr};
    std::vector<Layer> layers;
    Head head{nullptr};
    torch::Tensor cos, sin;
};
TORCH_MODULE(Llama);

/** torch's fused AdamW over f32 master weights of bf16 parameters (see the file comment). */
class FusedAdamW {
public:
    FusedAdamW(const std::vector<torch::Tensor>& params, double lr, double weight_decay)
        : params_(params), lr_(lr), weight_decay_(weight_decay) {
        torch::NoGradGuard no_grad;
        for (const auto& p : params_) {
            masters_.push_back(p.detach().to(torch::kFloat32, false, true));
            grads_.push_back(torch::zeros_like(masters_.back()));
            exp_avgs_.push_back(torch::zeros_like(masters_.back()));
            exp_avg_sqs_.push_back(torch::zeros_like(masters_.back()));
            steps_.push_back(torch::zeros({}, masters_.back().options()));
        }
    }
    void step(double max_norm) {
        torch::NoGradGuard no_grad;
        std::vector<torch::Tensor> bf16_grads;
        for (auto& p : params_) bf16_grads.push_back(p.grad());
        at::_foreach_copy_(grads_, bf16_grads);
        for (auto& p : params_) p.mutable_grad().reset();
        if (max_norm > 0) {
            const auto norms = at::_foreach_norm(grads_, 2);
            const auto total = torch::linalg_vector_norm(torch::stack(norms), 2);
            at::_foreach_mul_(grads_, torch::clamp_max(max_norm / (total + 1e-6), 1.0));
        }
        at::_foreach_add_(steps_, 1); // the fused kernel reads the step count; its caller counts
        at::_fused_adamw_(masters_, grads_, exp_avgs_, exp_avg_sqs_, {}, steps_, lr_, 0.9, 0.95, weight_decay_, 1e-8,
                          /*amsgrad=*/false, /*maximize=*/false);
        at::_foreach_copy_(params_, masters_);
    }

private:
    std::vector<torch::Tensor> params_, masters_, grads_, exp_avgs_, exp_avg_sqs_, steps_;
    double lr_, weight_decay_;
};

Config parse(int argc, char** argv) {
    std::map<std::string, std::string> kv;
    for (int i = 1; i < argc; i++) {
        const std::string k = argv[i];
        if (k == "--help" || k == "-h") {
            std::printf(
                "so_llama_bench --system ours|fused [--device cuda|cpu] [--clip X (0: none)] [--steps N] [--warmup N] "
                "[--batch B]\n"
                "  [--seq T] [--layers L] [--hidden H] [--intermediate I] [--heads N] [--kv-heads N]\n"
                "  [--vocab V] [--sub-group-numel N] [--json FILE]\n");
            std::exit(0);
        }
        if (k.rfind("--", 0) != 0 || i + 1 >= argc) throw std::invalid_argument("bad argument " + k + " (--help)");
        kv[k.substr(2)] = argv[++i];
    }
    Config c;
    auto take = [&](const char* key, auto& field) {
        auto it = kv.find(key);
        if (it == kv.end()) return;
        std::istringstream in(it->second);
        in >> field;
        if (!in) throw std::invalid_argument(std::string("--") + key + ": " + it->second);
        kv.erase(it);
    };
    take("system", c.system);
    take("device", c.device);
    take("clip", c.clip);
    take("steps", c.steps);
    take("warmup", c.warmup);
    take("batch", c.batch);
    take("seq", c.seq);
    take("layers", c.layers);
    take("hidden", c.hidden);
    take("intermediate", c.intermediate);
    take("heads", c.heads);
    take("kv-heads", c.kv_heads);
    take("vocab", c.vocab);
    take("sub-group-numel", c.sub_group_numel);
    take("json", c.json);
    if (!kv.empty()) throw std::invalid_argument("unknown argument --" + kv.begin()->first + " (--help)");
    if (c.system != "ours" && c.system != "fused") throw std::invalid_argument("--system ours|fused");
    if (c.device != "cuda" && c.device != "cpu") throw std::invalid_argument("--device cuda|cpu");
    if (c.steps <= c.warmup) throw std::invalid_argument("--steps must exceed --warmup");
    return c;
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int run(const Config& c) {
    const bool cuda = c.device == "cuda";
    if (cuda && !torch::cuda::is_available()) throw std::runtime_error("torch sees no CUDA device");
    // The optimizer takes bf16 parameters on a GPU, f32 ones on the CPU.
    const auto o = cuda ? torch::TensorOptions().device(torch::kCUDA, 0).dtype(torch::kBFloat16)
                        : torch::TensorOptions().dtype(torch::kFloat32);
    auto synchronize = [cuda] {
        if (cuda) torch::cuda::synchronize();
    };
    torch::manual_seed(0);
    Llama model(c, o);
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    const double lr = 1e-4, weight_decay = 0.01;

    std::unique_ptr<sot::AdamW> ours;
    std::unique_ptr<FusedAdamW> fused;
    if (c.system == "ours") {
        sot::Options options;
        options.max_grad_norm = c.clip;
        options.sub_group_numel = c.sub_group_numel;
        ours = std::make_unique<sot::AdamW>(
            *model, torch::optim::AdamWOptions(lr).betas({0.9, 0.95}).weight_decay(weight_decay), options);
    } else {
        fused = std::make_unique<FusedAdamW>(model->parameters(), lr, weight_decay);
    }
    std::printf("%s, clip %s: %.3f B parameters, %" PRId64 " layers, batch %" PRId64 " x %" PRId64
                " tokens, %d steps (%d warm-up)%s\n",
                c.system.c_str(), c.clip > 0 ? std::to_string(c.clip).c_str() : "off", numel / 1e9, c.layers, c.batch,
                c.seq, c.steps, c.warmup,
                ours ? (", " + std::to_string(ours->num_subgroups()) + " sub-groups").c_str() : "");
    std::fflush(stdout);

    std::vector<double> step_s, losses;
    synchronize();
    auto last = std::chrono::steady_clock::now();
    for (int step = 0; step < c.steps; step++) {
        torch::manual_seed(1000 + step);
        const auto tokens = torch::randint(c.vocab, {c.batch, c.seq + 1}, o.dtype(torch::kInt64));
        const auto logits = model->forward(tokens.narrow(1, 0, c.seq), ours.get());
        const auto loss = torch::cross_entropy_loss(logits.view({-1, c.vocab}).to(torch::kFloat32),
                                                    tokens.narrow(1, 1, c.seq).reshape({-1}));
        loss.backward();
        if (ours) {
            ours->step();
        } else {
            fused->step(c.clip);
        }
        synchronize();
        const auto now = std::chrono::steady_clock::now();
        step_s.push_back(std::chrono::duration<double>(now - last).count());
        last = now;
        losses.push_back(loss.item<double>());
        std::printf("step %3d  %.4f s  loss %.4f%s\n", step, step_s.back(), losses.back(),
                    step < c.warmup ? "  (warm-up)" : "");
        std::fflush(stdout);
    }
    const std::vector<double> measured(step_s.begin() + c.warmup, step_s.end());
    double mean = 0;
    for (double s : measured) mean += s / static_cast<double>(measured.size());
    const double med = median(measured);
    const double flops = 6.0 * static_cast<double>(numel) * static_cast<double>(c.batch * c.seq);
    std::printf("%s, clip %s: median %.4f s, mean %.4f s over %zu steps; %.0f TFLOPS (6 N tokens / median)\n",
                c.system.c_str(), c.clip > 0 ? "on" : "off", med, mean, measured.size(), flops / med / 1e12);
    std::string extra;
    if (ours) {
        ours->wait_all();
        const auto budget = ours->session().gpu_budget();
        extra = ", \"optimizer_device_bytes\": " + std::to_string(ours->session().device_bytes()) +
                ", \"gpu_budget_bytes\": " + (budget ? std::to_string(*budget) : std::string("null")) +
                ", \"optimizer_host_bytes\": " + std::to_string(ours->session().host_bytes()) +
                ", \"pinned_bytes\": " + std::to_string(ours->session().pinned_bytes());
        std::printf("ours: optimizer GPU bytes %.2f GiB, automatic GPU budget %s\n",
                    ours->session().device_bytes() / 1073741824.0,
                    budget ? (std::to_string(*budget / 1073741824.0) + " GiB").c_str() : "not chosen");
    }
    if (!c.json.empty()) {
        std::ofstream f(c.json);
        auto list = [](const std::vector<double>& v) {
            std::ostringstream s;
            s.precision(9);
            for (size_t i = 0; i < v.size(); i++) {
                s << (i ? ", " : "");
                if (std::isfinite(v[i])) {
                    s << v[i];
                } else {
                    s << "NaN"; // as Python's json reads it
                }
            }
            return "[" + s.str() + "]";
        };
        f << "{\"system\": \"" << c.system << "\", \"clip\": " << c.clip << ", \"parameters\": " << numel
          << ", \"layers\": " << c.layers << ", \"hidden\": " << c.hidden << ", \"batch\": " << c.batch
          << ", \"seq\": " << c.seq << ", \"device\": \"" << c.device << "\", \"torch\": \"" << TORCH_VERSION
          << "\", \"superoffload\": \"" << superoffload::version_string() << "\", \"warmup\": " << c.warmup
          << ", \"step_s\": " << list(step_s) << ", \"loss\": " << list(losses) << ", \"median_s\": " << med
          << ", \"mean_s\": " << mean << extra << "}\n";
        if (!f) throw std::runtime_error("cannot write " + c.json);
    }
    return 0;
}

} // namespace

int main(int argc, char** argv) {
    try {
        return run(parse(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
