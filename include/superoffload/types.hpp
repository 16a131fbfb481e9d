/**
 * @file superoffload/types.hpp
 * @brief The C enumerations as C++ types, the bf16 and f16 storage elements, and the traits
 *        that map element types to dtype codes.
 *
 * **Enumerations.** Each C enumeration has a C++ mirror (DType, Isa, Mode, Speculation,
 * Placement, SkipReason, NormSource) with the same values. They are unscoped enumerations
 * with the C enumeration's underlying type, each in a namespace of its own, and are spelled
 * through their type (`superoffload::DType::Bf16`). So a value assigns to, and compares
 * with, the `uint32_t` field of a C struct that holds it
 * (`options.grad_dtype = DType::Bf16`, `result.skip_reason == SkipReason::None`), while a
 * parameter of the enum type accepts neither a plain integer nor another enumeration.
 */
#ifndef SUPEROFFLOAD_TYPES_HPP
#define SUPEROFFLOAD_TYPES_HPP

#include "error.hpp"

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace superoffload {

/** One namespace per C enumeration, so that their enumerators never collide (`Auto`, `None`). */
namespace enums {
namespace dtype {
/** Element type of a buffer (`so_dtype`); see superoffload::DType. */
enum DType : std::uint32_t {
    None = SO_DTYPE_NONE, ///< No buffer (optional buffers only).
    F32 = SO_DTYPE_F32,   ///< IEEE binary32 (`float`).
    Bf16 = SO_DTYPE_BF16, ///< bfloat16 (superoffload::bf16).
    F16 = SO_DTYPE_F16,   ///< IEEE binary16 (superoffload::f16).
};
} // namespace dtype
namespace isa {
/** Instruction set of a pool's kernels (`so_isa`); see superoffload::Isa. */
enum Isa : std::uint32_t {
    Auto = SO_ISA_AUTO,         ///< The widest the CPU supports (only when creating a pool).
    Portable = SO_ISA_PORTABLE, ///< Plain code, one lane; runs on every CPU.
    Avx2 = SO_ISA_AVX2,         ///< x86-64 AVX2 + FMA + F16C, 8 lanes.
    Avx512 = SO_ISA_AVX512,     ///< x86-64 AVX-512F, 16 lanes.
};
} // namespace isa
namespace mode {
/** How weight decay enters a step (`so_adam_mode`); see superoffload::Mode. */
enum Mode : std::uint32_t {
    AdamW = SO_ADAM_MODE_ADAMW, ///< Decoupled decay `p <- p * (1 - lr * wd)` (torch AdamW).
    L2 = SO_ADAM_MODE_L2,       ///< L2 regularisation `g <- g + wd * p` (torch Adam).
};
} // namespace mode
namespace speculation {
/** Whether sub-groups are stepped during backward (`so_speculation`); see superoffload::Speculation. */
enum Speculation : std::uint32_t {
    Off = SO_SPECULATION_OFF,   ///< Every sub-group is stepped once, after step() decides.
    On = SO_SPECULATION_ON,     ///< Every sub-group that can speculate does.
    Auto = SO_SPECULATION_AUTO, ///< Decided per step from earlier steps' measurements (the default).
};
} // namespace speculation
namespace placement {
/** Where a sub-group's master weights and moments live (`so_placement`); see superoffload::Placement. */
enum Placement : std::uint32_t {
    Host = SO_PLACEMENT_HOST,     ///< Host memory, stepped by the CPU kernels.
    Device = SO_PLACEMENT_DEVICE, ///< GPU memory (CUDA sessions), stepped by the library's GPU kernel.
};
} // namespace placement
namespace host_copy {
/** Whether a CUDA session keeps a full host copy of its weights (`so_host_copy`); see superoffload::HostCopy. */
enum HostCopy : std::uint32_t {
    Auto = SO_HOST_COPY_AUTO,       ///< Where host memory allows (decided at the first step).
    Full = SO_HOST_COPY_FULL,       ///< Kept: speculative steps write it during backward.
    Bounded = SO_HOST_COPY_BOUNDED, ///< Not kept: each piece is written as it is published.
};
} // namespace host_copy
namespace gradient_home {
/** Where a CUDA session's host-stepped gradients wait (`so_gradient_home`); see superoffload::GradientHome. */
enum GradientHome : std::uint32_t {
    Auto = SO_GRADIENT_HOME_AUTO,     ///< On the host where its memory allows, else on the GPU.
    Host = SO_GRADIENT_HOME_HOST,     ///< A pinned host buffer.
    Device = SO_GRADIENT_HOME_DEVICE, ///< A device buffer, read back in pieces by each pass.
};
} // namespace gradient_home
namespace skip_reason {
/** Why a step was skipped (`so_skip_reason`); see superoffload::SkipReason. */
enum SkipReason : std::uint32_t {
    None = SO_SKIP_REASON_NONE,                             ///< The step was not skipped.
    Overflow = SO_SKIP_REASON_OVERFLOW,                     ///< The caller reported an overflow.
    NonFiniteGradient = SO_SKIP_REASON_NON_FINITE_GRADIENT, ///< A gradient element was inf or NaN.
    NonFiniteNorm = SO_SKIP_REASON_NON_FINITE_NORM,         ///< The caller-given norm was inf or NaN.
    UnusableFactor = SO_SKIP_REASON_UNUSABLE_FACTOR,        ///< The factor is 0 or inf in f32.
};
} // namespace skip_reason
namespace norm_source {
/** Where step() takes the global norm from (`so_norm_source`); see superoffload::NormSource. */
enum NormSource : std::uint32_t {
    Local = SO_NORM_SOURCE_LOCAL, ///< The session's own sums of squares (one rank).
    Given = SO_NORM_SOURCE_GIVEN, ///< `so_step_args.global_norm`, e.g. all-reduced across ranks.
};
} // namespace norm_source
} // namespace enums

/** Element type of a buffer (`so_dtype`): `DType::None`, `F32`, `Bf16`, `F16`. */
using DType = enums::dtype::DType;
/** Instruction set of a pool's kernels (`so_isa`): `Isa::Auto`, `Portable`, `Avx2`, `Avx512`. */
using Isa = enums::isa::Isa;
/** How weight decay enters a step (`so_adam_mode`): `Mode::AdamW`, `Mode::L2`. */
using Mode = enums::mode::Mode;
/** Whether sub-groups are stepped during backward (`so_speculation`): `Speculation::Off`, `On`, `Auto`. */
using Speculation = enums::speculation::Speculation;
/** Where a sub-group's state lives (`so_placement`): `Placement::Host`, `Placement::Device`. */
using Placement = enums::placement::Placement;
/** Whether a CUDA session keeps a full host copy (`so_host_copy`): `HostCopy::Auto`, `Full`, `Bounded`. */
using HostCopy = enums::host_copy::HostCopy;
/** Where host-stepped gradients wait (`so_gradient_home`): `GradientHome::Auto`, `Host`, `Device`. */
using GradientHome = enums::gradient_home::GradientHome;
/** Why a step was skipped (`so_skip_reason`): `SkipReason::None`, `Overflow`, ... */
using SkipReason = enums::skip_reason::SkipReason;
/** Where step() takes the global norm from (`so_norm_source`): `NormSource::Local`, `Given`. */
using NormSource = enums::norm_source::NormSource;

/**
 * A static name for an instruction set ("portable", "avx2", "avx512", "auto"; "unknown" for
 * other values). Takes an Isa or the `uint32_t` field of a C struct.
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline const char* isa_name(std::uint32_t isa) noexcept { return so_isa_name(isa); }

namespace detail {
/**
 * What the C++ mirror of every options struct shares: the library's defaults (`Default`, the
 * struct's `*_default()` function), a C struct's values with `struct_size` set to this
 * header's (its pointers borrowed as they are), and the C struct back. A mirror derives from
 * it and inherits its constructors.
 */
template <class C, C (*Default)()>
struct CStruct : C {
    /** The library's defaults. @note Never throws. */
    CStruct() noexcept : C(Default()) {}

    /** The values of a C struct (`struct_size` is set to this header's). @note Never throws. */
    explicit CStruct(const C& raw) noexcept : C(raw) { this->struct_size = sizeof(C); }

    /** The C struct (these values themselves). @note Never throws. */
    [[nodiscard]] const C& to_c() const noexcept { return *this; }
};

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
 * Thread-safety: a plain value.
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
 * Thread-safety: a plain value.
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

namespace detail {
/** A short name of a dtype code ("f32", ...), for the wrapper's own error messages. */
inline const char* dtype_name(std::uint32_t d) noexcept {
    switch (d) {
    case DType::None: return "none";
    case DType::F32: return "f32";
    case DType::Bf16: return "bf16";
    case DType::F16: return "f16";
    default: return "unknown dtype";
    }
}

/** The element type of a contiguous container (what its data() points at). */
template <class C>
using data_element_t = std::remove_pointer_t<decltype(std::declval<C&>().data())>;

/** Throws Error(`SO_STATUS_INVALID_ARGUMENT`) if `s` holds a NUL character (C would truncate it). */
inline void check_c_string(const std::string& s, const char* what, const char* where) {
    if (s.find('\0') != std::string::npos) {
        throw Error(SO_STATUS_INVALID_ARGUMENT,
                    std::string("superoffload::") + where + ": " + what + " contains a NUL character");
    }
}

/**
 * Memory that a pointer field of a C struct points into, owned by the C++ object that holds
 * the struct: immutable once made and shared by the object's copies. A move copies too, so
 * the pointer stays valid in every copy (moved-from ones included) for as long as any lives.
 */
template <class T>
class Shared {
public:
    /** Nothing owned. */
    Shared() noexcept = default;
    /** Owns `value`. @throws std::bad_alloc only. */
    explicit Shared(T value) : ptr_(std::make_shared<const T>(std::move(value))) {}
    /** Shares the other's value (no move constructor: a move copies). */
    Shared(const Shared&) noexcept = default;
    /** Shares the other's value. */
    Shared& operator=(const Shared&) noexcept = default;
    /** The owned value (nullptr if none). */
    [[nodiscard]] const T* get() const noexcept { return ptr_.get(); }

private:
    std::shared_ptr<const T> ptr_;
};
} // namespace detail

} // namespace superoffload

#endif // SUPEROFFLOAD_TYPES_HPP
