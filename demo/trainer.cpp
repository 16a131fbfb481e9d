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
//
// The sources: options (the command line), model (the layers, their initial weights, the
// teacher and the batches), threads and kernels (the training threads and the loops of the
// forward and backward), optimizer, session_optimizer and reference_optimizer (the interface
// and the two optimizers), training (the training loop) and this file (both runs and the
// check).

#include "model.hpp"
#include "options.hpp"
#include "reference_optimizer.hpp"
#include "session_optimizer.hpp"
#include "threads.hpp"
#include "training.hpp"
#include "superoffload.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

namespace so = superoffload;

namespace demo {

namespace {

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

} // namespace demo

int main(int argc, char** argv) {
    const demo::Options o = demo::parse_options(argc, argv);
    try {
        return demo::run(o);
    } catch (const so::Error& e) {
        std::fprintf(stderr, "superoffload-demo: %s (%s)\n", e.what(), e.status_description());
        return 2;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "superoffload-demo: %s\n", e.what());
        return 2;
    }
}
