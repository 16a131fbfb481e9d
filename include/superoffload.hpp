/**
 * @file superoffload.hpp
 * @brief Header-only C++17 wrapper over the superoffload C ABI (`superoffload.h`).
 *
 * Everything here is `inline` and calls only the C functions, so a program built with this
 * header links against the same `libsuperoffload.so.0` as a C program would; the C++ ABI
 * (compiler, standard library, `_GLIBCXX_USE_CXX11_ABI`) never matters. The header keeps no
 * state of its own.
 *
 * Error handling: every function documented as "Throws" raises superoffload::Error, which
 * carries the `so_status` of the failing C call and the message of `so_last_error_message`
 * read right after it. Functions marked `noexcept` never fail.
 *
 * Thread-safety: as the C functions underneath. Kernels may be called from any number of
 * threads at once on disjoint buffers; a Pool may be used from many threads at once, but one
 * Pool object (the handle) must not be moved, reset or destroyed while another thread uses it.
 * The same holds for a Session (whose calls the library serialises).
 *
 * Sessions (superoffload::Session, the `so_session_*` and `so_ticket_*` functions): a wait
 * that times out is not an error. Waiting calls without a Timeout wait forever; with one,
 * they return `bool` or `std::optional`, false or empty when the timeout expired. See the
 * "Sessions" section.
 *
 * @code
 *   namespace so = superoffload;
 *   if (!so::abi_compatible()) throw std::runtime_error("wrong libsuperoffload");
 *   so::Pool pool = so::Pool::create({16});  // 16 threads, unpinned
 *   so::Hparams hp;                       // torch.optim.AdamW defaults, step 1
 *   so::AdamBuffers bufs(p, g, m, v, n);  // float* p, const so::bf16* g, float* m, float* v
 *   bufs.with_param_copy(p_bf16);         // so::bf16*
 *   so::UpdateOptions opts;
 *   opts.compute_grad_sumsq = true;
 *   double sumsq = *so::adam_update(pool, hp, bufs, opts);
 *
 *   so::SessionOptions so_opts;                 // AdamW, f32 everything, speculation on
 *   so_opts.pool = pool;
 *   so::Session session = so::Session::create(so_opts);
 *   std::uint32_t g = session.add_group();       // torch.optim.AdamW defaults
 *   session.add_subgroup(g, master, {{"w", 0, 1000}, {"b", 1000, 10}});  // std::vector<float>
 *   const std::uint32_t w = session.slice_id("w"), b = session.slice_id("b");
 *   session.begin_step();
 *   session.grad_copy(b, grad_b);                // containers of the session's grad dtype
 *   session.grad_copy(w, grad_w);                // completes the sub-group: speculative step
 *   so::StepArgs args;
 *   args.max_norm = 1.0;
 *   const so::StepResult r = session.step_result(session.step(args));
 * @endcode
 */
#ifndef SUPEROFFLOAD_HPP
#define SUPEROFFLOAD_HPP

#include "superoffload.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if __cplusplus < 201703L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 201703L)
#error "superoffload.hpp needs C++17 or newer"
#endif

/** The C++ interface of superoffload. */
namespace superoffload {

// ------------------------------------------------------------------------------------------
// Versions
// ------------------------------------------------------------------------------------------

/** The ABI version of the header this program was compiled with (`SO_ABI_VERSION`). */
inline constexpr std::uint32_t header_abi_version = SO_ABI_VERSION;

/**
 * The ABI version of the library actually loaded (`so_abi_version()`).
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline std::uint32_t abi_version() noexcept { return so_abi_version(); }

/**
 * Whether the loaded library implements the ABI this header describes
 * (`so_abi_version() == SO_ABI_VERSION`). Check it once at start-up.
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline bool abi_compatible() noexcept { return so_abi_version() == SO_ABI_VERSION; }

/**
 * The loaded library's version, e.g. "0.1.0" (a static string; do not free it).
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline const char* version_string() noexcept { return so_version_string(); }

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

/**
 * A static description of a status value ("success", ...; "unknown status" otherwise).
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline const char* status_str(so_status status) noexcept {
    return so_status_str(static_cast<std::uint32_t>(status));
}

/**
 * The message of the most recent failed C call on this thread (`so_last_error_message`),
 * or an empty string if none has failed.
 * @note Thread-safety: the message is thread-local. Throws only std::bad_alloc.
 */
[[nodiscard]] inline std::string last_error_message() {
    char small[256];
    const std::size_t len = so_last_error_message(small, sizeof small);
    if (len < sizeof small) {
        return std::string(small, len);
    }
    std::vector<char> big(len + 1);
    const std::size_t again = so_last_error_message(big.data(), big.size());
    return std::string(big.data(), std::min(again, len));
}

/**
 * The exception every failing wrapper call throws: the C status plus the library's message
 * (e.g. "so_adam_update: buffers->param is NULL"), which is also what `what()` returns.
 *
 * Ownership: a plain value; copying it copies the message.
 * Thread-safety: as any exception object; it does not refer to library state.
 */
class Error : public std::runtime_error {
public:
    /** An error with `status` (never `SO_STATUS_OK` when thrown by this header) and `message`. */
    Error(so_status status, const std::string& message) : std::runtime_error(message), status_(status) {}

    /** The status of the failed call. */
    [[nodiscard]] so_status status() const noexcept { return status_; }

    /** The static description of status() (`so_status_str`). */
    [[nodiscard]] const char* status_description() const noexcept { return status_str(status_); }

private:
    so_status status_;
};

/**
 * Throws Error if `status` is not `SO_STATUS_OK`. Call it directly on the status of a C call:
 * the message is read from this thread's last error, so no other library call may come
 * in between. When the library left no message, the status description is used.
 * @throws Error with `status`.
 */
inline void check(so_status status) {
    if (status != SO_STATUS_OK) {
        std::string message = last_error_message();
        if (message.empty()) {
            message = status_str(status);
        }
        throw Error(status, message);
    }
}

// ------------------------------------------------------------------------------------------
// Enumerations and element types
// ------------------------------------------------------------------------------------------

/** Instruction set of a pool's kernels (`so_isa`). */
enum class Isa : std::uint32_t {
    Auto = SO_ISA_AUTO,         ///< The widest the CPU supports (only when creating a pool).
    Portable = SO_ISA_PORTABLE, ///< Plain code, one lane; runs on every CPU.
    Avx2 = SO_ISA_AVX2,         ///< x86-64 AVX2 + FMA + F16C, 8 lanes.
    Avx512 = SO_ISA_AVX512,     ///< x86-64 AVX-512F, 16 lanes.
};

/**
 * A static name for an instruction set ("portable", "avx2", "avx512", "auto").
 * @note Never throws.
 */
[[nodiscard]] inline const char* isa_name(Isa isa) noexcept { return so_isa_name(static_cast<std::uint32_t>(isa)); }

/** How weight decay enters a step (`so_adam_mode`). */
enum class Mode : std::uint32_t {
    AdamW = SO_ADAM_MODE_ADAMW, ///< Decoupled decay `p <- p * (1 - lr * wd)` (torch AdamW).
    L2 = SO_ADAM_MODE_L2,       ///< L2 regularisation `g <- g + wd * p` (torch Adam).
};

/** Whether sub-groups are stepped during backward (`so_speculation`). */
enum class Speculation : std::uint32_t {
    Off = SO_SPECULATION_OFF,   ///< Every sub-group is stepped once, after step() decides.
    On = SO_SPECULATION_ON,     ///< Every sub-group that can speculate does.
    Auto = SO_SPECULATION_AUTO, ///< Decided per step from earlier steps' measurements (default).
};

/** Where a sub-group's master weights and moments live (`so_placement`). */
enum class Placement : std::uint32_t {
    Host = SO_PLACEMENT_HOST,     ///< Host memory, stepped by the CPU kernels.
    Device = SO_PLACEMENT_DEVICE, ///< GPU memory, stepped by the library's GPU kernel.
};

/** Element type of a buffer (`so_dtype`). */
enum class DType : std::uint32_t {
    None = SO_DTYPE_NONE, ///< No buffer (optional buffers only).
    F32 = SO_DTYPE_F32,   ///< IEEE binary32 (`float`).
    Bf16 = SO_DTYPE_BF16, ///< bfloat16 (superoffload::bf16).
    F16 = SO_DTYPE_F16,   ///< IEEE binary16 (superoffload::f16).
};

namespace detail {
inline std::uint32_t float_bits(float x) noexcept {
    std::uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
inline float bits_float(std::uint32_t u) noexcept {
    float x;
    std::memcpy(&x, &u, sizeof x);
    return x;
}
} // namespace detail

/**
 * A bfloat16 storage element: the upper 16 bits of a binary32. Trivial, 2 bytes, so arrays of
 * it can be handed to the library (and to frameworks' bf16 tensors) as they are.
 * The conversions are the library's: round to nearest even, every NaN to 0x7FC0.
 */
struct bf16 {
    std::uint16_t bits; ///< The raw bits.

    /** The element with these raw bits. @note Never throws. */
    static constexpr bf16 from_bits(std::uint16_t raw) noexcept { return bf16{raw}; }

    /** `x` rounded to nearest even; overflow gives inf, NaN gives 0x7FC0. @note Never throws. */
    static bf16 from_float(float x) noexcept {
        const std::uint32_t u = detail::float_bits(x);
        if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
            return bf16{0x7FC0u};
        }
        const std::uint32_t half_ulp_even = 0x7FFFu + ((u >> 16) & 1u);
        return bf16{static_cast<std::uint16_t>((u + half_ulp_even) >> 16)};
    }

    /** The exact binary32 value. @note Never throws. */
    [[nodiscard]] float to_float() const noexcept { return detail::bits_float(static_cast<std::uint32_t>(bits) << 16); }

    /** Bitwise equality (so +0 != -0 and a NaN equals itself). */
    friend constexpr bool operator==(bf16 a, bf16 b) noexcept { return a.bits == b.bits; }
    /** Bitwise inequality. */
    friend constexpr bool operator!=(bf16 a, bf16 b) noexcept { return a.bits != b.bits; }
};

/**
 * An IEEE binary16 storage element. Trivial, 2 bytes. The conversions are the library's:
 * round to nearest even (subnormals included), overflow to inf; a NaN stays a NaN with its
 * sign and top payload bits, quieted.
 */
struct f16 {
    std::uint16_t bits; ///< The raw bits.

    /** The element with these raw bits. @note Never throws. */
    static constexpr f16 from_bits(std::uint16_t raw) noexcept { return f16{raw}; }

    /** `x` rounded to nearest even binary16. @note Never throws. */
    static f16 from_float(float x) noexcept {
        const std::uint32_t u = detail::float_bits(x);
        const std::uint32_t sign = (u >> 16) & 0x8000u;
        const std::uint32_t mag = u & 0x7FFFFFFFu;
        std::uint32_t h;
        if (mag > 0x7F800000u) {
            h = 0x7E00u | ((mag >> 13) & 0x3FFu); // NaN: quiet, top payload bits kept
        } else if (mag >= 0x47800000u) {
            h = 0x7C00u; // |x| >= 2^16 or inf
        } else if (mag >= 0x38800000u) {
            // Normal binary16 range: rebias 127 -> 15, round away the 13 low bits to even. A
            // carry out of the mantissa moves to the next exponent (up to inf), as it should.
            const std::uint32_t rebased = mag - (112u << 23);
            h = (rebased + 0x0FFFu + ((rebased >> 13) & 1u)) >> 13;
        } else {
            // Subnormal binary16 (or zero): count units of 2^-24, rounded to nearest even.
            const std::uint32_t exp = mag >> 23;
            const std::uint32_t shift = 126u - exp; // >= 14 here
            if (exp == 0 || shift >= 25u) {
                h = 0; // below half of the smallest subnormal (2^-25 itself ties to 0)
            } else {
                const std::uint32_t mant = (mag & 0x7FFFFFu) | 0x800000u;
                h = mant >> shift;
                const std::uint32_t rest = mant & ((1u << shift) - 1u);
                const std::uint32_t half = 1u << (shift - 1u);
                if (rest > half || (rest == half && (h & 1u) != 0)) {
                    ++h;
                }
            }
        }
        return f16{static_cast<std::uint16_t>(sign | h)};
    }

    /** The exact binary32 value (a signalling NaN comes back quieted). @note Never throws. */
    [[nodiscard]] float to_float() const noexcept {
        const std::uint32_t sign = (static_cast<std::uint32_t>(bits) & 0x8000u) << 16;
        const std::uint32_t exp = (bits >> 10) & 0x1Fu;
        const std::uint32_t mant = bits & 0x3FFu;
        if (exp == 0) {
            const float magnitude = static_cast<float>(mant) * (1.0f / 16777216.0f); // exact
            return sign != 0 ? -magnitude : magnitude;
        }
        if (exp == 0x1Fu) {
            return detail::bits_float(sign | 0x7F800000u | (mant << 13) | (mant != 0 ? 0x400000u : 0u));
        }
        return detail::bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
    }

    /** Bitwise equality. */
    friend constexpr bool operator==(f16 a, f16 b) noexcept { return a.bits == b.bits; }
    /** Bitwise inequality. */
    friend constexpr bool operator!=(f16 a, f16 b) noexcept { return a.bits != b.bits; }
};

static_assert(sizeof(bf16) == 2 && alignof(bf16) == 2 && std::is_trivial<bf16>::value, "bf16 layout");
static_assert(sizeof(f16) == 2 && alignof(f16) == 2 && std::is_trivial<f16>::value, "f16 layout");

/**
 * `dtype_of<T>::value` is the DType of element type `T` (float, bf16, f16). Other types have
 * no `value`, so they are rejected at compile time (also by SFINAE).
 */
template <class T>
struct dtype_of {};
/** float is SO_DTYPE_F32. */
template <>
struct dtype_of<float> : std::integral_constant<DType, DType::F32> {};
/** bf16 is SO_DTYPE_BF16. */
template <>
struct dtype_of<bf16> : std::integral_constant<DType, DType::Bf16> {};
/** f16 is SO_DTYPE_F16. */
template <>
struct dtype_of<f16> : std::integral_constant<DType, DType::F16> {};

/** Whether `T` is a storage element of the library (float, bf16, f16; not const). */
template <class T, class = void>
struct is_element : std::false_type {};
/** @copydoc is_element */
template <class T>
struct is_element<T, std::void_t<decltype(dtype_of<T>::value)>> : std::true_type {};
/** @copydoc is_element */
template <class T>
inline constexpr bool is_element_v = is_element<T>::value;
/** Whether `T` can hold the moments (float or bf16). */
template <class T>
inline constexpr bool is_moment_element_v = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
/** Whether `T` can hold the low-precision parameter copy (bf16 or f16). */
template <class T>
inline constexpr bool is_copy_element_v = std::is_same_v<T, bf16> || std::is_same_v<T, f16>;

// ------------------------------------------------------------------------------------------
// Pools
// ------------------------------------------------------------------------------------------

/**
 * How to create a Pool (the C++ form of `so_pool_options`; defaults are the library's).
 * Ownership: a plain value; the core list is copied by Pool::create.
 */
struct PoolOptions {
    /** Threads; 0 means one per listed core, or else one per CPU this process may run on. */
    std::size_t threads = 0;
    /** Cores to pin one thread each to, in order; empty for unpinned threads. */
    std::vector<std::uint32_t> cores = {};
    /** Instruction set; Isa::Auto picks the widest the CPU supports. */
    Isa isa = Isa::Auto;
};

/** What a pool runs with (the C++ form of `so_pool_info`). */
struct PoolInfo {
    Isa isa;              ///< Never Isa::Auto.
    const char* isa_name; ///< Static name of `isa` ("avx512", ...).
    std::size_t threads;  ///< Worker threads.
    bool pinned;          ///< Whether each thread is pinned to one core.
};

namespace detail {
inline PoolInfo pool_info(const so_pool* pool) {
    so_pool_info raw{};
    raw.struct_size = sizeof raw;
    check(so_pool_get_info(pool, &raw));
    return PoolInfo{static_cast<Isa>(raw.isa), so_isa_name(raw.isa), raw.num_threads, raw.pinned};
}
} // namespace detail

class PoolRef;

/**
 * An owned thread pool (`so_pool*`): move-only; destroying it calls `so_pool_destroy`, which
 * joins the pool's threads. A default-constructed or moved-from Pool is empty (raw() is
 * nullptr); destroying, resetting or moving an empty Pool is safe and does nothing.
 *
 * Thread-safety: kernels may run on one pool from any number of threads at once (pass the
 * Pool, or a PoolRef to it). The Pool object itself must not be moved, reset or destroyed
 * while another thread uses it.
 */
class Pool {
public:
    /** An empty pool handle (nothing to destroy). @note Never throws. */
    Pool() noexcept = default;

    /**
     * Creates a pool; its threads are started (and pinned, with a core list) on return.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (core not allowed or listed twice, thread
     *         count disagreeing with the core list), `SO_STATUS_UNSUPPORTED` (ISA the CPU
     *         lacks), `SO_STATUS_OUT_OF_RESOURCES` (threads cannot start or be pinned).
     */
    [[nodiscard]] static Pool create(const PoolOptions& options = {}) {
        so_pool_options raw = so_pool_options_default();
        raw.num_threads = options.threads;
        raw.cores = options.cores.empty() ? nullptr : options.cores.data();
        raw.num_cores = options.cores.size();
        raw.isa = static_cast<std::uint32_t>(options.isa);
        so_pool* out = nullptr;
        check(so_pool_create(&raw, &out));
        return adopt(out);
    }

    /**
     * Takes ownership of a handle from `so_pool_create` (or nullptr, giving an empty Pool).
     * @note Never throws.
     */
    [[nodiscard]] static Pool adopt(so_pool* raw) noexcept {
        Pool pool;
        pool.handle_.reset(raw);
        return pool;
    }

    /** Whether this handle owns a pool. @note Never throws. */
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    /** The C handle, still owned by this object (nullptr when empty). @note Never throws. */
    [[nodiscard]] so_pool* raw() const noexcept { return handle_.get(); }

    /** Gives up ownership: returns the C handle (the caller must `so_pool_destroy` it). */
    [[nodiscard]] so_pool* release() noexcept { return handle_.release(); }

    /** Destroys the owned pool now (joining its threads), leaving this handle empty. */
    void reset() noexcept { handle_.reset(); }

    /**
     * The pool's instruction set, thread count and pinning.
     * @throws Error `SO_STATUS_NULL_ARGUMENT` if this handle is empty (it would otherwise
     *         silently describe the default pool).
     */
    [[nodiscard]] PoolInfo info() const;

private:
    struct Deleter {
        void operator()(so_pool* pool) const noexcept { so_pool_destroy(pool); }
    };
    std::unique_ptr<so_pool, Deleter> handle_;
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
            throw Error(SO_STATUS_NULL_ARGUMENT, "superoffload::PoolRef: the Pool is empty (default-constructed or "
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

// ------------------------------------------------------------------------------------------
// Hyperparameters, options, buffers
// ------------------------------------------------------------------------------------------

/**
 * Hyperparameters of one step (the C++ form of `so_adam_hparams`). Default-constructed, it
 * holds the library's defaults (`so_adam_hparams_default()`: torch.optim.AdamW's, step 1).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct Hparams {
    Mode mode;            ///< How weight decay enters the step.
    double lr;             ///< Learning rate, finite and >= 0.
    double beta1;          ///< First-moment decay, in [0, 1).
    double beta2;          ///< Second-moment decay, in [0, 1).
    double eps;            ///< Added to the bias-corrected sqrt(v), finite and >= 0.
    double weight_decay;   ///< Finite and >= 0 (0 disables it).
    bool bias_correction; ///< Divide the moments by 1 - beta^t.
    std::uint64_t step;   ///< The step being taken (or undone), counting from 1.

    /** The library's defaults. @note Never throws. */
    Hparams() noexcept : Hparams(so_adam_hparams_default()) {}

    /** The values of a C struct (its struct_size is not kept). @note Never throws. */
    explicit Hparams(const so_adam_hparams& raw) noexcept
        : mode(static_cast<Mode>(raw.mode)), lr(raw.lr), beta1(raw.beta1), beta2(raw.beta2), eps(raw.eps),
          weight_decay(raw.weight_decay), bias_correction(raw.bias_correction), step(raw.step) {}

    /** The C struct, with struct_size set. @note Never throws. */
    [[nodiscard]] so_adam_hparams to_c() const noexcept {
        so_adam_hparams raw = so_adam_hparams_default();
        raw.mode = static_cast<std::uint32_t>(mode);
        raw.lr = lr;
        raw.beta1 = beta1;
        raw.beta2 = beta2;
        raw.eps = eps;
        raw.weight_decay = weight_decay;
        raw.bias_correction = bias_correction;
        raw.step = step;
        return raw;
    }
};

/**
 * Options of adam_update (`so_update_options` plus whether to return the gradient's sum of
 * squares). Default-constructed, it holds `so_update_options_default()` (scale 1, no check)
 * and does not ask for the sum of squares.
 */
struct UpdateOptions {
    float grad_scale;                ///< Multiplies each gradient element as loaded; finite, > 0.
    bool check_finite;               ///< Refuse (SO_STATUS_NON_FINITE) a non-finite scaled gradient.
    bool compute_grad_sumsq = false; ///< Return the f64 sum of squares of the scaled gradient.

    /** The library's defaults, no sum of squares. @note Never throws. */
    UpdateOptions() noexcept : UpdateOptions(so_update_options_default()) {}

    /** The values of a C struct. @note Never throws. */
    explicit UpdateOptions(const so_update_options& raw) noexcept
        : grad_scale(raw.grad_scale), check_finite(raw.check_finite) {}

    /** The C struct, with struct_size set. @note Never throws. */
    [[nodiscard]] so_update_options to_c() const noexcept {
        so_update_options raw = so_update_options_default();
        raw.grad_scale = grad_scale;
        raw.check_finite = check_finite;
        return raw;
    }
};

/**
 * Typed buffers of one step: fills `so_adam_buffers` with the dtype codes of the element
 * types, so that a dtype mistake (a bf16 array passed as f32, moments of two types, f16
 * moments, an f32 copy-out) is a compile error. With class template argument deduction,
 * `AdamBuffers bufs(p, g, m, v, n)` picks the types from the pointers.
 *
 * @tparam P parameter element (float, bf16, f16)
 * @tparam G gradient element (float, bf16, f16), independent of P
 * @tparam M element of both moments (float or bf16)
 *
 * Ownership: borrows every array; they must stay valid, hold `size()` elements each, be
 * disjoint, and not be accessed by anything else during a call that uses these buffers.
 * Thread-safety: a plain value of pointers.
 */
template <class P, class G = P, class M = float>
class AdamBuffers {
    static_assert(is_element_v<P>, "the parameter element must be float, superoffload::bf16 or superoffload::f16");
    static_assert(is_element_v<G>, "the gradient element must be float, superoffload::bf16 or superoffload::f16");
    static_assert(is_moment_element_v<M>, "the moments must be float or superoffload::bf16");

public:
    using param_type = P;  ///< Parameter element.
    using grad_type = G;   ///< Gradient element.
    using moment_type = M; ///< Moment element.

    /**
     * `numel` elements of each buffer, no parameter copy. Nothing is checked here; the library
     * checks NULL, alignment and overlap at the call. @note Never throws.
     */
    AdamBuffers(P* param, const G* grad, M* exp_avg, M* exp_avg_sq, std::size_t numel) noexcept
        : raw_(so_adam_buffers_default()) {
        raw_.numel = numel;
        raw_.param = param;
        raw_.grad = grad;
        raw_.exp_avg = exp_avg;
        raw_.exp_avg_sq = exp_avg_sq;
        raw_.param_dtype = static_cast<std::uint32_t>(dtype_of<P>::value);
        raw_.grad_dtype = static_cast<std::uint32_t>(dtype_of<G>::value);
        raw_.moment_dtype = static_cast<std::uint32_t>(dtype_of<M>::value);
        raw_.param_copy = nullptr;
        raw_.param_copy_dtype = SO_DTYPE_NONE;
    }

    /**
     * Also writes the updated parameter to `copy` (size() elements of bf16 or f16) in the same
     * pass. @return *this. @note Never throws.
     */
    template <class C>
    AdamBuffers& with_param_copy(C* copy) noexcept {
        static_assert(is_copy_element_v<C>, "the parameter copy must be superoffload::bf16 or superoffload::f16");
        raw_.param_copy = copy;
        raw_.param_copy_dtype = static_cast<std::uint32_t>(dtype_of<C>::value);
        return *this;
    }

    /** Drops the parameter copy. @return *this. @note Never throws. */
    AdamBuffers& without_param_copy() noexcept {
        raw_.param_copy = nullptr;
        raw_.param_copy_dtype = SO_DTYPE_NONE;
        return *this;
    }

    /** Elements in every buffer. @note Never throws. */
    [[nodiscard]] std::size_t size() const noexcept { return raw_.numel; }

    /** The dtype of the parameter copy (DType::None without one). @note Never throws. */
    [[nodiscard]] DType param_copy_dtype() const noexcept { return static_cast<DType>(raw_.param_copy_dtype); }

    /** The C struct, for the C functions or the raw overloads here. @note Never throws. */
    [[nodiscard]] const so_adam_buffers& raw() const noexcept { return raw_; }

private:
    so_adam_buffers raw_;
};

/**
 * AdamBuffers over four contiguous containers (anything with `data()` and `size()`, such
 * as std::vector), element types deduced from them.
 * @throws Error `SO_STATUS_INVALID_ARGUMENT` if the sizes differ.
 */
template <class PC, class GC, class MC1, class MC2>
[[nodiscard]] auto make_adam_buffers(PC& param, const GC& grad, MC1& exp_avg, MC2& exp_avg_sq)
    -> AdamBuffers<std::remove_pointer_t<decltype(param.data())>,
                   std::remove_const_t<std::remove_pointer_t<decltype(grad.data())>>,
                   std::remove_pointer_t<decltype(exp_avg.data())>> {
    const std::size_t n = param.size();
    if (grad.size() != n || exp_avg.size() != n || exp_avg_sq.size() != n) {
        throw Error(SO_STATUS_INVALID_ARGUMENT,
                    "superoffload::make_adam_buffers: sizes differ: param " + std::to_string(n) + ", grad " +
                        std::to_string(grad.size()) + ", exp_avg " + std::to_string(exp_avg.size()) +
                        ", exp_avg_sq " + std::to_string(exp_avg_sq.size()));
    }
    return {param.data(), grad.data(), exp_avg.data(), exp_avg_sq.data(), n};
}

// ------------------------------------------------------------------------------------------
// Kernels
// ------------------------------------------------------------------------------------------

/**
 * One Adam step in one pass (`so_adam_update`), on untyped C buffers.
 * @return The f64 sum of squares of the scaled gradient if `options.compute_grad_sumsq`,
 *         else std::nullopt.
 * @throws Error `SO_STATUS_NON_FINITE` (with `check_finite`; nothing was modified), or an
 *         argument error (NULL, dtype, range, alignment, overlap; nothing was modified).
 * @note Thread-safety: any number of threads at once on disjoint buffers.
 */
inline std::optional<double> adam_update(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers,
                                         const UpdateOptions& options = {}) {
    const so_adam_hparams hp = hparams.to_c();
    const so_update_options opts = options.to_c();
    double sumsq = 0.0;
    check(so_adam_update(pool.raw(), &hp, &buffers, &opts, options.compute_grad_sumsq ? &sumsq : nullptr));
    if (options.compute_grad_sumsq) {
        return sumsq;
    }
    return std::nullopt;
}

/** @copydoc adam_update(PoolRef, const Hparams&, const so_adam_buffers&, const UpdateOptions&) */
template <class P, class G, class M>
std::optional<double> adam_update(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers,
                                  const UpdateOptions& options = {}) {
    return adam_update(pool, hparams, buffers.raw(), options);
}

/**
 * Undoes one adam_update taken with the same gradient, `grad_scale` and hyperparameters
 * (`so_adam_rollback`), on untyped C buffers (f32 param and moments).
 * @throws Error `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an argument error;
 *         nothing was modified.
 * @note Thread-safety: as adam_update.
 */
inline void adam_rollback(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers,
                          float grad_scale = 1.0f) {
    const so_adam_hparams hp = hparams.to_c();
    check(so_adam_rollback(pool.raw(), &hp, &buffers, grad_scale));
}

/**
 * @copydoc adam_rollback(PoolRef, const Hparams&, const so_adam_buffers&, float)
 * Typed form: only for float parameters and float moments (anything else does not compile).
 */
template <class P, class G, class M, std::enable_if_t<std::is_same_v<P, float> && std::is_same_v<M, float>, int> = 0>
void adam_rollback(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers, float grad_scale = 1.0f) {
    adam_rollback(pool, hparams, buffers.raw(), grad_scale);
}

/**
 * Turns a step taken on `old_scale * g` into the step on `new_scale * g` from the same
 * starting state (`so_adam_rescale`), on untyped C buffers (f32 param and moments).
 * @throws Error `SO_STATUS_UNSUPPORTED` for non-f32 param or moments, or an argument error;
 *         nothing was modified.
 * @note Thread-safety: as adam_update.
 */
inline void adam_rescale(PoolRef pool, const Hparams& hparams, const so_adam_buffers& buffers, float old_scale,
                         float new_scale) {
    const so_adam_hparams hp = hparams.to_c();
    check(so_adam_rescale(pool.raw(), &hp, &buffers, old_scale, new_scale));
}

/**
 * @copydoc adam_rescale(PoolRef, const Hparams&, const so_adam_buffers&, float, float)
 * Typed form: only for float parameters and float moments (anything else does not compile).
 */
template <class P, class G, class M, std::enable_if_t<std::is_same_v<P, float> && std::is_same_v<M, float>, int> = 0>
void adam_rescale(PoolRef pool, const Hparams& hparams, const AdamBuffers<P, G, M>& buffers, float old_scale,
                  float new_scale) {
    adam_rescale(pool, hparams, buffers.raw(), old_scale, new_scale);
}

/**
 * f64 sum of squares of `scale * grad` (`so_grad_sumsq`): the value adam_update reports for
 * the same gradient and scale. Not finite iff an element is inf or NaN.
 * @throws Error for a NULL `grad` with `numel > 0`, a bad dtype or scale.
 * @note Thread-safety: safe from any thread.
 */
[[nodiscard]] inline double grad_sumsq(PoolRef pool, const void* grad, DType dtype, std::size_t numel,
                                       float scale = 1.0f) {
    double out = 0.0;
    check(so_grad_sumsq(pool.raw(), grad, static_cast<std::uint32_t>(dtype), numel, scale, &out));
    return out;
}

/** @copydoc grad_sumsq(PoolRef, const void*, DType, std::size_t, float) Typed form. */
template <class G, std::enable_if_t<is_element_v<G>, int> = 0>
[[nodiscard]] double grad_sumsq(PoolRef pool, const G* grad, std::size_t numel, float scale = 1.0f) {
    return grad_sumsq(pool, static_cast<const void*>(grad), dtype_of<G>::value, numel, scale);
}

// ------------------------------------------------------------------------------------------
// Sessions
// ------------------------------------------------------------------------------------------
//
// Waiting, timeouts and errors in the session API:
//
// - Every call that waits comes in two forms. Without a Timeout argument it waits forever
//   (the default) and returns its value; with a Timeout it returns `bool` (wait, wait_all) or
//   `std::optional` (step_result, local_grad_sumsq), which is false / empty iff the timeout
//   expired. An expired timeout is never an exception: nothing was changed, call again to
//   keep waiting.
// - Everything else that fails throws superoffload::Error, with the status and message of the
//   C call (misuse, unknown ids, and the failure of the awaited work itself, e.g.
//   `SO_STATUS_NON_FINITE` from a speculative step).
// - Session::query never waits and never throws for the state of a ticket: it returns
//   TicketStatus (done, pending, or failed with the work's Error).

/**
 * A ticket (`so_ticket`): a number in a per-session sequence, from 1, of work items that
 * complete in order. 0 (superoffload::no_ticket) means "no work" and is always complete.
 */
using Ticket = so_ticket;

/** The ticket meaning "no work was queued"; always complete. */
inline constexpr Ticket no_ticket = 0;

/**
 * How long a waiting call may wait. Converts implicitly from any std::chrono::duration;
 * default-constructed (superoffload::forever) it waits without limit.
 *
 * Conversion from a duration: rounded up to whole nanoseconds (a wait never gives up before
 * the duration has passed); zero, negative or NaN durations are an expired timeout, so the
 * call only polls (as with std::condition_variable::wait_for); 2^63 ns (about 292 years) or
 * more waits forever.
 *
 * Ownership: a plain value. Thread-safety: a plain value.
 */
class Timeout {
public:
    /** Waits forever. @note Never throws. */
    constexpr Timeout() noexcept = default;

    /** At most `d` (see the class comment for rounding and limits). @note Never throws. */
    template <class Rep, class Period>
    Timeout(const std::chrono::duration<Rep, Period>& d) noexcept // NOLINT(google-explicit-constructor)
        : ns_(from_duration(d)) {}

    /** Whether this waits without limit. @note Never throws. */
    [[nodiscard]] constexpr bool is_forever() const noexcept { return ns_ < 0; }

    /** The timeout as the C functions take it: nanoseconds, negative for forever. @note Never throws. */
    [[nodiscard]] constexpr std::int64_t c_ns() const noexcept { return ns_; }

private:
    template <class Rep, class Period>
    static std::int64_t from_duration(const std::chrono::duration<Rep, Period>& d) noexcept {
        const long double ns = std::chrono::duration<long double, std::nano>(d).count();
        if (!(ns > 0.0L)) {
            return 0;
        }
        if (ns >= 9223372036854775807.0L) {
            return -1;
        }
        return static_cast<std::int64_t>(std::ceil(ns));
    }

    std::int64_t ns_ = -1;
};

/** Wait without limit: the default of every waiting call. */
inline constexpr Timeout forever{};

/**
 * Settings of the built-in dynamic loss scaler (the C++ form of `so_loss_scaler_options`).
 * Default-constructed, it holds the library's defaults (torch GradScaler's: scale 65536,
 * growth 2, backoff 0.5, interval 2000, hysteresis 1, minimum 1).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct LossScalerOptions {
    float init_scale;             ///< Scale of the first step.
    float growth_factor;          ///< Multiplies the scale after growth_interval clean steps; > 1.
    float backoff_factor;         ///< Multiplies the scale after an overflow; in (0, 1).
    std::uint32_t growth_interval; ///< Steps without overflow before the scale grows; >= 1.
    std::uint32_t hysteresis;     ///< Overflowing steps tolerated before backing off; >= 1.
    float min_scale;              ///< The scale never goes below this.

    /** The library's defaults. @note Never throws. */
    LossScalerOptions() noexcept : LossScalerOptions(so_loss_scaler_options_default()) {}

    /** The values of a C struct (its struct_size is not kept). @note Never throws. */
    explicit LossScalerOptions(const so_loss_scaler_options& raw) noexcept
        : init_scale(raw.init_scale), growth_factor(raw.growth_factor), backoff_factor(raw.backoff_factor),
          growth_interval(raw.growth_interval), hysteresis(raw.hysteresis), min_scale(raw.min_scale) {}

    /** The C struct, with struct_size set. @note Never throws. */
    [[nodiscard]] so_loss_scaler_options to_c() const noexcept {
        so_loss_scaler_options raw = so_loss_scaler_options_default();
        raw.init_scale = init_scale;
        raw.growth_factor = growth_factor;
        raw.backoff_factor = backoff_factor;
        raw.growth_interval = growth_interval;
        raw.hysteresis = hysteresis;
        raw.min_scale = min_scale;
        return raw;
    }
};

/**
 * How to create a Session (the C++ form of `so_session_options`). Default-constructed, it
 * holds `so_session_options_default()`: the default pool, AdamW with bias correction, f32
 * moments, gradients and accumulation, automatic speculation, no memory limit, no loss scaler,
 * no master-weight copy, no automatic split.
 *
 * Ownership: a plain value. `pool` is a reference: the session takes its own reference to
 * the pool, so the Pool may be destroyed once Session::create has returned. The core list is
 * copied by Session::create.
 */
struct SessionOptions {
    /**
     * Pool for the optimizer passes; nullptr (the default) for the default pool or, with
     * `cores`, a pool of the session's own.
     */
    PoolRef pool;
    /** Cores for a pool of the session's own (one pinned thread each); empty for none. Not with `pool`. */
    std::vector<std::uint32_t> cores;
    /** How weight decay enters the steps. */
    Mode mode;
    /** Divide the moments by 1 - beta^t. */
    bool bias_correction;
    /** DType::F32 or DType::Bf16 (bf16 moments never speculate: rollback needs f32). */
    DType moment_dtype;
    /** DType of the gradients handed to Session::grad_copy. */
    DType grad_dtype;
    /** DType of the sub-group gradient buffers, in which micro-steps accumulate. */
    DType accum_dtype;
    /** Whether complete sub-groups are stepped during backward. */
    Speculation speculation;
    /** Host bytes the session may allocate (moments, gradient buffers, copies); 0 for no limit. */
    std::uint64_t host_memory_limit;
    /** Must stay false: sessions refuse AMSGrad (its running maximum cannot be rolled back). */
    bool amsgrad;
    /** The built-in loss scaler's settings; std::nullopt (the default) for none. */
    std::optional<LossScalerOptions> loss_scaler;
    /**
     * DType::None (the default), or DType::Bf16 / DType::F16 to keep a low-precision copy of
     * each sub-group's master weights, written in the same pass as every update.
     */
    DType copy_dtype;
    /** CUDA sessions: device bytes for the automatic split (0: off). */
    std::uint64_t gpu_budget_bytes;

    /** The library's defaults. @note Never throws. */
    SessionOptions() noexcept : SessionOptions(so_session_options_default()) {}

    /**
     * The values of a C struct (pool, cores and loss scaler are not kept: set them here).
     * @note Never throws.
     */
    explicit SessionOptions(const so_session_options& raw) noexcept
        : pool(), cores(), mode(static_cast<Mode>(raw.mode)), bias_correction(raw.bias_correction),
          moment_dtype(static_cast<DType>(raw.moment_dtype)), grad_dtype(static_cast<DType>(raw.grad_dtype)),
          accum_dtype(static_cast<DType>(raw.accum_dtype)),
          speculation(static_cast<Speculation>(raw.speculation)), host_memory_limit(raw.host_memory_limit),
          amsgrad(raw.amsgrad), loss_scaler(), copy_dtype(static_cast<DType>(raw.copy_dtype)),
          gpu_budget_bytes(raw.gpu_budget_bytes) {}
};

/**
 * Hyperparameters of a param group (the C++ form of `so_group_hparams`). Default-constructed,
 * it holds torch.optim.AdamW's (lr 1e-3, betas 0.9 and 0.999, eps 1e-8, weight decay 0.01).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct GroupHparams {
    double lr;           ///< Learning rate, finite and >= 0.
    double beta1;        ///< In [0, 1); 0 disables speculation for the group's sub-groups.
    double beta2;        ///< In [0, 1); 0 disables speculation for the group's sub-groups.
    double eps;          ///< Finite and >= 0.
    double weight_decay; ///< Finite and >= 0.

    /** The library's defaults. @note Never throws. */
    GroupHparams() noexcept : GroupHparams(so_group_hparams_default()) {}

    /** The values of a C struct (its struct_size is not kept). @note Never throws. */
    explicit GroupHparams(const so_group_hparams& raw) noexcept
        : lr(raw.lr), beta1(raw.beta1), beta2(raw.beta2), eps(raw.eps), weight_decay(raw.weight_decay) {}

    /** The C struct, with struct_size set. @note Never throws. */
    [[nodiscard]] so_group_hparams to_c() const noexcept {
        so_group_hparams raw = so_group_hparams_default();
        raw.lr = lr;
        raw.beta1 = beta1;
        raw.beta2 = beta2;
        raw.eps = eps;
        raw.weight_decay = weight_decay;
        return raw;
    }

    /** Field-wise equality (exact, as the session compares hyperparameters). */
    friend bool operator==(const GroupHparams& a, const GroupHparams& b) noexcept {
        return a.lr == b.lr && a.beta1 == b.beta1 && a.beta2 == b.beta2 && a.eps == b.eps &&
               a.weight_decay == b.weight_decay;
    }
    /** Field-wise inequality. */
    friend bool operator!=(const GroupHparams& a, const GroupHparams& b) noexcept { return !(a == b); }
};

/**
 * One named param slice of a sub-group (the C++ form of `so_slice_desc`): `numel` elements
 * from `offset` within the sub-group. Names are unique in the session; Session::add_subgroup
 * copies them.
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct Slice {
    std::string name;        ///< Non-empty, without NUL characters, unique in the session.
    std::size_t offset = 0;  ///< First element within the sub-group.
    std::size_t numel = 0;   ///< Elements, >= 1.
};

/**
 * What Session::step is told (the C++ form of `so_step_args`). Default-constructed: no
 * clipping, the session's own (local) norm, no overflow.
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct StepArgs {
    /** Clip the global norm to this (torch's clip_grad_norm_); 0 disables clipping. */
    double max_norm = 0.0;
    /**
     * The global norm of the unscaled gradient computed by the caller (e.g. all-reduced
     * across ranks from Session::local_grad_sumsq; inf or NaN skips the step), or
     * std::nullopt for the session's own norm.
     */
    std::optional<double> global_norm = std::nullopt;
    /** The caller saw an overflow (e.g. on another rank): skip the step. */
    bool overflow = false;

    /** The C struct, with struct_size set. @note Never throws. */
    [[nodiscard]] so_step_args to_c() const noexcept {
        so_step_args raw = so_step_args_default();
        raw.max_norm = max_norm;
        raw.norm_source = global_norm ? static_cast<std::uint32_t>(SO_NORM_SOURCE_GIVEN)
                                      : static_cast<std::uint32_t>(SO_NORM_SOURCE_LOCAL);
        raw.global_norm = global_norm.value_or(0.0);
        raw.overflow = overflow;
        return raw;
    }
};

/**
 * The outcome of one step (the C++ form of `so_step_result`; see there for each field).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct StepResult {
    std::uint64_t serial = 0;        ///< 1 for the session's first step, then one more per begin_step.
    bool skipped = false;            ///< Nothing was stepped (skip_reason says why).
    double global_norm = 0.0;        ///< Global norm of the unscaled gradient.
    double clip_coef = 1.0;          ///< Clip coefficient applied (1 when not clipped or skipped).
    float grad_factor = 0.0f;        ///< The factor the gradients were stepped with: clip_coef / loss_scale.
    float loss_scale = 0.0f;         ///< The loss scale this step's backward used.
    float next_loss_scale = 0.0f;    ///< The loss scale of the next step.
    std::uint32_t speculative = 0;   ///< Speculative steps submitted during backward.
    std::uint32_t late_gradients = 0; ///< Gradients that arrived after their sub-group's speculative step.
    std::uint32_t kept = 0;          ///< Speculative steps kept as taken.
    std::uint32_t rescaled = 0;      ///< Speculative steps rescaled to the final factor.
    std::uint32_t rolled_back = 0;   ///< Speculative steps undone (skipped step).
    std::uint32_t redone = 0;        ///< Speculative steps undone and taken again.
    std::uint32_t stepped = 0;       ///< Sub-groups stepped at step() that had not speculated.
    so_skip_reason skip_reason = SO_SKIP_REASON_NONE; ///< Why the step was skipped.
    std::uint32_t cancelled = 0;       ///< Speculative steps cancelled at step() (stepped once instead).
    std::uint32_t device_stepped = 0;  ///< Sub-groups stepped on the GPU.
    std::uint32_t device_subgroups = 0; ///< Sub-groups placed on the GPU during this step.
    std::uint64_t final_pass_elements = 0; ///< Elements the passes after step() touched.
    double forward_wait_s = 0.0;       ///< Seconds the forward waited on tickets since the previous step().

    /** All zero (clip_coef 1). @note Never throws. */
    StepResult() noexcept = default;

    /** The values of a C struct. @note Never throws. */
    explicit StepResult(const so_step_result& raw) noexcept
        : serial(raw.serial), skipped(raw.skipped), global_norm(raw.global_norm), clip_coef(raw.clip_coef),
          grad_factor(raw.grad_factor), loss_scale(raw.loss_scale), next_loss_scale(raw.next_loss_scale),
          speculative(raw.speculative), late_gradients(raw.late_gradients), kept(raw.kept), rescaled(raw.rescaled),
          rolled_back(raw.rolled_back), redone(raw.redone), stepped(raw.stepped),
          skip_reason(static_cast<so_skip_reason>(raw.skip_reason)), cancelled(raw.cancelled),
          device_stepped(raw.device_stepped), device_subgroups(raw.device_subgroups),
          final_pass_elements(raw.final_pass_elements), forward_wait_s(raw.forward_wait_s) {}
};

/** Where the work behind a ticket stands (TicketStatus::state). */
enum class TicketState {
    Done,    ///< Completed successfully.
    Pending, ///< Not completed yet.
    Failed,  ///< Completed with an error (TicketStatus::error).
};

/**
 * What Session::query reports about a ticket: its state and, if the work failed, the Error
 * it failed with (the status and message that waiting on it would throw).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct TicketStatus {
    TicketState state = TicketState::Pending; ///< Done, pending or failed.
    std::optional<Error> error = std::nullopt; ///< Set iff state is TicketState::Failed.

    /** Whether the work completed successfully. @note Never throws. */
    [[nodiscard]] bool done() const noexcept { return state == TicketState::Done; }
    /** Whether the work has not completed yet. @note Never throws. */
    [[nodiscard]] bool pending() const noexcept { return state == TicketState::Pending; }
    /** Whether the work completed with an error. @note Never throws. */
    [[nodiscard]] bool failed() const noexcept { return state == TicketState::Failed; }
};

namespace detail {
inline const char* dtype_name(DType d) noexcept {
    switch (d) {
    case DType::None: return "none";
    case DType::F32: return "f32";
    case DType::Bf16: return "bf16";
    case DType::F16: return "f16";
    }
    return "unknown dtype";
}

/** The element type of a contiguous container (what its data() points at). */
template <class C>
using data_element_t = std::remove_pointer_t<decltype(std::declval<C&>().data())>;

/** Throws Error(`SO_STATUS_INVALID_ARGUMENT`) if `s` holds a NUL character (C would truncate it). */
inline void check_c_string(const std::string& s, const char* what, const char* where) {
    if (s.find('\0') != std::string::npos) {
        throw Error(SO_STATUS_INVALID_ARGUMENT,
                    std::string("superoffload::Session::") + where + ": " + what + " contains a NUL character");
    }
}
} // namespace detail

/**
 * How a CUDA session moves data (the C++ form of `so_cuda_options`).
 * Ownership: a plain value. Thread-safety: a plain value.
 */
struct CudaOptions {
    int device = 0;                          ///< Device ordinal.
    std::size_t piece_bytes = std::size_t{16} << 20; ///< Gradients larger than this go in pieces.
};

/** Whether CUDA can be used here (driver loads, a device exists). @note Never throws. */
[[nodiscard]] inline bool cuda_available() noexcept { return so_cuda_available() == SO_STATUS_OK; }

/**
 * An owned offload session (`so_session*`): sub-groups of parameters whose Adam state lives in
 * host memory, stepped speculatively during backward on the session's CPU-Adam thread and
 * made exact at step(). Move-only; destroying it calls `so_session_destroy`, which waits for
 * every queued step, then stops the thread and frees the session's memory. A default-
 * constructed or moved-from Session is empty: destroying, resetting or moving it is safe and
 * does nothing; any other call on it throws Error (`SO_STATUS_NULL_ARGUMENT`).
 *
 * One step: begin_step(); grad_copy() (or grad_written()) for every slice, next_micro_step()
 * between micro-steps; optionally local_grad_sumsq(); step(), which returns at once with a
 * ticket; step_result(ticket). Master weights may be read again once the sub-group's
 * final_ticket() (or the step's ticket) is complete.
 *
 * Borrowed memory: the master weights (and caller gradient buffers) given to add_subgroup
 * are borrowed until the sub-group is removed or the session destroyed (see
 * `so_session_add_subgroup`): they must stay valid, and must not be touched from the
 * hand-off that completes their sub-group until its final ticket of that step.
 *
 * Errors and waiting: see the comment at the top of this section. Every function not marked
 * `noexcept` throws Error when the C call fails.
 *
 * Thread-safety: calls on one session may come from several threads at once (the library
 * serialises them), but the Session object itself must not be moved, reset or destroyed
 * while another thread uses it.
 */
class Session {
public:
    /** An empty session handle (nothing to destroy). @note Never throws. */
    Session() noexcept = default;

    /**
     * Creates a session and starts its CPU-Adam thread.
     * @throws Error `SO_STATUS_UNSUPPORTED` (AMSGrad, f16 moments), `SO_STATUS_INVALID_ARGUMENT`
     *         (a pool and cores both given, bad cores, bad dtypes or loss-scaler settings),
     *         `SO_STATUS_OUT_OF_RESOURCES` (threads cannot start).
     */
    [[nodiscard]] static Session create(const SessionOptions& options = {}) {
        return create_impl(options, nullptr);
    }

    /**
     * Creates a CUDA session: gradients arrive as device pointers (grad_device), updated
     * weights are published into each sub-group's device parameter (add_subgroup_cuda) after
     * step() decides. Uses the device's primary context and its own copy streams.
     * @throws Error as create, plus `SO_STATUS_CUDA_UNAVAILABLE` (no driver or device) and
     *         `SO_STATUS_CUDA_ERROR` (the driver's error name in the message).
     */
    [[nodiscard]] static Session create_cuda(const SessionOptions& options = {}, const CudaOptions& cuda = {}) {
        so_cuda_options raw = so_cuda_options_default();
        raw.device = cuda.device;
        raw.piece_bytes = cuda.piece_bytes;
        return create_impl(options, &raw);
    }

private:
    [[nodiscard]] static Session create_impl(const SessionOptions& options, const so_cuda_options* cuda) {
        so_session_options raw = so_session_options_default();
        raw.pool = options.pool.raw();
        raw.cores = options.cores.empty() ? nullptr : options.cores.data();
        raw.num_cores = options.cores.size();
        raw.mode = static_cast<std::uint32_t>(options.mode);
        raw.bias_correction = options.bias_correction;
        raw.moment_dtype = static_cast<std::uint32_t>(options.moment_dtype);
        raw.grad_dtype = static_cast<std::uint32_t>(options.grad_dtype);
        raw.accum_dtype = static_cast<std::uint32_t>(options.accum_dtype);
        raw.speculation = static_cast<std::uint32_t>(options.speculation);
        raw.gpu_budget_bytes = options.gpu_budget_bytes;
        raw.host_memory_limit = options.host_memory_limit;
        raw.amsgrad = options.amsgrad;
        raw.copy_dtype = static_cast<std::uint32_t>(options.copy_dtype);
        so_loss_scaler_options scaler = so_loss_scaler_options_default();
        if (options.loss_scaler) {
            scaler = options.loss_scaler->to_c();
            raw.loss_scaler = &scaler;
        }
        so_session* out = nullptr;
        check(cuda ? so_session_create_cuda(&raw, cuda, &out) : so_session_create(&raw, &out));
        return adopt(out, options.grad_dtype, options.accum_dtype);
    }

public:

    /**
     * Takes ownership of a handle from `so_session_create` (or nullptr, giving an empty
     * Session). `grad_dtype` and `accum_dtype` must be those the session was created with:
     * the typed calls check their element types against them.
     * @note Never throws.
     */
    [[nodiscard]] static Session adopt(so_session* raw, DType grad_dtype, DType accum_dtype) noexcept {
        Session session;
        session.handle_.reset(raw);
        session.grad_dtype_ = grad_dtype;
        session.accum_dtype_ = accum_dtype;
        return session;
    }

    /** Whether this handle owns a session. @note Never throws. */
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    /** The C handle, still owned by this object (nullptr when empty). @note Never throws. */
    [[nodiscard]] so_session* raw() const noexcept { return handle_.get(); }

    /** Gives up ownership: returns the C handle (the caller must `so_session_destroy` it). */
    [[nodiscard]] so_session* release() noexcept { return handle_.release(); }

    /** Destroys the owned session now (waiting for its queued work), leaving this handle empty. */
    void reset() noexcept { handle_.reset(); }

    /** The dtype grad_copy expects (SessionOptions::grad_dtype). @note Never throws. */
    [[nodiscard]] DType grad_dtype() const noexcept { return grad_dtype_; }

    /** The dtype of the sub-group gradient buffers (SessionOptions::accum_dtype). @note Never throws. */
    [[nodiscard]] DType accum_dtype() const noexcept { return accum_dtype_; }

    // ---- param groups ----------------------------------------------------------------

    /**
     * Adds a param group. @return Its id (0, 1, ... in order of addition).
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` for out-of-range values.
     */
    std::uint32_t add_group(const GroupHparams& hparams = {}) {
        const so_group_hparams raw = hparams.to_c();
        std::uint32_t id = 0;
        check(so_session_add_group(handle_.get(), &raw, &id));
        return id;
    }

    /**
     * Changes a group's hyperparameters, at any time (`so_session_set_group`: speculative
     * steps already taken with other values are rolled back and redone at step()).
     * @throws Error `SO_STATUS_NOT_FOUND` (unknown group), `SO_STATUS_INVALID_ARGUMENT`.
     */
    void set_group(std::uint32_t group, const GroupHparams& hparams) {
        const so_group_hparams raw = hparams.to_c();
        check(so_session_set_group(handle_.get(), group, &raw));
    }

    /** A group's current hyperparameters. @throws Error `SO_STATUS_NOT_FOUND` (unknown group). */
    [[nodiscard]] GroupHparams group(std::uint32_t group) const {
        so_group_hparams raw = so_group_hparams_default();
        check(so_session_get_group(handle_.get(), group, &raw));
        return GroupHparams(raw);
    }

    // ---- sub-groups ------------------------------------------------------------------

    /**
     * Registers a sub-group of `numel` master weights (float: speculates; bf16 or f16:
     * stepped at step()) in `group`, with the slices whose gradients complete it; the session
     * allocates its gradient buffer. `master` is borrowed (see the class comment).
     * Sub-groups are finalized in registration order: register them in forward order.
     * @return The sub-group id (0, 1, ... in order of registration).
     * @throws Error `SO_STATUS_INVALID_STATE` (during a step), `SO_STATUS_NOT_FOUND` (unknown
     *         group), `SO_STATUS_ALIASING` (overlapping slices or buffers),
     *         `SO_STATUS_INVALID_ARGUMENT` (bad slices or names), `SO_STATUS_OUT_OF_RESOURCES`
     *         (host-memory limit). Nothing is registered on error.
     */
    template <class T, std::enable_if_t<is_element_v<T>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices) {
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, nullptr);
    }

    /**
     * As add_subgroup(group, master, numel, slices), with a caller gradient buffer of
     * `numel` elements of the accumulation dtype, also borrowed, for grad_written().
     * @throws Error as the other form, and `SO_STATUS_INVALID_ARGUMENT` (from the wrapper) if
     *         `A` is not the session's accum_dtype().
     */
    template <class T, class A, std::enable_if_t<is_element_v<T> && is_element_v<A>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices,
                               A* grad) {
        if (handle_ && dtype_of<A>::value != accum_dtype_) {
            throw Error(SO_STATUS_INVALID_ARGUMENT, std::string("superoffload::Session::add_subgroup: the gradient "
                                                                "buffer is ") +
                                                        detail::dtype_name(dtype_of<A>::value) +
                                                        " but the session's accum_dtype is " +
                                                        detail::dtype_name(accum_dtype_));
        }
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, grad);
    }

    /**
     * As add_subgroup(group, master.data(), master.size(), slices), for a contiguous container
     * (std::vector, a span, ...) of float, bf16 or f16 that must not be resized while borrowed.
     * @throws Error as the pointer form.
     */
    template <class C, std::enable_if_t<is_element_v<detail::data_element_t<C>>, int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, C& master, const std::vector<Slice>& slices) {
        return add_subgroup(group, master.data(), master.size(), slices);
    }

    /**
     * As add_subgroup(group, master, slices), with a caller gradient buffer container of the
     * same size (else `SO_STATUS_INVALID_ARGUMENT`, from the wrapper).
     * @throws Error as the pointer form.
     */
    template <class C, class GC,
              std::enable_if_t<is_element_v<detail::data_element_t<C>> && is_element_v<detail::data_element_t<GC>>,
                               int> = 0>
    std::uint32_t add_subgroup(std::uint32_t group, C& master, const std::vector<Slice>& slices, GC& grad) {
        if (grad.size() != master.size()) {
            throw Error(SO_STATUS_INVALID_ARGUMENT, "superoffload::Session::add_subgroup: the gradient buffer has " +
                                                        std::to_string(grad.size()) + " elements, the master weights " +
                                                        std::to_string(master.size()));
        }
        return add_subgroup(group, master.data(), master.size(), slices, grad.data());
    }

    /**
     * Unregisters a sub-group between steps, after its outstanding work; its slice names
     * become free and its borrowed buffers are not used after this returns.
     * @throws Error `SO_STATUS_NOT_FOUND`, `SO_STATUS_INVALID_STATE` (during a step).
     */
    void remove_subgroup(std::uint32_t subgroup) { check(so_session_remove_subgroup(handle_.get(), subgroup)); }

    /**
     * The id of a slice (stable for the session's lifetime: look it up once).
     * @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] std::uint32_t slice_id(const std::string& name) const {
        detail::check_c_string(name, "the slice name", "slice_id");
        std::uint32_t id = 0;
        check(so_session_slice_id(handle_.get(), name.c_str(), &id));
        return id;
    }

    // ---- one step --------------------------------------------------------------------

    /**
     * Starts an optimizer step whose backward uses `loss_scale` (0: the built-in scaler's
     * scale, or 1 without one) and `micro_steps` micro-steps of gradient accumulation.
     * @throws Error `SO_STATUS_INVALID_STATE` (the previous step was not given to step()),
     *         `SO_STATUS_INVALID_ARGUMENT` (bad scale, 0 micro-steps).
     */
    void begin_step(float loss_scale = 0.0f, std::uint32_t micro_steps = 1) {
        check(so_session_begin_step(handle_.get(), loss_scale, micro_steps));
    }

    /** Moves to the next micro-step. @throws Error `SO_STATUS_INVALID_STATE` (beyond the count, or no step). */
    void next_micro_step() { check(so_session_next_micro_step(handle_.get())); }

    /**
     * Hands over a slice's gradient by copy (`so_session_grad_copy`): `numel` elements of
     * `G`, which must be the session's grad_dtype(). `grad` may be reused at once.
     * @return The ticket of the work this queued (the sub-group's speculative step, when this
     *         completed it), or no_ticket.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (wrong element type, from the wrapper; wrong
     *         size), `SO_STATUS_INVALID_STATE`, `SO_STATUS_NOT_FOUND`, `SO_STATUS_OUT_OF_RESOURCES`.
     */
    template <class G, std::enable_if_t<is_element_v<G>, int> = 0>
    Ticket grad_copy(std::uint32_t slice, const G* grad, std::size_t numel) {
        return grad_copy(slice, static_cast<const void*>(grad), dtype_of<G>::value, numel);
    }

    /** As grad_copy(slice, grad.data(), grad.size()), for a contiguous container. @throws Error as that. */
    template <class C, std::enable_if_t<is_element_v<std::remove_const_t<detail::data_element_t<const C>>>, int> = 0>
    Ticket grad_copy(std::uint32_t slice, const C& grad) {
        return grad_copy(slice, grad.data(), grad.size());
    }

    /**
     * Untyped form of grad_copy: `numel` elements of `dtype` at `grad` (e.g. a framework
     * tensor's data pointer). @throws Error as the typed form.
     */
    Ticket grad_copy(std::uint32_t slice, const void* grad, DType dtype, std::size_t numel) {
        if (handle_ && dtype != grad_dtype_) {
            throw Error(SO_STATUS_INVALID_ARGUMENT, std::string("superoffload::Session::grad_copy: the gradient is ") +
                                                        detail::dtype_name(dtype) +
                                                        " but the session's grad_dtype is " +
                                                        detail::dtype_name(grad_dtype_));
        }
        Ticket ticket = no_ticket;
        check(so_session_grad_copy(handle_.get(), slice, grad, numel, &ticket));
        return ticket;
    }

    /**
     * Records that the slice's gradient of this micro-step is in place in its sub-group's
     * caller gradient buffer (`so_session_grad_written`).
     * @return As grad_copy.
     * @throws Error `SO_STATUS_INVALID_ARGUMENT` (the session owns the buffer),
     *         `SO_STATUS_INVALID_STATE` (outside backward, or the sub-group already completed),
     *         `SO_STATUS_NOT_FOUND`.
     */
    Ticket grad_written(std::uint32_t slice) {
        Ticket ticket = no_ticket;
        check(so_session_grad_written(handle_.get(), slice, &ticket));
        return ticket;
    }

    /**
     * The sum of squares of this step's unscaled gradient over all sub-groups, waiting
     * forever for the speculative passes. Ends the backward: only step() may follow.
     * @throws Error `SO_STATUS_INVALID_STATE` (outside a step), or the error of a failed pass.
     */
    [[nodiscard]] double local_grad_sumsq() {
        const std::optional<double> sumsq = local_grad_sumsq(forever);
        if (!sumsq) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::local_grad_sumsq: timed out waiting forever");
        }
        return *sumsq;
    }

    /**
     * As local_grad_sumsq(), waiting at most `timeout`.
     * @return The sum, or std::nullopt if the timeout expired (call again to keep waiting).
     * @throws Error as local_grad_sumsq().
     */
    [[nodiscard]] std::optional<double> local_grad_sumsq(Timeout timeout) {
        double sumsq = 0.0;
        const so_status st = so_session_local_grad_sumsq(handle_.get(), timeout.c_ns(), &sumsq);
        if (st == SO_STATUS_TIMEOUT) {
            return std::nullopt;
        }
        check(st);
        return sumsq;
    }

    /**
     * Ends the step and returns at once; the CPU-Adam thread decides (norm, skip, clip) and
     * makes every sub-group exact in registration order.
     * @return The ticket that completes when every sub-group is final (for step_result).
     * @throws Error `SO_STATUS_INVALID_STATE` (no begin_step), `SO_STATUS_INVALID_ARGUMENT`
     *         (bad max_norm).
     */
    Ticket step(const StepArgs& args = {}) {
        const so_step_args raw = args.to_c();
        Ticket ticket = no_ticket;
        check(so_session_step(handle_.get(), &raw, &ticket));
        return ticket;
    }

    /**
     * Waits forever for the step of `ticket` (as returned by step()) and describes it.
     * @throws Error `SO_STATUS_NOT_FOUND` (not the latest step's ticket), or the step's error.
     */
    [[nodiscard]] StepResult step_result(Ticket ticket) const {
        const std::optional<StepResult> result = step_result(ticket, forever);
        if (!result) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::step_result: timed out waiting forever");
        }
        return *result;
    }

    /**
     * As step_result(ticket), waiting at most `timeout`.
     * @return The result, or std::nullopt if the timeout expired.
     * @throws Error as step_result(ticket).
     */
    [[nodiscard]] std::optional<StepResult> step_result(Ticket ticket, Timeout timeout) const {
        so_step_result raw{};
        raw.struct_size = sizeof raw;
        const so_status st = so_session_step_result(handle_.get(), ticket, timeout.c_ns(), &raw);
        if (st == SO_STATUS_TIMEOUT) {
            return std::nullopt;
        }
        check(st);
        return StepResult(raw);
    }

    // ---- queries ---------------------------------------------------------------------

    /**
     * The ticket that completes when the sub-group's latest step is final (no_ticket before
     * its first step). @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] Ticket final_ticket(std::uint32_t subgroup) const {
        Ticket ticket = no_ticket;
        check(so_session_final_ticket(handle_.get(), subgroup, &ticket));
        return ticket;
    }

    /**
     * Steps the sub-group has taken (skipped steps do not count); read it after the
     * sub-group's final ticket. @throws Error `SO_STATUS_NOT_FOUND`.
     */
    [[nodiscard]] std::uint64_t step_count(std::uint32_t subgroup) const {
        std::uint64_t count = 0;
        check(so_session_step_count(handle_.get(), subgroup, &count));
        return count;
    }

    /**
     * The built-in loss scaler's current scale (waiting for the latest step's verdict), or 1
     * without a scaler. @throws Error only for an empty handle.
     */
    [[nodiscard]] float loss_scale() const {
        float scale = 0.0f;
        check(so_session_loss_scale(handle_.get(), &scale));
        return scale;
    }

    /** Host bytes the session allocated. @throws Error only for an empty handle. */
    [[nodiscard]] std::size_t host_bytes() const {
        std::size_t bytes = 0;
        check(so_session_host_bytes(handle_.get(), &bytes));
        return bytes;
    }

    // ---- tickets ---------------------------------------------------------------------

    /**
     * The state of a ticket, without waiting: done, pending, or failed with the work's Error.
     * @throws Error `SO_STATUS_NOT_FOUND` for a ticket this session never issued (misuse, not
     *         a state), `SO_STATUS_NULL_ARGUMENT` for an empty handle.
     */
    [[nodiscard]] TicketStatus query(Ticket ticket) const {
        const so_status st = so_ticket_query(handle_.get(), ticket);
        TicketStatus out;
        switch (st) {
        case SO_STATUS_OK: out.state = TicketState::Done; return out;
        case SO_STATUS_PENDING: out.state = TicketState::Pending; return out;
        case SO_STATUS_NOT_FOUND:
        case SO_STATUS_NULL_ARGUMENT: check(st); break;
        default: break;
        }
        std::string message = last_error_message();
        if (message.empty()) {
            message = status_str(st);
        }
        out.state = TicketState::Failed;
        out.error = Error(st, message);
        return out;
    }

    /**
     * Waits forever for a ticket (no_ticket is always complete).
     * @throws Error the work's error if it failed; `SO_STATUS_NOT_FOUND` for a ticket never issued.
     */
    void wait(Ticket ticket) const {
        if (!wait(ticket, forever)) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::wait: timed out waiting forever");
        }
    }

    /**
     * Waits at most `timeout` for a ticket (a zero duration polls).
     * @return true if the work completed successfully, false if the timeout expired.
     * @throws Error as wait(ticket).
     */
    [[nodiscard]] bool wait(Ticket ticket, Timeout timeout) const {
        const so_status st = so_ticket_wait(handle_.get(), ticket, timeout.c_ns());
        if (st == SO_STATUS_TIMEOUT) {
            return false;
        }
        check(st);
        return true;
    }

    /**
     * Waits forever for every ticket up to and including `ticket`.
     * @throws Error the error of the first failed one (`so_ticket_wait_all`).
     */
    void wait_all(Ticket ticket) const {
        if (!wait_all(ticket, forever)) {
            throw Error(SO_STATUS_TIMEOUT, "superoffload::Session::wait_all: timed out waiting forever");
        }
    }

    /**
     * Waits at most `timeout` for every ticket up to and including `ticket`.
     * @return true if all completed successfully, false if the timeout expired.
     * @throws Error as wait_all(ticket).
     */
    [[nodiscard]] bool wait_all(Ticket ticket, Timeout timeout) const {
        const so_status st = so_ticket_wait_all(handle_.get(), ticket, timeout.c_ns());
        if (st == SO_STATUS_TIMEOUT) {
            return false;
        }
        check(st);
        return true;
    }

    // ---- CUDA sessions ---------------------------------------------------------------

    /**
     * As add_subgroup, for a CUDA session: the model's parameter lives at `device_param`
     * (`numel` elements of `device_dtype` on the GPU, borrowed like the master weights), where
     * updated weights are published after each step() decides.
     */
    template <class T>
    std::uint32_t add_subgroup_cuda(std::uint32_t group, T* master, std::size_t numel, const std::vector<Slice>& slices,
                                    so_device_ptr device_param, DType device_dtype,
                                    Placement placement = Placement::Host) {
        return add_subgroup_impl(group, master, dtype_of<T>::value, numel, slices, nullptr, device_param, device_dtype,
                                 placement);
    }

    /** Moves a sub-group between host and GPU memory, between steps (`so_session_set_placement`). */
    void set_placement(std::uint32_t subgroup, Placement placement) {
        check(so_session_set_placement(handle_.get(), subgroup, static_cast<std::uint32_t>(placement)));
    }

    /** GPU bytes the session allocated (`so_session_device_bytes`). */
    [[nodiscard]] std::size_t device_bytes() const {
        std::size_t n = 0;
        check(so_session_device_bytes(handle_.get(), &n));
        return n;
    }

    /**
     * Hands over the gradient of `slice` ready at device address `grad` (`numel` elements of
     * `dtype`, the session's accumulation dtype) on `stream`; the copy to the host is queued
     * and this returns at once. The device buffer must stay valid until copy_stream() has
     * passed the copy (with PyTorch: `grad.record_stream(copy_stream)`).
     * @return The ticket of the speculative step this queued, or no_ticket.
     */
    Ticket grad_device(std::uint32_t slice, so_device_ptr grad, std::size_t numel, DType dtype, so_cuda_stream_t stream) {
        Ticket ticket = 0;
        check(so_session_grad_device(handle_.get(), slice, grad, numel, static_cast<std::uint32_t>(dtype), stream,
                                     &ticket));
        return ticket;
    }

    /** Registers the compute stream: publication waits for the work queued on it before step(). */
    void set_compute_stream(so_cuda_stream_t stream) { check(so_session_set_compute_stream(handle_.get(), stream)); }

    /** Makes `stream` wait on the GPU (no host blocking) until `ticket` is complete. */
    void enqueue_wait(Ticket ticket, so_cuda_stream_t stream) const {
        check(so_ticket_enqueue_wait(handle_.get(), ticket, stream));
    }

    /** The session's first copy stream, on which every gradient copy ends (for record_stream). */
    [[nodiscard]] so_cuda_stream_t copy_stream() const {
        so_cuda_stream_t stream = nullptr;
        check(so_session_copy_stream(handle_.get(), &stream));
        return stream;
    }

    /** Host bytes the session page-locked (0 for a host session). */
    [[nodiscard]] std::size_t pinned_bytes() const {
        std::size_t bytes = 0;
        check(so_session_pinned_bytes(handle_.get(), &bytes));
        return bytes;
    }

    // ---- timeline ----------------------------------------------------------------------

    /** Starts (clearing an earlier one) or stops recording a timeline of the session's work. */
    void trace(bool enable) { check(so_session_trace(handle_.get(), enable)); }

    /** Writes the recorded timeline as Chrome trace JSON. @throws Error `SO_STATUS_IO`. */
    void save_trace(const std::string& path) const {
        detail::check_c_string(path, "the path", "save_trace");
        check(so_session_trace_save(handle_.get(), path.c_str()));
    }

    // ---- checkpoints -----------------------------------------------------------------

    /**
     * Saves a checkpoint between steps, after in-flight work (atomic: the file at `path` is
     * the old one or the new one). @throws Error `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE`.
     */
    void save(const std::string& path) {
        detail::check_c_string(path, "the path", "save");
        check(so_session_save(handle_.get(), path.c_str()));
    }

    /**
     * Loads a checkpoint into the registered sub-groups, between steps.
     * @throws Error `SO_STATUS_BAD_CHECKPOINT` (truncated, corrupt or mismatched: nothing
     *         changed), `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE`.
     */
    void load(const std::string& path) {
        detail::check_c_string(path, "the path", "load");
        check(so_session_load(handle_.get(), path.c_str()));
    }

private:
    std::uint32_t add_subgroup_impl(std::uint32_t group, void* master, DType master_dtype, std::size_t numel,
                                    const std::vector<Slice>& slices, void* grad, so_device_ptr device_param = 0,
                                    DType device_dtype = DType::None, Placement placement = Placement::Host) {
        std::vector<so_slice_desc> raw_slices;
        raw_slices.reserve(slices.size());
        for (const Slice& s : slices) {
            detail::check_c_string(s.name, "a slice name", "add_subgroup");
            so_slice_desc d;
            d.name = s.name.c_str();
            d.offset = s.offset;
            d.numel = s.numel;
            raw_slices.push_back(d);
        }
        so_subgroup_desc desc = so_subgroup_desc_default();
        desc.group = group;
        desc.master = master;
        desc.master_dtype = static_cast<std::uint32_t>(master_dtype);
        desc.numel = numel;
        desc.grad = grad;
        desc.slices = raw_slices.empty() ? nullptr : raw_slices.data();
        desc.num_slices = raw_slices.size();
        desc.device_param = device_param;
        desc.device_param_dtype = static_cast<std::uint32_t>(device_dtype);
        desc.placement = static_cast<std::uint32_t>(placement);
        std::uint32_t id = 0;
        check(so_session_add_subgroup(handle_.get(), &desc, &id));
        return id;
    }

    struct Deleter {
        void operator()(so_session* session) const noexcept { so_session_destroy(session); }
    };
    std::unique_ptr<so_session, Deleter> handle_;
    DType grad_dtype_ = DType::F32;
    DType accum_dtype_ = DType::F32;
};

} // namespace superoffload

#endif // SUPEROFFLOAD_HPP
