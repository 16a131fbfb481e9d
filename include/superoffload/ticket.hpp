/**
 * @file superoffload/ticket.hpp
 * @brief Tickets and waiting: Ticket, no_ticket, Timeout, forever, TicketState, TicketStatus.
 *
 * Waiting, timeouts and errors in the session API (superoffload::Session):
 *
 * - Every call that waits comes in two forms. Without a Timeout argument it waits forever
 *   and returns its value; with a Timeout it returns `bool` (wait, wait_all) or
 *   `std::optional` (step_result, local_grad_sumsq), which is false / empty iff the timeout
 *   expired. An expired timeout is never an exception: nothing was changed, call again to
 *   keep waiting.
 * - Everything else that fails throws superoffload::Error, with the status and message of the
 *   C call (misuse, unknown ids, and the failure of the awaited work itself, e.g.
 *   `SO_STATUS_NON_FINITE` from a speculative step).
 * - Session::query never waits and never throws for the state of a ticket: it returns
 *   TicketStatus (done, pending, or failed with the work's Error).
 */
#ifndef SUPEROFFLOAD_TICKET_HPP
#define SUPEROFFLOAD_TICKET_HPP

#include "error.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <optional>

namespace superoffload {

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
    TicketState state = TicketState::Pending;  ///< Done, pending or failed.
    std::optional<Error> error = std::nullopt; ///< Set iff state is TicketState::Failed.

    /** Whether the work completed successfully. @note Never throws. */
    [[nodiscard]] bool done() const noexcept { return state == TicketState::Done; }
    /** Whether the work has not completed yet. @note Never throws. */
    [[nodiscard]] bool pending() const noexcept { return state == TicketState::Pending; }
    /** Whether the work completed with an error. @note Never throws. */
    [[nodiscard]] bool failed() const noexcept { return state == TicketState::Failed; }
};

} // namespace superoffload

#endif // SUPEROFFLOAD_TICKET_HPP
