#include "comparisons.hpp"

#include "text_files.hpp"

#include <cinttypes>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>

namespace trainer {

namespace {

bool bits_equal(const torch::Tensor& a, const torch::Tensor& b) {
    auto x = a.contiguous(), y = b.contiguous();
    return x.scalar_type() == y.scalar_type() && x.numel() == y.numel() &&
           std::memcmp(x.data_ptr(), y.data_ptr(), static_cast<size_t>(x.numel()) * x.element_size()) == 0;
}

} // namespace

bool compare_exact(const char* what, const RunOut& a, const RunOut& b, int64_t from, int64_t steps) {
    bool ok = true;
    int shown = 0;
    for (int64_t s = from; s < steps; s++) {
        const double x = a.loss[static_cast<size_t>(s)], y = b.loss[static_cast<size_t>(s)];
        if (std::memcmp(&x, &y, sizeof x) != 0) {
            ok = false;
            if (shown++ < 5) std::printf("    step %" PRId64 ": loss %.9g vs %.9g (diff %.3g)\n", s, x, y, x - y);
        }
    }
    for (size_t k = 0; k < a.masters.size(); k++) {
        if (!bits_equal(a.masters[k], b.masters[k])) {
            ok = false;
            const double d = (a.masters[k] - b.masters[k]).abs().max().item<double>();
            const int64_t n = (a.masters[k] != b.masters[k]).sum().item<int64_t>();
            std::printf("    parameter %zu master weights differ: %" PRId64 " elements, max |diff| %.3g\n", k, n, d);
        }
        if (!bits_equal(a.model[k], b.model[k])) {
            ok = false;
            std::printf("    parameter %zu model weights differ\n", k);
        }
    }
    std::printf("  %s: losses of steps %" PRId64 "..%" PRId64 " and final master + model weights %s\n", what, from,
                steps - 1, ok ? "bit-identical" : "DIFFER");
    return ok;
}

void write_losses(const std::string& path, const RunOut& r, int64_t steps) {
    std::ofstream f(path);
    for (int64_t s = r.first_step; s < steps; s++) {
        char line[128];
        std::snprintf(line, sizeof line, "%" PRId64 " %a %.9g\n", s, r.loss[static_cast<size_t>(s)],
                      r.loss[static_cast<size_t>(s)]);
        f << line;
    }
    if (!f) throw std::runtime_error("cannot write " + path);
}

int compare_loss_files(const std::string& pa, const std::string& pb, int64_t from) {
    auto load = [](const std::string& p) {
        std::map<int64_t, std::string> m;
        std::istringstream in(read_text(p));
        int64_t s;
        std::string hex, dec;
        while (in >> s >> hex >> dec) m[s] = hex + " (" + dec + ")";
        return m;
    };
    auto a = load(pa), b = load(pb);
    int compared = 0, bad = 0;
    for (auto& kv : a) {
        if (kv.first < from) continue;
        auto it = b.find(kv.first);
        if (it == b.end()) continue;
        compared++;
        if (it->second != kv.second) {
            if (bad++ < 5)
                std::printf("  step %" PRId64 ": %s vs %s\n", kv.first, kv.second.c_str(), it->second.c_str());
        }
    }
    std::printf("compare %s %s from step %" PRId64 ": %d steps compared, %d differ\n", pa.c_str(), pb.c_str(), from,
                compared, bad);
    return compared > 0 && bad == 0 ? 0 : 1;
}

} // namespace trainer
