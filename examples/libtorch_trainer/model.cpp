#include "model.hpp"

#include <cmath>
#include <string>

namespace trainer {

BlockImpl::BlockImpl(int64_t dim, int64_t heads_) : heads(heads_) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    qkv = register_module("qkv", torch::nn::Linear(dim, 3 * dim));
    proj = register_module("proj", torch::nn::Linear(dim, dim));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    fc = register_module("fc", torch::nn::Linear(dim, 4 * dim));
    fc_proj = register_module("fc_proj", torch::nn::Linear(4 * dim, dim));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x) {
    const int64_t B = x.size(0), T = x.size(1), C = x.size(2);
    // [B, T, 3, H, hd] -> [3, B, H, T, hd]
    auto q_k_v = qkv(ln1(x)).view({B, T, 3, heads, C / heads}).permute({2, 0, 3, 1, 4});
    auto y = torch::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2], {}, 0.0, /*is_causal=*/true);
    y = y.transpose(1, 2).contiguous().view({B, T, C});
    auto h = x + proj(y);
    return h + fc_proj(torch::gelu(fc(ln2(h)), "tanh"));
}

GPTImpl::GPTImpl(const Config& c) : tied(c.tied) {
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

torch::Tensor GPTImpl::forward(const torch::Tensor& idx, superoffload::torch::AdamW* opt) {
    auto wait_for = [opt](const torch::nn::Module& layer) {
        if (opt != nullptr) opt->wait_for(layer);
    };
    wait_for(*tok);
    wait_for(*pos);
    auto positions = torch::arange(idx.size(1), idx.options());
    auto x = tok(idx) + pos(positions);
    for (auto& block : blocks) {
        wait_for(*block);
        x = block(x);
    }
    wait_for(*ln_f);
    if (!tied) wait_for(*head);
    x = ln_f(x);
    return tied ? torch::nn::functional::linear(x, tok->weight) : head(x);
}

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

} // namespace trainer
