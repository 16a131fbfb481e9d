#include "subgroup_layout.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <new>
#include <stdexcept>
#include <utility>

namespace trainer {

namespace {

/** A zeroed f32 CPU tensor on whole pages of its own: a CUDA session page-locks the master
 *  weights in place (cuMemHostRegister), so no two sub-groups should share a page. */
torch::Tensor page_aligned_f32(int64_t numel) {
    const size_t page = 4096, bytes = (static_cast<size_t>(numel) * 4 + page - 1) / page * page;
    void* p = std::aligned_alloc(page, bytes);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, bytes);
    return torch::from_blob(
        p, {numel}, [](void* q) { std::free(q); }, torch::kFloat32);
}

} // namespace

std::vector<SubGroupLayout> build_layout(GPT& model, const Config& c, torch::Device device, torch::Dtype dtype) {
    std::vector<SubGroupLayout> sgs;
    auto add = [&](const std::string& name, uint32_t group, const std::string& prefix,
                   const std::vector<std::string>& extra) {
        SubGroupLayout sg;
        sg.name = name;
        sg.group = group;
        for (auto& np : model->named_parameters()) {
            const std::string& n = np.key();
            const bool match =
                (!prefix.empty() && n.rfind(prefix, 0) == 0) || std::find(extra.begin(), extra.end(), n) != extra.end();
            if (match) sg.params.push_back(ParamRef{n, np.value(), 0, np.value().numel(), 0});
        }
        if (sg.params.empty()) throw std::logic_error("no parameters for sub-group " + name);
        sgs.push_back(std::move(sg));
    };
    add("embed", 1, "", {"tok.weight", "pos.weight"});
    for (int64_t l = 0; l < c.layers; l++) add("block" + std::to_string(l), 0, "block" + std::to_string(l) + ".", {});
    add("head", 1, "", {"ln_f.weight", "ln_f.bias", "head.weight"});

    size_t total = 0;
    torch::NoGradGuard ng;
    for (auto& sg : sgs) {
        for (auto& p : sg.params) {
            p.offset = sg.numel;
            sg.numel += p.numel;
        }
        sg.master = page_aligned_f32(sg.numel);
        for (auto& p : sg.params) sg.master.narrow(0, p.offset, p.numel).copy_(p.param.detach().reshape({-1}));
        sg.flat = sg.master.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
        for (auto& p : sg.params) p.param.set_data(sg.flat.narrow(0, p.offset, p.numel).view(p.param.sizes()));
        total += sg.params.size();
    }
    if (total != model->parameters().size()) throw std::logic_error("a parameter is in no sub-group");
    return sgs;
}

} // namespace trainer
