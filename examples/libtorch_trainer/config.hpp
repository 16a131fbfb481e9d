// The configuration: its defaults, the command line, the LR schedule, a checkpoint's fingerprint of it.
#ifndef SO_TORCH_TRAINER_CONFIG_HPP
#define SO_TORCH_TRAINER_CONFIG_HPP

#include <cstdint>
#include <map>
#include <string>

namespace trainer {

struct Config {
    bool cuda = false;
    bool bf16 = false; // model parameters (and gradients) in bf16; f32 otherwise
    int64_t vocab = 64, seq = 32, dim = 64, layers = 2, heads = 4, batch = 8;
    int64_t steps = 60, warmup = 6;
    bool tied = true;
    double lr = 1e-2, min_lr_ratio = 0.1, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
    double clip = 1.0;
    uint64_t seed = 1234, data_seed = 99;
    double parity_tol = 1e-3;
    bool math_sdpa = true;
    int log_every = 10;
};

struct Args {
    std::map<std::string, std::string> kv;
    bool has(const std::string& k) const { return kv.count(k) != 0; }
    std::string str(const std::string& k, const std::string& d) const { return has(k) ? kv.at(k) : d; }
    int64_t i64(const std::string& k, int64_t d) const { return has(k) ? std::stoll(kv.at(k)) : d; }
    double f64(const std::string& k, double d) const { return has(k) ? std::stod(kv.at(k)) : d; }
};

extern const char* kUsage;

Args parse_args(int argc, char** argv);

/** Linear warm-up to the peak, then cosine decay to min_lr_ratio * peak at the last step. */
double lr_at(const Config& c, int64_t step);

/** What must match between a checkpoint and the run that loads it. */
std::string config_fingerprint(const Config& c);

} // namespace trainer

#endif
