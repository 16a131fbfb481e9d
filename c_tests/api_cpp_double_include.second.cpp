// Double-include check, second translation unit (see api_cpp_double_include.cpp): uses the
// same header entities, with different template arguments too, so every inline function,
// inline variable and class member is emitted here as well.

#include "superoffload.hpp"

#include <cstdio>
#include <string>
#include <vector>

namespace so = superoffload;

int second_unit() {
    int failures = 0;
    if (so::abi_version() != so::header_abi_version || std::string(so::version_string()).empty()) {
        ++failures;
    }
    so::PoolOptions options;
    options.num_threads = 2;
    options.isa = so::Isa::Portable;
    so::Pool pool = so::Pool::create(options);
    so::Pool moved = std::move(pool);
    const so::PoolInfo info = so::PoolRef(moved).info();
    if (info.num_threads != 2 || info.isa != so::Isa::Portable ||
        std::string(so::isa_name(info.isa)) != info.isa_name()) {
        ++failures;
    }
    std::vector<so::bf16> p(100, so::bf16::from_float(1.0f)), g(100, so::bf16::from_float(-1.0f));
    std::vector<so::bf16> m(100, so::bf16::from_float(0.0f)), v(100, so::bf16::from_float(0.0f));
    std::vector<so::f16> copy(100);
    so::AdamBuffers bufs(p.data(), g.data(), m.data(), v.data(), p.size());
    bufs.with_param_copy(copy.data()).without_param_copy().with_param_copy(copy.data());
    so::Hparams hp;
    hp.mode = so::Mode::L2;
    hp.lr = 0.1f; // a step that bf16 parameters can see
    const so::UpdateOptions opts;
    if (so::adam_update(nullptr, hp, bufs, opts).has_value()) {
        ++failures;
    }
    if (!(p[0].to_float() > 1.0f) || copy[0] != so::f16::from_float(p[0].to_float())) {
        ++failures; // a negative gradient makes p grow
    }
    if (so::grad_sumsq(nullptr, static_cast<const void*>(g.data()), so::DType::Bf16, g.size(), 2.0f) != 400.0) {
        ++failures;
    }
    try {
        so::adam_rollback(moved, hp, bufs.raw(), 1.0f); // bf16 params: unsupported
        ++failures;
    } catch (const so::Error& e) {
        failures += e.status() == SO_STATUS_UNSUPPORTED ? 0 : 1;
    }
    // Sessions, their options and the out-of-class members of checkpoint.hpp and cuda.hpp.
    so::SessionOptions so_opts;
    so_opts.set_cores({}).clear_loss_scaler();
    so_opts.grad_dtype = so::DType::Bf16;
    so::Session session = so::Session::create(so_opts);
    std::vector<so::bf16> w(8, so::bf16::from_float(1.0f));
    session.add_subgroup(session.add_group(), w, {{"w", 0, 8}});
    if ((session.*(&so::Session::subgroup_state))(0).master != w.data() ||
        (session.*(&so::Session::pinned_bytes))() != 0 || so::StepArgs().global_norm()) {
        ++failures;
    }
    if (!session) { // never: the calls make this unit use the members of cuda.hpp too
        session.set_placement(0, so::Placement::Host);
        (void)session.grad_device(0, 0, 0, so::DType::F32, nullptr);
        session.set_compute_stream(session.copy_stream());
        session.enqueue_wait(so::no_ticket, nullptr);
        session.load(std::string());
    }
    if (failures != 0) {
        std::fprintf(stderr, "api_cpp_double_include.second: %d failure(s)\n", failures);
    }
    return failures;
}
