// superoffload demo trainer: an MLP trained on the CPU with its Adam state offloaded to a
// superoffload session, checked against a plain reference optimizer.
//
// The model: `--layers` linear layers (input -> width -> ... -> width -> classes) with tanh
// between them and softmax cross-entropy on top, trained on fresh synthetic batches labelled
// by a fixed random teacher network. The forward and backward are hand-written loops on
// the CPU (a small blocked matmul, optionally over a few threads); every output element is
// computed by one thread in a fixed order, so the results do not depend on the thread count.
//
// The optimizer: one superoffload sub-group per layer (the weight and the bias are its two
// named slices), registered in forward order. Backward hands each layer's gradient to the
// session as soon as it is computed (last layer first), so the session's CPU-Adam thread
// steps that layer speculatively while backward goes on; step() then makes every layer exact
// (rescaling the speculative steps when clipping changes the gradient factor) and the next
// forward of layer k waits only for layer k's final ticket.
//
// The check: the same run (same initial weights, same batches, same learning-rate schedule)
// is repeated with a reference optimizer that collects every gradient, takes the global norm
// exactly as the session does (sqrt of the sum over layers, in layer order, of
// grad_sumsq(grad, 1 / loss_scale)), clips with the same factor and calls adam_update on
// each layer. Without a rescaled, rolled-back or redone step the two runs must end with
// bit-identical weights; otherwise within the tolerance described at --tolerance. The
// program exits with status 1 if the check fails (2 for usage or library errors).
//
// Uses the C++ wrapper (superoffload.hpp): superoffload::Session, Pool, adam_update and
// grad_sumsq; every library error arrives as a superoffload::Error exception (main prints
// it and exits with status 2).

#include "superoffload.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace so = superoffload;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------

[[noreturn]] void usage_error(const std::string& message) {
    std::fprintf(stderr, "superoffload-demo: %s (try --help)\n", message.c_str());
    std::exit(2);
}

// ------------------------------------------------------------------------------------------
// Options
// ------------------------------------------------------------------------------------------

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

void pin_this_thread(uint32_t core) {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(core, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
        std::fprintf(stderr, "superoffload-demo: warning: cannot pin a training thread to core %u\n", core);
#else
    (void)core;
#endif
}

// Pins the calling thread for the lifetime of the object, then restores its mask. The main
// thread is pinned only while it trains: the library checks the cores of a pool against
// the *calling thread's* affinity mask, and the session's CPU-Adam thread inherits the
// mask of the thread that creates the session, so sessions and pools are created unpinned.
class ScopedPin {
public:
    explicit ScopedPin(const std::vector<uint32_t>& cores) {
#if defined(__linux__)
        if (cores.empty()) return;
        CPU_ZERO(&saved_);
        active_ = pthread_getaffinity_np(pthread_self(), sizeof saved_, &saved_) == 0;
        if (active_) pin_this_thread(cores[0]);
#else
        (void)cores;
#endif
    }
    ~ScopedPin() {
#if defined(__linux__)
        if (active_) pthread_setaffinity_np(pthread_self(), sizeof saved_, &saved_);
#endif
    }
    ScopedPin(const ScopedPin&) = delete;
    ScopedPin& operator=(const ScopedPin&) = delete;

private:
#if defined(__linux__)
    cpu_set_t saved_;
    bool active_ = false;
#endif
};

// ------------------------------------------------------------------------------------------
// Deterministic random numbers (splitmix64, Box-Muller)
// ------------------------------------------------------------------------------------------

class Rng {
public:
    explicit Rng(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 0x632BE59BD9B4E019ull) {}
    uint64_t next() {
        uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        return z ^ (z >> 31);
    }
    double uniform() { return ((next() >> 11) + 0.5) * (1.0 / 9007199254740992.0); } // (0, 1)
    double normal() {
        double u = uniform(), v = uniform();
        return std::sqrt(-2.0 * std::log(u)) * std::cos(6.283185307179586 * v);
    }

private:
    uint64_t state_;
};

// ------------------------------------------------------------------------------------------
// Training threads: a tiny fork-join pool. parallel_for splits [0, n) into one contiguous
// range per thread; callers make every output element depend on one index only.
// ------------------------------------------------------------------------------------------

class Workers {
public:
    // Thread 0 is the caller (pinned by ScopedPin while it trains); thread t to cores[t].
    Workers(int threads, const std::vector<uint32_t>& cores) : threads_(threads) {
        for (int t = 1; t < threads; ++t) {
            int core = cores.empty() ? -1 : (int)cores[t % cores.size()];
            pool_.emplace_back([this, t, core] {
                if (core >= 0) pin_this_thread((uint32_t)core);
                run(t);
            });
        }
    }
    ~Workers() {
        {
            std::lock_guard<std::mutex> lock(mu_);
            stop_ = true;
        }
        start_.notify_all();
        for (auto& th : pool_) th.join();
    }
    int threads() const { return threads_; }

    template <class F>
    void parallel_for(size_t n, F&& body) {
        if (threads_ == 1 || n < 2) {
            body(size_t(0), n);
            return;
        }
        std::function<void(size_t, size_t)> fn = body;
        {
            std::lock_guard<std::mutex> lock(mu_);
            task_ = &fn;
            n_ = n;
            pending_ = threads_ - 1;
            ++generation_;
        }
        start_.notify_all();
        auto [b, e] = share(0, n);
        fn(b, e);
        std::unique_lock<std::mutex> lock(mu_);
        done_.wait(lock, [&] { return pending_ == 0; });
        task_ = nullptr;
    }

private:
    std::pair<size_t, size_t> share(int t, size_t n) const {
        size_t per = n / threads_, extra = n % threads_;
        size_t b = t * per + std::min<size_t>(t, extra);
        return {b, b + per + (size_t(t) < extra ? 1 : 0)};
    }
    void run(int t) {
        uint64_t seen = 0;
        for (;;) {
            std::function<void(size_t, size_t)>* fn;
            size_t n;
            {
                std::unique_lock<std::mutex> lock(mu_);
                start_.wait(lock, [&] { return stop_ || generation_ != seen; });
                if (stop_) return;
                seen = generation_;
                fn = task_;
                n = n_;
            }
            auto [b, e] = share(t, n);
            if (b < e) (*fn)(b, e);
            {
                std::lock_guard<std::mutex> lock(mu_);
                if (--pending_ == 0) done_.notify_one();
            }
        }
    }

    int threads_;
    std::vector<std::thread> pool_;
    std::mutex mu_;
    std::condition_variable start_, done_;
    std::function<void(size_t, size_t)>* task_ = nullptr;
    size_t n_ = 0;
    int pending_ = 0;
    uint64_t generation_ = 0;
    bool stop_ = false;
};

// ------------------------------------------------------------------------------------------
// Dense kernels. Matrices are row-major; a layer's weight is stored [in][out].
// ------------------------------------------------------------------------------------------

constexpr int kRows = 4;  // output rows per register block
constexpr int kCols = 32; // output columns per register block

// Y[r, c] = init[c] (or 0) + sum_{k ascending} X(r, k) * M[k, c], for r < R, c < C, where
// X(r, k) = X[r * xr + k * xk] and M is K x C. Tasks are column blocks; each computes every
// row of its columns.
void gemm(Workers& w, int R, int K, int C, const float* X, size_t xr, size_t xk, const float* M, const float* init,
          float* Y) {
    size_t blocks = (C + kCols - 1) / kCols;
    w.parallel_for(blocks, [&](size_t b0, size_t b1) {
        for (size_t blk = b0; blk < b1; ++blk) {
            const int c0 = (int)blk * kCols;
            const int cn = std::min(kCols, C - c0);
            for (int r0 = 0; r0 < R; r0 += kRows) {
                const int rn = std::min(kRows, R - r0);
                float acc[kRows][kCols];
                for (int r = 0; r < kRows; ++r)
                    for (int c = 0; c < kCols; ++c) acc[r][c] = (init && c < cn) ? init[c0 + c] : 0.0f;
                if (rn == kRows && cn == kCols) {
                    for (int k = 0; k < K; ++k) {
                        const float* m = M + (size_t)k * C + c0;
                        const float x0 = X[(r0 + 0) * xr + k * xk], x1 = X[(r0 + 1) * xr + k * xk];
                        const float x2 = X[(r0 + 2) * xr + k * xk], x3 = X[(r0 + 3) * xr + k * xk];
                        for (int c = 0; c < kCols; ++c) {
                            acc[0][c] += x0 * m[c];
                            acc[1][c] += x1 * m[c];
                            acc[2][c] += x2 * m[c];
                            acc[3][c] += x3 * m[c];
                        }
                    }
                } else {
                    for (int k = 0; k < K; ++k) {
                        const float* m = M + (size_t)k * C + c0;
                        for (int r = 0; r < rn; ++r) {
                            const float x = X[(r0 + r) * xr + k * xk];
                            for (int c = 0; c < cn; ++c) acc[r][c] += x * m[c];
                        }
                    }
                }
                for (int r = 0; r < rn; ++r)
                    for (int c = 0; c < cn; ++c) Y[(size_t)(r0 + r) * C + c0 + c] = acc[r][c];
            }
        }
    });
}

// Dot product with 16 running partial sums, combined in a fixed order.
inline float dot(const float* a, const float* b, int n) {
    float s[16] = {};
    int i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; ++j) s[j] += a[i + j] * b[i + j];
    for (int j = 0; j < 8; ++j) s[j] += s[j + 8];
    for (int j = 0; j < 4; ++j) s[j] += s[j + 4];
    float t = (s[0] + s[1]) + (s[2] + s[3]);
    for (; i < n; ++i) t += a[i] * b[i];
    return t;
}

// dX[b, i] = sum_o dZ[b, o] * W[i, o] (dZ is B x O, W is I x O, dX is B x I). Tasks are
// blocks of 4 rows of W.
void backward_input(Workers& w, int B, int I, int O, const float* dZ, const float* W, float* dX) {
    size_t blocks = (I + 3) / 4;
    w.parallel_for(blocks, [&](size_t b0, size_t b1) {
        for (size_t blk = b0; blk < b1; ++blk) {
            const int i0 = (int)blk * 4, in = std::min(4, I - i0);
            for (int b = 0; b < B; ++b)
                for (int i = i0; i < i0 + in; ++i)
                    dX[(size_t)b * I + i] = dot(dZ + (size_t)b * O, W + (size_t)i * O, O);
        }
    });
}

// ------------------------------------------------------------------------------------------
// Model
// ------------------------------------------------------------------------------------------

struct LayerShape {
    int in, out;
    size_t weight_numel() const { return (size_t)in * out; }
    size_t numel() const { return weight_numel() + out; } // [weight (in x out) | bias (out)]
};

std::vector<LayerShape> shapes_of(const Options& o) {
    std::vector<LayerShape> s;
    for (int k = 0; k < o.layers; ++k)
        s.push_back({k == 0 ? o.input : o.width, k == o.layers - 1 ? o.classes : o.width});
    return s;
}

// Weights ~ N(0, 1/in) (tanh-friendly), biases 0.
std::vector<std::vector<float>> init_params(const std::vector<LayerShape>& shapes, uint64_t seed) {
    std::vector<std::vector<float>> params;
    for (size_t k = 0; k < shapes.size(); ++k) {
        Rng rng(seed * 1000 + k + 17);
        std::vector<float> p(shapes[k].numel(), 0.0f);
        const double sd = 1.0 / std::sqrt((double)shapes[k].in);
        for (size_t i = 0; i < shapes[k].weight_numel(); ++i) p[i] = (float)(rng.normal() * sd);
        params.push_back(std::move(p));
    }
    return params;
}

// The teacher: a fixed random network input -> 64 (tanh) -> classes; labels are its argmax.
struct Teacher {
    int input, hidden = 64, classes;
    std::vector<float> w1, w2;
    Teacher(int input_, int classes_, uint64_t seed) : input(input_), classes(classes_) {
        Rng rng(seed * 7919 + 3);
        w1.resize((size_t)input * hidden);
        w2.resize((size_t)hidden * classes);
        for (auto& x : w1) x = (float)(rng.normal() * 1.0 / std::sqrt((double)input));
        for (auto& x : w2) x = (float)(rng.normal() / std::sqrt((double)hidden));
    }
    int label(const float* x) const {
        std::vector<float> h(hidden, 0.0f);
        for (int i = 0; i < input; ++i)
            for (int j = 0; j < hidden; ++j) h[j] += x[i] * w1[(size_t)i * hidden + j];
        int best = 0;
        float best_v = -1e30f;
        for (int c = 0; c < classes; ++c) {
            float v = 0.0f;
            for (int j = 0; j < hidden; ++j) v += std::tanh(h[j]) * w2[(size_t)j * classes + c];
            if (v > best_v) best_v = v, best = c;
        }
        return best;
    }
};

struct Batch {
    std::vector<float> x;    // B x input
    std::vector<int> labels; // B
};

Batch make_batch(const Options& o, const Teacher& teacher, int step) {
    Batch b;
    Rng rng(o.seed * 1000003 + (uint64_t)step);
    b.x.resize((size_t)o.batch * o.input);
    for (auto& v : b.x) v = (float)rng.normal();
    for (int i = 0; i < o.batch; ++i) b.labels.push_back(teacher.label(&b.x[(size_t)i * o.input]));
    return b;
}

// ------------------------------------------------------------------------------------------
// The two optimizers behind one interface
// ------------------------------------------------------------------------------------------

struct StepInfo {
    double loss = 0, accuracy = 0; // of this step's forward
    double norm = 0, clip = 1;
    uint32_t speculative = 0, kept = 0, rescaled = 0, rolled_back = 0, redone = 0, stepped = 0;
    bool skipped = false;
    double exposed_ms = 0; // how long the next forward waited for this step's optimizer
};

// Linear warmup to the peak, then cosine decay to a tenth of it at the last step. The
// session's group is updated before each step's backward, so no step is redone for it.
double lr_at(const Options& o, int step) { // step counts from 1
    if (step <= o.warmup) return o.lr * (double)step / o.warmup;
    const int decay = o.steps - o.warmup;
    const double x = decay > 1 ? (double)(step - o.warmup - 1) / (decay - 1) : 1.0;
    return o.lr * (0.1 + 0.45 * (1.0 + std::cos(3.141592653589793 * x)));
}

class Optimizer {
public:
    virtual ~Optimizer() = default;
    // Before the forward of `layer` reads its weights.
    virtual void before_layer(int layer) { (void)layer; }
    virtual void begin_step(int step) = 0;
    // The layer's gradient [dW | db] is complete; the buffer may be reused after the call.
    virtual void grad_ready(int layer, const float* grad) = 0;
    // After backward. Fills info now, or (session) later through collect().
    virtual void end_step(int step, StepInfo& info) = 0;
    // After the forward of the next step (or at the end): completes the previous step's info.
    virtual void collect(StepInfo& info) { (void)info; }
    virtual double waited_seconds() const { return 0.0; }
    virtual double handoff_seconds() const { return 0.0; }
};

// The session: one sub-group per layer.
class SessionOptimizer : public Optimizer {
public:
    SessionOptimizer(const Options& o, const std::vector<LayerShape>& shapes, std::vector<std::vector<float>>& params)
        : o_(o), shapes_(shapes) {
        so::SessionOptions options;
        options.cores = o.cores; // empty: the default pool
        options.speculation = o.speculation ? so::Speculation::Auto : so::Speculation::Off;
        session_ = so::Session::create(options);
        group_ = session_.add_group(group_hparams(1));
        for (size_t k = 0; k < shapes.size(); ++k) {
            const std::string wname = "layer" + std::to_string(k) + ".weight";
            const std::string bname = "layer" + std::to_string(k) + ".bias";
            const size_t wn = shapes[k].weight_numel();
            const uint32_t sg =
                session_.add_subgroup(group_, params[k], {{wname, 0, wn}, {bname, wn, (size_t)shapes[k].out}});
            if (sg != k) throw std::logic_error("unexpected sub-group id " + std::to_string(sg));
            weight_slice_.push_back(session_.slice_id(wname));
            bias_slice_.push_back(session_.slice_id(bname));
        }
        final_.assign(shapes.size(), so::no_ticket);
    }

    void before_layer(int layer) override {
        auto t0 = Clock::now();
        session_.wait(final_[layer]);
        double dt = seconds_since(t0);
        waited_ += dt;
        if (pending_) exposed_ += dt;
    }
    void begin_step(int step) override {
        session_.set_group(group_, group_hparams(step));
        session_.begin_step(1.0f, 1);
    }
    void grad_ready(int layer, const float* grad) override {
        auto t0 = Clock::now();
        const LayerShape& s = shapes_[layer];
        session_.grad_copy(weight_slice_[layer], grad, s.weight_numel());
        session_.grad_copy(bias_slice_[layer], grad + s.weight_numel(), (size_t)s.out);
        handoff_ += seconds_since(t0);
    }
    void end_step(int, StepInfo&) override {
        so::StepArgs args;
        args.max_norm = o_.max_norm;
        step_ticket_ = session_.step(args);
        for (size_t k = 0; k < shapes_.size(); ++k) final_[k] = session_.final_ticket((uint32_t)k);
        pending_ = true;
        exposed_ = 0;
    }
    void collect(StepInfo& info) override {
        if (!pending_) return;
        auto t0 = Clock::now();
        const so::StepResult r = session_.step_result(step_ticket_);
        double dt = seconds_since(t0);
        waited_ += dt;
        info.exposed_ms = (exposed_ + dt) * 1e3;
        info.norm = r.global_norm;
        info.clip = r.clip_coef;
        info.skipped = r.skipped;
        info.speculative = r.speculative;
        info.kept = r.kept;
        info.rescaled = r.rescaled;
        info.rolled_back = r.rolled_back;
        info.redone = r.redone;
        info.stepped = r.stepped;
        pending_ = false;
    }
    double waited_seconds() const override { return waited_; }
    double handoff_seconds() const override { return handoff_; }

private:
    so::GroupHparams group_hparams(int step) const {
        so::GroupHparams gh; // betas and eps: the AdamW defaults
        gh.lr = lr_at(o_, step);
        gh.weight_decay = o_.weight_decay;
        return gh;
    }

    const Options& o_;
    std::vector<LayerShape> shapes_;
    so::Session session_; // destroyed (after its queued work) with the optimizer
    uint32_t group_ = 0;
    std::vector<uint32_t> weight_slice_, bias_slice_;
    std::vector<so::Ticket> final_;
    so::Ticket step_ticket_ = so::no_ticket;
    bool pending_ = false;
    double waited_ = 0, handoff_ = 0, exposed_ = 0;
};

// The reference: collect every gradient; norm, clip and adam_update per layer at the end.
class ReferenceOptimizer : public Optimizer {
public:
    ReferenceOptimizer(const Options& o, const std::vector<LayerShape>& shapes, std::vector<std::vector<float>>& params)
        : o_(o), shapes_(shapes), params_(params) {
        if (!o.cores.empty()) { // else the default pool
            so::PoolOptions po;
            po.cores = o.cores;
            pool_ = so::Pool::create(po);
        }
        for (const auto& s : shapes) {
            grads_.emplace_back(s.numel());
            m_.emplace_back(s.numel(), 0.0f);
            v_.emplace_back(s.numel(), 0.0f);
        }
    }

    void begin_step(int) override {}
    void grad_ready(int layer, const float* grad) override {
        std::memcpy(grads_[layer].data(), grad, grads_[layer].size() * sizeof(float));
    }
    void end_step(int step, StepInfo& info) override {
        auto t0 = Clock::now();
        const so::PoolRef pool = pool_ ? so::PoolRef(pool_) : so::PoolRef();
        const float loss_scale = 1.0f;
        const float unscale = (float)(1.0 / (double)loss_scale);
        // The global norm exactly as the session takes it: the sums of squares of each slice's
        // unscaled gradient (a layer's weight, then its bias), added in registration order.
        double sumsq = 0.0;
        for (size_t k = 0; k < shapes_.size(); ++k) {
            const size_t wn = shapes_[k].weight_numel();
            sumsq += so::grad_sumsq(pool, grads_[k].data(), wn, unscale);
            sumsq += so::grad_sumsq(pool, grads_[k].data() + wn, grads_[k].size() - wn, unscale);
        }
        const double norm = std::sqrt(sumsq);
        const double clip = o_.max_norm > 0 ? std::min(1.0, o_.max_norm / (norm + 1e-6)) : 1.0;
        so::UpdateOptions uo;
        uo.grad_scale = (float)(clip / (double)loss_scale);
        so::Hparams hp; // betas and eps: the AdamW defaults, as the group's
        hp.mode = so::Mode::AdamW;
        hp.lr = lr_at(o_, step);
        hp.weight_decay = o_.weight_decay;
        hp.bias_correction = true;
        hp.step = (uint64_t)step;
        for (size_t k = 0; k < shapes_.size(); ++k)
            so::adam_update(pool, hp, so::make_adam_buffers(params_[k], grads_[k], m_[k], v_[k]), uo);
        info.norm = norm;
        info.clip = clip;
        info.stepped = (uint32_t)shapes_.size();
        waited_ += seconds_since(t0);
    }
    double waited_seconds() const override { return waited_; }

private:
    const Options& o_;
    std::vector<LayerShape> shapes_;
    std::vector<std::vector<float>>& params_;
    so::Pool pool_; // empty: the default pool
    std::vector<std::vector<float>> grads_, m_, v_;
    double waited_ = 0;
};

// ------------------------------------------------------------------------------------------
// Training loop
// ------------------------------------------------------------------------------------------

struct RunResult {
    std::vector<StepInfo> steps;
    double seconds = 0, waited = 0, handoff = 0, forward = 0, backward = 0;
};

void print_header() {
    std::printf("%5s %8s %6s %9s %7s %5s %5s %5s %5s %5s %8s\n", "step", "loss", "acc", "|g|", "clip", "spec", "kept",
                "resc", "rback", "redo", "wait_ms");
}

void print_step(int step, const StepInfo& s) {
    std::printf("%5d %8.4f %6.3f %9.4f %7.4f %5u %5u %5u %5u %5u %8.2f%s\n", step, s.loss, s.accuracy, s.norm, s.clip,
                s.speculative, s.kept, s.rescaled, s.rolled_back, s.redone, s.exposed_ms, s.skipped ? "  skipped" : "");
}

RunResult train(const Options& o, const std::vector<LayerShape>& shapes, std::vector<std::vector<float>>& params,
                Optimizer& opt, Workers& workers, bool print) {
    const int L = (int)shapes.size(), B = o.batch;
    Teacher teacher(o.input, o.classes, o.seed);
    std::vector<std::vector<float>> acts(L + 1); // acts[k]: input of layer k (B x in); acts[L]: logits
    for (int k = 0; k < L; ++k) acts[k].resize((size_t)B * shapes[k].in);
    acts[L].resize((size_t)B * o.classes);
    std::vector<float> dz, dprev, grad;
    RunResult run;
    run.steps.resize(o.steps);
    ScopedPin pin(o.train_cores);
    if (print) print_header();
    auto t_start = Clock::now();

    for (int step = 1; step <= o.steps; ++step) {
        Batch batch = make_batch(o, teacher, step);
        StepInfo& info = run.steps[step - 1];

        // Forward: layer k first waits for its own final ticket of the previous step.
        auto t_fwd = Clock::now();
        std::memcpy(acts[0].data(), batch.x.data(), batch.x.size() * sizeof(float));
        for (int k = 0; k < L; ++k) {
            opt.before_layer(k);
            const LayerShape& s = shapes[k];
            const float* W = params[k].data();
            gemm(workers, B, s.in, s.out, acts[k].data(), s.in, 1, W, W + s.weight_numel(), acts[k + 1].data());
            if (k < L - 1)
                for (auto& v : acts[k + 1]) v = std::tanh(v);
        }
        // Softmax cross-entropy; dz = d(mean loss)/d(logits).
        dz.assign((size_t)B * o.classes, 0.0f);
        double loss = 0;
        int correct = 0;
        for (int b = 0; b < B; ++b) {
            const float* z = &acts[L][(size_t)b * o.classes];
            float mx = *std::max_element(z, z + o.classes);
            double sum = 0;
            for (int c = 0; c < o.classes; ++c) sum += std::exp((double)(z[c] - mx));
            const int y = batch.labels[b];
            loss += std::log(sum) - (double)(z[y] - mx);
            correct += (int)(std::max_element(z, z + o.classes) - z) == y;
            for (int c = 0; c < o.classes; ++c) {
                double p = std::exp((double)(z[c] - mx)) / sum;
                dz[(size_t)b * o.classes + c] = (float)((p - (c == y ? 1.0 : 0.0)) / B);
            }
        }
        info.loss = loss / B;
        info.accuracy = (double)correct / B;
        run.forward += seconds_since(t_fwd);

        // The previous step's result is complete once every layer's final ticket is.
        if (step > 1) {
            opt.collect(run.steps[step - 2]);
            if (print && ((step - 1) % o.print_every == 0 || step - 1 == 1)) print_step(step - 1, run.steps[step - 2]);
        }

        // Backward, last layer first; each layer's gradient goes to the optimizer at once.
        auto t_bwd = Clock::now();
        opt.begin_step(step);
        for (int k = L - 1; k >= 0; --k) {
            const LayerShape& s = shapes[k];
            const float* W = params[k].data();
            if (k > 0) {
                // dA = dz * W^T reads this layer's weights: before the hand-off, which lets the
                // session step them.
                dprev.resize((size_t)B * s.in);
                backward_input(workers, B, s.in, s.out, dz.data(), W, dprev.data());
                const std::vector<float>& a = acts[k]; // tanh output of layer k-1
                for (size_t i = 0; i < dprev.size(); ++i) dprev[i] *= 1.0f - a[i] * a[i];
            }
            grad.resize(s.numel());
            // dW[i, o] = sum_b A[b, i] dz[b, o]; db[o] = sum_b dz[b, o].
            gemm(workers, s.in, B, s.out, acts[k].data(), 1, s.in, dz.data(), nullptr, grad.data());
            float* db = grad.data() + s.weight_numel();
            for (int c = 0; c < s.out; ++c) {
                float t = 0.0f;
                for (int b = 0; b < B; ++b) t += dz[(size_t)b * s.out + c];
                db[c] = t;
            }
            opt.grad_ready(k, grad.data());
            if (k > 0) dz.swap(dprev);
        }
        opt.end_step(step, info);
        run.backward += seconds_since(t_bwd);
    }
    opt.collect(run.steps[o.steps - 1]);
    if (print) print_step(o.steps, run.steps[o.steps - 1]);
    run.seconds = seconds_since(t_start);
    run.waited = opt.waited_seconds();
    run.handoff = opt.handoff_seconds();
    return run;
}

// ------------------------------------------------------------------------------------------
// main
// ------------------------------------------------------------------------------------------

double mean_loss(const RunResult& r, int first, int count) {
    double s = 0;
    for (int i = first; i < first + count; ++i) s += r.steps[i].loss;
    return s / count;
}

int run(const Options& o) {
    if (!so::abi_compatible()) {
        std::fprintf(stderr, "superoffload-demo: libsuperoffload has ABI %u, this program was built for %u\n",
                     so::abi_version(), so::header_abi_version);
        return 2;
    }
    std::vector<LayerShape> shapes = shapes_of(o);
    size_t total = 0;
    for (const auto& s : shapes) total += s.numel();
    std::printf("superoffload-demo (libsuperoffload %s)\n", so::version_string());
    std::printf("model: %d layers %d -> %d x %d -> %d, %.2f M parameters, batch %d, %d steps\n", o.layers, o.input,
                o.width, o.layers - 1, o.classes, total / 1e6, o.batch, o.steps);
    char clip[64] = "off";
    if (o.max_norm > 0) std::snprintf(clip, sizeof clip, "max_norm %g", o.max_norm);
    std::printf("AdamW peak lr %g (warmup %d, cosine decay), wd %g, clip %s, speculation %s\n", o.lr, o.warmup,
                o.weight_decay, clip, o.speculation ? "on" : "off");
    std::printf("threads: %d training (cores %s), CPU-Adam pool cores %s\n\n", o.threads,
                cores_text(o.train_cores).c_str(), cores_text(o.cores).c_str());

    if (!o.train_cores.empty() && (size_t)o.threads > o.train_cores.size())
        std::printf(
            "note: %d training threads share %zu core(s) (--train-cores %s); pass more cores, they may overlap "
            "--cores\n\n",
            o.threads, o.train_cores.size(), cores_text(o.train_cores).c_str());
    Workers workers(o.threads, o.train_cores);
    const std::vector<std::vector<float>> initial = init_params(shapes, o.seed);

    // Run 1: the session.
    std::vector<std::vector<float>> params = initial;
    RunResult run;
    uint32_t rescaled = 0, rolled_back = 0, redone = 0, clipped = 0, speculative = 0;
    {
        SessionOptimizer opt(o, shapes, params);
        run = train(o, shapes, params, opt, workers, true);
    } // the session is destroyed here; `params` holds its final master weights
    for (const auto& s : run.steps) {
        rescaled += s.rescaled;
        rolled_back += s.rolled_back;
        redone += s.redone;
        speculative += s.speculative;
        clipped += s.clip < 1.0;
    }
    const int k = std::min(5, o.steps);
    std::printf("\nloss: %.4f (mean of the first %d steps) -> %.4f (last %d)\n", mean_loss(run, 0, k), k,
                mean_loss(run, o.steps - k, k), k);
    std::printf("steps clipped: %u of %d; speculative steps %u, rescaled %u, rolled back %u, redone %u\n", clipped,
                o.steps, speculative, rescaled, rolled_back, redone);
    std::printf("session run: %.2f s (forward %.2f s, backward %.2f s incl. hand-offs %.3f s)\n", run.seconds,
                run.forward, run.backward, run.handoff);
    std::printf("training thread waited for the optimizer: %.3f s in total (%.2f ms per step, %.1f%% of the run)\n",
                run.waited, run.waited * 1e3 / o.steps, 100.0 * run.waited / run.seconds);
    if (!o.check) return 0;

    // Run 2: the reference optimizer, from the same initial weights on the same batches.
    std::vector<std::vector<float>> ref_params = initial;
    RunResult ref;
    {
        ReferenceOptimizer opt(o, shapes, ref_params);
        ref = train(o, shapes, ref_params, opt, workers, false);
    }
    std::printf("reference run: %.2f s (optimizer after backward, training thread waiting: %.3f s, %.2f ms per step)\n",
                ref.seconds, ref.waited, ref.waited * 1e3 / o.steps);

    // Compare.
    size_t differing = 0;
    double max_abs = 0;
    for (size_t l = 0; l < params.size(); ++l)
        for (size_t i = 0; i < params[l].size(); ++i) {
            float a = params[l][i], b = ref_params[l][i];
            uint32_t ua, ub;
            std::memcpy(&ua, &a, 4);
            std::memcpy(&ub, &b, 4);
            if (ua != ub) ++differing;
            double d = std::fabs((double)a - (double)b);
            if (!(d <= max_abs)) max_abs = d; // NaN propagates
        }
    int first_loss_diff = 0, first_norm_diff = 0;
    double max_loss_diff = 0;
    for (int i = 0; i < o.steps; ++i) {
        if (!first_loss_diff && run.steps[i].loss != ref.steps[i].loss) first_loss_diff = i + 1;
        if (!first_norm_diff && run.steps[i].norm != ref.steps[i].norm) first_norm_diff = i + 1;
        max_loss_diff = std::max(max_loss_diff, std::fabs(run.steps[i].loss - ref.steps[i].loss));
    }
    int first_inexact = 0;
    for (int i = 0; i < o.steps && !first_inexact; ++i)
        if (run.steps[i].rescaled + run.steps[i].rolled_back + run.steps[i].redone) first_inexact = i + 1;
    auto step_text = [](int s) { return s ? "step " + std::to_string(s) : std::string("none"); };

    std::printf("\ncheck against the reference optimizer (%.2f M weights):\n", total / 1e6);
    std::printf(
        "  first step rescaled/rolled back/redone: %s; first step whose loss differs: %s, whose norm "
        "differs: %s\n",
        step_text(first_inexact).c_str(), step_text(first_loss_diff).c_str(), step_text(first_norm_diff).c_str());
    std::printf("  weights differing: %zu of %zu, max |difference| %.3g (%.4f x lr), max loss difference %.3g\n",
                differing, total, max_abs, o.lr > 0 ? max_abs / o.lr : 0.0, max_loss_diff);
    bool ok;
    if (rescaled + rolled_back + redone == 0) {
        ok = differing == 0 && first_loss_diff == 0 && first_norm_diff == 0;
        std::printf("  no step was rescaled, rolled back or redone: the weights must be bit-identical: %s\n",
                    ok ? "they are" : "THEY ARE NOT");
    } else {
        // Before the first inexact step everything must match bit for bit; after it the runs
        // may drift apart by f32 rounding only.
        const bool exact_before = (first_loss_diff == 0 || first_loss_diff > first_inexact) &&
                                  (first_norm_diff == 0 || first_norm_diff > first_inexact);
        const double limit = o.tolerance * o.lr;
        ok = exact_before && max_abs <= limit;
        std::printf("  bit-identical up to the first rescaled step: %s; max |difference| <= %.3g x lr = %.3g: %s\n",
                    exact_before ? "yes" : "NO", o.tolerance, limit, max_abs <= limit ? "yes" : "NO");
    }
    std::printf("check %s\n", ok ? "passed" : "FAILED");
    return ok ? 0 : 1;
}

} // namespace

int main(int argc, char** argv) {
    const Options o = parse_options(argc, argv);
    try {
        return run(o);
    } catch (const so::Error& e) {
        std::fprintf(stderr, "superoffload-demo: %s (%s)\n", e.what(), e.status_description());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "superoffload-demo: %s\n", e.what());
        return 2;
    }
}
