// Tests of the session part of include/superoffload.hpp: exceptions carrying the C status and
// message (library errors, and the wrapper's own type and size checks); timeouts reported as
// false / std::nullopt, never as exceptions; TicketStatus from query; save/load with
// std::string paths.

#include "superoffload.hpp"

#include "so_test.hpp"

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

namespace so = superoffload;
using namespace std::chrono_literals;

namespace {

using so_test::contains;
using so_test::temp_path;

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

} // namespace

int main() {
    test_exceptions();
    test_timeouts();
    return so_test::finish("api_cpp_session_errors");
}
