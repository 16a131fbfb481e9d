/**
 * @file superoffload/handle.hpp
 * @brief What the owning handles (Pool, Session) share: ownership of a C handle.
 *
 * Part of the C++ wrapper; included by superoffload/pool.hpp and superoffload/session.hpp.
 */
#ifndef SUPEROFFLOAD_HANDLE_HPP
#define SUPEROFFLOAD_HANDLE_HPP

#include "version.hpp"

#include <memory>

namespace superoffload {
namespace detail {
/**
 * The ownership of a C handle (`Handle*`, destroyed by `Destroy`) that an owning wrapper
 * (`Derived`) derives from: move-only; a default-constructed or moved-from handle is empty
 * (raw() is nullptr), and destroying, resetting or moving an empty one does nothing.
 */
template <class Derived, class Handle, void (*Destroy)(Handle*)>
class OwnedHandle {
public:
    /**
     * Takes ownership of a handle from the C create function (or nullptr, giving an empty
     * handle).
     * @note Never throws.
     */
    [[nodiscard]] static Derived adopt(Handle* raw) noexcept {
        Derived owner;
        owner.handle_.reset(raw);
        return owner;
    }

    /** Whether this handle owns an object. @note Never throws. */
    explicit operator bool() const noexcept { return handle_ != nullptr; }

    /** The C handle, still owned by this object (nullptr when empty). @note Never throws. */
    [[nodiscard]] Handle* raw() const noexcept { return handle_.get(); }

    /** Gives up ownership: returns the C handle (the caller must destroy it). @note Never throws. */
    [[nodiscard]] Handle* release() noexcept { return handle_.release(); }

    /** Destroys the owned object now, leaving this handle empty. @note Never throws. */
    void reset() noexcept { handle_.reset(); }

private:
    struct Deleter {
        void operator()(Handle* handle) const noexcept { Destroy(handle); }
    };
    std::unique_ptr<Handle, Deleter> handle_;
};
} // namespace detail
} // namespace superoffload

#endif // SUPEROFFLOAD_HANDLE_HPP
