// Double-include check, first translation unit: superoffload.hpp is included here and in
// api_cpp_double_include.second.cpp, and both are linked into one executable. Any definition
// in the header that is not inline (or a template, or constexpr) is then defined twice and
// the link fails. Both units use every kind of entity the header defines, so each one is
// really emitted in both object files.

#include "superoffload.hpp"
#include "superoffload.hpp" // the include guard makes a second inclusion harmless

#include <cstdio>
#include <vector>

namespace so = superoffload;

// Defined in api_cpp_double_include.second.cpp.
int second_unit();

int main() {
    if (!so::abi_compatible()) {
        std::fprintf(stderr, "ABI mismatch: library %u, header %u\n", so::abi_version(), so::header_abi_version);
        return 1;
    }
    so::Pool pool = so::Pool::create({1});
    std::vector<float> p(64, 0.5f), g(64, 0.25f), m(64, 0.0f), v(64, 0.0f);
    std::vector<so::bf16> copy(64);
    auto bufs = so::make_adam_buffers(p, g, m, v);
    bufs.with_param_copy(copy.data());
    so::UpdateOptions opts;
    opts.compute_grad_sumsq = true;
    const double sumsq = so::adam_update(pool, so::Hparams(), bufs, opts).value();
    const float p_after_update = p[0];
    so::adam_rescale(pool, so::Hparams(), bufs, 1.0f, 0.5f);
    so::adam_rollback(pool, so::Hparams(), bufs, 0.5f);
    const double again = so::grad_sumsq(pool, g.data(), g.size());
    so::f16 h = so::f16::from_float(p[0]);
    int failures = 0;
    if (sumsq != again || sumsq != 64 * 0.0625) {
        std::fprintf(stderr, "sum of squares %g / %g\n", sumsq, again);
        ++failures;
    }
    // The step moved p; rollback (which also writes the copy) brought it back.
    if (!(p_after_update < 0.5f) || copy[0] != so::bf16::from_float(p[0])) {
        std::fprintf(stderr, "p after the step %g, copy %#x for p %g\n", p_after_update, copy[0].bits, p[0]);
        ++failures;
    }
    if (h.to_float() <= 0.0f || pool.info().num_threads != 1 || so::last_error_message().size() > 100000) {
        std::fprintf(stderr, "f16 %g, pool threads %zu\n", h.to_float(), pool.info().num_threads);
        ++failures;
    }
    try {
        so::check(SO_STATUS_INVALID_ARGUMENT);
        std::fprintf(stderr, "check did not throw\n");
        ++failures;
    } catch (const so::Error& e) {
        failures += e.status() == SO_STATUS_INVALID_ARGUMENT ? 0 : 1;
    }
    // Sessions, their options and the out-of-class members of checkpoint.hpp and cuda.hpp.
    so::SessionOptions so_opts;
    so_opts.set_pool(pool).set_loss_scaler(so::LossScalerOptions());
    so_opts.speculation = so::Speculation::Off;
    so::Session session = so::Session::create(so_opts);
    std::vector<float> w(32, 0.5f);
    session.add_subgroup(session.add_group(so::GroupHparams()), w, {so::Slice("w", 0, w.size())});
    session.begin_step();
    (void)session.grad_copy(0, g.data(), 32);
    so::StepArgs args;
    args.set_global_norm(1.0);
    const so::StepResult r = session.step_result(session.step(args));
    const so::SubgroupState st = session.subgroup_state(0);
    session.set_step_count(0, st.step_count);
    if (r.stepped != 1 || st.step_count != 1 || st.master != w.data() || session.device_bytes() != 0) {
        std::fprintf(stderr, "session: stepped %u, step count %llu\n", r.stepped,
                     static_cast<unsigned long long>(st.step_count));
        ++failures;
    }
    const so::CudaOptions cuda;
    if (cuda.device != 0 || (so::cuda_available() && so::Session::create_cuda().raw() == nullptr)) ++failures;
    failures += second_unit();
    if (failures != 0) {
        std::fprintf(stderr, "api_cpp_double_include: %d failure(s)\n", failures);
        return 1;
    }
    std::printf("api_cpp_double_include: ok (%s)\n", so::version_string());
    return 0;
}
