#include "gradient_hooks.hpp"

#if SO_TRAINER_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstddef>
#include <stdexcept>

namespace trainer {

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

} // namespace trainer
