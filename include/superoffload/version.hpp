/**
 * @file superoffload/version.hpp
 * @brief The C++17 check, the C header, and the version of the header against the library.
 *
 * Part of the C++ wrapper; include `superoffload.hpp` (which includes every part), or this
 * file alone.
 */
#ifndef SUPEROFFLOAD_VERSION_HPP
#define SUPEROFFLOAD_VERSION_HPP

#include "../superoffload.h"

#include <cstdint>

#if __cplusplus < 201703L && !(defined(_MSVC_LANG) && _MSVC_LANG >= 201703L)
#error "the superoffload C++ wrapper needs C++17 or newer"
#endif

/** The C++ interface of superoffload. */
namespace superoffload {

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
 * The loaded library's version, e.g. "0.4.0" (a static string; do not free it).
 * @note Thread-safety: safe from any thread. Never throws.
 */
[[nodiscard]] inline const char* version_string() noexcept { return so_version_string(); }

} // namespace superoffload

#endif // SUPEROFFLOAD_VERSION_HPP
