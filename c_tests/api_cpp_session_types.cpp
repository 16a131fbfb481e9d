// Tests of the session part of include/superoffload.hpp: compile-time properties of Session,
// Timeout and the typed calls (which element types and containers they take); Timeout's
// conversions; the option, argument and result types against their C defaults; move
// semantics of Session (construction, assignment over a live session, release/adopt, empty
// handles, a move with work in flight).

#include "superoffload.hpp"

#include "so_test.hpp"

#include <chrono>
#include <cstdint>
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
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)a.id());
    EXPECT(b.id() != 0 && b.id() != so::Session::create().id());
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

} // namespace

int main() {
    test_timeout();
    test_options();
    test_move_semantics();
    return so_test::finish("api_cpp_session_types");
}
