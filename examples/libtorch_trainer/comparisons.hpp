// Comparisons: runs bit for bit, and the per-step loss files of runs in separate processes.
#ifndef SO_TORCH_TRAINER_COMPARISONS_HPP
#define SO_TORCH_TRAINER_COMPARISONS_HPP

#include "training_run.hpp"

#include <cstdint>
#include <string>

namespace trainer {

/** Bitwise comparison of losses from `from` on and of every parameter's weights. */
bool compare_exact(const char* what, const RunOut& a, const RunOut& b, int64_t from, int64_t steps);

void write_losses(const std::string& path, const RunOut& r, int64_t steps);

int compare_loss_files(const std::string& pa, const std::string& pb, int64_t from);

} // namespace trainer

#endif
