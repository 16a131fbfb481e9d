// The model: a GPT-style decoder of pre-norm blocks.
#ifndef SO_TORCH_TRAINER_MODEL_HPP
#define SO_TORCH_TRAINER_MODEL_HPP

#include "config.hpp"

#include <superoffload/torch.hpp>
#include <torch/torch.h>

#include <cstdint>
#include <vector>

namespace trainer {

struct BlockImpl : torch::nn::Module {
    BlockImpl(int64_t dim, int64_t heads_);
    torch::Tensor forward(const torch::Tensor& x);
    int64_t heads;
    torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
    torch::nn::Linear qkv{nullptr}, proj{nullptr}, fc{nullptr}, fc_proj{nullptr};
};
TORCH_MODULE(Block);

struct GPTImpl : torch::nn::Module {
    explicit GPTImpl(const Config& c);
    /** With an offloading optimizer, each layer waits for its own weights before it runs. */
    torch::Tensor forward(const torch::Tensor& idx, superoffload::torch::AdamW* opt);
    bool tied;
    torch::nn::Embedding tok{nullptr}, pos{nullptr};
    std::vector<Block> blocks;
    torch::nn::LayerNorm ln_f{nullptr};
    torch::nn::Linear head{nullptr};
};
TORCH_MODULE(GPT);

/** GPT-2 style init, in f32 on the CPU, from `seed`. */
void init_weights(GPT& model, int64_t layers, uint64_t seed);

} // namespace trainer

#endif
