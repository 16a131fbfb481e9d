// superoffload::torch::AdamW on the CPU: its weights after every step bit for bit those of a
// session driven directly over the same gradients (clipping that triggers, a learning rate
// that changes each step, two interleaved param groups), for two layouts; a run resumed
// through torch::save / torch::load bit for bit the uninterrupted one; and its errors.

#include <superoffload/torch.hpp>

#include <torch/torch.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

namespace so = superoffload;
namespace sot = superoffload::torch;

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
    std::printf("%s: %s\n", ok ? "ok" : "FAILED", what.c_str());
    if (!ok) failures++;
}

/** Three layers; each waits for its own weights when an optimizer is given. */
struct NetImpl : torch::nn::Module {
    explicit NetImpl(bool with_unused = false) {
        l1 = register_module("l1", torch::nn::Linear(16, 32));
        l2 = register_module("l2", torch::nn::Linear(32, 32));
        l3 = register_module("l3", torch::nn::Linear(32, 4));
        if (with_unused) unused = register_module("unused", torch::nn::Linear(4, 4));
    }
    torch::Tensor forward(const torch::Tensor& x, sot::AdamW* opt) {
        auto layer = [&](torch::nn::Linear& l, const torch::Tensor& in) {
            if (opt != nullptr) opt->wait_for(*l);
            return l(in);
        };
        return layer(l3, torch::tanh(layer(l2, torch::tanh(layer(l1, x)))));
    }
    torch::nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr}, unused{nullptr};
};
TORCH_MODULE(Net);

Net make_net(uint64_t seed, bool with_unused = false) {
    torch::manual_seed(seed);
    return Net(with_unused);
}

/** The batch of step `step`, the same for every run. */
std::pair<torch::Tensor, torch::Tensor> batch(int step) {
    torch::manual_seed(1000 + step);
    return {torch::randn({64, 16}), torch::randn({64, 4})};
}

double lr_at(int step) { return 1e-2 * (1.0 + 0.1 * step); }

/** Weights with decay, biases without: two groups whose parameters interleave in forward order. */
std::vector<torch::optim::OptimizerParamGroup> decay_groups(Net& net) {
    std::vector<torch::Tensor> weights, biases;
    for (auto& np : net->named_parameters()) {
        (np.key().find("bias") != std::string::npos ? biases : weights).push_back(np.value());
    }
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(weights, std::make_unique<torch::optim::AdamWOptions>(
                                     torch::optim::AdamWOptions(lr_at(0)).weight_decay(0.1).betas({0.9, 0.95})));
    groups.emplace_back(biases, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(lr_at(0)).weight_decay(0.0).betas({0.9, 0.95})));
    return groups;
}

void set_lr(sot::AdamW& opt, double lr) {
    for (auto& g : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(g.options()).lr(lr);
}

torch::Tensor train_step(Net& net, sot::AdamW& opt, int step) {
    auto [x, y] = batch(step);
    set_lr(opt, lr_at(step));
    auto loss = torch::mse_loss(net->forward(x, &opt), y);
    loss.backward();
    opt.step();
    return loss;
}

bool bits_equal(const torch::Tensor& a, const torch::Tensor& b) {
    auto x = a.detach().contiguous(), y = b.detach().contiguous();
    return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() &&
           std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.numel()) * x.element_size()) == 0;
}

bool same_weights(Net& a, Net& b) {
    auto pa = a->parameters(), pb = b->parameters();
    for (size_t i = 0; i < pa.size(); i++) {
        if (!bits_equal(pa[i], pb[i])) return false;
    }
    return true;
}

using Layout = std::vector<std::vector<std::string>>; // sub-groups of parameter names, in order

/** The same training through a session driven by hand: the sub-groups of `layout`, the
 *  gradients handed over after backward, the master weights copied into the model. */
std::vector<double> train_reference(Net& net, int steps, double max_norm, const Layout& layout) {
    so::SessionOptions options;
    options.speculation = so::Speculation::On;
    so::Session session = so::Session::create(options);
    so::GroupHparams hp[2];
    for (int g = 0; g < 2; g++) {
        hp[g].lr = lr_at(0), hp[g].beta1 = 0.9, hp[g].beta2 = 0.95, hp[g].eps = 1e-8;
        hp[g].weight_decay = g == 0 ? 0.1 : 0.0;
        session.add_group(hp[g]);
    }
    auto named = net->named_parameters();
    struct Place {
        torch::Tensor param;
        size_t subgroup, offset;
        uint32_t slice;
    };
    std::vector<Place> places; // in the order of the layout
    std::vector<std::vector<float>> masters(layout.size());
    for (size_t k = 0; k < layout.size(); k++) {
        std::vector<so::Slice> slices;
        for (const std::string& name : layout[k]) {
            const auto p = named[name].detach().contiguous();
            places.push_back({named[name], k, masters[k].size(), 0});
            slices.emplace_back(name, masters[k].size(), static_cast<size_t>(p.numel()));
            masters[k].insert(masters[k].end(), p.data_ptr<float>(), p.data_ptr<float>() + p.numel());
        }
        const uint32_t group = layout[k][0].find("bias") != std::string::npos ? 1 : 0;
        session.add_subgroup(group, masters[k], slices);
        for (size_t j = 0; j < layout[k].size(); j++) {
            places[places.size() - layout[k].size() + j].slice = session.slice_id(layout[k][j]);
        }
    }
    std::vector<double> norms;
    for (int step = 0; step < steps; step++) {
        for (int g = 0; g < 2; g++) {
            hp[g].lr = lr_at(step);
            session.set_group(static_cast<uint32_t>(g), hp[g]);
        }
        auto [x, y] = batch(step);
        net->zero_grad();
        torch::mse_loss(net->forward(x, nullptr), y).backward();
        session.begin_step();
        for (const Place& pl : places) {
            const auto grad = pl.param.grad().contiguous();
            session.grad_copy(pl.slice, grad.data_ptr<float>(), static_cast<size_t>(grad.numel()));
        }
        so::StepArgs args;
        args.max_norm = max_norm;
        norms.push_back(session.step_result(session.step(args)).global_norm);
        torch::NoGradGuard no_grad;
        for (Place& pl : places) {
            pl.param.copy_(
                torch::from_blob(masters[pl.subgroup].data() + pl.offset, pl.param.sizes(), torch::kFloat32));
        }
    }
    return norms;
}

/** The optimizer against the session driven by hand with the layout the optimizer should make. */
void check_against_session(size_t sub_group_numel, const Layout& layout) {
    const int steps = 8;
    const double max_norm = 0.05; // below the gradients' norm: every step is clipped
    Net ref = make_net(7);
    const std::vector<double> ref_norms = train_reference(ref, steps, max_norm, layout);

    Net net = make_net(7);
    sot::Options options;
    options.max_grad_norm = max_norm;
    options.speculation = so::Speculation::On;
    options.sub_group_numel = sub_group_numel;
    sot::AdamW opt(*net, decay_groups(net), {}, options);
    bool norms_equal = true, clipped = true;
    for (int step = 0; step < steps; step++) {
        train_step(net, opt, step);
        const so::StepResult r = opt.last_result();
        if (r.global_norm != ref_norms[static_cast<size_t>(step)]) {
            std::printf("    step %d: global norm %.17g, the directly driven session's %.17g\n", step, r.global_norm,
                        ref_norms[static_cast<size_t>(step)]);
            norms_equal = false;
        }
        clipped &= r.clip_coef < 1.0;
    }
    opt.wait_all();
    const std::string what = "sub_group_numel " + std::to_string(sub_group_numel);
    expect(opt.num_subgroups() == layout.size(), what + ": " + std::to_string(opt.num_subgroups()) + " sub-groups");
    expect(clipped, what + ": every step clipped");
    expect(norms_equal, what + ": global norms equal the directly driven session's");
    expect(same_weights(net, ref),
           what + ": weights after " + std::to_string(steps) + " steps bit for bit the directly driven session's");
    expect(opt.step_count() == static_cast<uint64_t>(steps), what + ": step count");
}

void check_resume() {
    const int half = 4, steps = 8;
    const std::string path = "torch_adamw_test.pt";
    sot::Options options;
    options.max_grad_norm = 0.5;

    Net a = make_net(11);
    sot::AdamW opt_a(*a, decay_groups(a), {}, options);
    for (int step = 0; step < half; step++) train_step(a, opt_a, step);
    torch::save(opt_a, path);
    for (int step = half; step < steps; step++) train_step(a, opt_a, step);
    opt_a.wait_all();

    Net b = make_net(12); // another init: the checkpoint brings the weights
    sot::AdamW opt_b(*b, decay_groups(b), {}, options);
    torch::load(opt_b, path);
    const double lr = static_cast<const torch::optim::AdamWOptions&>(opt_b.param_groups()[0].options()).lr();
    expect(lr == lr_at(half - 1), "load() restores the param groups' learning rate");
    expect(opt_b.step_count() == static_cast<uint64_t>(half), "load() restores the step count");
    for (int step = half; step < steps; step++) train_step(b, opt_b, step);
    opt_b.wait_all();
    expect(same_weights(a, b),
           "resumed through torch::save / torch::load: weights bit for bit the uninterrupted run's");
    std::remove(path.c_str());
}

void expect_error(const std::function<void()>& f, so_status status, const std::string& needle,
                  const std::string& what) {
    try {
        f();
        expect(false, what + " (no error)");
    } catch (const so::Error& e) {
        const bool ok = e.status() == status && std::string(e.what()).find(needle) != std::string::npos;
        expect(ok, what + ": " + e.what());
    }
}

void check_errors() {
    expect_error(
        [] {
            Net net = make_net(1);
            net->to(torch::kBFloat16);
            sot::AdamW opt(*net);
        },
        SO_STATUS_INVALID_ARGUMENT, "float32 on the CPU", "bf16 CPU parameters are refused");
    expect_error(
        [] {
            Net net = make_net(1);
            sot::AdamW opt(*net);
            opt.step();
        },
        SO_STATUS_INVALID_STATE, "without a backward", "step() without a backward");
    expect_error(
        [] {
            Net net = make_net(1, /*with_unused=*/true);
            sot::AdamW opt(*net);
            auto [x, y] = batch(0);
            torch::mse_loss(net->forward(x, &opt), y).backward();
            opt.step();
        },
        SO_STATUS_INVALID_STATE, "unused.weight", "a parameter without a gradient is named");
    expect_error(
        [] {
            Net a = make_net(1), b = make_net(1);
            sot::AdamW opt_a(*a), opt_b(*b, decay_groups(b));
            torch::serialize::OutputArchive out;
            opt_a.save(out);
            std::ostringstream bytes;
            out.save_to(bytes);
            torch::serialize::InputArchive in;
            std::istringstream read(bytes.str());
            in.load_from(read);
            opt_b.load(in);
        },
        SO_STATUS_BAD_CHECKPOINT, "another layout", "a checkpoint of another layout is refused");
}

} // namespace

int main() {
    torch::set_num_threads(1);
    try {
        // One sub-group per parameter, in forward order.
        check_against_session(0, {{"l1.weight"}, {"l1.bias"}, {"l2.weight"}, {"l2.bias"}, {"l3.weight"}, {"l3.bias"}});
        // Packed per param group up to 600 elements; the biases' sub-group takes its place at l1.bias.
        check_against_session(600, {{"l1.weight"}, {"l1.bias", "l2.bias", "l3.bias"}, {"l2.weight"}, {"l3.weight"}});
        check_resume();
        check_errors();
    } catch (const std::exception& e) {
        std::printf("FAILED: %s\n", e.what());
        return 1;
    }
    std::printf("%s\n", failures == 0 ? "all checks passed" : "SOME CHECKS FAILED");
    return failures == 0 ? 0 : 1;
}
