/**
 * @file superoffload/cuda.hpp
 * @brief CUDA sessions: CudaOptions, cuda_available(), and Session's CUDA calls
 *        (create_cuda, add_subgroup_cuda, grad_device, streams, placement, device memory).
 *
 * The library loads the CUDA driver at run time, so these compile and link without CUDA;
 * without a driver or device they throw Error `SO_STATUS_CUDA_UNAVAILABLE`. Included by
 * superoffload/session.hpp (which declares the Session members); including this file alone
 * includes that one too.
 */
#ifndef SUPEROFFLOAD_CUDA_HPP
#define SUPEROFFLOAD_CUDA_HPP

#include "session.hpp"

#include <cstddef>
#include <cstdint>
#include <optional>

namespace superoffload {

/**
 * How a CUDA session moves data: `so_cuda_options` (`device`, `piece_bytes`; documented
 * there), initialised by `so_cuda_options_default()` (device 0, 16 MiB pieces).
 * Ownership: a plain value.
 */
struct CudaOptions : detail::CStruct<so_cuda_options, so_cuda_options_default> {
    using CStruct::CStruct;
};

/** Whether CUDA can be used here (`so_cuda_available`: the driver loads, a device exists). @note Never throws. */
[[nodiscard]] inline bool cuda_available() noexcept { return so_cuda_available() == SO_STATUS_OK; }

inline Session Session::create_cuda(const SessionOptions& options) { return create_cuda(options, CudaOptions()); }

inline Session Session::create_cuda(const SessionOptions& options, const CudaOptions& cuda) {
    so_session* out = nullptr;
    check(so_session_create_cuda(&options, &cuda, &out));
    return adopt(out, static_cast<DType>(options.grad_dtype), static_cast<DType>(options.accum_dtype));
}

/** @throws Error `SO_STATUS_UNSUPPORTED` (a host session, non-f32 master weights), and the others of the C call. */
inline void Session::set_placement(std::uint32_t subgroup, Placement placement) {
    check(so_session_set_placement(raw(), subgroup, placement));
}

/** @throws Error only for an empty handle. */
inline std::size_t Session::device_bytes() const {
    std::size_t bytes = 0;
    check(so_session_device_bytes(raw(), &bytes));
    return bytes;
}

/** @throws Error only for an empty handle. */
inline std::optional<std::uint64_t> Session::gpu_budget() const {
    std::uint64_t bytes = 0;
    check(so_session_gpu_budget(raw(), &bytes));
    if (bytes == SO_GPU_BUDGET_AUTO) return std::nullopt;
    return bytes;
}

/** @throws Error only for an empty handle. */
inline void Session::limit_device_memory(std::optional<std::uint64_t> limit_bytes) {
    check(so_session_limit_device_memory(raw(), limit_bytes.value_or(SO_DEVICE_MEMORY_UNLIMITED)));
}

/**
 * `numel` elements of `dtype` (the session's accumulation dtype); the copy to the host is
 * queued and this returns at once. The device buffer must stay valid until copy_stream() has
 * passed the copy (with PyTorch: `grad.record_stream(copy_stream)`).
 * @throws Error `SO_STATUS_INVALID_STATE` (outside backward), `SO_STATUS_INVALID_ARGUMENT`,
 *         `SO_STATUS_NOT_FOUND`, the CUDA statuses.
 */
inline Ticket Session::grad_device(std::uint32_t slice, so_device_ptr grad, std::size_t numel, DType dtype,
                                   so_cuda_stream_t stream) {
    Ticket ticket = no_ticket;
    check(so_session_grad_device(raw(), slice, grad, numel, dtype, stream, &ticket));
    return ticket;
}

/**
 * Publication waits for the work queued on `stream` before step().
 * @throws Error `SO_STATUS_INVALID_STATE` for a host session, `SO_STATUS_STREAM_CAPTURING`.
 */
inline void Session::set_compute_stream(so_cuda_stream_t stream) {
    check(so_session_set_compute_stream(raw(), stream));
}

/**
 * Waits on the host for a pending ticket, then makes `stream` wait for its publication.
 * @throws Error `SO_STATUS_NOT_FOUND` (a ticket never issued), the CUDA statuses.
 */
inline void Session::enqueue_wait(Ticket ticket, so_cuda_stream_t stream) const {
    check(so_ticket_enqueue_wait(raw(), ticket, stream));
}

/** Every gradient copy ends on it (for record_stream). @throws Error `SO_STATUS_INVALID_STATE` for a host session. */
inline so_cuda_stream_t Session::copy_stream() const {
    so_cuda_stream_t stream = nullptr;
    check(so_session_copy_stream(raw(), &stream));
    return stream;
}

/** @throws Error only for an empty handle. */
inline std::size_t Session::pinned_bytes() const {
    std::size_t bytes = 0;
    check(so_session_pinned_bytes(raw(), &bytes));
    return bytes;
}

} // namespace superoffload

#endif // SUPEROFFLOAD_CUDA_HPP
