/* Tickets of the session's C API: they count from 1 and increase in submission order; 0 is
 * "no work" and always complete; so_ticket_query reports pending, done and failed (with the
 * work's own status and message); so_ticket_wait with a 0 timeout (and a short one) on
 * pending work returns SO_STATUS_TIMEOUT and changes nothing; so_ticket_wait_all waits for
 * every earlier ticket and reports the first failure; so_session_local_grad_sumsq and
 * so_session_step_result time out the same way and can be called again; per-sub-group final
 * tickets come in registration order, after the backward's tickets and before the step's,
 * and complete in that order; several threads may wait on one ticket; only the latest step's
 * result is kept; unknown tickets are SO_STATUS_NOT_FOUND; the session stays usable after a
 * failed ticket.
 *
 * Pending work is made certain by a large sub-group stepped on a pool with one thread of the
 * portable instruction set: its speculative step takes about 0.1 s, and everything queued
 * behind it waits (tickets complete in order).
 */
#include <pthread.h>

#include "session_test.h"

#define BIG ((size_t)1 << 22)

typedef struct waiter {
    so_session *s;
    so_ticket ticket;
    so_status status;
} waiter;

static void *wait_in_thread(void *arg) {
    waiter *w = (waiter *)arg;
    w->status = so_ticket_wait(w->s, w->ticket, -1);
    return NULL;
}

int main(void) {
    so_pool *pool = so_test_pool(SO_ISA_PORTABLE, 1);
    CHECK(pool != NULL);
    so_session_options o = so_session_options_default();
    o.pool = pool;
    o.speculation = SO_SPECULATION_ON;
    so_session *s = NULL;
    CHECK_OK(so_session_create(&o, &s));
    so_pool_destroy(pool);
    so_group_hparams h = so_group_hparams_default();
    uint32_t g = 0;
    CHECK_OK(so_session_add_group(s, &h, &g));

    float *big = (float *)so_test_malloc(BIG * sizeof(float));
    float *big_grad = (float *)so_test_malloc(BIG * sizeof(float));
    float small1[16], small2[16], grad16[16], poisoned[16];
    for (size_t i = 0; i < BIG; i++) {
        big[i] = 0.5f;
        big_grad[i] = 0.01f;
    }
    for (int i = 0; i < 16; i++) {
        small1[i] = small2[i] = 0.25f;
        grad16[i] = poisoned[i] = 0.02f;
    }
    poisoned[5] = NAN;
    so_slice_desc sl_big = {"big", 0, BIG};
    so_slice_desc sl_s1[2] = {{"s1.a", 0, 10}, {"s1.b", 10, 6}};
    so_slice_desc sl_s2 = {"s2", 0, 16};
    so_subgroup_desc d = so_subgroup_desc_default();
    uint32_t id = 0;
    d.master = big;
    d.numel = BIG;
    d.slices = &sl_big;
    d.num_slices = 1;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
    d.master = small1;
    d.numel = 16;
    d.slices = sl_s1;
    d.num_slices = 2;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
    d.master = small2;
    d.slices = &sl_s2;
    d.num_slices = 1;
    CHECK_OK(so_session_add_subgroup(s, &d, &id));
    CHECK(id == 2);

    /* Before any work: final tickets are 0, ticket 0 is complete, ticket 1 unknown. */
    for (uint32_t sg = 0; sg < 3; sg++) {
        so_ticket f = 99;
        CHECK_OK(so_session_final_ticket(s, sg, &f));
        CHECK(f == 0);
    }
    CHECK_OK(so_ticket_query(s, 0));
    CHECK_OK(so_ticket_wait(s, 0, 0));
    CHECK_OK(so_ticket_wait_all(s, 0, 0));
    EXPECT_REFUSED(so_ticket_query(s, 1), SO_STATUS_NOT_FOUND, "so_ticket_query", "never issued");
    EXPECT_REFUSED(so_ticket_wait(s, 1, 0), SO_STATUS_NOT_FOUND, "so_ticket_wait", "never issued");

    /* Step 1: the big sub-group's speculative step, the small ones queued behind it; the
     * second small one has a NaN. */
    CHECK_OK(so_session_begin_step(s, 0.0f, 1));
    so_ticket t_big = 0, t_none = 77, t_s1 = 0, t_s2 = 0;
    CHECK_OK(so_session_grad_copy(s, 0, big_grad, BIG, &t_big));
    CHECK_OK(so_session_grad_copy(s, 1, grad16, 10, &t_none));
    CHECK_OK(so_session_grad_copy(s, 2, grad16 + 10, 6, &t_s1));
    CHECK_OK(so_session_grad_copy(s, 3, poisoned, 16, &t_s2));
    CHECKF(t_big == 1, "tickets count from 1: %llu", (unsigned long long)t_big);
    CHECK(t_none == 0 && t_s1 > t_big && t_s2 > t_s1);

    /* Queued behind the big step: pending, and a wait with a 0 (or short) timeout times out. */
    EXPECT_REFUSED(so_ticket_query(s, t_s2), SO_STATUS_PENDING, "so_ticket_query", "not completed");
    CHECK_STATUS(so_ticket_query(s, t_s1), SO_STATUS_PENDING);
    EXPECT_REFUSED(so_ticket_wait(s, t_s2, 0), SO_STATUS_TIMEOUT, "so_ticket_wait", "not complete");
    EXPECT_REFUSED(so_ticket_wait(s, t_s1, 1000000), SO_STATUS_TIMEOUT, "so_ticket_wait", "not complete");
    EXPECT_REFUSED(so_ticket_wait_all(s, t_s2, 0), SO_STATUS_TIMEOUT, "so_ticket_wait_all", "not complete");

    /* Two threads wait on the failing ticket while this one waits on the big one. */
    waiter w1 = {s, t_s2, SO_STATUS_OK}, w2 = {s, t_s2, SO_STATUS_OK};
    pthread_t th1, th2;
    CHECK(pthread_create(&th1, NULL, wait_in_thread, &w1) == 0);
    CHECK(pthread_create(&th2, NULL, wait_in_thread, &w2) == 0);
    CHECK_OK(so_ticket_wait(s, t_big, -1));
    CHECK(pthread_join(th1, NULL) == 0 && pthread_join(th2, NULL) == 0);
    CHECK(w1.status == SO_STATUS_NON_FINITE && w2.status == SO_STATUS_NON_FINITE);

    /* Done and failed. */
    CHECK_OK(so_ticket_query(s, t_big));
    CHECK_OK(so_ticket_query(s, t_s1));
    CHECK_OK(so_ticket_wait(s, t_s1, 0));
    EXPECT_REFUSED(so_ticket_query(s, t_s2), SO_STATUS_NON_FINITE, "so_ticket_query", "sub-group 2");
    EXPECT_REFUSED(so_ticket_wait(s, t_s2, -1), SO_STATUS_NON_FINITE, "so_ticket_wait", "inf or NaN");
    CHECK_OK(so_ticket_wait_all(s, t_s1, -1));
    char failed[64];
    snprintf(failed, sizeof failed, "ticket %llu failed", (unsigned long long)t_s2);
    EXPECT_REFUSED(so_ticket_wait_all(s, t_s2, -1), SO_STATUS_NON_FINITE, "so_ticket_wait_all", failed);
    /* The refused step changed nothing. */
    for (int i = 0; i < 16; i++) CHECK(small2[i] == 0.25f);

    /* The sum of squares arrives: not finite (the NaN). */
    double sumsq = -7.0;
    CHECK_OK(so_session_local_grad_sumsq(s, -1, &sumsq));
    CHECK(!isfinite(sumsq));

    so_ticket st = 0;
    CHECK_OK(so_session_step(s, NULL, &st));
    CHECK(st > t_s2);
    so_ticket fin[3];
    for (uint32_t sg = 0; sg < 3; sg++) CHECK_OK(so_session_final_ticket(s, sg, &fin[sg]));
    CHECKF(fin[0] > t_s2 && fin[0] < fin[1] && fin[1] < fin[2] && fin[2] < st,
           "final tickets %llu %llu %llu, step %llu", (unsigned long long)fin[0], (unsigned long long)fin[1],
           (unsigned long long)fin[2], (unsigned long long)st);
    /* The big sub-group's rollback takes a while: the step is pending, its result times out. */
    CHECK_STATUS(so_ticket_query(s, st), SO_STATUS_PENDING);
    so_step_result r;
    memset(&r, 0, sizeof r);
    r.struct_size = sizeof r;
    EXPECT_REFUSED(so_session_step_result(s, st, 0, &r), SO_STATUS_TIMEOUT, "so_session_step_result", "not complete");
    CHECK(r.serial == 0);
    /* Final tickets complete in registration order, and the step's last. */
    CHECK_OK(so_ticket_wait(s, fin[0], -1));
    CHECK_OK(so_ticket_wait(s, fin[1], -1));
    CHECK_OK(so_ticket_wait(s, fin[2], -1));
    r = so_test_step_result(s, st);
    CHECKF(r.skipped && r.speculative == 3 && r.rolled_back == 2 && r.kept == 0 && r.stepped == 0,
           "skipped %d speculative %u rolled back %u", (int)r.skipped, r.speculative, r.rolled_back);
    for (uint32_t sg = 0; sg < 3; sg++) {
        uint64_t count = 9;
        CHECK_OK(so_session_step_count(s, sg, &count));
        CHECK(count == 0);
    }
    for (int i = 0; i < 16; i++) CHECK(small2[i] == 0.25f);
    for (size_t i = 0; i < BIG; i += 4099) CHECKF(fabsf(big[i] - 0.5f) < 1e-6f, "big[%zu] = %.9g", i, (double)big[i]);

    /* Step 2: the session is usable; the previous step's result is no longer kept. */
    CHECK_OK(so_session_begin_step(s, 0.0f, 1));
    CHECK_OK(so_session_grad_copy(s, 1, grad16, 10, NULL));
    CHECK_OK(so_session_grad_copy(s, 2, grad16 + 10, 6, NULL));
    CHECK_OK(so_session_grad_copy(s, 3, grad16, 16, NULL));
    CHECK_OK(so_session_grad_copy(s, 0, big_grad, BIG, NULL));
    so_ticket st2 = 0;
    CHECK_OK(so_session_step(s, NULL, &st2));
    CHECK(st2 > st);
    r = so_test_step_result(s, st2);
    /* The big sub-group completed last: its speculative step was kept, or cancelled at step()
     * and folded into its final pass. */
    CHECKF(!r.skipped && r.serial == 2 && r.kept == 3, "kept %u cancelled %u", r.kept, r.cancelled);
    EXPECT_REFUSED(so_session_step_result(s, st, -1, &r), SO_STATUS_NOT_FOUND, "so_session_step_result", "latest step");
    so_ticket prev = st;
    for (uint32_t sg = 0; sg < 3; sg++) {
        so_ticket f = 0;
        CHECK_OK(so_session_final_ticket(s, sg, &f));
        CHECK(f > prev && f < st2);
        CHECK_OK(so_ticket_query(s, f));
        prev = f;
        uint64_t count = 0;
        CHECK_OK(so_session_step_count(s, sg, &count));
        CHECK(count == 1);
    }
    CHECK(small1[0] < 0.25f && small2[0] < 0.25f && big[0] < 0.5f);
    /* Old tickets keep their outcome; wait_all covers every ticket from 1, so it still reports
     * the failure of step 1 (documented: the status of the first that failed). */
    CHECK_OK(so_ticket_wait(s, st2, -1));
    CHECK_OK(so_ticket_query(s, t_big));
    CHECK_STATUS(so_ticket_query(s, t_s2), SO_STATUS_NON_FINITE);
    EXPECT_REFUSED(so_ticket_wait_all(s, st2, -1), SO_STATUS_NON_FINITE, "so_ticket_wait_all", failed);
    EXPECT_REFUSED(so_ticket_query(s, st2 + 1), SO_STATUS_NOT_FOUND, "so_ticket_query", "never issued");

    /* Step 3 clips: the big sub-group's final pass steps again and takes a while. Step 4's
     * preparation queues behind it, and nothing preempts a final pass (a preparation does
     * preempt a speculative pass, so a zero timeout is tried here, not during a backward). */
    CHECK_OK(so_session_begin_step(s, 0.0f, 1));
    CHECK_OK(so_session_grad_copy(s, 0, big_grad, BIG, NULL));
    CHECK_OK(so_session_grad_copy(s, 1, grad16, 10, NULL));
    CHECK_OK(so_session_grad_copy(s, 2, grad16 + 10, 6, NULL));
    CHECK_OK(so_session_grad_copy(s, 3, grad16, 16, NULL));
    so_step_args clip = so_step_args_default();
    clip.max_norm = 1e-3;
    so_ticket st3 = 0;
    CHECK_OK(so_session_step(s, &clip, &st3));
    CHECK_OK(so_session_begin_step(s, 1.0f, 1));
    sumsq = -7.0;
    EXPECT_REFUSED(so_session_local_grad_sumsq(s, 0, &sumsq), SO_STATUS_TIMEOUT, "so_session_local_grad_sumsq",
                   "not complete");
    CHECK(sumsq == -7.0);
    r = so_test_step_result(s, st3);
    CHECKF(!r.skipped && r.clip_coef < 1.0, "clip_coef %g", r.clip_coef);
    CHECK_OK(so_session_local_grad_sumsq(s, -1, &sumsq));
    CHECK(sumsq == 0.0); /* nothing handed over: every slice counts as zero */

    so_session_destroy(s);
    free(big);
    free(big_grad);
    printf("api_session_tickets: ok\n");
    return 0;
}
