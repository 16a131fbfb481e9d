// A GPT-style decoder trained from C++ with libtorch, its Adam state offloaded to the CPU
// through superoffload::torch::AdamW (the component SuperOffload::torch). No Python at run time.
//
// Model: token + position embedding, L pre-norm blocks (causal self-attention through
// torch::scaled_dot_product_attention, GELU MLP), final LayerNorm, LM head tied to the token
// embedding (default) or untied (--untied). Data: synthetic sequences of a fixed random
// Markov chain, generated here from the step number (so every run and every resumed run
// sees the same batches).
//
// Placement. CUDA mode (used when torch::cuda::is_available(), unless --device cpu): the
// model's parameters are bf16 on the GPU (--param-dtype f32 for f32); the optimizer keeps f32
// master weights and both Adam moments in host memory. CPU mode: f32 parameters on the CPU,
// which are the optimizer's master weights.
//
// The optimizer: two param groups, the blocks (weight decay) and embeddings, final norm and
// head (no decay), both following a linear warm-up + cosine LR schedule set in param_groups()
// before each step; sub-groups of one block's size, so each block is a sub-group of its own.
// The model's forward calls opt.wait_for(layer) before each layer, which waits only for that
// layer's sub-groups of the previous step (CUDA: the stream waits); backward hands each
// gradient to the session as autograd produces it, so sub-groups are stepped speculatively on
// the session's CPU-Adam thread while the backward of earlier layers goes on; step() clips at
// max_norm 1.0 (torch's clip_grad_norm_ semantics) and returns at once, and the session
// publishes each sub-group's final weights into the model while the next forward already runs
// on the layers that are final.
//
// Checks (--check, default "parity,exact,resume"; exit status 1 if one fails, 2 on errors):
//   parity  the same training with torch::optim::AdamW on f32 master weights kept on the
//           model's device (CUDA: bf16 model copies refreshed after each step), same init,
//           data, schedule and clipping (torch::nn::utils::clip_grad_norm_): per-step losses
//           must agree to a mean relative difference <= --parity-tol (default 1e-3); the
//           session's losses must also show learning. With f32 parameters the two agree to
//           ~1e-7 (rounding order only); with bf16 model copies a 1-ulp difference of an f32
//           master can flip a bf16 weight, so the runs drift apart slowly: at the CUDA
//           defaults ~1.2e-4 mean.
//   exact   clipping that never triggers (max_norm 1e6, so every clip coefficient is 1 and
//           each speculative step is kept, whether its pass ran or was cancelled at step()):
//           the speculative session must end bit for bit
//           equal (losses, master weights, model weights) to a session with speculation off.
//   resume  a run with speculation off (clipping triggers; a speculative run resumes bit for
//           bit as well, see tests/reproducibility.rs) saves a checkpoint (torch::save of the
//           optimizer + the step counter) half-way; a fresh model (other init seed) and optimizer
//           load it (torch::load) and train to the end: losses and final weights must equal the
//           uninterrupted run's bit for bit.
// --save-at/--ckpt and --resume run one training in a process of its own (run.sh uses them
// to check a resume across processes, with --losses-out files compared by --compare).
// The bit-for-bit checks need a deterministic forward and backward: the program sets
// CUBLAS_WORKSPACE_CONFIG=:4096:8, turns on torch's deterministic algorithms (warn-only) and
// by default restricts scaled_dot_product_attention to the math backend (--sdpa auto lifts
// that; fused attention backwards may accumulate in a nondeterministic order).

#include <torch/torch.h>

#include <superoffload/torch.hpp>

#include "comparisons.hpp"
#include "config.hpp"
#include "markov_data.hpp"
#include "model.hpp"
#include "training_run.hpp"

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

namespace trainer {

namespace so = superoffload;

namespace {

/** Does what the command line asks: --help, --compare, one training run, or the checks. */
int run(const Args& args) {
    if (args.has("help")) {
        std::printf("%s", kUsage);
        return 0;
    }
    if (args.has("compare_a")) {
        return compare_loss_files(args.str("compare_a", ""), args.str("compare_b", ""), args.i64("from", 0));
    }
    if (!so::abi_compatible()) {
        std::fprintf(stderr, "libsuperoffload ABI %u, header %u\n", so::abi_version(), SO_ABI_VERSION);
        return 2;
    }
    Config c;
    const std::string dev = args.str("device", "auto");
    const bool have_gpu = torch::cuda::is_available();
    if (dev == "cuda" && !have_gpu) throw std::runtime_error("--device cuda: torch sees no CUDA device");
    c.cuda = dev == "cuda" || (dev == "auto" && have_gpu);
    if (dev != "auto" && dev != "cpu" && dev != "cuda") throw std::invalid_argument("--device auto|cpu|cuda");
    if (c.cuda) {
        if (!so::cuda_available())
            throw std::runtime_error("torch sees a GPU, superoffload does not (so_cuda_available)");
        c.vocab = 256, c.seq = 128, c.dim = 384, c.layers = 6, c.heads = 6, c.batch = 16, c.steps = 80, c.warmup = 8;
        c.lr = 1e-3;
    }
    c.steps = args.i64("steps", c.steps);
    c.warmup = args.i64("warmup", std::max<int64_t>(1, c.steps / 10));
    c.vocab = args.i64("vocab", c.vocab);
    c.seq = args.i64("seq", c.seq);
    c.dim = args.i64("dim", c.dim);
    c.layers = args.i64("layers", c.layers);
    c.heads = args.i64("heads", c.heads);
    c.batch = args.i64("batch", c.batch);
    c.lr = args.f64("lr", c.lr);
    c.clip = args.f64("clip", c.clip);
    c.tied = !args.has("untied");
    c.seed = static_cast<uint64_t>(args.i64("seed", static_cast<int64_t>(c.seed)));
    c.parity_tol = args.f64("parity-tol", c.parity_tol);
    c.math_sdpa = args.str("sdpa", "math") == "math";
    const std::string pd = args.str("param-dtype", c.cuda ? "bf16" : "f32");
    if (pd != "bf16" && pd != "f32") throw std::invalid_argument("--param-dtype bf16|f32");
    if (pd == "bf16" && !c.cuda) throw std::invalid_argument("--param-dtype bf16 needs CUDA (CPU parameters are f32)");
    c.bf16 = pd == "bf16";
    c.log_every = static_cast<int>(args.i64("log-every", c.log_every));
    if (c.dim % c.heads != 0) throw std::invalid_argument("--dim must be a multiple of --heads");
    if (c.steps < 2) throw std::invalid_argument("--steps must be at least 2");

    // Determinism for the bit-for-bit checks: deterministic kernels (warn where there is
    // none) and, by default, the math attention backend (fused attention backwards may
    // accumulate with atomics).
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/true);
    if (c.math_sdpa) {
        at::globalContext().setSDPUseFlash(false);
        at::globalContext().setSDPUseMemEfficient(false);
        at::globalContext().setSDPUseCuDNN(false);
        at::globalContext().setSDPUseMath(true);
    }

    const MarkovData data(c.vocab, c.data_seed, static_cast<int>(args.i64("order", 1)));
    {
        GPT probe(c);
        int64_t n = 0;
        for (auto& p : probe->parameters()) n += p.numel();
        const so::PoolInfo info = so::PoolRef::from_raw(nullptr).info();
        std::printf("superoffload %s; torch %s; mode %s, %s model parameters%s\n", so::version_string(), TORCH_VERSION,
                    c.cuda ? "CUDA (parameters on the GPU, a CUDA session)" : "CPU (a host session)",
                    c.bf16 ? "bf16" : "f32", c.cuda || have_gpu ? "" : " [no GPU]");
        std::printf("model: vocab %" PRId64 ", seq %" PRId64 ", dim %" PRId64 ", layers %" PRId64 ", heads %" PRId64
                    ", %s head, %" PRId64 " parameters in %" PRId64 " sub-groups; batch %" PRId64 ", %" PRId64
                    " steps (warm-up %" PRId64 ", peak lr %.1e, cosine), clip %.1f; session pool: %zu threads, %s\n",
                    c.vocab, c.seq, c.dim, c.layers, c.heads, c.tied ? "tied" : "untied", n, c.layers + 2, c.batch,
                    c.steps, c.warmup, c.lr, c.clip, info.num_threads, so_isa_name(info.isa));
        std::printf("data: Markov chain (order %d), entropy floor %.3f nats (uniform: %.3f)\n", data.order,
                    MarkovData::entropy(), std::log(static_cast<double>(c.vocab)));
        std::fflush(stdout);
    }

    // ---- a single run (run.sh's cross-process resume check) ----
    if (args.has("resume") || args.has("save-at") || args.has("losses-out")) {
        RunSpec s;
        s.label = args.has("resume") ? "resumed" : "train";
        // Speculation off: the resume check compares with the non-speculative reference run
        // (a speculative run repeats bit for bit as well, whatever its timing).
        s.kind = OptKind::SessionNoSpec;
        s.max_norm = c.clip;
        s.init_seed = args.has("resume") ? c.seed + 1000 : c.seed;
        s.resume_dir = args.str("resume", "");
        s.save_at = args.str("save-at", "") == "half" ? c.steps / 2 : args.i64("save-at", -1);
        s.ckpt_dir = args.str("ckpt", "ckpt");
        RunOut r = train(c, data, s);
        if (args.has("losses-out")) write_losses(args.str("losses-out", ""), r, c.steps);
        return 0;
    }

    // ---- the checks ----
    const std::string checks = args.str("check", "parity,exact,resume,gpu");
    auto want = [&](const char* k) { return checks.find(k) != std::string::npos; };
    bool ok = true;
    const int64_t half = c.steps / 2;
    const std::string ckpt = args.str("ckpt", "so_trainer_ckpt");

    if (want("parity") || want("resume")) {
        std::printf("\n== run 1: %s, clip %.1f\n", opt_name(OptKind::Session), c.clip);
        RunSpec s1{"session", OptKind::Session, c.clip, c.seed, -1, "", "", false};
        RunOut r1 = train(c, data, s1);

        // Learning: the last losses are well below the first ones.
        const size_t n5 = 5;
        double head = 0, tail = 0;
        for (size_t i = 0; i < n5; i++) head += r1.loss[i] / n5, tail += r1.loss[r1.loss.size() - 1 - i] / n5;
        const bool learned = tail < head - 0.25 * (head - MarkovData::entropy());
        std::printf("  learning: mean loss of the first 5 steps %.4f, of the last 5 %.4f -> %s\n", head, tail,
                    learned ? "ok" : "NOT LEARNING");
        ok &= learned;

        if (want("parity")) {
            std::printf("\n== run 2: %s on f32 masters on the %s%s, clip %.1f\n", opt_name(OptKind::TorchAdamW),
                        c.cuda ? "GPU" : "CPU", c.bf16 ? ", bf16 model copies" : "", c.clip);
            RunSpec s2{"torch", OptKind::TorchAdamW, c.clip, c.seed, -1, "", "", false};
            RunOut r2 = train(c, data, s2);
            double sum = 0, mx = 0, nd = 0, nmx = 0;
            for (int64_t s = 0; s < c.steps; s++) {
                const double a = r1.loss[static_cast<size_t>(s)], b = r2.loss[static_cast<size_t>(s)];
                const double rel = std::fabs(a - b) / std::max(std::fabs(b), 1e-12);
                sum += rel;
                mx = std::max(mx, rel);
                const double na = r1.norm[static_cast<size_t>(s)], nb = r2.norm[static_cast<size_t>(s)];
                const double nrel = std::fabs(na - nb) / std::max(nb, 1e-12);
                nd += nrel;
                nmx = std::max(nmx, nrel);
            }
            const double mean = sum / static_cast<double>(c.steps);
            double wmax = 0;
            for (size_t k = 0; k < r1.masters.size(); k++) {
                wmax = std::max(wmax, (r1.masters[k] - r2.masters[k]).abs().max().item<double>());
            }
            std::printf("  parity over %" PRId64
                        " steps: loss relative difference mean %.3g, max %.3g (tolerance: "
                        "mean <= %.1g); gradient norm relative difference mean %.3g, max %.3g; final master "
                        "weights max |diff| %.3g\n",
                        c.steps, mean, mx, c.parity_tol, nd / static_cast<double>(c.steps), nmx, wmax);
            for (int64_t s : {int64_t(0), int64_t(1), half, c.steps - 1}) {
                std::printf("    step %3" PRId64 ": session %.6f (norm %.4f)  torch %.6f (norm %.4f)\n", s,
                            r1.loss[static_cast<size_t>(s)], r1.norm[static_cast<size_t>(s)],
                            r2.loss[static_cast<size_t>(s)], r2.norm[static_cast<size_t>(s)]);
            }
            const bool pass = mean <= c.parity_tol && std::isfinite(mean);
            std::printf("  parity: %s\n", pass ? "PASS" : "FAIL");
            ok &= pass;
            if (r1.stats.clipped == 0) std::printf("  note: clipping never triggered in this configuration\n");
        }
        if (want("resume")) {
            // Speculation off, as run 2's reference (a speculative run repeats bit for bit as
            // well, whatever its timing).
            std::printf("\n== run 3: %s, clip %.1f, checkpoint half-way\n", opt_name(OptKind::SessionNoSpec), c.clip);
            RunSpec s3{"uninterrupted", OptKind::SessionNoSpec, c.clip, c.seed, half, ckpt, "", false};
            RunOut r3 = train(c, data, s3);
            std::printf("\n== run 3b: fresh model (init seed %" PRIu64 ") and session, resumed from %s at step %" PRId64
                        "\n",
                        c.seed + 1000, ckpt.c_str(), half);
            RunSpec s3b{"resumed", OptKind::SessionNoSpec, c.clip, c.seed + 1000, -1, "", ckpt, false};
            RunOut r3b = train(c, data, s3b);
            const bool pass = compare_exact("resume vs uninterrupted", r3b, r3, half, c.steps);
            std::printf("  resume: %s\n", pass ? "PASS" : "FAIL");
            ok &= pass;
        }
    }
    if (want("exact")) {
        std::printf("\n== runs 4 and 5: clipping that never triggers (max_norm 1e6), speculative vs speculation off\n");
        RunSpec s4{"spec", OptKind::Session, 1e6, c.seed, -1, "", "", true};
        RunSpec s5{"no-spec", OptKind::SessionNoSpec, 1e6, c.seed, -1, "", "", true};
        RunOut r4 = train(c, data, s4);
        RunOut r5 = train(c, data, s5);
        std::printf("  speculative: %.1f s, speculative steps %" PRIu64
                    " all kept: %s; speculation off: %.1f s, "
                    "stepped at step() %" PRIu64 "; final loss %.6f / %.6f\n",
                    r4.seconds, r4.stats.speculative, r4.every_step_kept ? "yes" : "NO", r5.seconds, r5.stats.stepped,
                    r4.loss.back(), r5.loss.back());
        bool pass = r4.every_step_kept && r4.stats.kept > 0 && r5.every_step_stepped;
        pass &= compare_exact("speculative vs non-speculative", r4, r5, 0, c.steps);
        std::printf("  exact: %s\n", pass ? "PASS" : "FAIL");
        ok &= pass;
        if (want("gpu") && c.cuda) {
            // The library's GPU kernel is the CPU kernels' operation sequence: keeping the
            // first sub-groups on the GPU changes no bit of the run.
            RunSpec s6{"gpu-resident", OptKind::Session, 1e6, c.seed, -1, "", "", true};
            s6.gpu_subgroups = std::max<size_t>(1, static_cast<size_t>(c.layers) / 3);
            std::printf("\n== run 6: the first %zu sub-groups on the GPU (library GPU kernel) vs all offloaded\n",
                        s6.gpu_subgroups);
            RunOut r6 = train(c, data, s6);
            bool gpu_pass = r6.every_step_kept;
            gpu_pass &= compare_exact("GPU-resident vs all offloaded", r6, r4, 0, c.steps);
            std::printf("  GPU-resident: %.1f s vs %.1f s; %s\n", r6.seconds, r4.seconds, gpu_pass ? "PASS" : "FAIL");
            ok &= gpu_pass;
        }
    }
    std::printf("\n%s\n", ok ? "ALL CHECKS PASSED" : "SOME CHECKS FAILED");
    return ok ? 0 : 1;
}

} // namespace

} // namespace trainer

int main(int argc, char** argv) {
    // Deterministic cuBLAS (needed for the bit-for-bit checks); before CUDA starts.
    setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8", 0);
    try {
        return trainer::run(trainer::parse_args(argc, argv));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 2;
    }
}
