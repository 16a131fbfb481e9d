// Tests of the session part of include/superoffload.hpp: a training loop through the wrapper
// (typed bf16 gradients from containers, a caller gradient buffer written in place, two
// groups with an LR schedule, clipping, a skipped step, a late gradient, micro-steps, a given
// norm, hyperparameters changed between backward and step) checked against so::adam_update on
// the full gradients with the factor the session reports; a run resumed from a checkpoint
// equal bit for bit to one that did not stop; the sub-group state in place, and a sub-group
// from a C description with caller moment buffers.

#include "superoffload.hpp"

#include "session_test.h"
#include "so_test.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace so = superoffload;
using namespace std::chrono_literals;

namespace {

using so_test::Rng;
using so_test::same_bits;
using so_test::temp_path;

// ---- helpers -------------------------------------------------------------------------------

// A sub-group's state as the tests compare it.
struct SgState {
    std::vector<float> p, m, v;
};

struct SliceInfo {
    std::string name;
    std::size_t sg, offset, numel;
};

// Moments (and master weights) of every sub-group, read through a checkpoint.
std::vector<SgState> read_state(so::Session& s, const std::vector<std::vector<float>*>& masters,
                                const std::vector<SliceInfo>& slices, const std::string& path) {
    s.save(path);
    so_st_ckpt c = so_st_ckpt_read(path.c_str());
    std::vector<SgState> out(masters.size());
    for (std::size_t sg = 0; sg < masters.size(); ++sg) {
        const std::size_t n = masters[sg]->size();
        out[sg].p = *masters[sg];
        out[sg].m.assign(n, 0.0f);
        out[sg].v.assign(n, 0.0f);
    }
    for (const SliceInfo& sl : slices) {
        so_st_ckpt_copy_f32(&c, "exp_avg", sl.name.c_str(), out[sl.sg].m.data() + sl.offset, sl.numel);
        so_st_ckpt_copy_f32(&c, "exp_avg_sq", sl.name.c_str(), out[sl.sg].v.data() + sl.offset, sl.numel);
        std::vector<float> master(sl.numel);
        so_st_ckpt_copy_f32(&c, "master", sl.name.c_str(), master.data(), sl.numel);
        EXPECT(std::memcmp(master.data(), out[sl.sg].p.data() + sl.offset, sl.numel * sizeof(float)) == 0);
    }
    so_st_ckpt_free(&c);
    std::remove(path.c_str());
    return out;
}

// ---- run-time tests ------------------------------------------------------------------------

// What the session must have done with a sub-group (as predicted by the test).
enum class Outcome { Untouched, Kept, Stepped, Rescaled, RolledBack, Redone };

void test_training_loop() {
    so::Pool pool = so::Pool::create({2});
    so::Pool ref_pool = so::Pool::create({1});
    so::SessionOptions opts;
    opts.set_pool(pool);
    opts.grad_dtype = so::DType::Bf16;
    opts.speculation = so::Speculation::On; // the paths predicted below are the speculative ones
    so::Session s = so::Session::create(opts);
    pool.reset(); // the session holds its own reference
    EXPECT(s.grad_dtype() == so::DType::Bf16 && s.accum_dtype() == so::DType::F32);

    auto schedule = [](std::uint32_t group, int step) {
        so::GroupHparams h;
        const double warm = std::min(1.0, (step + 1) / 4.0);
        if (group == 0) {
            h.lr = 1e-3 * warm;
        } else {
            h.lr = 5e-4 * warm;
            h.beta1 = 0.85;
            h.weight_decay = 0.0;
        }
        return h;
    };
    EXPECT(s.add_group(schedule(0, 0)) == 0);
    EXPECT(s.add_group(schedule(1, 0)) == 1);

    Rng rng{7};
    std::vector<float> m0(1200), m1(800), m2(333), grad2(333, 0.0f);
    for (auto* m : {&m0, &m1, &m2}) {
        for (float& x : *m) x = static_cast<float>(0.5 * rng.uniform());
    }
    EXPECT(s.add_subgroup(0, m0, {{"emb", 0, 1000}, {"emb.ln", 1000, 200}}) == 0);
    EXPECT(s.add_subgroup(0, m1.data(), m1.size(), {{"blk", 0, 800}}) == 1);
    EXPECT(s.add_subgroup(1, m2, {{"out.w", 0, 300}, {"out.b", 300, 33}}, grad2) == 2); // written in place
    const std::vector<SliceInfo> slices = {
        {"emb", 0, 0, 1000}, {"emb.ln", 0, 1000, 200}, {"blk", 1, 0, 800}, {"out.w", 2, 0, 300}, {"out.b", 2, 300, 33}};
    std::vector<std::uint32_t> ids;
    for (const SliceInfo& sl : slices) ids.push_back(s.slice_id(sl.name));
    EXPECT(ids == (std::vector<std::uint32_t>{0, 1, 2, 3, 4}));
    const std::vector<std::vector<float>*> masters = {&m0, &m1, &m2};
    const std::string path = temp_path("cpp-loop");

    struct Plan {
        float loss_scale;
        std::uint32_t micro;
        bool clip, overflow, late, given_norm;
        int changed_group;
    };
    const Plan plan[] = {
        {128.f, 1, false, false, false, false, -1}, {128.f, 1, true, false, false, false, -1},
        {128.f, 1, false, true, false, false, -1},  {64.f, 1, false, false, true, false, -1},
        {64.f, 2, true, false, false, false, -1},   {64.f, 1, true, false, false, true, -1},
        {1.f, 2, false, false, false, true, 1},     {1.f, 1, false, false, false, false, -1},
    };
    std::vector<SgState> before = read_state(s, masters, slices, path);
    std::uint64_t counts[3] = {0, 0, 0};
    int exact_steps = 0, tolerance_checks = 0;
    for (int step = 0; step < static_cast<int>(sizeof plan / sizeof plan[0]); ++step) {
        const Plan& ev = plan[step];
        so::GroupHparams spec_hp[2] = {schedule(0, step), schedule(1, step)};
        so::GroupHparams final_hp[2] = {spec_hp[0], spec_hp[1]};
        s.set_group(0, spec_hp[0]);
        s.set_group(1, spec_hp[1]);
        EXPECT(s.group(1) == spec_hp[1]);

        s.begin_step(ev.loss_scale, ev.micro);
        std::vector<std::vector<float>> acc = {std::vector<float>(1200, 0.0f), std::vector<float>(800, 0.0f),
                                               std::vector<float>(333, 0.0f)};
        std::vector<std::vector<float>> spec_grad(3);
        so::Ticket spec_ticket[3] = {0, 0, 0};
        for (std::uint32_t micro = 0; micro < ev.micro; ++micro) {
            if (micro > 0) s.next_micro_step();
            for (std::size_t k = slices.size(); k-- > 0;) {
                const SliceInfo& sl = slices[k];
                std::vector<so::bf16> g(sl.numel);
                for (auto& x : g) x = so::bf16::from_float(static_cast<float>(0.01 * rng.uniform() * ev.loss_scale));
                float* dst = acc[sl.sg].data() + sl.offset;
                so::Ticket t = so::no_ticket;
                if (sl.sg == 2) {
                    // In place: the caller accumulates, as torch does into .grad.
                    for (std::size_t j = 0; j < sl.numel; ++j) {
                        const float x = g[j].to_float();
                        grad2[sl.offset + j] = micro == 0 ? x : grad2[sl.offset + j] + x;
                    }
                    t = s.grad_written(ids[k]);
                } else if (k % 2 == 0) {
                    t = s.grad_copy(ids[k], g); // container
                } else {
                    t = s.grad_copy(ids[k], g.data(), g.size()); // typed pointer
                }
                for (std::size_t j = 0; j < sl.numel; ++j) {
                    dst[j] = micro == 0 ? g[j].to_float() : dst[j] + g[j].to_float();
                }
                const bool completes = micro + 1 == ev.micro && (k == 0 || k == 2 || k == 3);
                EXPECT((t != so::no_ticket) == completes);
                if (completes) {
                    spec_ticket[sl.sg] = t;
                    spec_grad[sl.sg] = acc[sl.sg];
                }
            }
        }
        bool late_sg[3] = {false, false, false};
        if (ev.late) {
            std::vector<so::bf16> g(200);
            for (auto& x : g) x = so::bf16::from_float(static_cast<float>(0.01 * rng.uniform() * ev.loss_scale));
            EXPECT(s.grad_copy(ids[1], static_cast<const void*>(g.data()), so::DType::Bf16, g.size()) == so::no_ticket);
            for (std::size_t j = 0; j < 200; ++j) acc[0][1000 + j] += g[j].to_float();
            late_sg[0] = true;
        }
        if (ev.changed_group >= 0) {
            final_hp[ev.changed_group].lr *= 0.5;
            final_hp[ev.changed_group].eps *= 2.0;
            s.set_group(static_cast<std::uint32_t>(ev.changed_group), final_hp[ev.changed_group]);
        }
        for (so::Ticket t : spec_ticket) EXPECT(s.wait(t, 10s));

        const float unscale = static_cast<float>(1.0 / ev.loss_scale);
        double local = 0.0; // per slice, in forward order, as the session takes them at hand-over
        for (const SliceInfo& sl : slices)
            local += so::grad_sumsq(ref_pool, acc[sl.sg].data() + sl.offset, sl.numel, unscale);
        so::StepArgs args;
        args.max_norm = ev.clip ? 0.5 * std::sqrt(local) : 0.0;
        args.overflow = ev.overflow;
        if (ev.given_norm) {
            const double sumsq = s.local_grad_sumsq();
            EXPECT(sumsq == local);
            args.set_global_norm(std::sqrt(sumsq));
        }
        const so::Ticket st = s.step(args);
        const so::StepResult r = s.step_result(st);
        const double clip = ev.overflow ? 1.0
                            : ev.clip   ? std::min(1.0, args.max_norm / (std::sqrt(local) + 1e-6))
                                        : 1.0;
        const float factor = static_cast<float>(clip / ev.loss_scale);
        EXPECT(r.serial == static_cast<std::uint64_t>(step + 1) && r.skipped == ev.overflow);
        EXPECT(r.grad_factor == factor && r.clip_coef == clip && r.loss_scale == ev.loss_scale);
        EXPECT(r.late_gradients == (ev.late ? 1u : 0u) && r.speculative == 3);

        // Per sub-group: prediction, then comparison with the plain step from the state before.
        std::vector<SgState> after = read_state(s, masters, slices, path);
        std::uint32_t tally[6] = {0, 0, 0, 0, 0, 0};
        bool exact = true;
        for (std::size_t sg = 0; sg < 3; ++sg) {
            const std::uint32_t group = sg == 2 ? 1 : 0;
            Outcome o = Outcome::Kept;
            if (ev.overflow) {
                o = Outcome::RolledBack;
            } else if (late_sg[sg] || ev.changed_group == static_cast<int>(group)) {
                o = Outcome::Redone;
            } else if (factor != unscale) {
                o = Outcome::Rescaled;
            }
            ++tally[static_cast<int>(o)];
            SgState want = before[sg];
            if (!ev.overflow) {
                so::Hparams hp;
                hp.lr = final_hp[group].lr;
                hp.beta1 = final_hp[group].beta1;
                hp.beta2 = final_hp[group].beta2;
                hp.eps = final_hp[group].eps;
                hp.weight_decay = final_hp[group].weight_decay;
                hp.step = counts[sg] + 1;
                so::UpdateOptions uo;
                uo.grad_scale = factor;
                (void)so::adam_update(ref_pool, hp, so::make_adam_buffers(want.p, acc[sg], want.m, want.v), uo);
                ++counts[sg];
            }
            EXPECT(s.step_count(static_cast<std::uint32_t>(sg)) == counts[sg]);
            if (o == Outcome::Kept || o == Outcome::Untouched || o == Outcome::Stepped) {
                EXPECT(same_bits(after[sg].p, want.p) && same_bits(after[sg].m, want.m) &&
                       same_bits(after[sg].v, want.v));
                continue;
            }
            // Rescaled, rolled back, redone: within 2^-16 of the magnitude of each value
            // (relative to |value| + the natural scale of its terms: lr for the weights, the
            // scaled gradient for m, its square for v). f32 rounding through these paths stays
            // around 1e-6 of that (api_session_training checks tight bounds); a wrong factor,
            // a missing rollback or a lost gradient is off by 1e-2 or more.
            exact = false;
            const double lr = final_hp[group].lr;
            for (std::size_t j = 0; j < want.p.size(); ++j) {
                const double g = std::fabs(acc[sg][j] * static_cast<double>(unscale));
                const double gs =
                    spec_grad[sg].empty() ? 0.0 : std::fabs(spec_grad[sg][j] * static_cast<double>(unscale));
                const double tol = 0x1.0p-16;
                const bool ok = std::fabs(after[sg].p[j] - want.p[j]) <= tol * (std::fabs(want.p[j]) + lr) &&
                                std::fabs(after[sg].m[j] - want.m[j]) <= tol * (std::fabs(want.m[j]) + g + gs) &&
                                std::fabs(after[sg].v[j] - want.v[j]) <= tol * (want.v[j] + g * g + gs * gs);
                if (!ok) {
                    std::fprintf(stderr, "step %d sub-group %zu element %zu: p %.9g/%.9g m %.9g/%.9g v %.9g/%.9g\n",
                                 step, sg, j, static_cast<double>(after[sg].p[j]), static_cast<double>(want.p[j]),
                                 static_cast<double>(after[sg].m[j]), static_cast<double>(want.m[j]),
                                 static_cast<double>(after[sg].v[j]), static_cast<double>(want.v[j]));
                    ++so_test::failures;
                    break;
                }
                ++tolerance_checks;
            }
        }
        EXPECT(r.kept == tally[static_cast<int>(Outcome::Kept)]);
        EXPECT(r.rescaled == tally[static_cast<int>(Outcome::Rescaled)]);
        EXPECT(r.rolled_back == tally[static_cast<int>(Outcome::RolledBack)]);
        EXPECT(r.redone == tally[static_cast<int>(Outcome::Redone)]);
        EXPECT(r.stepped == 0);
        exact_steps += exact;
        before = after;
    }
    EXPECT(exact_steps >= 2 && tolerance_checks > 0);
    EXPECT(s.host_bytes() == (1200 + 800 + 333) * 8 + (1200 + 800) * 4 + 1200 * 4); // + one late buffer
}

void test_checkpoint_resume() {
    // N steps + save + load into a fresh session + N steps == 2N steps, through the wrapper.
    auto make = [](std::vector<float>& w, std::uint64_t seed) {
        so::SessionOptions o;
        // Clipping triggers, speculation on: both runs write the same bits whatever the timing.
        o.speculation = so::Speculation::On;
        so::LossScalerOptions scaler;
        scaler.init_scale = 256.0f;
        scaler.growth_interval = 2;
        o.set_loss_scaler(scaler);
        so::Session s = so::Session::create(o);
        s.add_group();
        Rng rng{seed};
        for (float& x : w) x = static_cast<float>(rng.uniform());
        s.add_subgroup(0, w, {{"x", 0, 300}, {"y", 300, 212}});
        return s;
    };
    auto run = [](so::Session& s, int from, int to) {
        for (int step = from; step < to; ++step) {
            s.begin_step();
            const float scale = s.loss_scale();
            for (std::uint32_t slice : {1u, 0u}) {
                std::vector<float> g(slice == 0 ? 300 : 212);
                Rng rng{static_cast<std::uint64_t>(step * 2 + static_cast<int>(slice))};
                for (float& x : g) x = static_cast<float>(0.01 * rng.uniform() * scale);
                (void)s.grad_copy(slice, g);
            }
            so::StepArgs a;
            a.max_norm = 0.05;
            a.overflow = step == 3;
            EXPECT(s.step_result(s.step(a)).skipped == (step == 3));
        }
    };
    std::vector<float> w1(512), w2(512), w3(512);
    so::Session straight = make(w1, 1), first = make(w2, 1), resumed = make(w3, 2);
    run(straight, 0, 8);
    run(first, 0, 4);
    const std::string path = temp_path("cpp-resume");
    first.save(path);
    resumed.load(path);
    EXPECT(w3 == w2 && resumed.loss_scale() == first.loss_scale());
    run(resumed, 4, 8);
    EXPECT(same_bits(w1, w3) && straight.loss_scale() == resumed.loss_scale());
    EXPECT(straight.step_count(0) == 7 && resumed.step_count(0) == 7);

    // The state in place: the borrowed master weights, the session's moments, the step count.
    const so::SubgroupState st = resumed.subgroup_state(0);
    EXPECT(st.placement == so::Placement::Host && st.numel == 512 && st.master == w3.data());
    EXPECT(st.master_dtype == so::DType::F32 && st.moment_dtype == so::DType::F32 && st.step_count == 7);
    EXPECT(st.exp_avg != nullptr && st.exp_avg_sq != nullptr);
    resumed.set_step_count(0, 9);
    EXPECT(resumed.step_count(0) == 9 && resumed.subgroup_state(0).step_count == 9);
    resumed.set_step_count(0, 7);
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)resumed.subgroup_state(4));

    // A sub-group from a C description, with caller moment buffers.
    std::vector<float> w4(64, 0.5f), m4(64, 0.0f), v4(64, 0.0f);
    const so::Slice z("z", 0, 64);
    so_subgroup_desc desc = so_subgroup_desc_default();
    desc.group = 0;
    desc.master = w4.data();
    desc.master_dtype = so::DType::F32;
    desc.numel = w4.size();
    desc.slices = &z;
    desc.num_slices = 1;
    desc.exp_avg = m4.data();
    desc.exp_avg_sq = v4.data();
    EXPECT(resumed.add_subgroup(desc) == 1);
    EXPECT(resumed.subgroup_state(1).exp_avg == m4.data() && resumed.slice_id("z") == 2);
    const std::vector<SliceInfo> slices = {{"x", 0, 0, 300}, {"y", 0, 300, 212}};
    const std::vector<SgState> a = read_state(straight, {&w1}, slices, path);
    const std::vector<SgState> b = read_state(resumed, {&w3}, slices, path);
    EXPECT(same_bits(a[0].m, b[0].m) && same_bits(a[0].v, b[0].v));
}

} // namespace

int main() {
    test_training_loop();
    test_checkpoint_resume();
    return so_test::finish("api_cpp_session");
}
