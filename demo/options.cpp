#include "options.hpp"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#if defined(__linux__)
#include <sched.h>
#endif

namespace demo {

namespace {

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "superoffload-demo: %s (try --help)\n", message.c_str());
    std::exit(2);
}

const char* const kUsage = R"(superoffload-demo: train an MLP on the CPU with its Adam state in a superoffload
session (speculative per-layer steps during backward, exact clipping at step()), then
check the result against a plain reference optimizer.

USAGE: superoffload-demo [OPTIONS]

MODEL AND DATA
  --layers L         linear layers, >= 2 (default 5): input -> width x (L-1) -> classes
  --width W          hidden width (default 1024)
  --input D          input features (default 256)
  --classes C        classes of the teacher's labels (default 10)
  --batch B          samples per step, fresh each step (default 64)
  --seed S           seed of the initial weights, the teacher and the data (default 1)
TRAINING
  --steps N          optimizer steps (default 100)
  --lr X             peak learning rate of AdamW (default 3e-4); linear warmup, then
                     cosine decay to a tenth of it at the last step
  --warmup N         steps of linear learning-rate warmup (default 5)
  --weight-decay X   AdamW weight decay (default 0.01)
  --max-norm X       clip the global gradient norm to X; 0 disables clipping (default 3.4:
                     with the default model the norm starts near 2.9 and grows past 3.4
                     after ~20 steps, so some steps are clipped and some are not)
  --no-speculation   step every layer at step() instead of during backward
THREADS
  --threads T        threads of the forward and backward (default 1)
  --cores LIST       cores of the session's CPU-Adam pool, e.g. 1 or 2-3 (default: the last
                     CPU this process may run on, if it may run on two or more; else the
                     library's default pool, unpinned). "none" for the default pool.
  --train-cores LIST cores for the training threads (default: the allowed CPUs that are not
                     in --cores; unpinned if there are none). "none" for unpinned.
CHECK
  --no-check         skip the reference run
  --tolerance X      largest |w_session - w_reference| allowed, in units of the peak
                     learning rate, when some step was rescaled, rolled back or redone
                     (default 0.05: the runs must agree to 5% of one Adam step's size;
                     without such a step the weights must be bit-identical)
OUTPUT
  --print-every N    print every N-th step (default 1)
  -h, --help         this text
)";

long parse_long(const std::string& flag, const std::string& s, long lo, long hi) {
    char* end = nullptr;
    errno = 0;
    long v = std::strtol(s.c_str(), &end, 10);
    if (s.empty() || *end != '\0' || errno != 0 || v < lo || v > hi)
        usage_error(flag + ": \"" + s + "\" is not a whole number in [" + std::to_string(lo) + ", " +
                    std::to_string(hi) + "]");
    return v;
}

double parse_double(const std::string& flag, const std::string& s, double lo) {
    char* end = nullptr;
    double v = std::strtod(s.c_str(), &end);
    if (s.empty() || *end != '\0' || !std::isfinite(v) || v < lo)
        usage_error(flag + ": \"" + s + "\" is not a finite number >= " + std::to_string(lo));
    return v;
}

std::vector<uint32_t> parse_cores(const std::string& flag, const std::string& s) {
    std::vector<uint32_t> cores;
    if (s == "none") return cores;
    size_t pos = 0;
    while (pos <= s.size()) {
        size_t comma = s.find(',', pos);
        std::string part = s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
        if (!part.empty()) {
            size_t dash = part.find('-');
            long a = parse_long(flag, part.substr(0, dash), 0, 1 << 20);
            long b = dash == std::string::npos ? a : parse_long(flag, part.substr(dash + 1), 0, 1 << 20);
            if (a > b) usage_error(flag + ": \"" + part + "\" is not a core or a range like 2-3");
            for (long c = a; c <= b; ++c) cores.push_back(static_cast<uint32_t>(c));
        }
        if (comma == std::string::npos) break;
        pos = comma + 1;
    }
    if (cores.empty()) usage_error(flag + ": the list is empty");
    return cores;
}

std::vector<uint32_t> allowed_cpus() {
    std::vector<uint32_t> cpus;
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c)
            if (CPU_ISSET(c, &set)) cpus.push_back(static_cast<uint32_t>(c));
    }
#endif
    return cpus;
}

} // namespace

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        std::string arg = argv[i];
        std::string value;
        bool has_inline = false;
        if (arg.rfind("--", 0) == 0 && arg.find('=') != std::string::npos) {
            value = arg.substr(arg.find('=') + 1);
            arg = arg.substr(0, arg.find('='));
            has_inline = true;
        }
        auto next = [&]() -> std::string {
            if (has_inline) return value;
            if (i + 1 >= argc) usage_error(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "-h" || arg == "--help") {
            std::fputs(kUsage, stdout);
            std::exit(0);
        } else if (arg == "--layers")
            o.layers = (int)parse_long(arg, next(), 2, 64);
        else if (arg == "--width")
            o.width = (int)parse_long(arg, next(), 1, 1 << 16);
        else if (arg == "--input")
            o.input = (int)parse_long(arg, next(), 1, 1 << 16);
        else if (arg == "--classes")
            o.classes = (int)parse_long(arg, next(), 2, 1 << 16);
        else if (arg == "--batch")
            o.batch = (int)parse_long(arg, next(), 1, 1 << 16);
        else if (arg == "--seed")
            o.seed = (uint64_t)parse_long(arg, next(), 0, 1L << 62);
        else if (arg == "--steps")
            o.steps = (int)parse_long(arg, next(), 1, 1 << 20);
        else if (arg == "--lr")
            o.lr = parse_double(arg, next(), 0.0);
        else if (arg == "--warmup")
            o.warmup = (int)parse_long(arg, next(), 0, 1 << 20);
        else if (arg == "--weight-decay")
            o.weight_decay = parse_double(arg, next(), 0.0);
        else if (arg == "--max-norm")
            o.max_norm = parse_double(arg, next(), 0.0);
        else if (arg == "--no-speculation")
            o.speculation = false;
        else if (arg == "--threads")
            o.threads = (int)parse_long(arg, next(), 1, 256);
        else if (arg == "--cores") {
            o.cores = parse_cores(arg, next());
            o.cores_given = true;
        } else if (arg == "--train-cores") {
            o.train_cores = parse_cores(arg, next());
            o.train_cores_given = true;
        } else if (arg == "--no-check")
            o.check = false;
        else if (arg == "--tolerance")
            o.tolerance = parse_double(arg, next(), 0.0);
        else if (arg == "--print-every")
            o.print_every = (int)parse_long(arg, next(), 1, 1 << 20);
        else
            usage_error("unknown argument \"" + arg + "\"");
    }
    std::vector<uint32_t> cpus = allowed_cpus();
    if (!o.cores_given && cpus.size() >= 2) o.cores = {cpus.back()};
    if (!o.train_cores_given) {
        for (uint32_t c : cpus)
            if (std::find(o.cores.begin(), o.cores.end(), c) == o.cores.end()) o.train_cores.push_back(c);
    }
    return o;
}

std::string cores_text(const std::vector<uint32_t>& cores) {
    if (cores.empty()) return "unpinned";
    std::string s;
    for (size_t i = 0; i < cores.size(); ++i) s += (i ? "," : "") + std::to_string(cores[i]);
    return s;
}

} // namespace demo
