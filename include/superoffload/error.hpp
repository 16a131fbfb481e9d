/**
 * @file superoffload/error.hpp
 * @brief Errors: superoffload::Error, check(), the library's thread-local message.
 *
 * Every wrapper call documented as "Throws" raises superoffload::Error, which carries the
 * `so_status` of the failing C call and the message of `so_last_error_message` read right
 * after it. Functions marked `noexcept` never fail. A wait that times out is not an error
 * (see superoffload/ticket.hpp).
 */
#ifndef SUPEROFFLOAD_ERROR_HPP
#define SUPEROFFLOAD_ERROR_HPP

#include "version.hpp"

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace superoffload {

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
 * Checks the wrapper makes itself (a container of the wrong element type, sizes that
 * differ) throw it too, with `SO_STATUS_INVALID_ARGUMENT` and a message naming the wrapper
 * function.
 *
 * Ownership: a plain value; copying it copies the message.
 * Thread-safety: as any exception object; it does not refer to library state.
 */
class Error : public std::runtime_error {
public:
    /** An error with `status` (never `SO_STATUS_OK` when thrown by this header) and `message`. */
    Error(so_status status, const std::string& message) : std::runtime_error(message), status_(status) {}

    /** The status of the failed call. @note Never throws. */
    [[nodiscard]] so_status status() const noexcept { return status_; }

    /** The static description of status() (`so_status_str`). @note Never throws. */
    [[nodiscard]] const char* status_description() const noexcept { return status_str(status_); }

private:
    so_status status_;
};

/**
 * Throws Error if `status` is not `SO_STATUS_OK`. Call it directly on the status of a C call:
 * the message is read from this thread's last error, so no other library call may come
 * in between. When the library left no message, the status description is used.
 * @throws Error with `status`.
 * @note Thread-safety: safe from any thread.
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

} // namespace superoffload

#endif // SUPEROFFLOAD_ERROR_HPP
