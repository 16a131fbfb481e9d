// Tests of include/superoffload.hpp, the header-only C++17 wrapper: every entry point, move
// semantics of Pool, exceptions (status and message), and that the typed buffers drive the
// library exactly as a hand-filled so_adam_buffers does (same bits out).

#include "superoffload.hpp"

#include "so_test.hpp"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <sched.h>
#endif

namespace so = superoffload;

namespace {

using so_test::contains;
using so_test::Rng;
using so_test::same_bits;

template <class T>
T from_float(float x) {
    if constexpr (std::is_same_v<T, float>) {
        return x;
    } else {
        return T::from_float(x);
    }
}

template <class T>
std::vector<T> random_vector(Rng& rng, std::size_t n, float scale, bool non_negative = false) {
    std::vector<T> out(n);
    for (std::size_t i = 0; i < n; ++i) {
        const float value = static_cast<float>(rng.uniform()) * scale;
        out[i] = from_float<T>(non_negative ? std::fabs(value) : value);
    }
    return out;
}

// SFINAE probes: can adam_rollback / adam_rescale be called with these typed buffers?
template <class B, class = void>
struct can_rollback : std::false_type {};
template <class B>
struct can_rollback<B, std::void_t<decltype(so::adam_rollback(so::PoolRef{}, std::declval<const so::Hparams&>(),
                                                              std::declval<const B&>(), 1.0f))>> : std::true_type {};
template <class B, class = void>
struct can_rescale : std::false_type {};
template <class B>
struct can_rescale<B, std::void_t<decltype(so::adam_rescale(so::PoolRef{}, std::declval<const so::Hparams&>(),
                                                            std::declval<const B&>(), 1.0f, 0.5f))>> : std::true_type {
};
template <class G, class = void>
struct can_sumsq : std::false_type {};
template <class G>
struct can_sumsq<G, std::void_t<decltype(so::grad_sumsq(so::PoolRef{}, std::declval<const G*>(), std::size_t{1}))>>
    : std::true_type {};

// ---- compile-time properties --------------------------------------------------------------

static_assert(!std::is_copy_constructible_v<so::Pool> && !std::is_copy_assignable_v<so::Pool>, "Pool is move-only");
static_assert(std::is_nothrow_move_constructible_v<so::Pool> && std::is_nothrow_move_assignable_v<so::Pool>,
              "Pool moves never throw");
static_assert(std::is_nothrow_destructible_v<so::Pool>, "destroying a Pool never throws");
static_assert(!std::is_constructible_v<so::PoolRef, so::Pool&&>, "no PoolRef to a temporary Pool");
static_assert(std::is_convertible_v<std::nullptr_t, so::PoolRef> && std::is_convertible_v<const so::Pool&, so::PoolRef>,
              "PoolRef from nullptr or a Pool");
static_assert(std::is_trivially_copyable_v<so::PoolRef>, "PoolRef is a pointer");

static_assert(so::is_element_v<float> && so::is_element_v<so::bf16> && so::is_element_v<so::f16>, "elements");
static_assert(!so::is_element_v<double> && !so::is_element_v<std::uint16_t> && !so::is_element_v<const float>,
              "non-elements are rejected");
static_assert(so::dtype_of<so::bf16>::value == so::DType::Bf16 && so::dtype_of<so::f16>::value == so::DType::F16 &&
                  so::dtype_of<float>::value == so::DType::F32,
              "dtype codes");
static_assert(static_cast<std::uint32_t>(so::DType::Bf16) == SO_DTYPE_BF16, "DType mirrors so_dtype");
static_assert(static_cast<std::uint32_t>(so::Isa::Avx512) == SO_ISA_AVX512, "Isa mirrors so_isa");
static_assert(static_cast<std::uint32_t>(so::Mode::L2) == SO_ADAM_MODE_L2, "Mode mirrors so_adam_mode");
static_assert(so::is_moment_element_v<float> && so::is_moment_element_v<so::bf16> && !so::is_moment_element_v<so::f16>,
              "moments are float or bf16");
static_assert(so::is_copy_element_v<so::bf16> && so::is_copy_element_v<so::f16> && !so::is_copy_element_v<float>,
              "copies are bf16 or f16");

static_assert(can_rollback<so::AdamBuffers<float, so::bf16, float>>::value, "rollback on f32 master weights");
static_assert(!can_rollback<so::AdamBuffers<so::bf16, so::bf16, float>>::value, "no rollback of bf16 params");
static_assert(!can_rollback<so::AdamBuffers<float, float, so::bf16>>::value, "no rollback of bf16 moments");
static_assert(can_rescale<so::AdamBuffers<float, so::f16, float>>::value, "rescale on f32 master weights");
static_assert(!can_rescale<so::AdamBuffers<so::f16, so::f16, float>>::value, "no rescale of f16 params");
static_assert(can_sumsq<so::bf16>::value && can_sumsq<float>::value && !can_sumsq<double>::value, "typed sumsq");

// Class template argument deduction picks the element types from the pointers.
static_assert(
    std::is_same_v<decltype(so::AdamBuffers(static_cast<float*>(nullptr), static_cast<const so::bf16*>(nullptr),
                                            static_cast<float*>(nullptr), static_cast<float*>(nullptr), 0)),
                   so::AdamBuffers<float, so::bf16, float>>,
    "CTAD");

// ---- run-time tests ------------------------------------------------------------------------

void test_versions() {
    EXPECT(so::abi_compatible());
    EXPECT(so::abi_version() == so::header_abi_version);
    EXPECT(so::header_abi_version == SO_ABI_VERSION);
    const std::string expected = std::to_string(SO_VERSION_MAJOR) + "." + std::to_string(SO_VERSION_MINOR) + "." +
                                 std::to_string(SO_VERSION_PATCH);
    EXPECT(std::string(so::version_string()) == expected);
    EXPECT(std::string(so::status_str(SO_STATUS_OK)) == so_status_str(SO_STATUS_OK));
    EXPECT(std::string(so::isa_name(so::Isa::Avx2)) == "avx2");
    EXPECT(std::string(so::isa_name(so::Isa::Auto)) == "auto");
}

void test_check_and_error() {
    so::check(SO_STATUS_OK); // no throw

    // A failing C call, then check(): the error carries its status and the library's message.
    double out = 0.0;
    const so_status st = so_grad_sumsq(nullptr, nullptr, SO_DTYPE_F32, 4, 1.0f, &out);
    EXPECT(st == SO_STATUS_NULL_ARGUMENT);
    const std::string raw_message = so::last_error_message();
    EXPECT(contains(raw_message, "so_grad_sumsq"));
    const std::string msg = EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, so::check(st));
    EXPECT(msg == raw_message);

    // Error is a std::runtime_error.
    so::Error e(SO_STATUS_ALIASING, "x overlaps y");
    const std::runtime_error& base = e;
    EXPECT(std::string(base.what()) == "x overlaps y");
    EXPECT(e.status() == SO_STATUS_ALIASING);
    so::Error copy = e;
    EXPECT(copy.status() == SO_STATUS_ALIASING && std::string(copy.what()) == "x overlaps y");
}

#ifdef __linux__
std::vector<std::uint32_t> allowed_cores() {
    cpu_set_t set;
    CPU_ZERO(&set);
    std::vector<std::uint32_t> cores;
    if (sched_getaffinity(0, sizeof set, &set) == 0) {
        for (int c = 0; c < CPU_SETSIZE; ++c) {
            if (CPU_ISSET(c, &set)) {
                cores.push_back(static_cast<std::uint32_t>(c));
            }
        }
    }
    return cores;
}
#endif

void test_pool() {
    // Default pool through a null PoolRef.
    const so::PoolRef default_ref;
    EXPECT(default_ref.is_default() && default_ref.raw() == nullptr);
    const so::PoolInfo dinfo = default_ref.info();
    EXPECT(dinfo.threads >= 1);
    EXPECT(dinfo.isa != so::Isa::Auto);
    EXPECT(std::string(dinfo.isa_name) == so::isa_name(dinfo.isa));
    EXPECT(!dinfo.pinned);
    EXPECT(so::PoolRef(nullptr).is_default());

    // Explicit options.
    so::PoolOptions two;
    two.threads = 2;
    so::Pool pool = so::Pool::create(two);
    EXPECT(static_cast<bool>(pool) && pool.raw() != nullptr);
    so::PoolInfo info = pool.info();
    EXPECT(info.threads == 2 && !info.pinned && info.isa == dinfo.isa);
    EXPECT(so::PoolRef(pool).raw() == pool.raw());
    EXPECT(so::PoolRef::from_raw(pool.raw()).info().threads == 2);

    // Aggregate initialisation, default options.
    so::Pool one = so::Pool::create({1});
    EXPECT(one.info().threads == 1);
    so::Pool dflt = so::Pool::create();
    EXPECT(dflt.info().threads == dinfo.threads);

    so::PoolOptions portable;
    portable.threads = 1;
    portable.isa = so::Isa::Portable;
    so::Pool p1 = so::Pool::create(portable);
    EXPECT(p1.info().isa == so::Isa::Portable && std::string(p1.info().isa_name) == "portable");

#ifdef __linux__
    const std::vector<std::uint32_t> cores = allowed_cores();
    EXPECT(!cores.empty());
    if (!cores.empty()) {
        so::PoolOptions pinned;
        pinned.cores = {cores[0]};
        so::Pool pp = so::Pool::create(pinned);
        so::PoolInfo pi = pp.info();
        EXPECT(pi.pinned && pi.threads == 1);

        so::PoolOptions mismatch;
        mismatch.cores = {cores[0]};
        mismatch.threads = 3;
        std::string m = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::Pool::create(mismatch));
        EXPECT(contains(m, "so_pool_create"));

        so::PoolOptions twice;
        twice.cores = {cores[0], cores[0]};
        m = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::Pool::create(twice));
        EXPECT(contains(m, "twice"));
    }
    so::PoolOptions bad_core;
    bad_core.cores = {100000};
    const std::string m = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::Pool::create(bad_core));
    EXPECT(contains(m, "affinity"));
    EXPECT(m == so::last_error_message());
#endif

    // Move construction: the source becomes empty.
    so_pool* const raw = pool.raw();
    so::Pool moved(std::move(pool));
    EXPECT(moved.raw() == raw);
    EXPECT(!pool && pool.raw() == nullptr); // NOLINT(bugprone-use-after-move): the point of the test
    // An empty Pool is not silently the default pool.
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, so::PoolRef r(pool); (void)r);
    EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)pool.info());
    pool.reset(); // resetting an empty Pool is a no-op

    // Move assignment: the target's old pool is destroyed, the source becomes empty.
    so::Pool target = so::Pool::create({1});
    target = std::move(moved);
    EXPECT(target.raw() == raw && !moved);
    EXPECT(target.info().threads == 2);
    moved = std::move(pool); // empty into empty
    EXPECT(!moved && !pool);

    // release / adopt hand ownership to C and back.
    so_pool* const released = target.release();
    EXPECT(!target && released == raw);
    so::Pool adopted = so::Pool::adopt(released);
    EXPECT(adopted.raw() == raw && adopted.info().threads == 2);
    EXPECT(!so::Pool::adopt(nullptr));
    adopted.reset();
    EXPECT(!adopted);

    // A default-constructed Pool is empty, and destroying it is safe.
    {
        so::Pool empty;
        EXPECT(!empty);
    }
    // Moved-from handles (pool, moved, target) are destroyed at scope exit.
}

void test_hparams_and_options() {
    const so_adam_hparams c = so_adam_hparams_default();
    const so::Hparams hp;
    EXPECT(static_cast<std::uint32_t>(hp.mode) == c.mode);
    EXPECT(hp.lr == c.lr && hp.beta1 == c.beta1 && hp.beta2 == c.beta2 && hp.eps == c.eps);
    EXPECT(hp.weight_decay == c.weight_decay && hp.bias_correction == c.bias_correction && hp.step == c.step);
    EXPECT(hp.mode == so::Mode::AdamW && hp.step == 1);
    so::Hparams changed;
    changed.mode = so::Mode::L2;
    changed.lr = 0.25f;
    changed.step = 7;
    changed.bias_correction = false;
    const so_adam_hparams back = changed.to_c();
    EXPECT(back.struct_size == sizeof(so_adam_hparams));
    EXPECT(back.mode == SO_ADAM_MODE_L2 && back.lr == 0.25f && back.step == 7 && !back.bias_correction);
    const so::Hparams round(back);
    EXPECT(round.mode == so::Mode::L2 && round.lr == 0.25f && round.step == 7 && round.beta2 == c.beta2);

    const so_update_options uc = so_update_options_default();
    const so::UpdateOptions uo;
    EXPECT(uo.grad_scale == uc.grad_scale && uo.check_finite == uc.check_finite && !uo.compute_grad_sumsq);
    so::UpdateOptions u2;
    u2.grad_scale = 0.5f;
    u2.check_finite = true;
    const so_update_options ub = u2.to_c();
    EXPECT(ub.struct_size == sizeof(so_update_options) && ub.grad_scale == 0.5f && ub.check_finite);
}

void test_element_conversions() {
    // Known values.
    EXPECT(so::bf16::from_float(1.0f).bits == 0x3F80);
    EXPECT(so::bf16::from_float(-2.0f).bits == 0xC000);
    EXPECT(so::bf16::from_float(std::numeric_limits<float>::infinity()).bits == 0x7F80);
    EXPECT(so::bf16::from_float(std::nanf("")).bits == 0x7FC0);
    EXPECT(so::bf16::from_bits(0x4049).to_float() == 3.140625f);
    EXPECT(so::f16::from_float(1.0f).bits == 0x3C00);
    EXPECT(so::f16::from_float(-2.0f).bits == 0xC000);
    EXPECT(so::f16::from_float(65504.0f).bits == 0x7BFF);
    EXPECT(so::f16::from_float(65520.0f).bits == 0x7C00); // rounds up to inf
    EXPECT(so::f16::from_float(0x1.0p-24f).bits == 0x0001);
    EXPECT(so::f16::from_float(0x1.0p-25f).bits == 0x0000); // tie to even zero
    EXPECT(so::f16::from_float(0x1.8p-24f).bits == 0x0002); // tie to even 2
    EXPECT(so::f16::from_float(0x1.0p-14f).bits == 0x0400);
    EXPECT(so::f16::from_bits(0x3555).to_float() == 0x1.554p-2f);
    EXPECT(std::isnan(so::f16::from_bits(0x7E00).to_float()));
    EXPECT(so::f16::from_bits(0xFC00).to_float() == -std::numeric_limits<float>::infinity());
    EXPECT(so::bf16::from_bits(1) == so::bf16{1} && so::f16::from_bits(1) != so::f16{2});

    // Every non-NaN binary16 and bfloat16 survives the round trip.
    for (std::uint32_t b = 0; b <= 0xFFFF; ++b) {
        const auto bits = static_cast<std::uint16_t>(b);
        const float h = so::f16::from_bits(bits).to_float();
        if (!std::isnan(h) && so::f16::from_float(h).bits != bits) {
            std::fprintf(stderr, "f16 round trip of %#06x failed\n", b);
            ++so_test::failures;
            break;
        }
        const float bfl = so::bf16::from_bits(bits).to_float();
        if (!std::isnan(bfl) && so::bf16::from_float(bfl).bits != bits) {
            std::fprintf(stderr, "bf16 round trip of %#06x failed\n", b);
            ++so_test::failures;
            break;
        }
    }

    // The library's conversions (through a copy-out with lr = 0, which leaves p as it is) match
    // the header's on random bit patterns and on values near the binary16 rounding boundaries.
    Rng rng{42};
    std::vector<float> p;
    for (int i = 0; i < 200000; ++i) {
        float x;
        std::uint32_t u = static_cast<std::uint32_t>(rng.next());
        if (i % 2 == 0) {
            u = (u & 0x807FFFFFu) | ((100u + (u >> 24) % 50u) << 23); // exponents around the f16 range
        }
        std::memcpy(&x, &u, sizeof x);
        if (!std::isnan(x)) {
            p.push_back(x);
        }
    }
    p.push_back(std::numeric_limits<float>::infinity());
    p.push_back(-0.0f);
    const std::size_t n = p.size();
    std::vector<float> g(n, 0.0f), m(n, 0.0f), v(n, 0.0f);
    std::vector<so::f16> h(n);
    std::vector<so::bf16> bh(n);
    so::Hparams hp;
    hp.lr = 0.0f;
    const std::vector<float> p0 = p;
    so::AdamBuffers bufs(p.data(), g.data(), m.data(), v.data(), n);
    bufs.with_param_copy(h.data());
    (void)so::adam_update(nullptr, hp, bufs);
    bufs.with_param_copy(bh.data());
    (void)so::adam_update(nullptr, hp, bufs);
    EXPECT(same_bits(p, p0));
    std::size_t f16_bad = 0, bf16_bad = 0;
    for (std::size_t i = 0; i < n; ++i) {
        f16_bad += so::f16::from_float(p0[i]) != h[i];
        bf16_bad += so::bf16::from_float(p0[i]) != bh[i];
    }
    EXPECT(f16_bad == 0);
    EXPECT(bf16_bad == 0);
}

// One typed update (and, for master weights, rollback and rescale) against the raw C calls on
// an identical copy of the data: the typed path must produce the same bits.
template <class P, class G, class M, class C>
void typed_vs_raw(std::uint64_t seed, std::size_t n, so::PoolRef pool) {
    Rng rng{seed};
    std::vector<P> p = random_vector<P>(rng, n, 0.1f);
    std::vector<G> g = random_vector<G>(rng, n, 2.0f);
    std::vector<M> m = random_vector<M>(rng, n, 0.01f);
    std::vector<M> v = random_vector<M>(rng, n, 0.001f, true);
    const std::vector<P> p_start = p;
    std::vector<P> p2 = p;
    std::vector<M> m2 = m, v2 = v;
    constexpr bool with_copy = !std::is_void_v<C>;
    using CopyT = std::conditional_t<with_copy, C, so::bf16>;
    std::vector<CopyT> c1(with_copy ? n : 0), c2(with_copy ? n : 0);

    so::Hparams hp;
    hp.step = 3;
    hp.weight_decay = 0.05f;
    so::UpdateOptions opts;
    opts.grad_scale = 0.5f;
    opts.compute_grad_sumsq = true;

    auto typed = so::make_adam_buffers(p, g, m, v);
    static_assert(std::is_same_v<decltype(typed), so::AdamBuffers<P, G, M>>, "deduced element types");
    if constexpr (with_copy) {
        typed.with_param_copy(c1.data());
        EXPECT(typed.param_copy_dtype() == so::dtype_of<C>::value);
    } else {
        EXPECT(typed.param_copy_dtype() == so::DType::None);
    }
    EXPECT(typed.size() == n);
    const std::optional<double> s1 = so::adam_update(pool, hp, typed, opts);

    so_adam_buffers raw = so_adam_buffers_default();
    raw.numel = n;
    raw.param = p2.data();
    raw.grad = g.data();
    raw.exp_avg = m2.data();
    raw.exp_avg_sq = v2.data();
    raw.param_dtype = std::is_same_v<P, float>      ? SO_DTYPE_F32
                      : std::is_same_v<P, so::bf16> ? SO_DTYPE_BF16
                                                    : SO_DTYPE_F16;
    raw.grad_dtype = std::is_same_v<G, float>      ? SO_DTYPE_F32
                     : std::is_same_v<G, so::bf16> ? SO_DTYPE_BF16
                                                   : SO_DTYPE_F16;
    raw.moment_dtype = std::is_same_v<M, float> ? SO_DTYPE_F32 : SO_DTYPE_BF16;
    if constexpr (with_copy) {
        raw.param_copy = c2.data();
        raw.param_copy_dtype = std::is_same_v<C, so::bf16> ? SO_DTYPE_BF16 : SO_DTYPE_F16;
    }
    // The typed struct is the hand-filled one, up to which arrays it points at.
    const so_adam_buffers& tr = typed.raw();
    EXPECT(tr.struct_size == raw.struct_size && tr.numel == raw.numel && tr.grad == raw.grad);
    EXPECT(tr.param == p.data() && tr.exp_avg == m.data() && tr.exp_avg_sq == v.data());
    EXPECT(tr.param_dtype == raw.param_dtype && tr.grad_dtype == raw.grad_dtype && tr.moment_dtype == raw.moment_dtype);
    EXPECT(tr.param_copy_dtype == raw.param_copy_dtype && (tr.param_copy != nullptr) == (raw.param_copy != nullptr));
    so_adam_hparams chp = so_adam_hparams_default();
    chp.step = 3;
    chp.weight_decay = 0.05f;
    so_update_options copts = so_update_options_default();
    copts.grad_scale = 0.5f;
    double s2 = -1.0;
    EXPECT(so_adam_update(pool.raw(), &chp, &raw, &copts, &s2) == SO_STATUS_OK);

    EXPECT(s1.has_value() && *s1 == s2);
    EXPECT(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2));
    EXPECT(!same_bits(p, p_start)); // the step did something
    if constexpr (with_copy) {
        EXPECT(same_bits(c1, c2));
    }

    // The sum of squares the update returned is grad_sumsq's, typed and untyped.
    EXPECT(so::grad_sumsq(pool, g.data(), n, 0.5f) == s2);
    EXPECT(so::grad_sumsq(pool, static_cast<const void*>(g.data()), so::dtype_of<G>::value, n, 0.5f) == s2);

    // Without asking, there is no sum.
    so::UpdateOptions plain;
    plain.grad_scale = 0.5f;
    hp.step = 4;
    chp.step = 4;
    EXPECT(!so::adam_update(pool, hp, typed, plain).has_value());
    EXPECT(so_adam_update(pool.raw(), &chp, &raw, &copts, nullptr) == SO_STATUS_OK);
    EXPECT(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2));

    if constexpr (std::is_same_v<P, float> && std::is_same_v<M, float>) {
        so::adam_rescale(pool, hp, typed, 0.5f, 0.25f);
        EXPECT(so_adam_rescale(pool.raw(), &chp, &raw, 0.5f, 0.25f) == SO_STATUS_OK);
        EXPECT(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2));
        so::adam_rollback(pool, hp, typed, 0.25f);
        EXPECT(so_adam_rollback(pool.raw(), &chp, &raw, 0.25f) == SO_STATUS_OK);
        EXPECT(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2));
        // The raw overloads take the C struct directly.
        so::adam_update(pool, hp, typed.raw(), plain);
        so::adam_rollback(pool, hp, typed.raw(), 0.5f);
        so::adam_rescale(pool, hp, typed.raw(), 1.0f, 1.0f); // same scale: nothing changes
        EXPECT(so_adam_update(pool.raw(), &chp, &raw, &copts, nullptr) == SO_STATUS_OK);
        EXPECT(so_adam_rollback(pool.raw(), &chp, &raw, 0.5f) == SO_STATUS_OK);
        EXPECT(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2));
        if constexpr (with_copy) {
            EXPECT(same_bits(c1, c2));
        }
    }
}

void test_typed_buffers() {
    so::Pool pool = so::Pool::create({2});
    const std::size_t n = 3 * 8192 + 77; // several blocks plus a ragged tail
    typed_vs_raw<float, float, float, void>(1, n, pool);
    typed_vs_raw<float, so::bf16, float, so::bf16>(2, n, pool);
    typed_vs_raw<float, so::f16, float, so::f16>(3, n, nullptr);
    typed_vs_raw<so::bf16, so::bf16, so::bf16, void>(4, n, pool);
    typed_vs_raw<so::f16, so::f16, float, so::f16>(5, n, pool);
    typed_vs_raw<float, float, so::bf16, so::bf16>(6, n, nullptr);
    typed_vs_raw<so::bf16, float, float, so::f16>(7, 5, pool); // tiny
}

void test_errors() {
    so::Pool pool = so::Pool::create({1});
    const std::size_t n = 1000;
    std::vector<float> p(n, 0.5f), g(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
    const so::Hparams hp;

    // NULL buffer.
    so::AdamBuffers<float, float, float> null_param(nullptr, g.data(), m.data(), v.data(), n);
    std::string msg = EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, so::adam_update(pool, hp, null_param));
    EXPECT(contains(msg, "so_adam_update") && contains(msg, "param"));
    EXPECT(msg == so::last_error_message());

    // Overlapping moments.
    so::AdamBuffers<float, float, float> aliased(p.data(), g.data(), m.data(), m.data(), n);
    msg = EXPECT_ERROR(SO_STATUS_ALIASING, so::adam_update(pool, hp, aliased));
    EXPECT(contains(msg, "overlap"));

    // Bad hyperparameters and scales.
    auto bufs = so::make_adam_buffers(p, g, m, v);
    so::Hparams bad = hp;
    bad.lr = -1.0f;
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, so::adam_update(pool, bad, bufs));
    EXPECT(contains(msg, "lr"));
    so::UpdateOptions zero_scale;
    zero_scale.grad_scale = 0.0f;
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, so::adam_update(pool, hp, bufs, zero_scale));
    EXPECT(contains(msg, "grad_scale"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, so::adam_rollback(pool, hp, bufs, -1.0f));
    EXPECT(contains(msg, "so_adam_rollback"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, so::adam_rescale(pool, hp, bufs, 1.0f, 0.0f));
    EXPECT(contains(msg, "so_adam_rescale"));
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::grad_sumsq(pool, g.data(), n, 0.0f));
    EXPECT(contains(msg, "so_grad_sumsq"));
    msg = EXPECT_ERROR(SO_STATUS_NULL_ARGUMENT, (void)so::grad_sumsq(pool, static_cast<const float*>(nullptr), n));

    // Non-finite gradient with check_finite: refused, nothing modified.
    g[500] = std::numeric_limits<float>::infinity();
    const std::vector<float> p0 = p, m0 = m, v0 = v;
    so::UpdateOptions checked;
    checked.check_finite = true;
    checked.compute_grad_sumsq = true;
    msg = EXPECT_ERROR(SO_STATUS_NON_FINITE, so::adam_update(pool, hp, bufs, checked));
    EXPECT(!msg.empty() && msg == so::last_error_message());
    EXPECT(same_bits(p, p0) && same_bits(m, m0) && same_bits(v, v0));
    EXPECT(std::isinf(so::grad_sumsq(pool, g.data(), n)));
    g[500] = 1.0f;
    const std::optional<double> ok = so::adam_update(pool, hp, bufs, checked);
    EXPECT(ok.has_value() && *ok == static_cast<double>(n));

    // Untyped rollback of bf16 parameters: the library refuses it at run time.
    std::vector<so::bf16> pb(n, so::bf16::from_float(0.5f));
    so::AdamBuffers<so::bf16, float, float> bf(pb.data(), g.data(), m.data(), v.data(), n);
    msg = EXPECT_ERROR(SO_STATUS_UNSUPPORTED, so::adam_rollback(pool, hp, bf.raw(), 1.0f));
    EXPECT(contains(msg, "f32"));

    // A bad struct through the raw overload.
    so_adam_buffers broken = bufs.raw();
    broken.struct_size = 3;
    EXPECT_ERROR(SO_STATUS_STRUCT_SIZE, so::adam_update(nullptr, hp, broken));

    // Mismatched container sizes are caught by the wrapper itself.
    std::vector<float> short_v(n - 1);
    msg = EXPECT_ERROR(SO_STATUS_INVALID_ARGUMENT, (void)so::make_adam_buffers(p, g, m, short_v));
    EXPECT(contains(msg, "make_adam_buffers") && contains(msg, "999"));

    // Empty buffers are a valid no-op.
    std::vector<float> none;
    auto empty = so::make_adam_buffers(none, none, none, none);
    so::UpdateOptions sum;
    sum.compute_grad_sumsq = true;
    const std::optional<double> zero = so::adam_update(nullptr, hp, empty, sum);
    EXPECT(zero.has_value() && *zero == 0.0);
}

} // namespace

int main() {
    test_versions();
    test_check_and_error();
    test_pool();
    test_hparams_and_options();
    test_element_conversions();
    test_typed_buffers();
    test_errors();
    return so_test::finish("api_cpp_wrapper");
}
