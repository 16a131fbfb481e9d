#include "training.hpp"

#include "kernels.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace demo {

namespace {

void print_header() {
    std::printf("%5s %8s %6s %9s %7s %5s %5s %5s %5s %5s %8s\n", "step", "loss", "acc", "|g|", "clip", "spec", "kept",
                "resc", "rback", "redo", "wait_ms");
}

void print_step(int step, const StepInfo& s) {
    std::printf("%5d %8.4f %6.3f %9.4f %7.4f %5u %5u %5u %5u %5u %8.2f%s\n", step, s.loss, s.accuracy, s.norm, s.clip,
                s.speculative, s.kept, s.rescaled, s.rolled_back, s.redone, s.exposed_ms, s.skipped ? "  skipped" : "");
}

} // namespace

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

} // namespace demo
