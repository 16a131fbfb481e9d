// Tests of the session part of include/superoffload.hpp: a training loop through the wrapper
// (typed bf16 gradients from containers, a caller gradient buffer written in place, two
// groups with an LR schedule, clipping, a skipped step, a late gradient, micro-steps, a given
// norm, hyperparameters changed between backward and step) checked against so::adam_update on
// the full gradients with the factor the session reports; move semantics of Session
// (construction, assignment over a live session, release/adopt, empty handles, a move with
// work in flight); exceptions carrying the C status and message (library errors, and the
// wrapper's own type and size checks); timeouts reported as false / std::nullopt, never as
// exceptions; TicketStatus from query; save/load with std::string paths.

#include "superoffload.hpp"

#include "session_test.h"
#include "so_test.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace so = superoffload;
using namespace std::chrono_literals;

namespace {

using so_test::contains;
using so_test::Rng;
using so_test::same_bits;

// ---- compile-time properties --------------------------------------------------------------

static_assert(!std::is_copy_constructible_v<so::Session> && !std::is_copy_assignable_v<so::Session>,
              "Session is move-only");
static_assert(std::is_nothrow_move_constructible_v<so::Session> && std::is_nothrow_move_assignable_v<so::Session>,
              "Session moves never throw");
static_assert(std::is_nothrow_destructible_v<so::Session> && std::is_nothrow_default_constructible_v<so::Session>,
              "an empty Session is free to make and destroy");
static_assert(std::is_same_v<so::Ticket, so_ticket> && so::no_ticket == 0, "tickets are so_ticket");
static_assert(std::is_convertible_v<std::chrono::milliseconds, so::Timeout> &&
                  std::is_convertible_v<std::chrono::duration<double>, so::Timeout> &&
                  std::is_convertible_v<std::chrono::hours, so::Timeout>,
              "any duration is a Timeout");
static_assert(so::forever.is_forever() && so::forever.c_ns() < 0 && so::Timeout().is_forever(), "forever");
static_assert(std::is_trivially_copyable_v<so::Timeout>, "Timeout is a value");

// SFINAE probes: which element types and containers the typed calls take.
template <class G, class = void>
struct can_grad_copy : std::false_type {};
template <class G>
struct can_grad_copy<
    G, std::void_t<decltype(std::declval<so::Session&>().grad_copy(0u, std::declval<const G*>(), std::size_t{1}))>>
    : std::true_type {};
template <class C, class = void>
struct can_register : std::false_type {};
template <class C>
struct can_register<C, std::void_t<decltype(std::declval<so::Session&>().add_subgroup(
                           0u, std::declval<C&>(), std::declval<const std::vector<so::Slice>&>()))>> : std::true_type {
};

static_assert(can_grad_copy<float>::value && can_grad_copy<so::bf16>::value && can_grad_copy<so::f16>::value,
              "gradients of the three element types");
static_assert(!can_grad_copy<double>::value && !can_grad_copy<std::uint16_t>::value, "no other element types");
static_assert(can_register<std::vector<float>>::value && can_register<std::vector<so::bf16>>::value,
              "master weights from containers");
static_assert(!can_register<const std::vector<float>>::value, "borrowed master weights must be writable");
static_assert(!can_register<std::vector<double>>::value, "no double master weights");

// ---- helpers -------------------------------------------------------------------------------

std::string temp_path(const char* tag) {
    char buf[512];
    so_st_temp_path(buf, sizeof buf, tag);
    return buf;
}

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

void test_timeout() {
    EXPECT(so::Timeout(1ms).c_ns() == 1000000);
    EXPECT(so::Timeout(2s).c_ns() == 2000000000);
    EXPECT(so::Timeout(0ns).c_ns() == 0);
    EXPECT(so::Timeout(-5ms).c_ns() == 0);                                           // an expired timeout polls
    EXPECT(so::Timeout(std::chrono::duration<double, std::nano>(1.25)).c_ns() == 2); // rounded up
    EXPECT(so::Timeout(std::chrono::duration<double>(std::numeric_limits<double>::quiet_NaN())).c_ns() == 0);
    EXPECT(so::Timeout(std::chrono::hours::max()).is_forever());
    EXPECT(so::Timeout(std::chrono::nanoseconds::max()).is_forever());
    EXPECT(!so::Timeout(std::chrono::hours(24 * 365)).is_forever());
    EXPECT(so::Timeout(std::chrono::duration<double>(std::numeric_limits<double>::infinity())).is_forever());
}

void test_options() {
    const so_session_options c = so_session_options_default();
    const so::SessionOptions o;
    EXPECT(o.struct_size == sizeof(so_session_options) && o.pool == nullptr && o.cores == nullptr && o.num_cores == 0 &&
           o.loss_scaler == nullptr);
    EXPECT(o.mode == c.mode && o.mode == so::Mode::AdamW && o.bias_correction == c.bias_correction);
    EXPECT(o.moment_dtype == c.moment_dtype && o.grad_dtype == c.grad_dtype && o.accum_dtype == c.accum_dtype &&
           o.copy_dtype == c.copy_dtype && o.grad_dtype == so::DType::F32 && o.copy_dtype == so::DType::None);
    EXPECT(o.speculation == c.speculation && o.speculation == so::Speculation::Auto &&
           o.host_memory_limit == c.host_memory_limit && o.amsgrad == c.amsgrad &&
           o.gpu_budget_bytes == c.gpu_budget_bytes);
    EXPECT(&o.to_c() == static_cast<const so_session_options*>(&o));

    // The owned pointers stay valid in copies, and in a moved-from object.
    so::SessionOptions owner;
    so::LossScalerOptions settings;
    settings.init_scale = 8.0f;
    owner.set_cores({3, 1}).set_loss_scaler(settings);
    EXPECT(owner.num_cores == 2 && owner.cores[0] == 3 && owner.cores[1] == 1);
    EXPECT(owner.loss_scaler != nullptr && owner.loss_scaler->init_scale == 8.0f &&
           owner.loss_scaler->struct_size == sizeof(so_loss_scaler_options));
    so::SessionOptions copied = owner;
    so::SessionOptions moved = std::move(owner);
    EXPECT(owner.cores[0] == 3 && owner.loss_scaler->init_scale == 8.0f); // NOLINT(bugprone-use-after-move)
    owner.set_cores({}).clear_loss_scaler();
    EXPECT(owner.cores == nullptr && owner.num_cores == 0 && owner.loss_scaler == nullptr);
    EXPECT(copied.cores[1] == 1 && moved.cores[0] == 3 && copied.loss_scaler->init_scale == 8.0f);
    so::Pool one = so::Pool::create({1});
    EXPECT(so::SessionOptions().set_pool(one).pool == one.raw() &&
           so::SessionOptions().set_pool(nullptr).pool == nullptr);
    const so::SessionOptions from_c(c);
    EXPECT(from_c.grad_dtype == c.grad_dtype && from_c.struct_size == sizeof(so_session_options));

    const so_group_hparams gc = so_group_hparams_default();
    so::GroupHparams g;
    EXPECT(g.lr == gc.lr && g.beta1 == gc.beta1 && g.beta2 == gc.beta2 && g.eps == gc.eps &&
           g.weight_decay == gc.weight_decay);
    g.lr = 0.5;
    const so_group_hparams back = g.to_c();
    EXPECT(back.struct_size == sizeof back && back.lr == 0.5 && so::GroupHparams(back) == g && g != so::GroupHparams());

    const so_loss_scaler_options lc = so_loss_scaler_options_default();
    so::LossScalerOptions ls;
    EXPECT(ls.init_scale == lc.init_scale && ls.growth_interval == lc.growth_interval && ls.min_scale == lc.min_scale);
    ls.hysteresis = 3;
    EXPECT(ls.to_c().hysteresis == 3 && ls.to_c().struct_size == sizeof(so_loss_scaler_options));

    so::StepArgs a;
    so_step_args ac = a.to_c();
    EXPECT(ac.struct_size == sizeof ac && ac.max_norm == 0.0 && ac.norm_source == SO_NORM_SOURCE_LOCAL && !ac.overflow);
    EXPECT(!a.global_norm().has_value() && a.norm_source == so::NormSource::Local);
    a.set_global_norm(2.5).overflow = true;
    ac = a.to_c();
    EXPECT(ac.norm_source == SO_NORM_SOURCE_GIVEN && ac.global_norm == 2.5 && ac.overflow);
    EXPECT(a.global_norm() == 2.5 && so::StepArgs(ac).global_norm() == 2.5);
    a.set_global_norm(std::nullopt);
    EXPECT(a.to_c().norm_source == SO_NORM_SOURCE_LOCAL && !a.global_norm().has_value());

    so_step_result rc;
    std::memset(&rc, 0, sizeof rc);
    rc.serial = 7;
    rc.rescaled = 3;
    rc.grad_factor = 0.25f;
    const so::StepResult r(rc);
    EXPECT(r.serial == 7 && r.rescaled == 3 && r.grad_factor == 0.25f && !r.skipped);
    EXPECT(r.struct_size == sizeof(so_step_result) && r.skip_reason == so::SkipReason::None);
    const so::StepResult zero;
    EXPECT(zero.serial == 0 && zero.clip_coef == 1.0 && zero.struct_size == sizeof(so_step_result));

    const so::Slice sl("w", 4, 6);
    const so::Slice sl_copy = sl;
    EXPECT(std::string(sl_copy.name) == "w" && sl_copy.name == sl.name && sl.offset == 4 && sl.numel == 6);
    EXPECT(sl.name_string() == "w");

    so::SubgroupState state;
    EXPECT(state.struct_size == sizeof(so_subgroup_state) && state.master == nullptr);
}

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

void test_move_semantics() {
    so::Session a = so::Session::create();
    so_session* const raw = a.raw();
    EXPECT(raw != nullptr && static_cast<bool>(a));
    so::Session b(std::move(a));
    EXPECT(b.raw() == raw && !a && a.raw() == nullptr); // NOLINT(bugprone-use-after-move): the point
    // Calls on an empty handle throw (the C call gets NULL).
    std::string msg = EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)a.add_group());
    EXPECT(contains(msg, "so_session_add_group") && contains(msg, "session is NULL"));
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)a.host_bytes());
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)a.query(1));
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, a.wait(0));
    a.reset(); // no-op on an empty handle
    EXPECT(b.add_group() == 0);

    // Move assignment over a live session destroys that one.
    so::SessionOptions bf;
    bf.grad_dtype = so::DType::Bf16;
    so::Session c = so::Session::create(bf);
    c = std::move(b);
    EXPECT(c.raw() == raw && !b && c.grad_dtype() == so::DType::F32); // dtypes move with the handle
    EXPECT(c.group(0) == so::GroupHparams());
    b = std::move(a); // empty into empty
    EXPECT(!a && !b);

    // release / adopt hand ownership to C and back.
    so_session* released = c.release();
    EXPECT(!c && released == raw);
    so::Session adopted = so::Session::adopt(released, so::DType::F32, so::DType::F32);
    EXPECT(adopted.raw() == raw && adopted.add_group() == 1);
    EXPECT(!so::Session::adopt(nullptr, so::DType::F32, so::DType::F32));
    adopted.reset();
    EXPECT(!adopted);

    // A move with work in flight: the new owner's destruction completes it.
    std::vector<float> w(1 << 18, 0.5f);
    std::vector<float> g(w.size(), 0.01f);
    {
        so::Session first = so::Session::create();
        first.add_group();
        first.add_subgroup(0, w, {{"w", 0, w.size()}});
        first.begin_step();
        EXPECT(first.grad_copy(0, g) != so::no_ticket);
        first.step();
        so::Session second = std::move(first);
    } // second is destroyed here, with the speculative step and the step possibly queued
    bool all_stepped = true;
    for (float x : w) all_stepped = all_stepped && x < 0.5f;
    EXPECT(all_stepped);
}

void test_exceptions() {
    so::SessionOptions ams;
    ams.amsgrad = true;
    std::string msg = EXPECT_ERROR(SO_STATUS_UNSUPPORTED, (void)so::Session::create(ams));
    EXPECT(contains(msg, "so_session_create") && contains(msg, "AMSGrad") && msg == so::last_error_message());
    so::SessionOptions both;
    so::Pool pool = so::Pool::create({1});
    both.set_pool(pool);
    both.set_cores({0});
    EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::Session::create(both));
    so::SessionOptions scaler;
    so::LossScalerOptions shrinking;
    shrinking.growth_factor = 0.5f;
    scaler.set_loss_scaler(shrinking);
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::Session::create(scaler));
    EXPECT(contains(msg, "growth_factor"));

    so::SessionOptions o;
    o.grad_dtype = so::DType::Bf16;
    o.speculation = so::Speculation::On; // a speculative step's failure is checked below
    so::Session s = so::Session::create(o);
    so::GroupHparams bad;
    bad.beta1 = 1.0;
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.add_group(bad));
    EXPECT(contains(msg, "beta1"));
    s.add_group();
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, s.set_group(3, so::GroupHparams()));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.group(3));
    std::vector<float> w(100, 0.5f), other(100, 0.5f);
    std::vector<so::bf16> bf_buf(100);
    msg = EXPECT_ERROR(SO_STATUS_ALIASING, (void)s.add_subgroup(0, w, {{"a", 0, 60}, {"b", 50, 50}}));
    EXPECT(contains(msg, "so_session_add_subgroup") && contains(msg, "overlap"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.add_subgroup(0, w, {{std::string("a\0b", 3), 0, 100}}));
    EXPECT(contains(msg, "NUL"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.add_subgroup(0, w, {{"a", 0, 100}}, bf_buf));
    EXPECT(contains(msg, "superoffload::Session::add_subgroup") && contains(msg, "accum_dtype"));
    std::vector<float> short_grad(99);
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.add_subgroup(0, w, {{"a", 0, 100}}, short_grad));
    EXPECT(contains(msg, "99"));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.add_subgroup(4, w, {{"a", 0, 100}}));
    EXPECT(s.add_subgroup(0, w, {{"a", 0, 60}, {"b", 60, 40}}) == 0);
    msg = EXPECT_ERROR(SO_STATUS_ALIASING, (void)s.add_subgroup(0, w.data() + 10, 10, {{"c", 0, 10}}));
    EXPECT(contains(msg, "sub-group 0"));
    msg = EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.slice_id("nope"));
    EXPECT(contains(msg, "so_session_slice_id") && contains(msg, "nope"));

    std::vector<so::bf16> g60(60, so::bf16::from_float(0.01f)), g40(40, so::bf16::from_float(0.01f));
    std::vector<float> wrong(60, 0.01f);
    EXPECT_ERROR(SO_STATUS_INVALID_STATE, (void)s.grad_copy(0, g60));
    EXPECT_ERROR(SO_STATUS_INVALID_STATE, (void)s.step());
    s.begin_step();
    msg = EXPECT_ERROR(SO_STATUS_INVALID_STATE, s.begin_step());
    EXPECT(contains(msg, "so_session_begin_step"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.grad_copy(0, wrong)); // f32 into a bf16 session
    EXPECT(contains(msg, "superoffload::Session::grad_copy") && contains(msg, "grad_dtype") && contains(msg, "f32"));
    EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.grad_copy(0, wrong.data(), so::DType::F32, 60));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.grad_copy(0, g40));
    EXPECT(contains(msg, "60 elements"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.grad_written(0));
    EXPECT(contains(msg, "session-owned"));
    EXPECT_ERROR(SO_STATUS_INVALID_STATE, s.next_micro_step());
    EXPECT(s.grad_copy(0, g60) == so::no_ticket);
    const so::Ticket t = s.grad_copy(1, g40);
    EXPECT(t != so::no_ticket);
    so::StepArgs neg;
    neg.max_norm = -1.0;
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)s.step(neg));
    EXPECT(contains(msg, "max_norm"));
    const so::Ticket st = s.step();
    EXPECT(st > t);
    EXPECT_ERROR(SO_STATUS_INVALID_STATE, (void)s.step());
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.step_result(t));
    msg = EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.query(st + 100));
    EXPECT(contains(msg, "never issued"));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, s.wait(st + 100));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.wait_all(st + 100, 0ms));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.final_ticket(5));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, (void)s.step_count(5));
    EXPECT_ERROR(SO_STATUS_NOT_FOUND, s.remove_subgroup(5));
    // The speculative step was kept, whether its pass ran or was cancelled at step().
    const so::StepResult kept = s.step_result(st);
    EXPECT(kept.kept == 1);

    // A failed ticket: query reports it, waiting throws it.
    s.begin_step();
    std::vector<so::bf16> nan40(40, so::bf16::from_float(0.01f));
    nan40[7] = so::bf16::from_bits(0x7FC0);
    (void)s.grad_copy(0, g60);
    const so::Ticket bad_t = s.grad_copy(1, nan40);
    msg = EXPECT_ERROR(SO_STATUS_NON_FINITE, s.wait(bad_t));
    EXPECT(contains(msg, "so_ticket_wait") && contains(msg, "sub-group 0"));
    EXPECT_ERROR(SO_STATUS_NON_FINITE, (void)s.wait(bad_t, 0ms)); // complete: a failure, not a timeout
    const so::TicketStatus q = s.query(bad_t);
    EXPECT(q.failed() && !q.done() && !q.pending() && q.state == so::TicketState::Failed);
    EXPECT(q.error.has_value() && q.error->status() == SO_STATUS_NON_FINITE &&
           contains(q.error->what(), "so_ticket_query"));
    EXPECT(s.query(t).done() && !s.query(t).error.has_value() && s.query(so::no_ticket).done());
    EXPECT_ERROR(SO_STATUS_NON_FINITE, s.wait_all(bad_t));
    const so::StepResult r = s.step_result(s.step());
    EXPECT(r.skipped && r.rolled_back == 0 && r.speculative == 1);

    // Checkpoints with std::string paths.
    const std::string path = temp_path("cpp-errors");
    s.save(path);
    s.load(path);
    {
        std::FILE* f = std::fopen(path.c_str(), "r+b");
        EXPECT(f != nullptr);
        if (f != nullptr) {
            std::fseek(f, -5, SEEK_END);
            std::fputc('x', f);
            std::fclose(f);
        }
    }
    msg = EXPECT_ERROR(SO_STATUS_BAD_CHECKPOINT, s.load(path));
    EXPECT(contains(msg, "so_session_load") && contains(msg, "checksum"));
    std::remove(path.c_str());
    msg = EXPECT_ERROR(SO_STATUS_IO, s.load(path));
    EXPECT(contains(msg, path.c_str()));
    EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, s.save(std::string("x\0y", 3)));
    EXPECT(s.step_count(0) == 1);
}

void test_timeouts() {
    // A large sub-group on one portable thread: its steps take tens of milliseconds, and
    // everything queued behind it is pending meanwhile.
    so::PoolOptions po;
    po.num_threads = 1;
    po.isa = so::Isa::Portable;
    so::SessionOptions o;
    so::Pool pool = so::Pool::create(po);
    o.set_pool(pool);
    so::Session s = so::Session::create(o);
    s.add_group();
    std::vector<float> big(std::size_t(1) << 22, 0.5f), small(16, 0.5f);
    std::vector<float> g_big(big.size(), 0.01f), g_small(16, 0.01f);
    EXPECT(s.add_subgroup(0, big, {{"big", 0, big.size()}}) == 0);
    EXPECT(s.add_subgroup(0, small, {{"small", 0, 16}}) == 1);
    EXPECT(s.final_ticket(0) == so::no_ticket && s.step_count(0) == 0);

    s.begin_step();
    const so::Ticket t_big = s.grad_copy(0, g_big);
    const so::Ticket t_small = s.grad_copy(1, g_small);
    EXPECT(t_big == 1 && t_small == 2);
    const so::TicketStatus q = s.query(t_small);
    EXPECT(q.pending() && !q.error.has_value());
    EXPECT(!s.wait(t_small, 0ms));
    EXPECT(!s.wait(t_small, 100us));
    EXPECT(!s.wait_all(t_small, std::chrono::duration<double>(0.0)));
    const double sumsq = s.local_grad_sumsq(); // the sums of squares were taken at hand-over
    EXPECT(sumsq > 0.0);
    EXPECT(s.wait(t_small, so::forever) && s.wait_all(t_small, 10s) && s.query(t_small).done());

    so::StepArgs args;
    args.max_norm = 0.5 * std::sqrt(sumsq); // both rescale; the big one takes a while
    const so::Ticket st = s.step(args);
    EXPECT(s.final_ticket(0) > t_small && s.final_ticket(0) < s.final_ticket(1) && s.final_ticket(1) < st);
    EXPECT(s.query(st).pending());
    EXPECT(!s.step_result(st, 0ms).has_value());
    // The next step's preparation queues behind this step's final passes, which nothing
    // preempts (a preparation does preempt a speculative pass, so it is not asked earlier).
    s.begin_step(1.0f);
    EXPECT(!s.local_grad_sumsq(0ms).has_value());
    const std::optional<so::StepResult> r = s.step_result(st, 10s);
    EXPECT(r.has_value() && r->rescaled == 2 && r->clip_coef < 0.6);
    EXPECT(s.wait(st, 0ms) && s.step_count(0) == 1 && s.step_count(1) == 1);
    EXPECT(s.loss_scale() == 1.0f);
    EXPECT(s.local_grad_sumsq() == 0.0); // no gradient handed over: every slice counts as zero
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
    test_timeout();
    test_options();
    test_training_loop();
    test_move_semantics();
    test_exceptions();
    test_timeouts();
    test_checkpoint_resume();
    return so_test::finish("api_cpp_session");
}
