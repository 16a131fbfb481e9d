// The gradient hooks: each parameter's gradient handed to the session as autograd produces it.
#ifndef SO_TORCH_TRAINER_GRADIENT_HOOKS_HPP
#define SO_TORCH_TRAINER_GRADIENT_HOOKS_HPP

#include <torch/torch.h>

#include "superoffload.h"
#include "superoffload.hpp"

#include <atomic>
#include <cstdint>
#include <string>

namespace trainer {

namespace so = superoffload;

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
void hand_over(HookState& h, uint32_t slice, const std::string& name, const torch::Tensor& grad);

} // namespace trainer

#endif
