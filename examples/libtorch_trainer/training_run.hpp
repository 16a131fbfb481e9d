// One training run: the model, its optimizer (superoffload::torch::AdamW or torch::optim::AdamW),
// checkpoints, the loop and its results.
#ifndef SO_TORCH_TRAINER_TRAINING_RUN_HPP
#define SO_TORCH_TRAINER_TRAINING_RUN_HPP

#include "config.hpp"
#include "markov_data.hpp"

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace trainer {

enum class OptKind { Session, SessionNoSpec, TorchAdamW };

const char* opt_name(OptKind k);

struct RunSpec {
    std::string label;
    OptKind kind = OptKind::Session;
    double max_norm = 1.0;
    uint64_t init_seed = 0;
    int64_t save_at = -1;   // save a checkpoint after this many steps
    std::string ckpt_dir;   // where
    std::string resume_dir; // start from this checkpoint
    bool quiet = false;
    size_t gpu_subgroups = 0; // the first sub-groups kept on the GPU (Placement::Device)
};

struct StepStats {
    int clipped = 0, skipped = 0;
    uint64_t speculative = 0, kept = 0, rescaled = 0, redone = 0, rolled_back = 0, stepped = 0, late = 0;
};

struct RunOut {
    int64_t first_step = 0;
    std::vector<double> loss;           // indexed by step; NaN where not run
    std::vector<double> norm;           // global gradient norm per step
    std::vector<torch::Tensor> masters; // per parameter, the f32 master weights, on the CPU
    std::vector<torch::Tensor> model;   // per parameter, the model's weights, on the CPU
    StepStats stats;
    bool every_step_kept = true;    // each step: clip coefficient 1, every sub-group kept or stepped once
    bool every_step_stepped = true; // each step: every sub-group stepped at step() (speculation off)
    double seconds = 0;
};

RunOut train(const Config& c, const MarkovData& data, const RunSpec& spec);

} // namespace trainer

#endif
