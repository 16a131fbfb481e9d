// The installed C++ wrapper compiles on its own (the umbrella header, a topic header, and the
// C header) in a consumer, and works: a pool, a session and one step.
#include <superoffload.hpp>
#include <superoffload/session.hpp>
#include <superoffload.h>

#include <cstdio>
#include <vector>

namespace so = superoffload;

int main() {
    if (!so::abi_compatible()) return 1;
    so::Pool pool = so::Pool::create({1});
    so::SessionOptions options;
    options.set_pool(pool);
    options.speculation = so::Speculation::Off;
    so::Session session = so::Session::create(options);
    std::vector<float> w(16, 0.5f), g(16, 0.25f);
    session.add_subgroup(session.add_group(), w, {{"w", 0, w.size()}});
    session.begin_step();
    session.grad_copy(session.slice_id("w"), g);
    so::StepArgs args;
    args.max_norm = 1.0;
    const so::StepResult r = session.step_result(session.step(args));
    if (r.stepped != 1 || !(w[0] < 0.5f)) return 1;
    std::printf("superoffload %s from C++: ok\n", so::version_string());
    return 0;
}
