/**
 * @file superoffload/checkpoint.hpp
 * @brief A session's state on disk and in place: Session::save and Session::load, and
 *        SubgroupState with Session::subgroup_state and Session::set_step_count (e.g. to
 *        build or restore a torch-style optimizer state dict).
 *
 * Included by superoffload/session.hpp (which declares these members); including this file
 * alone includes that one too.
 */
#ifndef SUPEROFFLOAD_CHECKPOINT_HPP
#define SUPEROFFLOAD_CHECKPOINT_HPP

#include "session.hpp"

#include <cstdint>
#include <string>

namespace superoffload {

/**
 * Where a sub-group's state lives: `so_subgroup_state` (each field is documented there),
 * filled by Session::subgroup_state. `placement`, `master_dtype` and `moment_dtype` compare
 * with the C++ enumerations (`state.placement == Placement::Host`). The pointers stay valid
 * until the sub-group is removed or the session destroyed.
 * Ownership: a plain value of borrowed pointers.
 */
struct SubgroupState : so_subgroup_state {
    /** All zero, `struct_size` set, ready to be filled by `so_session_get_subgroup_state`. @note Never throws. */
    SubgroupState() noexcept : so_subgroup_state{} { struct_size = sizeof(so_subgroup_state); }
};

/**
 * Saves a checkpoint between steps, after in-flight work (`so_session_save`; atomic: the file
 * at `path` is the old one or the new one).
 * @throws Error `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE`.
 */
inline void Session::save(const std::string& path) {
    detail::check_c_string(path, "the path", "Session::save");
    check(so_session_save(raw(), path.c_str()));
}

/**
 * Loads a checkpoint into the registered sub-groups, between steps (`so_session_load`).
 * @throws Error `SO_STATUS_BAD_CHECKPOINT` (truncated, corrupt or mismatched: nothing
 *         changed), `SO_STATUS_IO`, `SO_STATUS_INVALID_STATE`.
 */
inline void Session::load(const std::string& path) {
    detail::check_c_string(path, "the path", "Session::load");
    check(so_session_load(raw(), path.c_str()));
}

/**
 * Describes a sub-group's state buffers after its outstanding work, so that they can be read
 * (or, between steps, written) in place (`so_session_get_subgroup_state`).
 * @throws Error `SO_STATUS_NOT_FOUND`, `SO_STATUS_CUDA_ERROR`.
 */
inline SubgroupState Session::subgroup_state(std::uint32_t subgroup) const {
    SubgroupState state;
    check(so_session_get_subgroup_state(raw(), subgroup, &state));
    return state;
}

/**
 * Sets a sub-group's step count, between steps, after writing its state in place
 * (`so_session_set_step_count`).
 * @throws Error `SO_STATUS_NOT_FOUND`, `SO_STATUS_INVALID_STATE` (during a step).
 */
inline void Session::set_step_count(std::uint32_t subgroup, std::uint64_t count) {
    check(so_session_set_step_count(raw(), subgroup, count));
}

} // namespace superoffload

#endif // SUPEROFFLOAD_CHECKPOINT_HPP
