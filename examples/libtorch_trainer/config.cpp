#include "config.hpp"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <stdexcept>

namespace trainer {

const char* kUsage =
    "usage: so_torch_trainer [--check parity,exact,resume] [--device auto|cpu|cuda]\n"
    "   [--steps N] [--vocab V] [--seq T] [--dim D] [--layers L] [--heads H] [--batch B]\n"
    "   [--lr X] [--warmup N] [--clip X] [--untied] [--seed S] [--order 1|2|3] [--parity-tol X]\n"
    "   [--sdpa math|auto] [--param-dtype bf16|f32] [--log-every N]\n"
    "   [--ckpt DIR] [--save-at K|half] [--resume DIR] [--losses-out FILE]   (one training run)\n"
    "   [--compare A B [--from K]]   (compare the steps two --losses-out files share, bit for bit)\n"
    "Defaults are small on the CPU (D 64, L 2, 60 steps) and larger on CUDA (D 384, L 6, 80 steps).\n";

Args parse_args(int argc, char** argv) {
    Args a;
    for (int i = 1; i < argc; i++) {
        std::string k = argv[i];
        if (k.rfind("--", 0) != 0) throw std::invalid_argument("unexpected argument " + k + "\n" + kUsage);
        k = k.substr(2);
        if (k == "untied" || k == "help") {
            // A std::string, not the literal: GCC 12 at -O3 warns, falsely, of -Wrestrict on assigning the literal.
            a.kv[k] = std::string("1");
        } else if (k == "compare") {
            if (i + 2 >= argc) throw std::invalid_argument("--compare needs two files");
            a.kv["compare_a"] = argv[++i];
            a.kv["compare_b"] = argv[++i];
        } else {
            if (i + 1 >= argc) throw std::invalid_argument("--" + k + " needs a value");
            a.kv[k] = argv[++i];
        }
    }
    return a;
}

double lr_at(const Config& c, int64_t step) {
    if (step < c.warmup) return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup);
    const double span = std::max<int64_t>(1, c.steps - 1 - c.warmup);
    const double t = std::min(1.0, static_cast<double>(step - c.warmup) / span);
    const double lo = c.lr * c.min_lr_ratio;
    return lo + 0.5 * (c.lr - lo) * (1.0 + std::cos(3.14159265358979323846 * t));
}

std::string config_fingerprint(const Config& c) {
    std::ostringstream o;
    o << "vocab " << c.vocab << " seq " << c.seq << " dim " << c.dim << " layers " << c.layers << " heads " << c.heads
      << " batch " << c.batch << " steps " << c.steps << " warmup " << c.warmup << " tied " << c.tied << " lr " << c.lr
      << " data_seed " << c.data_seed << " cuda " << c.cuda << " bf16 " << c.bf16;
    return o.str();
}

} // namespace trainer
