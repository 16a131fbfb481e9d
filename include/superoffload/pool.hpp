/**
 * @file superoffload/pool.hpp
 * @brief Thread pools: PoolOptions, PoolInfo, the owning Pool and the non-owning PoolRef.
 */
#ifndef SUPEROFFLOAD_POOL_HPP
#define SUPEROFFLOAD_POOL_HPP

#include "error.hpp"
#include "handle.hpp"
#include "types.hpp"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace superoffload {

/**
 * How to create a Pool: `so_pool_options` (each field is documented there), initialised by
 * `so_pool_options_default()`, plus a core list it can own.
 *
 * `isa` takes an Isa (`options.isa = Isa::Portable`). `cores` either borrows (assign the
 * C fields `cores` and `num_cores`; the array must outlive Pool::create) or, through
 * set_cores(), points into a copy these options own (shared by their copies).
 *
 * Ownership: a value; see set_cores(). Thread-safety: a plain value.
 */
struct PoolOptions : detail::CStruct<so_pool_options, so_pool_options_default> {
    using CStruct::CStruct;

    /** The library's defaults (`so_pool_options_default()`). @note Never throws. */
    PoolOptions() noexcept = default;

    /**
     * The library's defaults with `threads` threads, so that `Pool::create({16})` asks for 16
     * unpinned threads. @note Never throws.
     */
    PoolOptions(std::size_t threads) noexcept : PoolOptions() { // NOLINT(google-explicit-constructor)
        num_threads = threads;
    }

    /**
     * Pins one thread to each of `core_list`, in order: copies the list into memory these
     * options own and points `cores` / `num_cores` at it (an empty list: unpinned threads).
     * @return *this. @throws std::bad_alloc only.
     */
    PoolOptions& set_cores(std::vector<std::uint32_t> core_list) {
        owned_cores_ = detail::Shared<std::vector<std::uint32_t>>(std::move(core_list));
        cores = owned_cores_.get()->empty() ? nullptr : owned_cores_.get()->data();
        num_cores = owned_cores_.get()->size();
        return *this;
    }

private:
    detail::Shared<std::vector<std::uint32_t>> owned_cores_;
};

/**
 * What a pool runs with: `so_pool_info` (`isa`, `num_threads`, `pinned`; documented there),
 * filled by Pool::info() / PoolRef::info(), plus the name of its instruction set.
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct PoolInfo : so_pool_info {
    /** All zero, `struct_size` set, ready to be filled by `so_pool_get_info`. @note Never throws. */
    PoolInfo() noexcept : so_pool_info{} { struct_size = sizeof(so_pool_info); }

    /** Static name of `isa` ("avx512", ...). @note Never throws. */
    [[nodiscard]] const char* isa_name() const noexcept { return so_isa_name(isa); }
};

namespace detail {
inline PoolInfo pool_info(const so_pool* pool) {
    PoolInfo info;
    check(so_pool_get_info(pool, &info));
    return info;
}
} // namespace detail

class PoolRef;

/**
 * An owned thread pool (`so_pool*`): move-only; destroying it calls `so_pool_destroy`, which
 * joins the pool's threads (once no session uses the pool any more). A default-constructed or
 * moved-from Pool is empty (raw() is nullptr); destroying, resetting or moving an empty Pool
 * is safe and does nothing.
 *
 * Thread-safety: kernels may run on one pool from any number of threads at once (pass the
 * Pool, or a PoolRef to it). The Pool object itself must not be moved, reset or destroyed
 * while another thread uses it.
 */
class Pool : public detail::OwnedHandle<Pool, so_pool, so_pool_destroy> {
public:
    /** An empty pool handle (nothing to destroy). @note Never throws. */
    Pool() noexcept = default;

    /**
     * Creates a pool (`so_pool_create`); its threads are started (and pinned, with a core
     * list) on return.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (core not allowed or listed twice, thread
     *         count disagreeing with the core list), `SO_STATUS_UNSUPPORTED` (ISA the CPU
     *         lacks), `SO_STATUS_OUT_OF_RESOURCES` (threads cannot start or be pinned).
     * @note Thread-safety: safe from any thread.
     */
    [[nodiscard]] static Pool create(const PoolOptions& options = {}) {
        so_pool* out = nullptr;
        check(so_pool_create(&options, &out));
        return adopt(out);
    }

    // adopt, operator bool, raw, release (the caller must then `so_pool_destroy` the handle)
    // and reset (which joins the pool's threads) are OwnedHandle's.

    /**
     * The pool's instruction set, thread count and pinning (`so_pool_get_info`).
     * @throws Error `SO_STATUS_NULL_ARGUMENT` if this handle is empty (it would otherwise
     *         silently describe the default pool).
     */
    [[nodiscard]] PoolInfo info() const;
};

/**
 * A non-owning reference to a pool, or to the process-wide default pool (`nullptr`, the
 * default). Every kernel function takes one: pass a Pool, a PoolRef, or `nullptr`.
 *
 * Ownership: borrows; the referenced Pool must outlive every call made through the
 * reference. The default pool is owned by the library and lives until the process exits.
 * Thread-safety: a PoolRef is a pointer; copies may be used from any number of threads.
 */
class PoolRef {
public:
    /** The process-wide default pool (created by the library on first use). */
    constexpr PoolRef() noexcept = default;
    /** The process-wide default pool. */
    constexpr PoolRef(std::nullptr_t) noexcept {} // NOLINT(google-explicit-constructor)

    /**
     * A reference to `pool`.
     * @throws Error `SO_STATUS_NULL_ARGUMENT` if `pool` is empty (moved from), rather than
     *         running on the default pool by accident.
     */
    PoolRef(const Pool& pool) : raw_(pool.raw()) { // NOLINT(google-explicit-constructor)
        if (raw_ == nullptr) {
            throw Error(SO_STATUS_NULL_ARGUMENT,
                        "superoffload::PoolRef: the Pool is empty (default-constructed or "
                        "moved from); pass nullptr to mean the default pool");
        }
    }

    /** Refused: a reference to a temporary Pool would dangle. */
    PoolRef(Pool&&) = delete;

    /** A reference to a C handle; nullptr means the default pool. @note Never throws. */
    [[nodiscard]] static constexpr PoolRef from_raw(const so_pool* raw) noexcept { return PoolRef(raw, 0); }

    /** The C handle (nullptr for the default pool). @note Never throws. */
    [[nodiscard]] constexpr const so_pool* raw() const noexcept { return raw_; }

    /** Whether this refers to the process-wide default pool. @note Never throws. */
    [[nodiscard]] constexpr bool is_default() const noexcept { return raw_ == nullptr; }

    /**
     * The pool's instruction set, thread count and pinning (the default pool is created
     * here if it does not exist yet).
     * @throws Error if the default pool cannot be created.
     */
    [[nodiscard]] PoolInfo info() const { return detail::pool_info(raw_); }

private:
    constexpr PoolRef(const so_pool* raw, int) noexcept : raw_(raw) {}
    const so_pool* raw_ = nullptr;
};

inline PoolInfo Pool::info() const { return PoolRef(*this).info(); }

} // namespace superoffload

#endif // SUPEROFFLOAD_POOL_HPP
