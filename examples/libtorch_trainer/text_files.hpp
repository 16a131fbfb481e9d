// Whole text files: the trainer's checkpoint state and the per-step loss files.
#ifndef SO_TORCH_TRAINER_TEXT_FILES_HPP
#define SO_TORCH_TRAINER_TEXT_FILES_HPP

#include <string>

namespace trainer {

void write_text(const std::string& path, const std::string& text);

std::string read_text(const std::string& path);

} // namespace trainer

#endif
