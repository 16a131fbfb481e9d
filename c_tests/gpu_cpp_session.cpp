// The C++ wrapper's CUDA calls: a CUDA session through superoffload.hpp, a device gradient
// handed over, weights published and read back after a GPU-side wait. Skipped (77) without
// a GPU.
#include <cstdio>
#include <vector>

#include "cuda_driver.h"
#include "superoffload.hpp"

namespace so = superoffload;

int main() {
    if (!so::cuda_available()) {
        std::printf("SKIP: CUDA unavailable\n");
        return 77;
    }
    cuda_driver_load();
    const std::size_t n = 3000;
    std::vector<float> master(n, 0.25f);
    std::vector<uint16_t> grad(n, so_f32_to_bf16(0.01f)), back(n, 0);
    cu_ptr d_param = 0, d_grad = 0;
    CU_CHECK(cu.mem_alloc(&d_param, n * 2));
    CU_CHECK(cu.mem_alloc(&d_grad, n * 2));
    CU_CHECK(cu.htod(d_grad, grad.data(), n * 2));
    CU_CHECK(cu.ctx_sync());
    so_cuda_stream_t stream = nullptr;
    CU_CHECK(cu.stream_create(&stream, 1));

    so::SessionOptions options;
    options.grad_dtype = so::DType::Bf16;
    options.accum_dtype = so::DType::Bf16;
    so::Session session = so::Session::create_cuda(options);
    session.set_compute_stream(stream);
    std::uint32_t group = session.add_group(so::GroupHparams{});
    session.add_subgroup_cuda(group, master.data(), n, {{"w", 0, n}}, d_param, so::DType::Bf16);
    CHECK(session.pinned_bytes() > 0);
    CHECK(session.copy_stream() != nullptr);
    session.begin_step();
    so::Ticket spec = session.grad_device(0, d_grad, n, so::DType::Bf16, stream);
    CHECK(spec != 0);
    so::Ticket done = session.step();
    session.enqueue_wait(session.final_ticket(0), stream);
    CU_CHECK(cu.dtoh_async(back.data(), d_param, n * 2, stream));
    CU_CHECK(cu.stream_sync(stream));
    session.wait(done);
    for (std::size_t i = 0; i < n; i++) CHECK(back[i] == so_f32_to_bf16(master[i]));
    CHECK(master[0] < 0.25f);
    bool refused = false;
    try {
        session.grad_device(0, d_grad, n, so::DType::F32, stream);
    } catch (const so::Error& e) {
        refused = e.status() == SO_STATUS_INVALID_STATE; // no step has begun
    }
    CHECK(refused);
    session.reset();
    CU_CHECK(cu.stream_destroy(stream));
    CU_CHECK(cu.mem_free(d_param));
    CU_CHECK(cu.mem_free(d_grad));
    std::printf("gpu_cpp_session: ok\n");
    return 0;
}
