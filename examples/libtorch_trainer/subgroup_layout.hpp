// Sub-group layout: flat buffers, parameter views, master weights.
#ifndef SO_TORCH_TRAINER_SUBGROUP_LAYOUT_HPP
#define SO_TORCH_TRAINER_SUBGROUP_LAYOUT_HPP

#include "config.hpp"
#include "model.hpp"

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

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

/** Groups the parameters into sub-groups in forward order, fills each sub-group's f32
 *  master from the current (f32, CPU) values and moves the parameters into one flat buffer
 *  per sub-group on `device` in `dtype` (parameters become views into it). */
std::vector<SubGroupLayout> build_layout(GPT& model, const Config& c, torch::Device device, torch::Dtype dtype);

} // namespace trainer

#endif
