// The command line of superoffload-demo: its options (the flags are described in --help).

#ifndef SUPEROFFLOAD_DEMO_OPTIONS_HPP
#define SUPEROFFLOAD_DEMO_OPTIONS_HPP

#include <cstdint>
#include <string>
#include <vector>

namespace demo {

struct Options {
    int layers = 5;
    int width = 1024;
    int input = 256;
    int classes = 10;
    int batch = 64;
    uint64_t seed = 1;
    int steps = 100;
    double lr = 3e-4;
    int warmup = 5;
    double weight_decay = 0.01;
    double max_norm = 3.4;
    bool speculation = true;
    int threads = 1;
    bool cores_given = false;
    std::vector<uint32_t> cores;
    bool train_cores_given = false;
    std::vector<uint32_t> train_cores;
    bool check = true;
    double tolerance = 0.05;
    int print_every = 1;
};

// Parses the flags. --help prints the usage and exits with status 0; a usage error is
// printed and exits with status 2. Without --cores and --train-cores the cores are chosen
// from the CPUs this process may run on.
Options parse_options(int argc, char** argv);

// "1,2,3", or "unpinned" for an empty list.
std::string cores_text(const std::vector<uint32_t>& cores);

} // namespace demo

#endif // SUPEROFFLOAD_DEMO_OPTIONS_HPP
