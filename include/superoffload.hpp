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
 * @endcode
 */
#ifndef SUPEROFFLOAD_HPP
#define SUPEROFFLOAD_HPP

#include "superoffload.h"

#include <algorithm>
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

} // namespace superoffload

#endif // SUPEROFFLOAD_HPP
